"""Bad input at every public entry point: a specific, clear error, and nothing written.

Entry points: the LockService constructor and methods, provider constructors and URLs, the
Celery decorator, ExclusiveTask options and app settings, and the CLI (both front ends).
Each bad input must raise InvalidArgumentError or ConfigurationError (checked by type and
a message fragment) *before* any backend is touched: most cases run against unreachable
servers, where touching the backend would surface as BackendError (or CLI exit 3) instead,
and again against real stores, which must be left exactly as they were (not even the lock
table is created). Odd but valid keys (emoji, RTL marks, SQL- and glob-looking text) must
work everywhere and drop nothing. Credentials must never appear in errors or logs.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sqlite3
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from celery_exclusive import (
    BackendError,
    ConfigurationError,
    ExclusiveError,
    InvalidArgumentError,
    LockService,
    MemoryLockProvider,
    MissingDriverError,
    ReleaseOutcome,
)
from celery_exclusive.cli import cli, exclusive
from celery_exclusive.providers._sql_common import engine_from_url
from celery_exclusive.providers._sql_params import LIBPQ_CHOICES
from celery_exclusive.providers.sql import SqlLockProvider, lock_table
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import ExclusiveTask, exclusive_task
from celery_exclusive.urls import provider_from_url
from celery_exclusive.worker import get_lock_service
from tests.conftest import (
    MYSQL_URL,
    POSTGRES_URL,
    REDIS_URL,
    delete_redis_keys,
    drop_lock_table,
    require_server,
)

#: Every password below contains this marker; it must never be shown.
MARKER = "Zq8SECRETpw"
UNREACHABLE = {
    "postgres": f"postgresql+psycopg://u:{MARKER}@127.0.0.1:1/x",
    "redis": f"redis://:{MARKER}@127.0.0.1:1/0",
    "mariadb": f"mysql+pymysql://u:{MARKER}@127.0.0.1:1/x",
}
UNREACHABLE_PG = UNREACHABLE["postgres"]


@pytest.fixture(autouse=True)
def _no_store_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own CELERY_EXCLUSIVE_* settings must not leak into these tests."""
    for name in ("CELERY_EXCLUSIVE_URL", "CELERY_EXCLUSIVE_PREFIX", "CELERY_EXCLUSIVE_DEFAULT_TTL"):
        monkeypatch.delenv(name, raising=False)


def _never() -> None:
    raise AssertionError("the protected function must not run for rejected input")


# -- LockService methods -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One rejected call: what to call, the error type, and a fragment of its message."""

    id: str
    call: Callable[[LockService], object]
    exc: type[ExclusiveError]
    fragment: str


BAD_KEYS: list[tuple[str, object, str]] = [
    ("int", 123, "must be a str, got int"),
    ("none", None, "must be a str, got NoneType"),
    ("bytes", b"key", "must be a str, got bytes"),
    ("empty", "", "must not be empty"),
    ("nul", "\x00", "NUL"),
    ("inner-nul", "a\x00b", "NUL"),
    ("lone-high-surrogate", "\ud800", "lone surrogates"),
    ("lone-low-surrogate", "ok\udfffok", "lone surrogates"),
    ("10kb", "x" * 10240, "this store accepts at most"),
    ("10kb-emoji", "🔒" * 2600, "this store accepts at most"),
]
BAD_DURATIONS: list[tuple[str, object, str]] = [
    ("zero", 0, "positive, finite"),
    ("negative", -1, "positive, finite"),
    ("nan", math.nan, "positive, finite"),
    ("inf", math.inf, "positive, finite"),
    ("zero-timedelta", timedelta(0), "positive, finite"),
    ("negative-timedelta", timedelta(seconds=-5), "positive, finite"),
    ("bool", True, "got bool"),
    # Beyond any float (OverflowError), and too long to print (repr's ValueError).
    ("huge-int", 10**400, "positive, finite"),
    ("huge-int-unprintable", -(10**5000), "positive, finite"),
    ("str", "5", "got str"),
    ("list", [5], "got list"),
]
KEY_METHODS: dict[str, Callable[[LockService, Any], object]] = {
    "lock": lambda s, k: s.lock(k),
    "try_lock": lambda s, k: s.try_lock(k),
    "run_exclusive": lambda s, k: s.run_exclusive(k, _never),
    "peek": lambda s, k: s.peek(k),
    "force_release": lambda s, k: s.force_release(k, "some-token"),
    # A waiter subscribes (SQLite: marks itself) before its first attempt; its semaphore's
    # slot key "{key}#3" is a str whatever key is, so the key itself must be checked first.
    "lock-limit-wait": lambda s, k: s.lock(k, limit=3, wait=0.5),
    "try_lock-limit-wait": lambda s, k: s.try_lock(k, limit=3, wait=0.5),
    # Without wait too: lock(5, limit=3) raised TypeError and lock("", limit=3) took a
    # lease on the empty key (only the slot key "{key}#3" was checked).
    "lock-limit": lambda s, k: s.lock(k, limit=3),
    "try_lock-limit": lambda s, k: s.try_lock(k, limit=3),
}
DURATION_METHODS: dict[str, Callable[..., object]] = {
    "lock": lambda s, **kw: s.lock("k", **kw),
    "try_lock": lambda s, **kw: s.try_lock("k", **kw),
    "run_exclusive": lambda s, **kw: s.run_exclusive("k", _never, **kw),
}


#: Holder metadata whose JSON is one character too long for every store.
HUGE_HOLDER = {"x": "y" * 65535}


def _key_case(method: str, key: object) -> Callable[[LockService], object]:
    return lambda s: KEY_METHODS[method](s, key)


def _duration_case(method: str, name: str, value: object) -> Callable[[LockService], object]:
    return lambda s: DURATION_METHODS[method](s, **{name: value})


SERVICE_CASES: list[Case] = [
    Case(f"{method}-key-{kid}", _key_case(method, key), InvalidArgumentError, fragment)
    for method in KEY_METHODS
    for kid, key, fragment in BAD_KEYS
]
SERVICE_CASES += [
    Case(f"{method}-{name}-{did}", _duration_case(method, name, value), InvalidArgumentError, f"{name} must")
    for method in DURATION_METHODS
    for name in ("ttl", "refresh_interval", "max_lifetime")
    for did, value, _ in BAD_DURATIONS
]
SERVICE_CASES += [
    Case("duration-message", lambda s: s.lock("k", ttl=-1), InvalidArgumentError, "positive, finite"),
    Case(
        "refresh-not-below-ttl",
        lambda s: s.lock("k", ttl=5, refresh_interval=5),
        InvalidArgumentError,
        "shorter",
    ),
    Case(
        "ttl-above-lifetime", lambda s: s.lock("k", ttl=100, max_lifetime=50), InvalidArgumentError, "exceed"
    ),
    Case(
        "lifetime-above-cap", lambda s: s.try_lock("k", max_lifetime=10**6), InvalidArgumentError, "hard cap"
    ),
    Case("holder-str", lambda s: s.lock("k", holder="me"), InvalidArgumentError, "holder must be a mapping"),
    Case("holder-int-keys", lambda s: s.lock("k", holder={1: 2}), InvalidArgumentError, "str keys"),
    Case("holder-pairs", lambda s: s.lock("k", holder=[("a", 1)]), InvalidArgumentError, "holder must"),
    # Beyond MariaDB's TEXT column: a BackendError there ("Data too long"), after the write.
    *[
        Case(f"holder-too-long-{mid}", lambda s, call=call: call(s), InvalidArgumentError, "holder is")
        for mid, call in (
            ("lock", lambda s: s.lock("k", holder=HUGE_HOLDER)),
            ("try_lock-wait", lambda s: s.try_lock("k", holder=HUGE_HOLDER, wait=0.5)),
            ("lock_many", lambda s: s.lock_many(["a", "b"], holder=HUGE_HOLDER)),
            ("mark", lambda s: s.mark("k", holder=HUGE_HOLDER)),
        )
    ],
    Case("fn-not-callable", lambda s: s.run_exclusive("k", 5), InvalidArgumentError, "fn must be callable"),
    # fn and on_locked are called with no arguments: one that needs some raised a bare
    # TypeError after the lease was taken (fn), or only once the key was found held.
    Case(
        "fn-needs-arguments",
        lambda s: s.run_exclusive("k", lambda x: x),
        InvalidArgumentError,
        "fn must be callable with no arguments",
    ),
    Case(
        "on-locked-needs-arguments",
        lambda s: s.run_exclusive("k", _never, on_locked=lambda holder: None),
        InvalidArgumentError,
        "on_locked must be callable with no arguments",
    ),
    Case(
        "on-locked-not-callable",
        lambda s: s.run_exclusive("k", _never, on_locked="skip"),
        InvalidArgumentError,
        "on_locked must be callable",
    ),
    # lock(on_lost=) and try_lock(on_lost=) on each of their paths (the plain and the
    # semaphore's hot paths, wait, hold_at_least): checked before the store is asked.
    *[
        Case(
            f"{method}-on-lost-{name}",
            lambda s, method=method, options=options: getattr(s, method)("k", on_lost="log", **options),
            InvalidArgumentError,
            "on_lost callback must be callable",
        )
        for method in ("lock", "try_lock")
        for name, options in (
            ("plain", {}),
            ("limit", {"limit": 2}),
            ("wait", {"wait": 1}),
            ("cooldown", {"hold_at_least": 1}),
        )
    ],
    Case("token-empty", lambda s: s.force_release("k", ""), InvalidArgumentError, "token must be"),
    Case("token-none", lambda s: s.force_release("k", None), InvalidArgumentError, "token must be"),
    Case("token-int", lambda s: s.force_release("k", 5), InvalidArgumentError, "token must be"),
    # A lone surrogate raised UnicodeEncodeError from the driver; a NUL reached the store.
    Case("token-nul", lambda s: s.force_release("k", "t\x00"), InvalidArgumentError, "NUL"),
    Case("token-surrogate", lambda s: s.force_release("k", "t\udc80"), InvalidArgumentError, "surrogates"),
    # begin_mark used to take the marker anyway (with a new token on the stores that answer
    # at once: a marker its caller could never release, until its ttl).
    *[
        Case(
            f"begin-mark-token-{tid}",
            lambda s, t=t: s.begin_mark("k", token=t),
            InvalidArgumentError,
            "token must",
        )
        for tid, t in (("empty", ""), ("none", None), ("int", 5), ("bytes", b"t"), ("nul", "t\x00"))
    ],
    # A wait beyond any float raised OverflowError.
    *[
        Case(
            f"{m}-wait-huge-int",
            lambda s, m=m: getattr(s, m)("k", wait=10**400),
            InvalidArgumentError,
            "wait",
        )
        for m in ("lock", "try_lock")
    ],
    Case("lock_many-wait-huge-int", lambda s: s.lock_many(["a"], wait=10**400), InvalidArgumentError, "wait"),
    # Too long to print: the message's repr raised ValueError.
    Case("lock-wait-unprintable", lambda s: s.lock("k", wait=10**5000), InvalidArgumentError, "wait"),
    Case("lock-limit-unprintable", lambda s: s.lock("k", limit=10**5000), InvalidArgumentError, "limit"),
    Case(
        "lock-hold-huge", lambda s: s.lock("k", hold_at_least=10**400), InvalidArgumentError, "hold_at_least"
    ),
    Case("mark-ttl-huge", lambda s: s.mark("k", ttl=10**400), InvalidArgumentError, "ttl must"),
    # Beyond a 64-bit int: PostgreSQL answered a BackendError, SQLite raised OverflowError.
    Case("sweep-limit-2**63", lambda s: s.sweep("k", limit=2**63), InvalidArgumentError, "limit"),
    Case("sweep-limit-unprintable", lambda s: s.sweep(limit=-(10**5000)), InvalidArgumentError, "limit"),
    # task_id is ignored by a semaphore, but a bad one is still a bad argument (it reached the store).
    *[
        Case(
            f"lock-limit-task-id-{tid}",
            lambda s, t=t: s.lock("k", limit=3, task_id=t),
            InvalidArgumentError,
            "task",
        )
        for tid, t in (("int", 5), ("empty", ""))
    ],
    # lock()'s inline test of the usual task id must send everything else to the full check.
    *[
        Case(f"lock-task-id-{tid}", lambda s, t=t: s.lock("k", task_id=t), InvalidArgumentError, fragment)
        for tid, t, fragment in (
            ("empty", "", "non-empty str"),
            ("int", 5, "non-empty str"),
            ("bytes", b"t", "non-empty str"),
            ("str-subclass-empty", type("S", (str,), {})(""), "non-empty str"),
            ("nul", "a\x00b", "without NUL"),
            ("too-long", "t" * 201, "at most 200"),
            ("too-long-non-ascii", "é" * 201, "at most 200"),
            ("lone-surrogate", "t\udc80", "lone surrogates"),
        )
    ],
    Case("locks-int", lambda s: s.locks(5), InvalidArgumentError, "prefix must be a str"),
    Case("locks-bytes", lambda s: s.locks(b"a"), InvalidArgumentError, "prefix must be a str"),
    Case("locks-nul", lambda s: s.locks("a\x00"), InvalidArgumentError, "NUL"),
    Case("locks-surrogate", lambda s: s.locks("\ud800"), InvalidArgumentError, "lone surrogates"),
]


