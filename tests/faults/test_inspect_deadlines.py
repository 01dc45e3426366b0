"""Inspection and operator calls end by ``call_timeout`` on a silent store (issue #17).

``peek``, ``locks``, ``completion``, ``completions``, ``forget`` and ``force_release`` get
the same per-call deadline as ``lock``: a store behind a stalled relay (it accepts bytes
and answers nothing, like a network that went silent) makes each raise BackendError
within ``call_timeout``, never hang on the driver's own timeouts (tens of seconds). The
provider enforces it (every built-in store takes ``timeout=``): the call itself ends, no
thread is left waiting for the store. PostgreSQL, Redis and MariaDB (the shared server)
behind the stalling relay; SQLite with another connection holding the database's write
lock (the one way a SQLite call blocks).
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_exclusive import BackendError, LockService, ReleaseOutcome
from celery_exclusive._releasing import RELEASE_TIMEOUT
from tests.conftest import MYSQL_URL, TIME_SLACK, drop_lock_table, require_server, with_option
from tests.faults.conftest import Backend, Faults
from tests.faults.servers import TcpProxy

CALL_TIMEOUT = 1.0
#: Thread start, the proxy's stall hand-shake and a loaded 2-core machine (1.5 s by default).
SLACK = 0.75 * TIME_SLACK

CALLS: dict[str, Callable[[LockService], object]] = {
    "peek": lambda s: s.peek("k"),
    "locks": lambda s: s.locks(),
    "completion": lambda s: s.completion("k", "task-1"),
    "completions": lambda s: s.completions(),
    "forget": lambda s: s.forget("k", "task-1"),
    "force_release": lambda s: s.force_release("k", "some-token"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_inspection_calls_end_by_call_timeout_on_a_silent_store(
    backend: Backend, faults: Faults, name: str
) -> None:
    """Each call answers on a healthy relay, then raises BackendError within call_timeout once
    the relay goes silent; the service still works after the relay resumes."""
    proxy = faults.proxy(backend.port)
    service = faults.service(backend.url(proxy.port), call_timeout=CALL_TIMEOUT)
    call = CALLS[name]
    call(service)  # connected and warm: the next call goes out on a connection that goes silent
    _stalled_call_fails_in_time(service, name, call, proxy)
    proxy.cut()  # the abandoned connection is not to be reused
    _works_again(service, call)


#: libpq's connect_timeout is whole seconds, at least 2: the floor of a bounded connect.
CONNECT_FLOOR = 2.0


def test_the_first_call_on_a_store_silent_from_the_start_ends_by_its_deadline(
    backend: Backend, faults: Faults
) -> None:
    """A service whose very first call meets a silent store (the SQL stores set up their
    schema then, on a connection of their own) still ends near ``call_timeout``, not at the
    driver's 10 s connect timeout, and leaves no thread waiting for the store."""
    proxy = faults.proxy(backend.port)
    _first_peek_ends_in_time(faults, proxy, backend.url)


def _first_peek_ends_in_time(faults: Faults, proxy: TcpProxy, url: Callable[[int], str]) -> LockService:
    """A service on ``url(proxy.port)`` whose first peek meets the stalled ``proxy``: it raises
    BackendError by its deadline, not abandoned in a thread. The proxy resumes after."""
    proxy.stall()
    try:
        service = faults.service(url(proxy.port), call_timeout=CALL_TIMEOUT)
        started = time.monotonic()
        with pytest.raises(BackendError):
            service.peek("k")
        took = time.monotonic() - started
        assert took <= max(CALL_TIMEOUT, CONNECT_FLOOR) + SLACK, f"first peek() took {took:.3f} s"
        assert service._calls.stuck == 0, "the first peek() was abandoned in a thread"
    finally:
        proxy.resume()
    return service


#: The SQL stores' acquire and release take the same deadline.
SQL_CALLS: dict[str, Callable[[LockService], object]] = {
    **CALLS,
    "try_lock": lambda s: s.try_lock("k2", ttl=30),
}


