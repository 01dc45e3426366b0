"""The PostgreSQL store's release signals (``WakesWaiters``: LISTEN/NOTIFY), on the shared
server: a table of this module's own, and only our own listener's backend is terminated."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from celery_exclusive import LockService, ReleaseOutcome
from celery_exclusive.providers._pg_listen import SignalsLost, channel
from celery_exclusive.providers.base import Grant, WakesWaiters
from celery_exclusive.providers.postgres import PostgresLockProvider
from celery_exclusive.waiting import POLL_MAX
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server

TABLE = f"ce_pgwake_{uuid.uuid4().hex[:10]}"
URL = f"{POSTGRES_URL}?ce_table={TABLE}"
DSN = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="module", autouse=True)
def _table() -> Iterator[None]:
    require_server(POSTGRES_URL)
    yield
    drop_lock_table(POSTGRES_URL, TABLE)


@pytest.fixture
def provider() -> Iterator[PostgresLockProvider]:
    made = LockService(URL).provider
    assert isinstance(made, PostgresLockProvider)
    yield made
    made.close()


def take(provider: PostgresLockProvider, key: str, token: str) -> None:
    assert isinstance(provider.acquire(key, token, 30.0, 60.0, "{}"), Grant)


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def subscribed(provider: PostgresLockProvider, key: str) -> Any:
    """A subscription to ``key``, once its LISTEN is in effect: the first one of a provider
    may return before its connection is up and then signals once (a "look again")."""
    subscription = provider.subscribe(key)
    while subscription.wait(0.3):
        pass
    return subscription


def test_psycopg_wakes_and_pgbouncer_mode_polls() -> None:
    woken = LockService(URL).provider
    polled: Any = LockService(URL + "&ce_pgbouncer=true").provider
    try:
        assert isinstance(woken, WakesWaiters)
        with pytest.raises(SignalsLost, match="PgBouncer"):  # no session to LISTEN on: waiters poll
            polled.subscribe("k")
        assert polled._listener is None
        service = LockService(polled, prefix=f"{uuid.uuid4().hex}:")
        lease = service.lock("k", ttl=30)
        started = time.monotonic()
        assert service.try_lock("k", wait=0.3) is None  # a polled wait answers as usual
        assert time.monotonic() - started >= 0.3
        lease.release()
    finally:
        woken.close()
        polled.close()


def test_a_release_signals_its_own_key_only_and_is_kept_until_waited(provider: PostgresLockProvider) -> None:
    key = f"{uuid.uuid4().hex}:k"
    take(provider, key, "t1")
    take(provider, key + "-other", "t2")
    subscription = subscribed(provider, key)
    assert provider.release(key + "-other", "t2") is True
    assert provider.release(key, "not-the-owner") is False
    assert subscription.wait(0.2) is False
    assert provider.release(key, "t1") is True
    assert subscription.wait(5) is True
    assert subscription.wait(0.1) is False  # consumed
    subscription.close()
    subscription.close()  # idempotent


def test_a_rolled_back_release_sends_nothing(provider: PostgresLockProvider) -> None:
    """NOTIFY is transactional: the release statement in a transaction rolled back signals
    nobody (and the lease stays); the same statement committed does."""
    key = f"{uuid.uuid4().hex}:rb"
    take(provider, key, "tok")
    subscription = subscribed(provider, key)
    statement = provider._psycopg_sql["release"]  # the release statement's very text
    params = {"key": key, "token": "tok", "channel": channel(TABLE, key)}
    with psycopg.connect(DSN) as conn:  # not autocommit: a transaction
        assert conn.execute(statement, params).fetchall() == [(2,)]  # freed it, notified
        conn.rollback()
        assert subscription.wait(0.5) is False
        assert provider.peek(key) is not None
        assert conn.execute(statement, params).fetchall() == [(2,)]
        conn.commit()
    assert subscription.wait(5) is True
    assert provider.peek(key) is None
    subscription.close()


def test_a_release_notifies_only_while_a_waiter_is_registered(provider: PostgresLockProvider) -> None:
    """A bare LISTEN on the key's channel hears nothing: the release notifies only while a
    waiter (our subscription) holds the channel's registration lock."""
    key = f"{uuid.uuid4().hex}:reg"
    with psycopg.connect(DSN, autocommit=True) as spy:
        spy.execute(f"LISTEN {channel(TABLE, key)}")
        take(provider, key, "t1")
        assert provider.release(key, "t1") is True
        assert list(spy.notifies(timeout=0.3)) == []
        take(provider, key, "t2")
        subscription = subscribed(provider, key)
        assert provider.release(key, "t2") is True
        assert [n.channel for n in spy.notifies(timeout=5, stop_after=1)] == [channel(TABLE, key)]
        assert subscription.wait(5) is True
        subscription.close()
        listener = provider._listener
        assert listener is not None
        # The registration goes with the last subscriber; the LISTEN lingers on.
        assert wait_until(lambda: registrations(listener) == 0)
        assert channel(TABLE, key) in listener._listened
        take(provider, key, "t3")
        assert provider.release(key, "t3") is True
        assert list(spy.notifies(timeout=0.3)) == []