def test_lock_many_reads_at_most_one_key_past_its_limit(unreachable_services: dict[str, LockService]) -> None:
    """A huge (or endless) iterable of keys is refused after MAX_KEYS + 1 of them: it used
    to be read whole into a list first (an endless generator: all the memory there is)."""
    from celery_exclusive.many import MAX_KEYS

    def keys(pulled: list[int]) -> Iterator[str]:
        for i in range(100_000):
            pulled.append(i)
            yield f"k{i}"

    for service in unreachable_services.values():
        pulled: list[int] = []
        with pytest.raises(InvalidArgumentError, match=f"at most {MAX_KEYS} keys"):
            service.lock_many(keys(pulled))  # type: ignore[arg-type]
        assert len(pulled) <= MAX_KEYS + 1


@pytest.fixture(scope="module")
def unreachable_services() -> Iterator[dict[str, LockService]]:
    """One service per server kind, each pointed at a port where nothing listens."""
    services = {name: LockService(url, prefix="bad:") for name, url in UNREACHABLE.items()}
    yield services
    for service in services.values():
        service.close()


@pytest.mark.parametrize("case", SERVICE_CASES, ids=lambda c: c.id)
def test_service_rejects_bad_input_before_the_store(
    case: Case, unreachable_services: dict[str, LockService]
) -> None:
    """Every bad argument to a LockService method is an argument error, never a BackendError."""
    for name, service in unreachable_services.items():
        with pytest.raises(case.exc) as raised:
            case.call(service)
        assert case.fragment in str(raised.value), name
        assert not service.held()
        assert not service.heartbeat._pending_release  # no acquire was even attempted


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        *[({"prefix": p}, "key prefix") for p in (" x", "é", "x" * 65, "a b", "\x00", "a\tb", 5, None)],
        *[({name: v}, f"{name} must") for name in ("ttl", "max_lifetime") for _, v, _ in BAD_DURATIONS],
        *[({"refresh_interval": v}, "refresh_interval must") for _, v, _ in BAD_DURATIONS],
        ({"ttl": None}, "ttl must"),
        ({"ttl": 10, "refresh_interval": 10}, "shorter"),
        ({"ttl": 100, "max_lifetime": 50}, "exceed"),
        ({"max_lifetime": 24 * 3600 + 1}, "hard cap"),
        *[({"call_timeout": v}, "call_timeout must") for _, v, _ in BAD_DURATIONS],
        # Beyond about 24.8 days psycopg's poll overflowed at the first call (OverflowError).
        *[({"call_timeout": v}, "call_timeout must be at most") for v in (24 * 3600 + 1, 10**12)],
        *[({"heartbeat_batch_size": b}, "heartbeat_batch_size") for b in (0, -1, True, 1.5, "10", None)],
        ({"clock": 5}, "clock must be callable"),
        ({"thread_factory": "thread"}, "thread_factory must be callable"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    """LockService(...) rejects bad options with InvalidArgumentError, whatever the store."""
    for url in UNREACHABLE.values():
        with pytest.raises(InvalidArgumentError) as raised:
            LockService(url, **kwargs)
        assert fragment in str(raised.value)


@pytest.mark.parametrize("store", [5, b"redis://127.0.0.1/0", object(), ["memory://"], 3.5])
def test_constructor_rejects_a_store_of_the_wrong_type(store: object) -> None:
    """A store that is neither a URL nor a provider is named in the error."""
    with pytest.raises(InvalidArgumentError, match="store must be a URL or a LockProvider"):
        LockService(store)  # type: ignore[arg-type]


def test_a_closed_service_refuses_to_lock() -> None:
    """A closed service says so instead of silently reconnecting."""
    service = LockService(UNREACHABLE_PG)
    service.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        service.lock("k")


@pytest.mark.parametrize("where", ["memory", "redis", "postgres"])
def test_a_lease_released_through_another_service_stays_held_and_releasable(where: str) -> None:
    """service.release(lease) of a lease another service took (or of no lease at all) is an
    InvalidArgumentError before anything changes. It used to mark the lease released, miss
    it in its own heartbeat and delete from its own store: on another store the key stayed
    held, refreshed and released by no one, until its ttl (and a second release said
    NOT_OWNED). The lease stays held, in its service's heartbeat, and releases normally."""
    table = f"ce_bad_{uuid.uuid4().hex[:10]}"
    url = {"memory": "memory://", "redis": REDIS_URL, "postgres": f"{POSTGRES_URL}?ce_table={table}"}[where]
    if where != "memory":
        require_server(url)
    prefix = f"rel-{uuid.uuid4().hex[:10]}:"
    owner = LockService(url, prefix=prefix)
    strangers = [LockService("memory://", prefix=prefix), LockService(url, prefix=f"x{prefix}")]
    try:
        lease = owner.lock("k", ttl=30)
        for stranger in strangers:
            for given in (lease, None, "k", lease.token):
                with pytest.raises(InvalidArgumentError, match="taken through this service"):
                    stranger.release(given)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="taken through this service"):
            owner.release(None)  # type: ignore[arg-type]
        assert lease.held
        assert owner.held() == [lease]
        info = owner.peek("k")
        assert info is not None
        assert info.token == lease.token
        assert lease.release().value == "released"
        assert owner.peek("k") is None
    finally:
        for service in (owner, *strangers):
            service.close()
        if where == "redis":
            delete_redis_keys(prefix)
        if where == "postgres":
            drop_lock_table(POSTGRES_URL, table)


def test_an_on_lost_callback_that_is_not_callable_is_refused_at_once() -> None:
    """lease.on_lost(x) with x not callable raised nothing and was kept, to fail only when
    the lease was lost (a TypeError logged by the heartbeat, the other callbacks still run):
    now an InvalidArgumentError, and nothing is kept."""
    service = LockService("memory://", prefix="on-lost:")
    lease = service.lock("k", ttl=30)
    called: list[str] = []
    for bad in (None, "log", 5):
        with pytest.raises(InvalidArgumentError, match="on_lost callback must be callable"):
            lease.on_lost(bad)  # type: ignore[arg-type]
    lease.on_lost(lambda _lease, reason: called.append(reason))
    service._lose(lease, "test")
    assert called == ["test"]
    service.close()


# -- URLs and provider constructors --------------------------------------------------------------