@pytest.fixture
def mariadb_table() -> Iterator[str]:
    """A fresh lock table name on the shared MariaDB (dropped after)."""
    require_server(MYSQL_URL)
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    yield table
    drop_lock_table(MYSQL_URL, table)


@pytest.mark.parametrize("name", list(SQL_CALLS))
def test_mariadb_calls_end_by_call_timeout_on_a_silent_store(
    faults: Faults, mariadb_table: str, name: str
) -> None:
    """The same on MariaDB behind the relay: the socket watchdog ends each call's statements."""
    proxy = faults.proxy(3306)
    url = with_option(MYSQL_URL.replace(":3306/", f":{proxy.port}/"), "table", mariadb_table)
    service = faults.service(url, call_timeout=CALL_TIMEOUT)
    call = SQL_CALLS[name]
    call(service)
    _stalled_call_fails_in_time(service, name, call, proxy)
    proxy.cut()
    _works_again(service, call)


def test_mariadb_first_call_on_a_store_silent_from_the_start_ends_by_its_deadline(
    faults: Faults, mariadb_table: str
) -> None:
    """MariaDB behind a relay silent from the start: the TCP connect succeeds and the server's
    greeting never comes. PyMySQL's connect_timeout covers only the TCP connect, so the
    greeting and authentication must be bounded by the call's deadline too (they were not:
    the first peek waited over 60 s); the call ends by it, no thread left waiting."""
    proxy = faults.proxy(3306)
    url = with_option(MYSQL_URL, "table", mariadb_table)
    service = _first_peek_ends_in_time(faults, proxy, lambda port: url.replace(":3306/", f":{port}/"))
    _works_again(service, CALLS["peek"])
    pooled = service.provider._engine.raw_connection()  # type: ignore[attr-defined]
    try:  # the connect's bounds were given back: statements have only the watchdog's
        driver = pooled.driver_connection
        assert (driver._read_timeout, driver._write_timeout) == (None, None)
    finally:
        pooled.close()


def test_pg_lock_and_release_end_by_their_deadlines_on_a_silent_store(
    pg_backend: Backend, faults: Faults
) -> None:
    """PostgreSQL's acquire and release run on the libpq runner, whose own wait for the reply
    ends them by their deadline (no watchdog thread): behind a relay gone silent, ``try_lock``
    raises BackendError within call_timeout and ``release`` answers UNKNOWN within its own
    bound; the service works again once the relay resumes."""
    proxy = faults.proxy(pg_backend.port)
    locking = faults.service(pg_backend.url(proxy.port), call_timeout=CALL_TIMEOUT)
    releasing = faults.service(pg_backend.url(proxy.port), call_timeout=CALL_TIMEOUT)
    SQL_CALLS["try_lock"](locking)  # connected and warm
    held = releasing.try_lock("held", ttl=30)
    assert held is not None
    _stalled_call_fails_in_time(locking, "try_lock", SQL_CALLS["try_lock"], proxy)
    proxy.stall()
    try:
        started = time.monotonic()
        assert held.release() is ReleaseOutcome.UNKNOWN
        took = time.monotonic() - started
        assert took <= min(CALL_TIMEOUT, RELEASE_TIMEOUT) + SLACK, f"release() took {took:.3f} s"
    finally:
        proxy.resume()
    proxy.cut()
    _works_again(locking, lambda s: s.lock("again", ttl=30).release())


#: The calls that only read: on SQLite they begin a deferred transaction (WAL mode), so a
#: writer elsewhere does not hold them up at all.
READS = ("peek", "locks", "completion", "completions")


