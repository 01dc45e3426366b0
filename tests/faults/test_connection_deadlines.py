"""The SQL stores' calls end by their deadlines while they wait for a connection, and a
connect that fails leaves no socket behind.

A call that finds every connection of its engine's pool checked out (calls stuck on a
stalled server, more threads than the pool has connections) waits for one to come free:
up to SQLAlchemy's ``pool_timeout`` (30 s) before, however short its own deadline. Now the
wait ends by the call's deadline, with BackendError naming the pool (an outage, never "not
acquired"). On the shared PostgreSQL and MariaDB, and on a SQLite file.

A connect that gives up (a server that accepts and never answers: ``tests/silent.py``)
closes its socket at once. psycopg left the PostgreSQL one open, its half-made connection
referenced from the error's traceback, until the garbage collector found it.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_exclusive import BackendError, LockService
from celery_exclusive.diagnostics import provider_findings
from celery_exclusive.providers.base import RefreshRequest
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option
from tests.contract.test_close import _open_to
from tests.faults.conftest import SLACK, Faults
from tests.faults.servers import TcpProxy
from tests.silent import silent_server

CALL_TIMEOUT = 1.0

#: Each kind of call the service makes, as the provider is called with a deadline.
CALLS: dict[str, Callable[[Any, str], object]] = {
    "acquire": lambda p, k: p.acquire(k, "tok", 30.0, 30.0, "h", timeout=CALL_TIMEOUT),
    "refresh": lambda p, k: p.refresh([RefreshRequest(k, "tok", 30.0)], timeout=CALL_TIMEOUT),
    "release": lambda p, k: p.release(k, "tok", timeout=CALL_TIMEOUT),
    "peek": lambda p, k: p.peek(k, timeout=CALL_TIMEOUT),
    "sweep": lambda p, k: p.sweep(k, timeout=CALL_TIMEOUT),
}


@pytest.fixture(scope="module", params=["sqlite", "postgres", "mariadb"])
def sql_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Each SQL store's URL, with a table of the module's (dropped after): its tests use
    keys of their own, and only the first creates the schema."""
    name: str = request.param
    if name == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('pool') / 'locks.db'}"
        return
    server = POSTGRES_URL if name == "postgres" else MYSQL_URL
    require_server(server)
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    yield with_option(server, "table", table)
    drop_lock_table(server, table)


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_on_an_exhausted_pool_ends_by_its_deadline(sql_url: str, call: str) -> None:
    """With every connection of the store's pool checked out, each call raises BackendError
    naming the pool within its deadline (it waited the pool's 30 s before); it answers again
    once a connection comes back."""
    provider = SqlLockProvider.from_url(sql_url)
    key = f"k{uuid.uuid4().hex[:8]}"
    try:
        CALLS[call](provider, key)  # the schema is set up: the next call only needs a connection
        executor = getattr(provider, "_executor", None)
        if executor is not None:  # PostgreSQL: its kept connections closed, as if all busy
            executor.close()
        pool = provider._engine.pool
        held = [pool.connect() for _ in range(pool.size() + pool._max_overflow)]
        try:
            started = time.monotonic()
            with pytest.raises(BackendError, match="QueuePool") as raised:
                CALLS[call](provider, key)
            took = time.monotonic() - started
            assert took <= CALL_TIMEOUT + SLACK, f"{call}() waited {took:.3f} s for a pooled connection"
            assert "deadline" in str(raised.value)
        finally:
            for connection in held:
                connection.close()
        CALLS[call](provider, key)
    finally:
        provider.close()


#: The store URLs of a server on ``port`` (libpq's connect_timeout is whole seconds, at least 2).
SILENT_URLS = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:{port}/test?connect_timeout=2",
    "mariadb": "mysql+pymysql://root@127.0.0.1:{port}/test?connect_timeout=2",
}