BAD_URLS: list[tuple[str, str, str]] = [
    ("unknown-scheme", f"foo://u:{MARKER}@h/x", "unknown lock store scheme 'foo'"),
    ("http", "http://h/x", "unknown lock store scheme 'http'"),
    ("no-scheme", "not a url", "malformed lock store URL"),
    ("no-scheme-credentials", f"user:{MARKER}@host/db", "malformed lock store URL 'user:***@host/db'"),
    ("no-scheme-password-only", f":{MARKER}@host:6379/0", "malformed lock store URL"),
    ("scheme-only-colon", "redis:/h", "malformed lock store URL"),
    ("whitespace-scheme", " redis://h/0", "unknown lock store scheme"),
    ("unknown-ce-option-sql", f"{UNREACHABLE_PG}?ce_bogus=1", "unknown option 'ce_bogus'"),
    ("unknown-ce-option-redis", f"{UNREACHABLE['redis']}?ce_table=x", "unknown option 'ce_table'"),
    ("unknown-ce-option-memory", "memory://?ce_table=x", "unknown option 'ce_table'"),
    ("bad-table-dash", f"{UNREACHABLE_PG}?ce_table=bad-name", "invalid lock table name"),
    ("bad-table-digit", f"{UNREACHABLE_PG}?ce_table=1abc", "invalid lock table name"),
    ("bad-table-long", f"{UNREACHABLE_PG}?ce_table={'t' * 60}", "invalid lock table name"),
    ("bad-table-injection", f"{UNREACHABLE_PG}?ce_table=x;DROP%20TABLE%20y", "invalid lock table name"),
    ("bad-table-quote", f"{UNREACHABLE_PG}?ce_table=x%22y", "invalid lock table name"),
    ("bad-table-empty", f"{UNREACHABLE_PG}?ce_table=", "invalid lock table name"),
    ("bad-table-unicode", f"{UNREACHABLE['mariadb']}?ce_table=t%C3%A9", "invalid lock table name"),
    ("bad-create-flag", f"{UNREACHABLE_PG}?ce_create_table=maybe", "must be true or false"),
    (
        "sql-port-not-a-number",
        f"postgresql+psycopg://u:{MARKER}@h:notaport/x",
        "malformed SQL lock store URL",
    ),
    ("redis-port-not-a-number", f"redis://:{MARKER}@h:notaport/0", "bad redis URL"),
    ("redis-port-out-of-range", "redis://h:99999/0", "bad redis URL"),
    ("sql-broken-ipv6", f"postgresql+psycopg://u:{MARKER}@[::1/x", "malformed lock store URL"),
    ("redis-broken-ipv6", f"redis://:{MARKER}@[::1/0", "malformed lock store URL"),
    ("redis-bad-db", "redis://h/0?db=notanint", "bad redis URL"),
    # redis-py reads a path that is no number as database 0, and "/1/2" as 12: a typo there
    # used to put the locks in another database than the URL seems to say.
    ("redis-db-not-a-number", f"redis://:{MARKER}@h:6379/x", "bad redis URL"),
    ("redis-db-two-parts", "rediss://h/1/2", "bad redis URL"),
    # redis-py passes an unknown query parameter on to its connection class, which refused
    # it only on the first call, with a TypeError.
    ("redis-unknown-option", f"redis://:{MARKER}@h/0?sockettimeout=2", "unknown URL option 'sockettimeout'"),
    ("unix-unknown-option", "unix:///tmp/ce.sock?db=1&sockettimeout=2", "unknown URL option 'sockettimeout'"),
    (
        "sentinel-unknown-option",
        f"redis+sentinel://:{MARKER}@h1,h2/svc/0?sockettimeout=2",
        "unknown URL option 'sockettimeout'",
    ),
    # A cluster client is built on first use, and keeps only the connection options of its
    # query (redis-py's cleanup_kwargs): an unknown parameter was dropped silently, one that
    # binds a RedisCluster argument was passed as text ("false" is true), a bad value waited.
    (
        "cluster-unknown-option",
        f"redis+cluster://:{MARKER}@127.0.0.1:7000/?bogus=1",
        "unknown URL option 'bogus'",
    ),
    (
        "cluster-misspelt-option",
        f"rediss+cluster://:{MARKER}@h1:7000,h2:7001?sockettimeout=2",
        "unknown URL option 'sockettimeout'",
    ),
    (
        "cluster-dropped-option",
        f"redis+cluster://:{MARKER}@h:7000?health_check_interval=5",
        "unknown URL option 'health_check_interval'",
    ),
    (
        "cluster-client-argument",
        f"redis+cluster://:{MARKER}@h:7000?require_full_coverage=false",
        "unknown URL option 'require_full_coverage'",
    ),
    ("cluster-tls-option-without-tls", f"redis+cluster://:{MARKER}@h?ssl_cert_reqs=none", "'ssl_cert_reqs'"),
    ("cluster-bad-timeout", f"redis+cluster://:{MARKER}@h:7000?socket_timeout=abc", "'socket_timeout'"),
    ("cluster-bad-cert-reqs", f"rediss+cluster://:{MARKER}@h:7000?ssl_cert_reqs=bogus", "bad redis URL"),
    ("cluster-bad-pool-size", f"redis+cluster://:{MARKER}@h:7000?max_connections=-1", "max_connections"),
    # redis-py's Sentinel pool reads these itself, any text as true: "ssl=false" meant TLS.
    ("sentinel-ssl-option", f"redis+sentinel://:{MARKER}@h1,h2/svc?ssl=false", "unknown URL option 'ssl'"),
    (
        "sentinel-check-connection",
        f"redis+sentinel://:{MARKER}@h1/svc?check_connection=no",
        "unknown URL option 'check_connection'",
    ),
    ("sentinel-bad-timeout", f"redis+sentinel://:{MARKER}@h1/svc?socket_timeout=abc", "'socket_timeout'"),
    # It also meant TLS: the query's connection_class was taken for the one rediss:// sets.
    (
        "sentinel-connection-class",
        f"redis+sentinel://:{MARKER}@h1/svc?connection_class=x",
        "URL option 'connection_class'",
    ),
    # Parameters that take a Python object (a class, a cache, a callback): redis-py passed
    # the URL's text on, to fail as a bare AttributeError or TypeError (at once, or on the
    # first call), a message naming no parameter, or not at all (cache_factory: unused).
    ("redis-cache-config", f"redis://:{MARKER}@h/0?cache_config=x", "URL option 'cache_config'"),
    ("redis-cache", f"redis://:{MARKER}@h/0?cache=true&protocol=3", "URL option 'cache'"),
    ("redis-cache-factory", f"redis://:{MARKER}@h/0?cache_factory=x", "URL option 'cache_factory'"),
    ("redis-connection-class", f"redis://:{MARKER}@h/0?connection_class=x", "URL option 'connection_class'"),
    ("redis-retry-object", f"redis://:{MARKER}@h/0?retry=x", "URL option 'retry'"),
    ("redis-credential-provider", f"redis://h/0?credential_provider={MARKER}", "'credential_provider'"),
    ("redis-socket-type", f"redis://:{MARKER}@h/0?socket_type=1", "URL option 'socket_type'"),
    ("unix-parser-class", "unix:///tmp/ce.sock?parser_class=x", "URL option 'parser_class'"),
    (
        "sentinel-cache-config",
        f"redis+sentinel://:{MARKER}@h1/svc?cache_config=x",
        "URL option 'cache_config'",
    ),
    ("cluster-cache-config", f"redis+cluster://:{MARKER}@h:7000?cache_config=x", "URL option 'cache_config'"),
    # Truth values: redis-py read any text but its false ones as true (decode_responses:
    # any text at all, "false" too).
    ("redis-truth-value", f"redis://:{MARKER}@h/0?decode_responses=maybe", "URL option 'decode_responses'"),
    ("rediss-truth-value", f"rediss://:{MARKER}@h/0?ssl_check_hostname=2", "URL option 'ssl_check_hostname'"),
    ("sentinel-truth-value", f"redis+sentinel://:{MARKER}@h1/svc?socket_keepalive=x", "'socket_keepalive'"),
    ("cluster-truth-value", f"redis+cluster://:{MARKER}@h?retry_on_timeout=maybe", "'retry_on_timeout'"),
    # Numbers out of range: a bare ValueError or an error from the server on the first
    # call, or read as something else (max_connections=0 is 100, socket_timeout=0 no wait).
    ("redis-negative-timeout", f"redis://:{MARKER}@h/0?socket_timeout=-1", "URL option 'socket_timeout'"),
    ("redis-zero-timeout", f"redis://:{MARKER}@h/0?socket_timeout=0", "URL option 'socket_timeout'"),
    ("redis-nan-timeout", f"redis://:{MARKER}@h/0?socket_connect_timeout=nan", "'socket_connect_timeout'"),
    ("redis-infinite-timeout", f"redis://:{MARKER}@h/0?socket_timeout=inf", "URL option 'socket_timeout'"),
    ("sentinel-negative-timeout", f"redis+sentinel://:{MARKER}@h1/svc?socket_timeout=-1", "'socket_timeout'"),
    ("cluster-negative-timeout", f"redis+cluster://:{MARKER}@h?socket_connect_timeout=-1", "'socket_connect"),
    ("redis-negative-db", f"redis://:{MARKER}@h?db=-1", "URL option 'db'"),
    ("redis-health-check", f"redis://:{MARKER}@h/0?health_check_interval=-1", "'health_check_interval'"),
    ("redis-pool-size-zero", f"redis://:{MARKER}@h/0?max_connections=0", "URL option 'max_connections'"),
    ("redis-read-size-zero", f"redis://:{MARKER}@h/0?socket_read_size=0", "URL option 'socket_read_size'"),
    ("rediss-tls-version", f"rediss://:{MARKER}@h/0?ssl_min_version=99", "URL option 'ssl_min_version'"),
    ("redis-client-name", f"redis://:{MARKER}@h/0?client_name=a%20b", "URL option 'client_name'"),
    ("redis-encoding", f"redis://:{MARKER}@h/0?encoding=bogus", "URL option 'encoding'"),
    ("redis-encoding-errors", f"redis://:{MARKER}@h/0?encoding_errors=bogus", "URL option 'encoding_errors'"),
    # Given twice: redis-py took the first value, the ce_ options the last; the database
    # in the path and the query, redis-py the query's, a Sentinel URL the path's.
    ("redis-db-twice", f"redis://:{MARKER}@h?db=1&db=2", "URL option 'db' is given twice"),
    ("redis-db-path-and-query", f"redis://:{MARKER}@h/0?db=1", "URL option 'db'"),
    ("sentinel-db-path-and-query", f"redis+sentinel://:{MARKER}@h1/svc/1?db=2", "URL option 'db'"),
    ("cluster-option-twice", f"redis+cluster://:{MARKER}@h?socket_timeout=1&socket_timeout=2", "given twice"),
    ("ce-option-twice", f"redis://:{MARKER}@h/0?ce_wait_timeout=1&ce_wait_timeout=2", "given twice"),
    ("rediss-bad-cert-reqs", f"rediss://:{MARKER}@h/0?ssl_cert_reqs=bogus", "bad redis URL"),
    ("redis-raw-slash-in-password", f"redis://:ab/{MARKER}@h/0", "percent-encode a '/' in the password"),
    # A raw "@" in an SQL password: SQLAlchemy ends the password at the first one and took
    # the rest for the host, which the driver then tried to resolve (a BackendError).
    ("pg-raw-at-in-password", f"postgresql://u:ab@{MARKER}@127.0.0.1/x", "percent-encode an '@'"),
    ("mysql-raw-at-in-password", f"mysql+pymysql://u:ab@{MARKER}@127.0.0.1/x", "percent-encode an '@'"),
    # SQLAlchemy's own ArgumentError, outside the package's errors (the CLI's "unexpected" exit 3).
    ("sqlite-two-slashes", "sqlite://locks.db", "malformed SQL lock store URL 'sqlite://locks.db'"),
    ("missing-driver", "postgresql+nosuchdriver://h/x", "pip install"),
    # Driver parameters SQLAlchemy converts when it builds the engine: named, never a ValueError.
    ("sqlite-timeout", "sqlite:///x.db?timeout=abc", "bad value for URL option 'timeout'"),
    ("sqlite-flag", "sqlite:///x.db?uri=abc&timeout=2", "bad value for URL option 'uri'"),
    ("sqlite-int", "sqlite:///x.db?cached_statements=1.5", "bad value for URL option 'cached_statements'"),
    (
        "mysql-timeout",
        f"{UNREACHABLE['mariadb']}?connect_timeout=abc",
        "bad value for URL option 'connect_timeout'",
    ),
    (
        "mysql-flag",
        f"{UNREACHABLE['mariadb']}?charset=utf8mb4&compress=abc",
        "bad value for URL option 'compress'",
    ),
    (
        "mariadb-timeout",
        f"mariadb+pymysql://u:{MARKER}@h/x?read_timeout=1e3",
        "bad value for URL option 'read_timeout'",
    ),
    # Values SQLAlchemy passes on as they are: the driver would reject them only on connect.
    ("mysql-charset", f"{UNREACHABLE['mariadb']}?charset=nope", "bad value for URL option 'charset'"),
    ("mariadb-charset", f"mariadb://u:{MARKER}@h/x?charset=nope", "bad value for URL option 'charset'"),
    ("mysql-int", f"{UNREACHABLE['mariadb']}?max_allowed_packet=16M", "URL option 'max_allowed_packet'"),
    ("mysql-timeout-zero", f"{UNREACHABLE['mariadb']}?read_timeout=0", "URL option 'read_timeout'"),
    (
        "pg-keepalives-idle",
        f"{UNREACHABLE_PG}?keepalives_idle=abc",
        "bad value for URL option 'keepalives_idle'",
    ),
    (
        "pg-connect-timeout",
        f"{UNREACHABLE_PG}?connect_timeout=abc",
        "bad value for URL option 'connect_timeout'",
    ),
    (
        "pg-int-fraction",
        f"{UNREACHABLE_PG}?tcp_user_timeout=1.5",
        "bad value for URL option 'tcp_user_timeout'",
    ),
    ("pg-int-overflow", f"{UNREACHABLE_PG}?keepalives_count=9999999999", "URL option 'keepalives_count'"),
    ("pg-flag", f"{UNREACHABLE_PG}?sslsni=yes", "bad value for URL option 'sslsni'"),
    (
        "pg-host-list",
        f"postgresql://u:{MARKER}@h1,h2:5/x?keepalives=x",
        "bad value for URL option 'keepalives'",
    ),
    (
        "pg-secret-in-query",
        f"{UNREACHABLE_PG}?password={MARKER}&keepalives_interval=-",
        "bad value for URL option 'keepalives_interval'",
    ),
    ("pg-unknown-option", f"{UNREACHABLE_PG}?keepalive=1", "unknown URL option 'keepalive'"),
    # libpq's enumerated values: it judges them itself, asked without connecting.
    ("pg-sslmode", f"{UNREACHABLE_PG}?sslmode=bogus", "bad value for URL option 'sslmode'"),
    ("pg-sslmode-case", f"{UNREACHABLE_PG}?sslmode=REQUIRE", "bad value for URL option 'sslmode'"),
    (
        "pg-target-session-attrs",
        f"{UNREACHABLE_PG}?target_session_attrs=nope",
        "bad value for URL option 'target_session_attrs'",
    ),
    ("pg-gssencmode", f"{UNREACHABLE_PG}?gssencmode=x", "bad value for URL option 'gssencmode'"),
    ("pg-channel-binding", f"{UNREACHABLE_PG}?channel_binding=x", "URL option 'channel_binding'"),
    ("pg-load-balance", f"{UNREACHABLE_PG}?load_balance_hosts=x", "URL option 'load_balance_hosts'"),
    ("pg-sslnegotiation", f"{UNREACHABLE_PG}?sslnegotiation=x", "URL option 'sslnegotiation'"),
    ("pg-sslcertmode", f"{UNREACHABLE_PG}?sslcertmode=x", "bad value for URL option 'sslcertmode'"),
    ("pg-require-auth", f"{UNREACHABLE_PG}?require_auth=x", "bad value for URL option 'require_auth'"),
    (
        "pg-tls-version",
        f"{UNREACHABLE_PG}?ssl_min_protocol_version=TLSv9",
        "bad value for URL option 'ssl_min_protocol_version'",
    ),
    (
        "pg-weak-sslmode-for-direct",
        f"{UNREACHABLE_PG}?sslnegotiation=direct&application_name=a",
        "bad value for URL option 'sslnegotiation'",
    ),
    (
        "pg-secret-with-bad-enum",
        f"{UNREACHABLE_PG}?sslpassword={MARKER}&sslmode=bogus",
        "bad value for URL option 'sslmode'",
    ),
    (
        "pg-tls-range",
        f"{UNREACHABLE_PG}?ssl_min_protocol_version=TLSv1.3&ssl_max_protocol_version=TLSv1.2",
        "'ssl_min_protocol_version', 'ssl_max_protocol_version' of lock store URL",
    ),
    ("pg-no-such-service", f"{UNREACHABLE_PG}?service=ce-no-such-service", "URL option 'service'"),
    ("pg-replication", f"{UNREACHABLE_PG}?replication=database", "bad value for URL option 'replication'"),
    ("pg-replication-bogus", f"{UNREACHABLE_PG}?replication=x", "bad value for URL option 'replication'"),
    # PyMySQL arguments SQLAlchemy passes on as text, which PyMySQL reads as a truth value.
    ("mysql-ssl-disabled", f"{UNREACHABLE['mariadb']}?ssl_disabled=maybe", "URL option 'ssl_disabled'"),
    (
        "mysql-verify-identity",
        f"{UNREACHABLE['mariadb']}?ssl_verify_identity=2",
        "bad value for URL option 'ssl_verify_identity'",
    ),
    ("mysql-binary-prefix", f"{UNREACHABLE['mariadb']}?binary_prefix=x", "URL option 'binary_prefix'"),
    ("mysql-verify-cert", f"{UNREACHABLE['mariadb']}?ssl_verify_cert=bogus", "URL option 'ssl_verify_cert'"),
]