def registrations(listener: Any) -> int:
    """The waiter registrations (shared advisory locks) the listener's session holds."""
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock' AND pid = %s",
            (listener.backend_pid,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_release_tells_whether_its_notify_reached_a_waiter() -> None:
    """``had_waiters`` (KnowsWaiters, from the release statement's reply): True once after
    a release while another provider's waiter was registered; False after one nobody
    waited for, after one that freed nothing, and after one whose only listener was the
    releaser's own lingering channel (it waited for the key, took it and released it:
    no waiter; before, its own lingering registration made every such release notify)."""
    releaser, other = LockService(URL).provider, LockService(URL).provider
    assert isinstance(releaser, PostgresLockProvider)
    assert isinstance(other, PostgresLockProvider)
    key = f"{uuid.uuid4().hex}:told"
    try:
        take(releaser, key, "t1")
        assert releaser.release(key, "t1") is True
        assert releaser.had_waiters(key) is False
        subscription = subscribed(other, key)
        take(releaser, key, "t2")
        assert releaser.release(key, "t2") is True
        assert releaser.had_waiters(key) is True
        assert releaser.had_waiters(key) is False  # told once
        assert subscription.wait(2.0)
        assert releaser.release(key, "t2") is False
        assert releaser.had_waiters(key) is False
        subscription.close()
        own = subscribed(releaser, key)  # the releaser waited for the key itself...
        take(releaser, key, "t3")  # ...and took it
        own.close()
        assert releaser.release(key, "t3") is True  # at once: its unregistration may be in flight
        assert releaser.had_waiters(key) is False
        listener = releaser._listener
        assert listener is not None
        assert wait_until(lambda: registrations(listener) == 0)
        assert channel(TABLE, key) in listener._listened  # lingering: LISTENed, not registered
        take(releaser, key, "t4")
        assert releaser.release(key, "t4") is True
        assert releaser.had_waiters(key) is False
    finally:
        releaser.close()
        other.close()


def test_a_waiter_registers_again_on_a_lingering_channel() -> None:
    """A new wait on a key whose channel lingers (LISTENed, registration dropped) is
    registered again: the next release notifies and wakes it at once, and tells the
    releaser so."""
    waiter, releaser = LockService(URL).provider, LockService(URL).provider
    assert isinstance(waiter, PostgresLockProvider)
    key = f"{uuid.uuid4().hex}:again"
    try:
        subscribed(waiter, key).close()
        listener = waiter._listener
        assert listener is not None
        assert wait_until(lambda: registrations(listener) == 0)
        assert channel(TABLE, key) in listener._listened
        subscription = waiter.subscribe(key)  # lingering: no new LISTEN, a new registration
        assert registrations(listener) == 1
        take(releaser, key, "t")
        assert releaser.release(key, "t") is True
        assert subscription.wait(5) is True
        assert isinstance(releaser, PostgresLockProvider)
        assert releaser.had_waiters(key) is True
        subscription.close()
    finally:
        waiter.close()
        releaser.close()


def test_one_listen_connection_shared_and_released_with_the_last_waiter(
    provider: PostgresLockProvider,
) -> None:
    keys = [f"{uuid.uuid4().hex}:{i}" for i in range(3)]
    subscriptions = [provider.subscribe(k) for k in keys for _ in range(2)]
    listener = provider._listener
    assert listener is not None
    assert listener.backend_pid is not None
    assert provider.subscribe(keys[0]) is not None  # more subscribers: the same listener
    assert provider._listener is listener
    for subscription in subscriptions:
        subscription.close()
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND state IS NOT NULL",
            (listener.backend_pid,),
        ).fetchone()
        assert row is not None
        assert row[0] == 1
    provider.close()
    assert listener.closed
    assert listener._thread is not None
    assert not listener._thread.is_alive()


def _terminate(pid: int) -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
        assert row is not None
        assert row[0] is True


