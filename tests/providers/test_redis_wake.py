"""The Redis store's release signals (``WakesWaiters``, providers/_redis_wake.py) on the
shared Redis: sharded pub/sub on the lock key, published by release.lua.

Only this test's own subscriber connection is ever killed (``CLIENT KILL ID`` of the
connection whose address is our socket's), never another client of the shared server.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_exclusive import BackendError, LockService
from celery_exclusive.providers.base import Grant, WakesWaiters
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.testing.contract import wait_until
from celery_exclusive.waiting import POLL_MAX
from tests.conftest import REDIS_URL, delete_redis_keys, require_server


@pytest.fixture
def prefix() -> Iterator[str]:
    require_server(REDIS_URL)
    name = f"wake{uuid.uuid4().hex[:10]}:"
    yield name
    delete_redis_keys(name)


@pytest.fixture
def direct() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    yield client
    client.close()


def subscribers(direct: redis.Redis, key: str) -> int:
    reply = direct.execute_command("PUBSUB", "SHARDNUMSUB", key)
    return int(reply[1])


def wake_threads() -> set[threading.Thread]:
    """The release-signal reader threads alive in this process (other tests' included: a
    test compares with those alive when it began)."""
    return {t for t in threading.enumerate() if t.name.startswith("celery-exclusive-wake")}


def take(provider: RedisLockProvider, key: str, token: str) -> None:
    assert isinstance(provider.acquire(key, token, 30.0, 600.0, "{}"), Grant)


def kill_own_subscriber(provider: RedisLockProvider, direct: redis.Redis) -> None:
    """CLIENT KILL ID of this provider's subscriber connection (found by its address)."""
    signals = provider._signals
    assert signals is not None
    (link,) = signals._links.values()
    host, port = link.conn._sock.getsockname()[:2]
    (found,) = [c for c in direct.client_list(_type="pubsub") if c["addr"] == f"{host}:{port}"]
    assert direct.execute_command("CLIENT", "KILL", "ID", found["id"]) == 1


def test_a_release_signals_its_own_key_only_and_only_when_it_freed_a_lease(
    prefix: str, direct: redis.Redis
) -> None:
    provider = RedisLockProvider(REDIS_URL)
    try:
        assert isinstance(provider, WakesWaiters)
        key, other = prefix + "a", prefix + "b"
        take(provider, key, "t1")
        take(provider, other, "t2")
        subscription = provider.subscribe(key)
        assert subscribers(direct, key) == 1
        assert provider.release(other, "t2") is True  # another key: no signal
        assert provider.release(key, "wrong") is False  # not the holder: no signal
        assert subscription.wait(0.2) is False
        assert provider.release(key, "t1") is True
        assert subscription.wait(5.0) is True
        assert provider.release(key, "t1") is False  # already free: no second signal
        assert subscription.wait(0.2) is False
        take(provider, key, "t3")
        assert provider.release(key, "t3") is True
        time.sleep(0.1)  # signalled before wait(): kept
        assert subscription.wait(0) is True
        subscription.close()
        subscription.close()
        assert wait_until(lambda: subscribers(direct, key) == 0, timeout=5.0)
    finally:
        provider.close()


def test_one_connection_serves_every_waiter_and_the_last_to_leave_unsubscribes(
    prefix: str, direct: redis.Redis
) -> None:
    before = wake_threads()
    provider = RedisLockProvider(REDIS_URL)
    try:
        key, other = prefix + "a", prefix + "b"
        first, second, third = provider.subscribe(key), provider.subscribe(key), provider.subscribe(other)
        signals = provider._signals
        assert signals is not None
        assert len(signals._links) == 1
        assert subscribers(direct, key) == 1
        take(provider, key, "t")
        assert provider.release(key, "t") is True
        assert first.wait(5.0) is True
        assert second.wait(5.0) is True  # one release wakes every waiter
        # Another key's waiter is not woken, unless its SSUBSCRIBE was answered only after
        # subscribe() returned (a loaded machine): such a one signals on the answer, by design.
        assert third.wait(0) is False or signals._watches[other].early
        first.close()
        assert subscribers(direct, key) == 1
        second.close()
        assert wait_until(lambda: subscribers(direct, key) == 0, timeout=5.0)
        again = provider.subscribe(key)  # subscribing anew right after leaving works
        take(provider, key, "t")
        assert provider.release(key, "t") is True
        assert again.wait(5.0) is True
        again.close()
        third.close()
    finally:
        provider.close()
    assert not wake_threads() - before


def test_a_killed_subscriber_connection_only_costs_latency(prefix: str, direct: redis.Redis) -> None:
    """The subscriber connection is killed while a waiter waits, and the release follows at
    once (its message is lost): the waiter still acquires within the poll bound, and the
    next wait subscribes on a new connection and is woken again."""
    holder = LockService(REDIS_URL, prefix=prefix)
    waiter = LockService(REDIS_URL, prefix=prefix)
    try:
        provider = waiter.provider
        assert isinstance(provider, RedisLockProvider)
        for _ in range(3):
            lease = holder.lock("k", ttl=30)
            got: list[float] = []
            thread = threading.Thread(target=_append_locked_at, args=(waiter, got))
            thread.start()
            assert wait_until(lambda: subscribers(direct, prefix + "k") == 1, timeout=5.0)
            kill_own_subscriber(provider, direct)
            released = time.monotonic()
            assert lease.release().name == "RELEASED"
            thread.join(15)
            assert got, "the waiter did not acquire"
            assert got[0] - released <= POLL_MAX + 0.3, got[0] - released
        woken: list[float] = []
        for _ in range(5):  # a fresh connection: woken again, far under the poll bound
            lease = holder.lock("k", ttl=30)
            thread = threading.Thread(target=_append_locked_at, args=(waiter, woken))
            thread.start()
            assert wait_until(lambda: subscribers(direct, prefix + "k") == 1, timeout=5.0)
            released = time.monotonic()
            lease.release()
            thread.join(15)
            woken[-1] -= released
        assert sorted(woken)[2] <= 0.05, woken
    finally:
        holder.close()
        waiter.close()