@pytest.mark.parametrize(
    ("url", "fragment"), [(u, f) for _, u, f in BAD_URLS], ids=[i for i, _, _ in BAD_URLS]
)
def test_bad_urls_raise_configuration_error(url: str, fragment: str) -> None:
    """provider_from_url and LockService(url) reject a bad URL by name, with its password masked."""
    for build in (provider_from_url, LockService):
        with pytest.raises(ConfigurationError) as raised:
            build(url)
        assert fragment in str(raised.value)
        assert MARKER not in str(raised.value)
        assert MARKER not in repr(raised.value)


MULTI_HOST_BAD_URLS = [(name, url) for name, url, _ in BAD_URLS if name.startswith(("cluster-", "sentinel-"))]


@pytest.mark.parametrize(
    "url", [url for _, url in MULTI_HOST_BAD_URLS], ids=[name for name, _ in MULTI_HOST_BAD_URLS]
)
def test_bad_cluster_and_sentinel_parameters_show_no_piece_of_the_password(url: str) -> None:
    """A refused query parameter of a multi-host Redis URL: no 4-character piece of the
    password in the error, its repr or its traceback (the chained driver error included)."""
    pieces = {MARKER[i : i + 4] for i in range(len(MARKER) - 3)}
    for build in (provider_from_url, LockService):
        with pytest.raises(ConfigurationError) as raised:
            build(url)
        texts = _texts_of(raised.value)
        assert not [text for text in texts if any(piece in text for piece in pieces)], texts[0]
        assert "***" in str(raised.value)


@pytest.mark.parametrize(
    ("server", "options"),
    [
        (
            POSTGRES_URL,
            "keepalives_idle=%207&keepalives=1&tcp_user_timeout=+20000&sslsni=0&connect_timeout=5",
        ),
        (POSTGRES_URL, "application_name=ce-bad-input&target_session_attrs=any"),
        (
            POSTGRES_URL,
            "sslmode=prefer&gssencmode=disable&channel_binding=prefer&target_session_attrs=read-write"
            "&load_balance_hosts=random&sslnegotiation=postgres&sslcertmode=allow"
            "&require_auth=!password&ssl_min_protocol_version=TLSv1.2&replication=off",
        ),
        (
            MYSQL_URL,
            "charset=utf8mb4&read_timeout=30&write_timeout=30&local_infile=0&max_allowed_packet=65536",
        ),
        # PyMySQL read each "false" as true: TLS required of a server without it.
        (MYSQL_URL, "ssl_verify_identity=false&ssl_verify_cert=false&binary_prefix=0"),
    ],
    ids=["postgres-numbers", "postgres-strings", "postgres-enums", "mariadb", "mariadb-truths"],
)
def test_valid_driver_options_still_work(server: str, options: str) -> None:
    """The driver parameter checks let every valid value through: the store serves a lock."""
    require_server(server)
    table = f"ce_opt_{uuid.uuid4().hex[:10]}"
    service = LockService(f"{server}?{options}&ce_table={table}", prefix="opt:")
    try:
        lease = service.lock("k", ttl=30)
        assert lease.release() is ReleaseOutcome.RELEASED
    finally:
        service.close()
        drop_lock_table(server, table)


def test_pymysql_gets_typed_values_from_the_url() -> None:
    """PyMySQL kept ``max_allowed_packet`` as text (a TypeError in LOAD DATA LOCAL) and read
    ``ssl_disabled=false`` as true (no TLS even where the server offers it): both arrive typed."""
    require_server(MYSQL_URL)
    engine = engine_from_url(f"{MYSQL_URL}?max_allowed_packet=65536&ssl_disabled=false")
    try:
        connection = engine.raw_connection()
        try:
            driver = connection.driver_connection
            assert driver is not None
            assert driver.max_allowed_packet == 65536
            assert type(driver.max_allowed_packet) is int
            assert driver.ssl is True  # TLS preferred, as without the option
        finally:
            connection.close()
    finally:
        engine.dispose()