@pytest.mark.parametrize(
    ("store", "timeout"), [("postgres", None), ("postgres", CALL_TIMEOUT), ("mariadb", CALL_TIMEOUT)]
)
def test_a_connect_that_gives_up_leaves_no_socket_open(store: str, timeout: float | None) -> None:
    """Against a server that accepts and never answers, a call whose connect gives up (by
    the URL's connect_timeout, or by the call's deadline) raises BackendError with no socket
    to the server left open, while its error is still held and with the garbage collector
    off. (MariaDB without a deadline waits for the server's greeting forever: not here.)"""
    with silent_server() as port:
        url = SILENT_URLS[store].format(port=port) + "&ce_create_table=false"
        provider = SqlLockProvider.from_url(url)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with pytest.raises(BackendError) as raised:
                provider.peek("k", timeout=timeout)
            left = _open_to(port)
            assert left == 0, f"{left} socket(s) to the server left open by {raised.value}"
        finally:
            if collecting:
                gc.enable()
            provider.close()


#: A silent server's store URLs with the drivers' own connect timeouts (10 s) and no
#: set-up (``ce_create_table=false``): what a first use then looks up connects on its own.
SILENT_FIRST_USE = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:{port}/test?ce_create_table=false",
    "mariadb": "mysql+pymysql://root@127.0.0.1:{port}/test?ce_create_table=false",
}
#: libpq's connect_timeout is whole seconds, at least 2: the floor of a bounded connect.
CONNECT_FLOOR = 2.0


def _ended(call: Callable[[], object], within: float) -> object:
    """What ``call()`` returned or raised, run in a thread of its own and waited for at most
    ``within`` seconds (the test fails if it is still running: a hang is not waited out)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, name="deadline-test-call", daemon=True)
    thread.start()
    thread.join(within)
    assert outcome, f"the call was still waiting after {within:.3g} s"
    return outcome[0]


#: The first uses that looked something up on a connection of their own, with the call's
#: deadline (the completion-record table; PostgreSQL's marker function).
FIRST_USES: dict[str, Callable[[Any], object]] = {
    "completion": lambda p: p.completion("k", "task-1", timeout=CALL_TIMEOUT),
    "acquire_once": lambda p: p.acquire("k", "tok", 30.0, 30.0, "h", task_id="t", timeout=CALL_TIMEOUT),
    "acquire_unless": lambda p: p.acquire_unless("k", "tok", 30.0, "h", blocker="b", timeout=CALL_TIMEOUT),
}


@pytest.mark.parametrize(
    ("store", "call"),
    [("postgres", name) for name in FIRST_USES] + [("mariadb", "completion"), ("mariadb", "acquire_once")],
)
def test_a_first_use_lookup_on_a_silent_server_ends_by_the_calls_deadline(store: str, call: str) -> None:
    """With create_table off, the first call that needs the completion-record table (or, on
    PostgreSQL, the marker function) looks it up on a connection of its own. That connect
    waited the driver's 10 s connect timeout (PostgreSQL) or, MariaDB's greeting never
    coming, for ever, whatever the call's deadline; now it raises BackendError by then."""
    with silent_server() as port:
        provider = SqlLockProvider.from_url(SILENT_FIRST_USE[store].format(port=port))
        try:
            started = time.monotonic()
            raised = _ended(lambda: FIRST_USES[call](provider), 8.0)
            took = time.monotonic() - started
            assert isinstance(raised, BackendError), raised
            assert took <= max(CALL_TIMEOUT, CONNECT_FLOOR) + SLACK, f"{call}() took {took:.3f} s"
        finally:
            provider.close()


@pytest.mark.parametrize("store", ["postgres", "mariadb"])
def test_diagnose_on_a_silent_server_ends_by_its_deadline(store: str) -> None:
    """``diagnose(timeout=)`` (what ``celery-exclusive doctor`` calls) reports the failed
    connect by its deadline: it took no deadline, its connect waiting 10 s (PostgreSQL) or
    for ever (MariaDB) in a thread doctor had stopped waiting for."""
    with silent_server() as port:
        provider = SqlLockProvider.from_url(SILENT_FIRST_USE[store].format(port=port))
        try:
            started = time.monotonic()
            found = _ended(lambda: provider.diagnose(timeout=CALL_TIMEOUT), 8.0)
            took = time.monotonic() - started
            assert isinstance(found, list), found
            assert [(d.check, d.status) for d in found] == [("connect", "fail")]
            assert took <= max(CALL_TIMEOUT, CONNECT_FLOOR) + SLACK, f"diagnose() took {took:.3f} s"
        finally:
            provider.close()