def test_a_terminated_listener_costs_only_latency_and_recovers() -> None:
    """Our own listener's backend is terminated while a waiter waits and the holder then
    releases (its notification lost): the waiter still acquires within the poll bound; the
    listener reconnects and later releases wake waiters again (p50 <= 50 ms)."""
    holder = LockService(URL, prefix=f"{uuid.uuid4().hex}:")
    waiter = LockService(URL, prefix=holder.prefix)
    try:
        _handover(holder, waiter, "warm")  # a wait that was refused once listens
        listener = waiter.provider._listener  # type: ignore[attr-defined]
        assert listener is not None
        lease = holder.lock("k", ttl=30)
        got: list[float] = []
        thread = threading.Thread(target=lambda: got.append(_timed_lock(waiter, "k")))
        thread.start()
        time.sleep(0.2)  # the waiter is waiting, subscribed
        old_pid = listener.backend_pid
        assert old_pid is not None
        _terminate(old_pid)
        released = time.monotonic()
        assert lease.release() is ReleaseOutcome.RELEASED
        thread.join(15)
        assert got
        assert got[0] - released <= POLL_MAX + 0.5, got[0] - released
        deadline = time.monotonic() + 10
        while listener.backend_pid in (None, old_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.backend_pid not in (None, old_pid)  # reconnected
        latencies = [_handover(holder, waiter, f"after{i}") for i in range(7)]
        assert statistics.median(latencies) <= 0.05, latencies
        assert waiter.provider._listener is listener  # type: ignore[attr-defined]
    finally:
        waiter.close(release=True)
        holder.close(release=True)


def _timed_lock(service: LockService, key: str) -> float:
    lease = service.lock(key, ttl=30, wait=10)
    acquired = time.monotonic()
    lease.release()
    return acquired


def _handover(holder: LockService, waiter: LockService, key: str) -> float:
    lease = holder.lock(key, ttl=30)
    released: list[float] = []

    def release_later() -> None:
        time.sleep(0.1)
        # Release only once the waiter was refused and subscribed: a waiter whose first
        # attempt a loaded machine delays past the sleep would otherwise take the key free.
        deadline = time.monotonic() + 10
        while waiter.provider._listener is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.005)
        released.append(time.monotonic())
        lease.release()

    thread = threading.Thread(target=release_later)
    thread.start()
    got = waiter.lock(key, ttl=30, wait=10)
    acquired = time.monotonic()
    thread.join()
    got.release()
    return acquired - released[0]


def _child_waits(url: str, prefix: str, parent_listener_pid: int, results: Any) -> None:
    """In a forked child: the inherited provider waits through a listener of its own."""
    service = _inherited
    assert service is not None
    _handover(service, service, "child-key")
    listener = service.provider._listener  # type: ignore[attr-defined]
    results.put((os.getpid(), listener.pid, listener.backend_pid != parent_listener_pid))
    service.close()


_inherited: LockService | None = None


def test_a_forked_child_never_uses_the_parents_listener() -> None:
    global _inherited
    service = LockService(URL, prefix=f"{uuid.uuid4().hex}:")
    _inherited = service
    try:
        _handover(service, service, "parent-key")  # a wait that was refused once listens
        listener = service.provider._listener  # type: ignore[attr-defined]
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        proc = ctx.Process(target=_child_waits, args=(URL, service.prefix, listener.backend_pid, results))
        proc.start()
        child_pid, listener_pid, own_session = results.get(timeout=30)
        proc.join(30)
        assert proc.exitcode == 0
        assert listener_pid == child_pid
        assert own_session
        # The parent's listener is untouched and still wakes its waiters.
        assert service.provider._listener is listener  # type: ignore[attr-defined]
        holder = LockService(URL, prefix=service.prefix)
        try:
            assert _handover(holder, service, "parent-again") <= POLL_MAX + 0.5
        finally:
            holder.close(release=True)
    finally:
        _inherited = None
        service.close(release=True)


def test_a_wait_after_its_own_release_is_not_woken_by_that_release() -> None:
    """A provider whose channel lingers (it waited for the key and took it) releases it
    while another provider's waiter is registered, and at once waits again (giving way):
    its own release's notification, which reaches its lingering LISTEN too, does not wake
    that new wait; the other's release does. Before, it cut every give-way short (~1 ms)."""
    holder, other = LockService(URL).provider, LockService(URL).provider
    assert isinstance(holder, PostgresLockProvider)
    assert isinstance(other, PostgresLockProvider)
    key = f"{uuid.uuid4().hex}:echo"
    try:
        for round_ in range(3):
            subscribed(holder, key).close()  # the holder waited for the key and took it
            take(holder, key, f"h{round_}")
            waiting = subscribed(other, key)
            assert holder.release(key, f"h{round_}") is True
            assert holder.had_waiters(key) is True
            again = holder.subscribe(key)  # giving way: waits at once
            assert waiting.wait(5) is True  # the other waiter was woken...
            assert again.wait(0.3) is False  # ...and the holder's new wait was not
            take(other, key, f"o{round_}")
            waiting.close()
            assert other.release(key, f"o{round_}") is True
            assert again.wait(5) is True  # woken by the other's release
            again.close()
    finally:
        holder.close()
        other.close()


def test_a_wait_on_a_free_key_does_not_listen() -> None:
    """A ``lock(wait=)`` whose first attempt wins subscribes to nothing (no listener
    connection, no registration round trip); the first refused attempt subscribes, and the
    wait is still woken by the release."""
    service = LockService(URL, prefix=f"{uuid.uuid4().hex}:")
    try:
        for _ in range(3):
            assert service.lock("free", ttl=30, wait=5).release() is ReleaseOutcome.RELEASED
        assert service.provider._listener is None  # type: ignore[attr-defined]
        assert _handover(service, service, "held") < POLL_MAX
        assert service.provider._listener is not None  # type: ignore[attr-defined]
    finally:
        service.close()