def test_libpq_choices_shown_are_ones_libpq_takes() -> None:
    """The allowed values an error lists (a kept list: libpq exposes none) are each taken by
    the libpq in use, and a bad value's error lists them."""
    # The two that libpq refuses alone with its defaults (sslmode=prefer, TLSv1.2 at least).
    context = {
        "sslnegotiation": "&sslmode=require",
        "ssl_max_protocol_version": "&ssl_min_protocol_version=TLSv1",
    }
    for name, choices in LIBPQ_CHOICES.items():
        for choice in choices:
            LockService(f"{UNREACHABLE_PG}?{name}={choice}{context.get(name, '')}").close()
        with pytest.raises(ConfigurationError) as raised:
            LockService(f"{UNREACHABLE_PG}?{name}=ce-bogus")
        assert f"URL option {name!r}" in str(raised.value)
        assert f"allowed: {', '.join(choices)}" in str(raised.value)


PSYCOPG2_BAD_URLS = [
    ("?keepalive=1", "unknown URL option 'keepalive'"),
    ("?sslmode=bogus", "bad value for URL option 'sslmode'"),
    ("?target_session_attrs=nope&connect_timeout=3", "bad value for URL option 'target_session_attrs'"),
    ("?keepalives_idle=abc", "bad value for URL option 'keepalives_idle'"),
]


@pytest.mark.parametrize(("query", "fragment"), PSYCOPG2_BAD_URLS)
def test_psycopg2_url_parameters_are_checked_too(query: str, fragment: str) -> None:
    """A postgresql+psycopg2:// URL's parameters are judged by psycopg2's libpq as psycopg's are."""
    pytest.importorskip("psycopg2")
    url = f"postgresql+psycopg2://u:{MARKER}@127.0.0.1:1/x{query}"
    with pytest.raises(ConfigurationError) as raised:
        LockService(url)
    assert fragment in str(raised.value)
    assert MARKER not in str(raised.value)
    assert MARKER not in repr(raised.value)


def test_psycopg2_valid_options_still_lock() -> None:
    """psycopg2 with valid libpq options serves a lock on the real PostgreSQL."""
    pytest.importorskip("psycopg2")
    require_server(POSTGRES_URL)
    server = POSTGRES_URL.replace("+psycopg://", "+psycopg2://", 1)
    table = f"ce_opt_{uuid.uuid4().hex[:10]}"
    options = "sslmode=prefer&target_session_attrs=read-write&keepalives=1&application_name=ce"
    service = LockService(f"{server}?{options}&ce_table={table}", prefix="opt:")
    try:
        assert service.lock("k", ttl=30).release() is ReleaseOutcome.RELEASED
    finally:
        service.close()
        drop_lock_table(POSTGRES_URL, table)


def test_missing_driver_is_a_configuration_error_naming_the_extra() -> None:
    """An unknown driver raises MissingDriverError, a ConfigurationError naming the pip line."""
    with pytest.raises(MissingDriverError, match=r"celery-exclusive\[postgres\]"):
        provider_from_url("postgresql+nosuchdriver://h/x")


@pytest.mark.parametrize(
    ("url", "hidden", "fragment"),
    [
        ("postgresql+nosuchdriver://h/x", None, "or use postgresql+psycopg:// (pip install"),
        ("mysql+nosuchdriver://h/x", None, "or use mysql+pymysql:// (pip install 'celery-exclusive[mysql]')"),
        ("postgresql://h/x", "psycopg", "pip install 'celery-exclusive[postgres]'"),
        ("mariadb://h/x", "pymysql", "pip install 'celery-exclusive[mysql]'"),
        # These advised "sqlite+sqlite3://", which SQLAlchemy does not know, and an extra
        # celery-exclusive[sqlite] that does not exist.
        ("sqlite+nosuchdriver:///x.db", None, "or use sqlite:/// (Python's own sqlite3 module"),
        ("sqlite:///x.db", "sqlite3", "a Python built with its sqlite3 module"),
    ],
)
def test_a_missing_driver_names_an_install_that_exists(
    url: str, hidden: str | None, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing driver's error names a pip extra the package has and a URL form SQLAlchemy
    knows, for every SQL backend (a driver not importable is simulated by hiding it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    if hidden is not None:
        for name in [m for m in sys.modules if m == hidden or m.startswith(f"{hidden}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(MissingDriverError) as raised:
        provider_from_url(url)
    message = str(raised.value)
    assert fragment in message
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for named in re.findall(r"celery-exclusive\[(\w+)\]", message):
        assert named in extras, message
    for scheme in re.findall(r"use ([\w+]+)://", message):
        sa.make_url(f"{scheme}://").get_dialect()  # a URL form SQLAlchemy knows


@pytest.mark.parametrize("url", ["", None])
def test_no_url_at_all_names_every_place_to_set_one(url: str | None) -> None:
    """No URL anywhere is a ConfigurationError naming the argument and the environment variable."""
    with pytest.raises(ConfigurationError, match="CELERY_EXCLUSIVE_URL"):
        LockService(url)


@pytest.mark.parametrize("url", [5, b"memory://", None, ["memory://"]])
def test_provider_from_url_rejects_non_strings(url: Any) -> None:
    """provider_from_url() of something that is not a str is a ConfigurationError, not a crash."""
    with pytest.raises(ConfigurationError, match="malformed lock store URL"):
        provider_from_url(url)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: SqlLockProvider(5), "expected an SQLAlchemy Engine or URL"),  # type: ignore[arg-type]
        (lambda: SqlLockProvider(UNREACHABLE_PG, table="bad name"), "invalid lock table name"),
        (lambda: SqlLockProvider(UNREACHABLE_PG, table=5), "invalid lock table name"),  # type: ignore[arg-type]
        (lambda: SqlLockProvider(UNREACHABLE_PG, table='x"; DROP TABLE y; --'), "invalid lock table name"),
        (lambda: SqlLockProvider("redis://h/0"), "not an SQL lock store URL"),
        (lambda: lock_table(sa.MetaData(), "1x"), "invalid lock table name"),
        (lambda: _redis_provider(None), "needs a url or a client"),
    ],
)
def test_provider_constructors_reject_bad_arguments(build: Callable[[], object], fragment: str) -> None:
    """The public provider constructors reject bad identifiers and types with ConfigurationError."""
    with pytest.raises(ConfigurationError) as raised:
        build()
    assert fragment in str(raised.value)


def _redis_provider(url: str | None) -> object:
    from celery_exclusive.providers.redis import RedisLockProvider

    return RedisLockProvider(url)


# -- the Celery integration ---------------------------------------------------------------------


def _app(url: object = UNREACHABLE_PG, **conf: object) -> Celery:
    app = Celery(f"bad-input-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.exclusive_url = url
    app.conf.update(conf)
    return app


def _body(x: object = 1) -> object:
    return x


def _declare(app: Celery, **options: Any) -> Any:
    # shared=False: a shared task (Celery's default) joins every app finalized later, other tests' too
    return exclusive_task(app=app, name=f"bad_input.t{uuid.uuid4().hex[:8]}", shared=False, **options)(_body)


DECLARATION_CASES: list[tuple[dict[str, Any], str]] = [
    ({"key": 123}, "format template str or a callable, got int"),
    ({"key": b"{x}"}, "got bytes"),
    ({"key": ""}, "must not be empty"),
    ({"key": "{missing}"}, "no parameter 'missing'"),
    ({"key": "{0}"}, "positional field"),
    ({"key": "{}"}, "positional field"),
    ({"key": "{"}, "malformed"),
    ({"key": "}"}, "malformed"),
    # Knowable from the template alone, yet refused only at every call.
    ({"key": "a\x00{x}"}, "NUL"),
    ({"key": ["a:{x}", "b\x00"]}, "NUL"),
    ({"key": "a\udc80{x}"}, "lone surrogates"),
    ({"key": "a:{x!z}"}, "conversion"),
    # A key callable is called with the task's arguments: one that cannot take them raised
    # a bare TypeError at every call.
    ({"key": lambda: "k"}, "lock key callable must take the task's arguments (x)"),
    ({"key": lambda x, y: "k"}, "lock key callable must take the task's arguments"),
    ({"key": lambda *, x: "k"}, "lock key callable must take the task's arguments"),
    *[
        ({name: v}, f"lock_{name} must")
        for name in ("ttl", "max_lifetime", "refresh_interval")
        for _, v, _ in BAD_DURATIONS
    ],
    *[
        ({name: v}, f"{name} must")
        for name in ("lock_retry_backoff", "lock_retry_backoff_max")
        for _, v, _ in BAD_DURATIONS
    ],
    ({"on_locked": "bogus"}, "on_locked must be one of"),
    ({"on_locked": 5}, "on_locked must be one of"),
    # A callable taking other than (task, key, holder) failed only once the key was held:
    # a TypeError from the worker, naming neither the option nor the task.
    ({"on_locked": lambda: None}, "on_locked callable must take (task, key, holder)"),
    ({"on_locked": lambda task: None}, "on_locked callable must take (task, key, holder)"),
    ({"on_locked": lambda task, key, holder, extra: None}, "on_locked callable must take"),
    ({"on_locked": lambda *, task, key, holder: None}, "on_locked callable must take"),
    ({"on_duplicate": lambda task, key: None}, "on_duplicate callable must take (task, key, existing"),
    ({"on_lost": "bogus"}, "on_lost must be one of"),
    # Options one policy alone reads, given beside another policy, were ignored without a word.
    ({"on_locked": "skip", "lock_wait": 5}, "lock_wait applies only under on_locked='wait'"),
    ({"on_locked": "retry", "lock_wait_fallback": "raise"}, "lock_wait_fallback applies only under"),
    ({"on_locked": "wait", "rerun_args": "latest"}, "lock_rerun_args applies only under on_locked='rerun'"),
    # 0 (or a negative) for "no records" was told only to be positive: False is the way.
    *[({"done_retention": v}, "or False to keep no completion records") for v in (0, -1, "0")],
    ({"on_lost": 1}, "on_lost must be one of"),
    ({"lock_max_retries": -1}, "lock_max_retries must be an int >= 0"),
    ({"lock_max_retries": True}, "lock_max_retries must be an int >= 0"),
    ({"lock_max_retries": "3"}, "lock_max_retries must be an int >= 0"),
    ({"lock_max_retries": 1.5}, "lock_max_retries must be an int >= 0"),
    ({"ttl": 5, "lock_ttl": 6}, "given twice"),
    ({"key": "{x}", "lock_key": "{x}"}, "given twice"),
    ({"base": int}, "base must be a celery Task subclass"),
    ({"base": "builtins:dict"}, "base must be a celery Task subclass"),
]


@pytest.mark.parametrize(("options", "fragment"), DECLARATION_CASES)
def test_exclusive_task_rejects_bad_options_when_declared(options: dict[str, Any], fragment: str) -> None:
    """exclusive_task(...) rejects a bad key or lock option at declaration, by name."""
    with pytest.raises(InvalidArgumentError) as raised:
        _declare(_app(), **options)
    assert fragment in str(raised.value)


class _Policy:
    def __call__(self, task: object, key: str, holder: object) -> str:
        return "instance"


@pytest.mark.parametrize(
    "policy",
    [
        lambda task, key, holder: "plain",
        lambda *args: "varargs",
        lambda task, key, holder, extra="x": "default",
        lambda task, /, key, holder: "positional-only",
        _Policy(),
        functools.partial(lambda tag, task, key, holder: tag, "partial"),
    ],
    ids=["plain", "varargs", "default", "positional-only", "instance", "partial"],
)
def test_an_on_locked_callable_of_any_fitting_signature_is_taken(policy: Callable[..., str]) -> None:
    """The signature check refuses no callable that takes (task, key, holder): each answers
    for a run whose key is held."""
    app = _app("memory://")
    task = _declare(app, on_locked=policy)
    with get_lock_service(app).lock(task.name, ttl=30):
        assert task() == policy(None, "k", None)
    _close_app_service(app)


@pytest.mark.parametrize(
    ("attrs", "fragment"),
    [
        ({"lock_ttl": "5"}, "lock_ttl must"),
        ({"lock_ttl": math.nan}, "lock_ttl must"),
        ({"lock_max_lifetime": -1}, "lock_max_lifetime must"),
        ({"lock_on_locked": "sometimes"}, "on_locked must be one of"),
        ({"lock_on_lost": "panic"}, "on_lost must be one of"),
        ({"lock_max_retries": -2}, "lock_max_retries must"),
        ({"lock_key": "{nope}"}, "no parameter 'nope'"),
        ({"lock_key": 7}, "format template str or a callable"),
    ],
)
def test_exclusive_task_subclass_rejects_bad_attributes(attrs: dict[str, Any], fragment: str) -> None:
    """A class-based ExclusiveTask with a bad lock attribute fails when the class is made."""

    def run(self: Any, a: object = None) -> object:
        return a

    with pytest.raises(InvalidArgumentError) as raised:
        type("BadTask", (ExclusiveTask,), {"run": run, **attrs})
    assert fragment in str(raised.value)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"ttl": 100, "max_lifetime": 50}, "must not exceed max_lifetime"),
        ({"ttl": 10, "refresh_interval": 10}, "must be shorter than ttl"),
        ({"max_lifetime": 10**6}, "hard cap"),
        ({"lock_retry_backoff": 10, "lock_retry_backoff_max": 1}, "must not be shorter"),
    ],
)
def test_inconsistent_task_options_fail_before_the_store(options: dict[str, Any], fragment: str) -> None:
    """Options fine alone but not together raise InvalidArgumentError by the first call at the latest."""
    app = _app()
    with pytest.raises(InvalidArgumentError) as raised:
        _declare(app, **options)(1)
    assert fragment in str(raised.value)
    _close_app_service(app)