@pytest.mark.parametrize("name", [name for name in SQL_CALLS if name not in READS])
def test_sqlite_calls_end_by_call_timeout_while_the_database_is_locked(
    faults: Faults, tmp_path: Path, name: str
) -> None:
    """SQLite: with the write lock held elsewhere each writing call fails by call_timeout (its
    busy timeout lowered to the deadline), not SQLite's 30 s busy timeout."""
    path = tmp_path / "locks.db"
    service = faults.service(f"sqlite:///{path}", call_timeout=CALL_TIMEOUT)
    call = SQL_CALLS[name]
    call(service)
    rival = sqlite3.connect(path, isolation_level=None)
    try:
        rival.execute("BEGIN IMMEDIATE")
        _stalled_call_fails_in_time(service, name, call, None)
    finally:
        rival.close()  # ends its transaction: the lock is free again
    _works_again(service, call)


@pytest.mark.parametrize("wait", [None, 0.2])
def test_a_new_sqlite_services_first_call_ends_by_call_timeout_while_the_database_is_locked(
    faults: Faults, tmp_path: Path, wait: float | None
) -> None:
    """SQLite: the first call of a new service (another process's, or after a restart) on an
    existing database first sets the store up (the fence row, the lease clock's anchor: both
    writes); with the write lock held elsewhere it fails by call_timeout too. It used to wait
    SQLite's 30 s busy timeout (the set-up's deadline bounded only connecting), so did a
    ``lock(key, wait=0.2)``."""
    path = tmp_path / "locks.db"
    faults.service(f"sqlite:///{path}").lock("made", ttl=30).release()  # the tables exist
    fresh = faults.service(f"sqlite:///{path}", call_timeout=CALL_TIMEOUT)
    rival = sqlite3.connect(path, isolation_level=None)
    try:
        rival.execute("BEGIN IMMEDIATE")
        _stalled_call_fails_in_time(fresh, "lock", lambda s: s.lock("k", ttl=30, wait=wait), None)
    finally:
        rival.close()
    _works_again(fresh, lambda s: s.lock("k", ttl=30, wait=wait).release())


@pytest.mark.parametrize("name", READS)
def test_sqlite_reads_answer_while_the_write_lock_is_held_elsewhere(
    faults: Faults, tmp_path: Path, name: str
) -> None:
    """SQLite: a read takes no write lock and waits for none (a deferred transaction on a WAL
    database), so a writer holding the database answers it at once, well inside its deadline,
    with what was committed before the writer began."""
    path = tmp_path / "locks.db"
    service = faults.service(f"sqlite:///{path}", call_timeout=CALL_TIMEOUT)
    lease = service.lock("k", ttl=30)
    call = SQL_CALLS[name]
    before = call(service)
    rival = sqlite3.connect(path, isolation_level=None)
    try:
        rival.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        answer = call(service)
        took = time.monotonic() - started
    finally:
        rival.close()
        lease.release()
    assert took < CALL_TIMEOUT / 2, f"{name}() waited {took:.3f} s for the writer"
    assert _settled(answer) == _settled(before)


def _settled(answer: object) -> object:
    """An answer without its clock readings (age, time left), which move between two calls."""
    if isinstance(answer, list):
        return [_settled(item) for item in answer]
    if answer is None:
        return None
    fields = dataclasses.asdict(answer)  # type: ignore[call-overload]
    return {k: v for k, v in fields.items() if k not in ("age", "expires_in", "hard_expires_in")}


def _stalled_call_fails_in_time(
    service: LockService, name: str, call: Callable[[LockService], object], proxy: TcpProxy | None
) -> None:
    if proxy is not None:
        proxy.stall()
    try:
        started = time.monotonic()
        with pytest.raises(BackendError):
            call(service)
        took = time.monotonic() - started
        assert took <= CALL_TIMEOUT + SLACK, f"{name}() took {took:.3f} s on a stalled store"
        assert service._calls.stuck == 0, f"{name}() was abandoned in a thread, not ended by the store"
    finally:
        if proxy is not None:
            proxy.resume()


def _works_again(service: LockService, call: Callable[[LockService], object]) -> None:
    deadline = time.monotonic() + 15
    while True:  # a connection broken by the stall may fail one more call
        try:
            call(service)
            return
        except BackendError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