def _append_locked_at(service: LockService, times: list[float]) -> None:
    """Wait for key ``k``; append when it was acquired (monotonic s), then release it."""
    lease = service.lock("k", ttl=30, wait=10)
    times.append(time.monotonic())
    lease.release()


def _child_wakes(
    provider: RedisLockProvider, key: str, parent_signals: int, answer: multiprocessing.Queue[object]
) -> None:
    try:
        subscription = provider.subscribe(key)
        assert provider._signals is not None
        own = id(provider._signals) != parent_signals
        take(provider, key, "child")
        provider.release(key, "child")
        answer.put((own, subscription.wait(5.0)))
        subscription.close()
    except Exception as exc:  # reported to the parent, which fails the test
        answer.put(repr(exc))


def test_a_forked_child_subscribes_on_its_own_connection(prefix: str) -> None:
    provider = RedisLockProvider(REDIS_URL)
    try:
        key = prefix + "fork"
        mine = provider.subscribe(key)
        ctx = multiprocessing.get_context("fork")
        answer: multiprocessing.Queue[object] = ctx.Queue()
        proc = ctx.Process(target=_child_wakes, args=(provider, key, id(provider._signals), answer))
        proc.start()
        assert answer.get(timeout=30) == (True, True)
        proc.join(30)
        assert mine.wait(5.0) is True  # the child's release woke the parent too
        take(provider, key, "parent")  # and the parent's connection still works after the child exited
        provider.release(key, "parent")
        assert mine.wait(5.0) is True
        mine.close()
    finally:
        provider.close()


def test_closing_the_provider_ends_its_listener_and_breaks_open_subscriptions(prefix: str) -> None:
    before = wake_threads()
    provider = RedisLockProvider(REDIS_URL)
    subscription = provider.subscribe(prefix + "c")
    provider.close()
    assert not wake_threads() - before
    with pytest.raises(ConnectionError):
        subscription.wait(0.1)
    subscription.close()
    again = provider.subscribe(prefix + "c")  # used after close(): a new connection
    again.close()
    provider.close()


def test_a_store_outage_is_an_error_for_the_waiter() -> None:
    """No server: subscribing fails (a BackendError, so the waiter polls) and the wait's
    attempt reports the outage instead of "not acquired"."""
    service = LockService("redis://127.0.0.1:1/0?socket_connect_timeout=0.5", prefix="wake:")
    try:
        with pytest.raises(BackendError):
            service.provider.subscribe("wake:x")  # type: ignore[attr-defined]
        with pytest.raises(BackendError):
            service.try_lock("x", wait=0.3)
    finally:
        service.close()


def test_a_release_tells_whether_its_signal_reached_a_waiter(prefix: str) -> None:
    """``had_waiters`` (KnowsWaiters, from release.lua's SPUBLISH count): True once after a
    release another provider's subscription received; False after one nobody listened to,
    and after a release that freed nothing."""
    releaser, listener = RedisLockProvider(REDIS_URL), RedisLockProvider(REDIS_URL)
    key = prefix + "told"
    try:
        take(releaser, key, "t1")
        assert releaser.release(key, "t1") is True
        assert releaser.had_waiters(key) is False
        subscription = listener.subscribe(key)
        take(releaser, key, "t2")
        assert releaser.release(key, "t2") is True
        assert releaser.had_waiters(key) is True
        assert releaser.had_waiters(key) is False  # told once
        assert subscription.wait(2.0)
        assert releaser.release(key, "t2") is False
        assert releaser.had_waiters(key) is False
        take(releaser, key, "t3")
        assert releaser.release(key, "t3") is True  # reached the waiter, not asked after
        subscription.close()
        take(releaser, key, "t4")
        assert releaser.release(key, "t4") is True  # reached nobody: the note is gone
        assert releaser.had_waiters(key) is False
    finally:
        releaser.close()
        listener.close()


def test_close_while_the_first_subscription_starts_its_listener_waits_for_it(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() running between a new link's registration and its reader thread's start
    (forced here: the start waits for close() to have been called) ends that link like any
    other instead of raising "cannot join thread before it is started" (a CI failure)."""
    before = wake_threads()
    provider = RedisLockProvider(REDIS_URL)
    real_start = threading.Thread.start
    closer_errors: list[BaseException] = []
    closing = threading.Event()

    def close_now() -> None:
        closing.set()
        try:
            provider.close()
        except BaseException as exc:
            closer_errors.append(exc)

    closer = threading.Thread(target=close_now, daemon=True)

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("celery-exclusive-wake") and not closer.is_alive():
            closer.start()
            assert closing.wait(5)
            time.sleep(0.2)  # the old code's close() runs all the way through here
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        # close() may take the link before the SSUBSCRIBE's answer (ConnectionError: the
        # waiter polls instead) or after it.
        with contextlib.suppress(ConnectionError):
            provider.subscribe(prefix + "k").close()
    finally:
        monkeypatch.undo()
        closer.join(10)
    assert not closer.is_alive()
    assert closer_errors == []
    assert wait_until(lambda: not wake_threads() - before, 5)
    provider.close()