def test_misspelt_lock_option_is_rejected() -> None:
    """A misspelt lock option (lock_tll) is rejected instead of silently ignored."""
    with pytest.raises(InvalidArgumentError, match="lock_tll"):
        _declare(_app(), lock_tll=5)
    # shared=False: a shared task would be added to every app created later, and fail there.
    proxy = _app().task(
        base=ExclusiveTask, name=f"bad_input.t{uuid.uuid4().hex[:8]}", shared=False, lock_tll=5
    )
    with pytest.raises(InvalidArgumentError, match="lock_tll"):
        proxy(_body).name  # noqa: B018 - evaluating the lazy proxy makes Celery build the task class


@pytest.mark.parametrize("name", ["lock_settings", "lock_service", "lock_key_for", "lock_keys_for"])
def test_a_helper_of_the_task_is_no_lock_option(name: str) -> None:
    """``lock_settings=...`` (a property of the task) is refused like a misspelt option, and
    the refusal's list of known options names options only. It used to be accepted, set
    over the property, and fail every run with an AttributeError."""
    with pytest.raises(InvalidArgumentError, match=f"unknown lock option\\(s\\) {name};") as raised:
        _declare(_app(), **{name: "oops"})
    known = str(raised.value).partition("known: ")[2].split(", ")
    assert "lock_ttl" in known
    assert not {"lock_settings", "lock_service", "lock_key_for", "lock_keys_for"} & set(known)


@pytest.mark.parametrize(
    "options",
    [
        {"ttl": 60, "max_lifetime": 30},
        {"ttl": 10, "refresh_interval": 10},
        {"max_lifetime": 90_000},
    ],
)
def test_inconsistent_durations_are_rejected_at_declaration(options: dict[str, float]) -> None:
    """ttl above max_lifetime, an interval not below the ttl, or a lifetime over 24 h fail when declared."""
    with pytest.raises(InvalidArgumentError):
        _declare(_app(), **options)


def _key_callable_returning(value: object) -> Callable[..., object]:
    return lambda x=1: value


@pytest.mark.parametrize(
    ("key", "args", "fragment"),
    [
        ("{x}", (), None),  # the control: a good key, so the call reaches the (unreachable) store
        ("{x}", ("\x00",), "NUL"),
        ("{x}", ("\ud800",), "lone surrogates"),
        ("{x}", ("x" * 10240,), "this store accepts at most"),
        ("{x}", (object(),), "an object has no stable text form"),
        ("{x}", (1, 2), "do not match its signature"),
        ("{x.missing}", (1,), "AttributeError"),
        ("{x[3]}", ([1],), "IndexError"),
        (_key_callable_returning(""), (), "must return a non-empty str"),
        (_key_callable_returning(5), (), "must return a non-empty str"),
        (_key_callable_returning("a\x00"), (), "NUL"),
        (_key_callable_returning("x" * 10240), (), "this store accepts at most"),
        (_key_callable_returning(["a", "b\ud800"]), (), "lone surrogates"),
        (["a:{x}", "b:{x}"], ("x" * 10240,), "this store accepts at most"),
    ],
)
def test_task_call_with_an_unusable_key_fails_before_the_store(
    key: Any, args: tuple[object, ...], fragment: str | None
) -> None:
    """A call whose lock key cannot be built or is invalid raises InvalidArgumentError, not
    BackendError, naming the task and where its key came from (a key too long, or with a
    NUL, used to be told as for LockService.lock: no task, no template)."""
    app = _app()
    task = _declare(app, key=key)
    if fragment is None:
        with pytest.raises(BackendError):
            task(*args)
    else:
        with pytest.raises(InvalidArgumentError) as raised:
            task(*args)
        assert fragment in str(raised.value)
        assert task.name in str(raised.value)
        source = repr(key) if isinstance(key, str) else repr(key) if isinstance(key, list) else "callable"
        assert source in str(raised.value)
    _close_app_service(app)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_an_error_raised_by_a_key_callable_says_which_task_it_was_building_for() -> None:
    """An exception a key callable raises is the caller's own (its type kept) with a note
    naming the task whose key it was building: the traceback showed only the callable."""

    def key(x: object = 1) -> str:
        raise LookupError("no such tenant")

    app = _app()
    task = _declare(app, key=key)
    with pytest.raises(LookupError) as raised:
        task()
    assert raised.value.__notes__ == [f"while building the lock key of {task.name} with its key callable"]
    _close_app_service(app)


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        ({"exclusive_default_ttl": "abc"}, "app.conf.exclusive_default_ttl"),
        ({"exclusive_default_ttl": -1}, "app.conf.exclusive_default_ttl"),
        ({"exclusive_default_ttl": math.nan}, "app.conf.exclusive_default_ttl"),
        ({"exclusive_max_lifetime": 10**6}, "hard cap"),
        ({"exclusive_prefix": "bad prefix"}, "app.conf.exclusive_prefix"),
        ({"exclusive_on_locked": "bogus"}, "app.conf.exclusive_on_locked"),
        ({"exclusive_on_lost": "bogus"}, "app.conf.exclusive_on_lost"),
        ({"exclusive_on_locked": lambda task: None}, "app.conf.exclusive_on_locked: on_locked callable"),
        ({"exclusive_lock_max_retries": -1}, "app.conf.exclusive_lock_max_retries"),
        ({"exclusive_url": 5}, "app.conf.exclusive_url"),
        ({"exclusive_url": f"foo://u:{MARKER}@h/x"}, "unknown lock store scheme"),
        ({"exclusive_url": f"{UNREACHABLE_PG}?ce_bogus=1"}, "unknown option 'ce_bogus'"),
        ({"exclusive_url": f"{UNREACHABLE_PG}?ce_table=a-b"}, "invalid lock table name"),
    ],
)
def test_bad_app_settings_raise_configuration_error_before_the_store(
    conf: dict[str, Any], fragment: str
) -> None:
    """A bad app.conf setting fails the first call with ConfigurationError naming the setting."""
    app = _app(**conf)
    task = _declare(app)
    with pytest.raises(ConfigurationError) as raised:
        task()
    assert fragment in str(raised.value)
    assert MARKER not in str(raised.value)