def _while_stalled(proxy: TcpProxy, call: Callable[[], object]) -> tuple[object, float]:
    """What ``call()`` gave (see :func:`_ended`) while ``proxy`` was stalled, and the seconds
    it took; the proxy is resumed after."""
    proxy.stall()
    try:
        started = time.monotonic()
        found = _ended(call, 8.0)
        return found, time.monotonic() - started
    finally:
        proxy.resume()


#: The shared servers' URLs and ports, for a relay in front of them.
SHARED = {"postgres": (POSTGRES_URL, 5432), "mariadb": (MYSQL_URL, 3306)}


@pytest.mark.parametrize("store", list(SHARED))
def test_diagnose_on_a_stalled_server_ends_by_its_deadline(faults: Faults, store: str) -> None:
    """Behind a relay that stalls once the store is set up and its connection pooled,
    diagnose's statements end by its deadline too (the socket watchdog: a failed ``connect``
    finding), and diagnose passes again once the relay resumes."""
    server, port = SHARED[store]
    require_server(server)
    proxy = faults.proxy(port)
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    url = with_option(server.replace(f":{port}/", f":{proxy.port}/"), "table", table)
    provider = SqlLockProvider.from_url(url)
    try:
        provider.set_up(timeout=10)
        assert all(d.status != "fail" for d in provider.diagnose(timeout=10))
        found, took = _while_stalled(proxy, lambda: provider.diagnose(timeout=CALL_TIMEOUT))
        assert isinstance(found, list), found
        assert [(d.check, d.status) for d in found] == [("connect", "fail")]
        assert took <= CALL_TIMEOUT + SLACK, f"diagnose() took {took:.3f} s"
        proxy.cut()
        assert all(d.status != "fail" for d in provider.diagnose(timeout=10))
    finally:
        provider.close()
        drop_lock_table(server, table)


#: A password that must never show in a Redis error.
REDIS_SECRET = "pw-diagnose"


@pytest.mark.parametrize("given", ["url", "client"])
def test_redis_diagnose_on_a_silent_server_ends_by_its_deadline(given: str) -> None:
    """Redis's ``diagnose(timeout=)`` (what ``celery-exclusive doctor`` calls) raises
    BackendError by its deadline on a server that accepts and never answers: it took no
    deadline, doctor waiting for it in a thread left asking for the client's 10 s. Through
    a client you passed (whose calls take no deadline) too."""
    with silent_server() as port:
        if given == "url":
            provider = RedisLockProvider(f"redis://:{REDIS_SECRET}@127.0.0.1:{port}/0")
        else:
            provider = RedisLockProvider(
                client=redis.Redis(port=port, password=REDIS_SECRET, socket_timeout=30)
            )
        try:
            started = time.monotonic()
            found = _ended(lambda: provider.diagnose(timeout=CALL_TIMEOUT), 8.0)
            took = time.monotonic() - started
            assert isinstance(found, BackendError), found
            assert took <= CALL_TIMEOUT + SLACK, f"diagnose() took {took:.3f} s"
            assert REDIS_SECRET not in str(found)
        finally:
            provider.close()


def _redis_behind(proxy_port: int) -> str:
    return REDIS_URL.replace(":6379/", f":{proxy_port}/")