@pytest.mark.parametrize(
    ("conf", "options"),
    [
        ({}, {"lock_wait": 5}),  # the default on_locked, "skip"
        ({"exclusive_on_locked": "retry"}, {"lock_wait_fallback": "raise"}),
        ({"exclusive_on_locked": "wait"}, {"rerun_args": "latest"}),
    ],
)
def test_a_policy_option_the_apps_policy_does_not_read_fails_the_call_before_the_store(
    conf: dict[str, Any], options: dict[str, Any]
) -> None:
    """A task that sets ``lock_wait`` (or another option one ``on_locked`` policy alone
    reads) but leaves ``on_locked`` to the app, whose policy is another, fails each call
    with InvalidArgumentError naming the task, the option and the app's policy (the
    worker's start-up check reports it: ``check_lock_settings``). It ran with the option
    ignored: a task given ``lock_wait=5`` and no ``on_locked`` skipped at once."""
    task = _declare(_app(**conf), **options)
    for call in (task, task.check_lock_settings):
        with pytest.raises(InvalidArgumentError) as raised:
            call()
        assert task.name in str(raised.value)
        assert "applies only under on_locked=" in str(raised.value)
        assert "(the app's)" in str(raised.value)


def test_a_policy_option_under_its_policy_is_taken() -> None:
    """The same options under the policy that reads them, the task's own or the app's."""
    assert _declare(_app(), on_locked="wait", lock_wait=5).lock_settings.lock_wait == 5
    wait_app = _app(exclusive_on_locked="wait")
    assert (
        _declare(wait_app, lock_wait=5, lock_wait_fallback="raise").lock_settings.lock_wait_fallback
        == "raise"
    )
    assert (
        _declare(_app(exclusive_on_locked="rerun"), rerun_args="latest").lock_settings.rerun_args == "latest"
    )
    assert (
        _declare(_app(), on_locked=lambda task, key, holder: None, lock_wait=5).lock_settings.lock_wait == 5
    )


@pytest.mark.parametrize("raw", ["nan", "inf", "abc", "-1", "0"])
def test_bad_environment_ttl_raises_configuration_error(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad CELERY_EXCLUSIVE_DEFAULT_TTL fails the first call with ConfigurationError naming it."""
    monkeypatch.setenv("CELERY_EXCLUSIVE_DEFAULT_TTL", raw)
    task = _declare(_app())
    with pytest.raises(ConfigurationError, match="CELERY_EXCLUSIVE_DEFAULT_TTL"):
        task()


@pytest.mark.parametrize(
    ("conf", "env", "fragment"),
    [
        ({"exclusive_ttl": 300}, {}, "app.conf.exclusive_ttl; did you mean exclusive_default_ttl?"),
        ({"exclusive_tll": "abc"}, {}, "unknown setting app.conf.exclusive_tll"),
        ({"exclusive_on_lock": "raise"}, {}, "did you mean exclusive_on_locked?"),
        ({}, {"CELERY_EXCLUSIVE_TTL": "300"}, "unknown environment variable CELERY_EXCLUSIVE_TTL"),
        ({}, {"CELERY_EXCLUSIVE_ON_LOCK": "raise"}, "did you mean CELERY_EXCLUSIVE_ON_LOCKED?"),
    ],
)
def test_unknown_exclusive_settings_are_refused_by_name(
    conf: dict[str, Any], env: dict[str, str], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt ``exclusive_*`` setting or ``CELERY_EXCLUSIVE_*`` variable fails the first
    call with ConfigurationError naming it and the setting meant. Both were ignored without
    a word: ``exclusive_ttl = 300`` left every lease at the default ttl."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    task = _declare(_app(**conf))
    with pytest.raises(ConfigurationError) as raised:
        task()
    assert fragment in str(raised.value)


def test_every_documented_exclusive_setting_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check for unknown settings lets every real one through: each ``exclusive_*``
    setting and ``CELERY_EXCLUSIVE_*`` variable of docs/celery.md's table (and
    ``CELERY_EXCLUSIVE_TABLE``, the Django setting Celery's ``CELERY`` namespace reads as
    ``exclusive_table``) is taken."""
    table = (Path(__file__).parent.parent / "docs" / "celery.md").read_text()
    conf_names = set(re.findall(r"^\| `(exclusive_[a-z_]+)`", table, re.MULTILINE)) | {"exclusive_table"}
    row = r"^\| `exclusive_[a-z_]+` \| `(CELERY_EXCLUSIVE_[A-Z_]+)`"
    env_names = set(re.findall(row, table, re.MULTILINE))
    assert len(conf_names) > 20
    assert len(env_names) == len(conf_names) - 1
    for name in (*env_names, "CELERY_EXCLUSIVE_TABLE"):
        monkeypatch.setenv(name, "")  # set, but empty: not configured
    settings = ExclusiveSettings.from_conf(dict.fromkeys(conf_names))
    assert settings.url is None


def _close_app_service(app: Celery) -> None:
    get_lock_service(app).close()


# -- the CLI ------------------------------------------------------------------------------------

CLI_CASES: list[tuple[str, list[str], list[str], str]] = [
    ("show-empty", [], ["show", ""], "must not be empty"),
    ("show-nul", [], ["show", "a\x00b"], "NUL"),
    ("show-10kb", [], ["show", "x" * 10240], "this store accepts at most"),
    ("show-surrogate", [], ["show", "\ud800"], "lone surrogates"),
    ("release-nul", [], ["release", "--yes", "a\x00b"], "NUL"),
    ("release-empty-token", [], ["release", "k", "--token", ""], "--token must not be empty"),
    ("list-nul", [], ["list", "a\x00"], "NUL"),
    ("list-surrogate", [], ["list", "\ud800"], "lone surrogates"),
    ("prefix-space", ["--prefix", "bad prefix"], ["list"], "key prefix"),
    ("prefix-unicode", ["--prefix", "é"], ["show", "k"], "key prefix"),
    ("prefix-long", ["--prefix", "p" * 65], ["show", "k"], "key prefix"),
]
CLI_URL_CASES: list[tuple[str, str, str]] = [
    ("unknown-scheme", f"foo://u:{MARKER}@h/x", "unknown lock store scheme"),
    ("malformed", "not a url", "malformed lock store URL"),
    ("no-scheme-credentials", f"user:{MARKER}@host/db", "malformed lock store URL"),
    ("unknown-option", f"{UNREACHABLE_PG}?ce_bogus=1", "unknown option 'ce_bogus'"),
    ("bad-table", f"{UNREACHABLE_PG}?ce_table=x;y", "invalid lock table name"),
    ("bad-port", f"postgresql+psycopg://u:{MARKER}@h:notaport/x", "malformed SQL lock store URL"),
    # These three used to exit 3 ("unexpected ArgumentError/TypeError") or read database 0.
    ("sqlite-two-slashes", "sqlite://locks.db", "malformed SQL lock store URL"),
    ("redis-unknown-option", f"redis://:{MARKER}@h/0?sockettimeout=2", "unknown URL option 'sockettimeout'"),
    ("redis-db-not-a-number", f"redis://:{MARKER}@h/x", "the path must be a database number"),
    ("cluster-unknown-option", f"redis+cluster://:{MARKER}@h:7000?bogus=1", "unknown URL option 'bogus'"),
]


def _run_cli(args: list[str], *, app: Celery | None = None) -> Any:
    env = {"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None}
    if app is None:
        return CliRunner().invoke(cli, args, env=env)
    return CliRunner().invoke(exclusive, args, env=env, obj=SimpleNamespace(app=app))


def _assert_usage_error(result: Any, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ")
    assert fragment in result.output
    assert "Traceback" not in result.output
    assert MARKER not in result.output


@pytest.mark.parametrize(
    ("group", "command", "fragment"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES]
)
def test_cli_rejects_bad_input_with_exit_2(group: list[str], command: list[str], fragment: str) -> None:
    """Both CLI front ends report bad input as one masked line and exit 2 (3 would mean it hit the store)."""
    for url in UNREACHABLE.values():
        _assert_usage_error(_run_cli(["--url", url, *group, *command]), fragment)
        _assert_usage_error(_run_cli([*group, *command], app=_app(url)), fragment)


@pytest.mark.parametrize(
    ("url", "fragment"), [c[1:] for c in CLI_URL_CASES], ids=[c[0] for c in CLI_URL_CASES]
)
def test_cli_rejects_bad_urls_with_exit_2(url: str, fragment: str) -> None:
    """A bad --url or app.conf.exclusive_url is one masked line and exit 2."""
    for command in (["list"], ["show", "k"], ["release", "--yes", "k"]):
        _assert_usage_error(_run_cli(["--url", url, *command]), fragment)
        _assert_usage_error(_run_cli(command, app=_app(url)), fragment)


def test_cli_without_any_url_names_where_to_set_one() -> None:
    """No URL anywhere is exit 2 with a message naming --url and the environment variable."""
    _assert_usage_error(_run_cli(["list"]), "CELERY_EXCLUSIVE_URL")
    _assert_usage_error(_run_cli(["--url", "", "list"]), "pass --url")


# -- real stores: rejected input writes nothing; odd valid keys work ------------------------------


@dataclass
class RealStore:
    """A store on a real server (or memory), isolated by a fresh table, file or key prefix."""

    name: str
    url: str
    prefix: str
    written: Callable[[], list[str]]
    service: Callable[[], LockService]
    engine: sa.Engine | None = None


@pytest.fixture(params=["memory", "sqlite", "postgres", "mariadb", "redis"])
def real_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RealStore]:
    """A store with nothing in it yet; ``written()`` lists whatever appeared since."""
    name: str = request.param
    run = uuid.uuid4().hex[:10]
    prefix = f"bi{run}:"
    table = f"ce_bad_input_{run}"
    services: list[LockService] = []

    def make(url: str) -> Callable[[], LockService]:
        def service() -> LockService:
            made = LockService(url, prefix=prefix)
            services.append(made)
            return made

        return service

    if name == "memory":
        provider = MemoryLockProvider()

        def memory_service() -> LockService:
            made = LockService(provider, prefix=prefix)
            services.append(made)
            return made

        def memory_written() -> list[str]:
            return sorted({*provider._rows, *provider._fences})

        yield RealStore(name, "memory://", prefix, memory_written, memory_service)
    elif name == "sqlite":
        path = tmp_path / "bad-input.sqlite3"
        url = f"sqlite:///{path}"
        engine = sa.create_engine(url)

        def sqlite_written() -> list[str]:
            if not path.exists():
                return []
            with sqlite3.connect(path) as conn:
                return [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]

        yield RealStore(name, url, prefix, sqlite_written, make(url), engine)
        engine.dispose()
    elif name in ("postgres", "mariadb"):
        server = POSTGRES_URL if name == "postgres" else MYSQL_URL
        require_server(server)
        url = f"{server}?ce_table={table}"
        engine = sa.create_engine(server)

        def sql_written() -> list[str]:
            inspector = sa.inspect(engine)
            names = inspector.get_table_names()
            if name == "postgres":
                names += inspector.get_sequence_names()
            return [n for n in names if n.startswith(table)]

        try:
            yield RealStore(name, url, prefix, sql_written, make(url), engine)
        finally:
            for service in services:
                service.close()
            services.clear()
            engine.dispose()
            drop_lock_table(server, table)
    else:
        require_server(REDIS_URL)
        import redis

        client = redis.Redis.from_url(REDIS_URL)

        def redis_written() -> list[str]:
            return sorted(k.decode() for k in client.scan_iter(match=f"*{prefix}*", count=1000))

        try:
            yield RealStore(name, REDIS_URL, prefix, redis_written, make(REDIS_URL))
        finally:
            for service in services:
                service.close()
            services.clear()
            delete_redis_keys(prefix)
            client.close()
    for service in services:
        service.close()


def test_rejected_input_writes_nothing(real_store: RealStore) -> None:
    """After every rejected call (service, tasks, CLI) the store is untouched: not even a table appears."""
    service = real_store.service()
    for case in SERVICE_CASES:
        with pytest.raises(case.exc) as raised:
            case.call(service)
        assert case.fragment in str(raised.value), case.id
    if real_store.name != "memory":  # other processes' views of the same store
        for _, group, command, fragment in CLI_CASES:
            result = _run_cli(["--url", real_store.url, "--prefix", real_store.prefix, *group, *command])
            _assert_usage_error(result, fragment)
        app = _app(real_store.url, exclusive_prefix=real_store.prefix)
        task = _declare(app, key="{x}")
        for bad in ("\x00", "\ud800", "x" * 10240, object()):
            with pytest.raises(InvalidArgumentError):
                task(bad)
        with pytest.raises(InvalidArgumentError):
            _declare(app, ttl=10, refresh_interval=10)(1)
        # A task of several keys took its first key before its second was checked.
        for bad in ("\x00", "\ud800", "x" * 10240):
            with pytest.raises(InvalidArgumentError):
                _declare(app, key=lambda x=1, bad=bad: ["a", f"b{bad}"])()
        _close_app_service(app)
    assert real_store.written() == []


def test_a_token_with_a_nul_releases_nothing(real_store: RealStore) -> None:
    """``force_release`` with a live lease's token followed by a NUL is refused, and the lease
    stays: PostgreSQL's text parameters end at a NUL, so that token released the lease."""
    service = real_store.service()
    lease = service.lock("held")
    with pytest.raises(InvalidArgumentError, match="NUL"):
        service.force_release("held", lease.token + "\x00forged")
    found = service.peek("held")
    assert found is not None
    assert found.token == lease.token
    assert lease.release() is ReleaseOutcome.RELEASED


SQL_LOOKING = "'; DROP TABLE x; --"
VALID_ODD_KEYS = [
    "🔒",
    "lock-🚀-👩‍👩‍👧",  # a ZWJ sequence
    "\u200f\u0645\u0631\u062d\u0628\u0627\u200f",  # RTL marks around Arabic (marhaba)
    "\u202eevil\u202c",  # a bidi override
    "e\u0301",  # decomposed é: a different key from the composed one
    "é",
    "A",
    "a",
    "a%",
    "a_b",
    "a!",
    "ab",
    "*",
    "?",
    "[x]",
    "\\",
    "}{",
    "tab\there",
    "\tleading tab",  # sorts below a space: MariaDB's LIKE index range missed it
    "\x01",
    "\U0010ffff",  # the last code point
    "new\nline",
    SQL_LOOKING,
    "x' OR '1'='1",
    'x"; DELETE FROM cache_entries; --',
    "') redis.call('DEL', KEYS[1]) --",
]


def test_odd_but_valid_keys_work_and_drop_nothing(real_store: RealStore) -> None:
    """Emoji, RTL marks, and SQL-, LIKE- and glob-looking keys are ordinary keys on every store."""
    sentinel = f"ce_sentinel_{uuid.uuid4().hex[:8]}"
    engine = real_store.engine
    if engine is not None:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {sentinel} (id INTEGER PRIMARY KEY)"))
            conn.execute(sa.text(f"INSERT INTO {sentinel} VALUES (1)"))
    keys = [*VALID_ODD_KEYS, f"'; DROP TABLE {sentinel}; --", f'"; DROP TABLE {sentinel}; --']
    try:
        service = real_store.service()
        leases = {key: service.lock(key) for key in keys}
        fences = {key: lease.fence for key, lease in leases.items()}
        for key in keys:
            info = service.peek(key)
            assert info is not None, key
            assert (info.key, info.token) == (key, leases[key].token)
            listed = [i.key for i in service.locks(key)]
            assert listed == sorted(k for k in keys if k.startswith(key)), key
            assert service.try_lock(key) is None
        assert sorted(i.key for i in service.locks()) == sorted(keys)
        for key in keys:
            assert leases[key].release().value == "released"
        assert service.locks() == []
        again = service.lock(SQL_LOOKING)
        assert again.fence > fences[SQL_LOOKING]
        assert service.force_release(SQL_LOOKING, again.token)
        if engine is not None:
            with engine.connect() as conn:
                assert conn.execute(sa.text(f"SELECT id FROM {sentinel}")).scalars().all() == [1]
            assert set(sa.inspect(engine).get_table_names()) >= {sentinel}
    finally:
        if engine is not None:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {sentinel}"))


def test_longest_key_works_and_one_more_character_is_rejected(real_store: RealStore) -> None:
    """A key of exactly the store's length limit (in 4-byte emoji) works; one more is an argument error."""
    service = real_store.service()
    room = service.provider.max_key_length - len(real_store.prefix)
    longest = "😀" * room
    with service.lock(longest) as lease:
        info = service.peek(longest)
        assert info is not None
        assert info.token == lease.token
    with pytest.raises(InvalidArgumentError, match="this store accepts at most"):
        service.lock(longest + "😀")


def test_keys_differing_only_by_trailing_space_are_distinct(real_store: RealStore) -> None:
    """'job' and 'job ' are two different keys, as on every other store."""
    service = real_store.service()
    with service.lock("job") as first, service.lock("job ") as second:
        assert first.fence > 0
        assert second.fence > 0
        info = service.peek("job ")
        assert info is not None
        assert info.key == "job "


# -- credentials ----------------------------------------------------------------------------------


def _texts_of(exc: BaseException) -> list[str]:
    """str and repr of an exception and of every exception chained to it, and its traceback."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return texts


def test_credentials_never_appear_in_errors_or_logs(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Failing and erroring operations with a distinctive password never show it, masked or decoded."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="celery_exclusive")
    texts: list[str] = []
    failing = [
        *UNREACHABLE.values(),
        f"postgresql+psycopg://postgres@127.0.0.1:1/x?password={MARKER}",
        f"postgresql+psycopg://u:{MARKER}%40x%3Ay@127.0.0.1:1/x",  # percent-encoded @ and :
        f"redis://u:p%40{MARKER}@127.0.0.1:1/0",
        f"redis://nobody:{MARKER}@127.0.0.1:6379/0",  # reachable: the server refuses the user
        f"mysql+pymysql://root:{MARKER}@127.0.0.1:3306/test",  # reachable: access denied
        f"postgresql+psycopg://postgres:{MARKER}@127.0.0.1:5432/ce_no_such_db_{uuid.uuid4().hex[:6]}",
    ]
    for url in failing:
        service = LockService(url, prefix="cred:")
        texts += [repr(service), repr(service.provider)]
        for call in (
            lambda s: s.lock("k"),
            lambda s: s.try_lock("k"),
            lambda s: s.run_exclusive("k", _never),
            lambda s: s.peek("k"),
            lambda s: s.locks(),
            lambda s: s.force_release("k", "t"),
        ):
            with pytest.raises(BackendError) as raised:
                call(service)
            texts += _texts_of(raised.value)
        service.close()
        for args in (["show", "k"], ["list"], ["release", "--yes", "k"], ["doctor"], ["doctor", "--json"]):
            result = _run_cli(["--url", url, *args])
            texts.append(result.output)
            assert result.exit_code in (1, 3), result.output
        app = _app(url)
        task = _declare(app)
        with pytest.raises(BackendError) as raised:
            task()
        texts += _texts_of(raised.value)
        texts += [repr(task.lock_settings), repr(ExclusiveSettings(url=url)), repr(get_lock_service(app))]
        _close_app_service(app)
    for _, url, _ in BAD_URLS:
        for build in (provider_from_url, LockService):
            try:
                build(url)
            except ExclusiveError as exc:
                texts += _texts_of(exc)
    texts += [caplog.text, *(r.getMessage() for r in caplog.records)]
    texts += [repr(r.args) for r in caplog.records]
    leaks = [text for text in texts if MARKER in text]
    assert not leaks, leaks[0]
    assert any("***" in text for text in texts)  # the URLs were shown, masked


def test_heartbeat_and_release_warnings_never_show_credentials(caplog: pytest.LogCaptureFixture) -> None:
    """When a held lease's store starts failing, the refresh, LOST and release warnings stay masked."""
    require_server(POSTGRES_URL)
    caplog.set_level(logging.DEBUG)
    table = f"ce_cred_{uuid.uuid4().hex[:10]}"
    server = sa.make_url(POSTGRES_URL).set(password=MARKER).render_as_string(hide_password=False)
    engine = sa.create_engine(POSTGRES_URL)
    service = LockService(f"{server}?ce_table={table}", prefix="cred:")
    try:
        lease = service.lock("k", ttl=1.0)
        with engine.begin() as conn:  # the store breaks under the held lease
            conn.execute(sa.text(f"DROP TABLE {table}"))
        time.sleep(1.3)
        assert lease.lost.is_set()
        assert lease.release().value == "unknown"
    finally:
        service.close()
        engine.dispose()
        drop_lock_table(POSTGRES_URL, table)
    messages = [r.getMessage() for r in caplog.records if r.name == "celery_exclusive"]
    assert any("could not refresh" in m for m in messages)
    assert any("LOST" in m for m in messages)
    assert any("could not release" in m for m in messages)
    assert MARKER not in caplog.text
    assert not [m for m in messages if MARKER in m]