def test_redis_diagnose_on_a_stalled_server_ends_by_its_deadline(faults: Faults) -> None:
    """Behind a relay that stalls once diagnose has passed on it, Redis's diagnose ends by
    its deadline with BackendError, and passes again once the relay is cut (a fresh
    connection)."""
    require_server(REDIS_URL)
    proxy = faults.proxy(6379)
    provider = RedisLockProvider(_redis_behind(proxy.port))
    try:
        assert all(d.status != "fail" for d in provider.diagnose(timeout=10)), provider.diagnose()
        found, took = _while_stalled(proxy, lambda: provider.diagnose(timeout=CALL_TIMEOUT))
        assert isinstance(found, BackendError), found
        assert took <= CALL_TIMEOUT + SLACK, f"diagnose() took {took:.3f} s"
        proxy.cut()
        assert all(d.status != "fail" for d in provider.diagnose(timeout=10))
    finally:
        provider.close()


def test_doctors_redis_findings_on_a_stalled_server_are_the_stores_own_deadline(faults: Faults) -> None:
    """doctor's provider findings on a stalled Redis are a failed ``diagnose`` check by the
    deadline, raised by the store's own diagnose (given the deadline), not doctor's wait for
    a thread that goes on asking (as before, for the client's 10 s)."""
    require_server(REDIS_URL)
    proxy = faults.proxy(6379)
    service = LockService(_redis_behind(proxy.port), prefix=f"ce-doctor-{uuid.uuid4().hex[:6]}:")
    try:
        assert all(d.status != "fail" for d in provider_findings(service, timeout=10))
        found, took = _while_stalled(proxy, lambda: provider_findings(service, timeout=CALL_TIMEOUT))
        assert isinstance(found, list), found
        assert [(d.check, d.status) for d in found] == [("diagnose", "fail")], found
        assert "gave no answer during diagnose" not in found[0].detail, found[0].detail
        assert took <= CALL_TIMEOUT + SLACK, f"doctor's diagnose took {took:.3f} s"
    finally:
        service.close(release=False)


#: PyMySQL's handshake without a deadline: within the URL's connect_timeout.
HANDSHAKE = 2.0


@pytest.mark.parametrize("call", ["peek", "diagnose"])
def test_mariadb_without_a_deadline_gives_up_on_a_server_that_never_greets(call: str) -> None:
    """A MariaDB call without ``timeout=`` (a direct provider call) against a server that
    accepts and never greets raises BackendError after the store's connect_timeout (the
    URL's 2 s here, 10 s by default): PyMySQL reads the greeting and the authentication with
    its read_timeout, none by default, so it waited for ever."""
    with silent_server() as port:
        url = f"mysql+pymysql://root@127.0.0.1:{port}/test?connect_timeout=2"
        provider = SqlLockProvider.from_url(url)
        calls: dict[str, Callable[[], object]] = {
            "peek": lambda: provider.peek("k"),
            "diagnose": provider.diagnose,
        }
        try:
            started = time.monotonic()
            answer = _ended(calls[call], HANDSHAKE + 8.0)
            took = time.monotonic() - started
            if call == "peek":
                assert isinstance(answer, BackendError), answer
            else:
                assert isinstance(answer, list), answer
                assert [(d.check, d.status) for d in answer] == [("connect", "fail")]
            assert took <= HANDSHAKE + SLACK, f"{call}() took {took:.3f} s"
        finally:
            provider.close()


def test_mariadb_connections_made_without_a_deadline_keep_the_configured_statement_timeouts() -> None:
    """The handshake's bound is given back once connected: statements without a deadline
    keep PyMySQL's read and write timeouts as configured (none, or the URL's)."""
    require_server(MYSQL_URL)
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    for extra, expected in (("", (None, None)), ("&read_timeout=33&write_timeout=34", (33, 34))):
        url = with_option(MYSQL_URL, "table", table) + extra
        provider = SqlLockProvider.from_url(url)
        try:
            provider.peek("k")  # connected without a deadline
            pooled = provider._engine.raw_connection()
            try:
                driver = pooled.driver_connection
                assert (driver._read_timeout, driver._write_timeout) == expected, extra
            finally:
                pooled.close()
        finally:
            provider.close()
    drop_lock_table(MYSQL_URL, table)
