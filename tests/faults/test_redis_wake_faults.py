"""Faults of Redis's release signals (providers/_redis_wake.py) on the suite's private Redis:
the subscriber connections killed, the server gone while waiting, a server that stops
answering subscriptions. A lost signal only costs latency; an outage is still an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from celery_exclusive import BackendError, LockService, ReleaseOutcome
from celery_exclusive.providers import _redis_wake
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.waiting import POLL_MAX
from tests.faults.conftest import holder_and_waiter, wait_until
from tests.faults.servers import PrivateRedis


@pytest.fixture
def services(redis_server: PrivateRedis) -> Iterator[tuple[LockService, LockService]]:
    yield from holder_and_waiter(redis_server.url, "wf")


def subscribed(server: PrivateRedis, key: str) -> bool:
    reply = server.command("PUBSUB", "SHARDNUMSUB", key)
    assert isinstance(reply, list)
    return int(reply[1]) == 1


def wait_in_thread(service: LockService, key: str, wait: float) -> tuple[threading.Thread, list[object]]:
    """``service.lock(key, wait=wait)`` in a thread: appends (acquired at, lease) or the error."""
    outcome: list[object] = []

    def run() -> None:
        try:
            lease = service.lock(key, ttl=30, wait=wait)
            outcome.append((time.monotonic(), lease))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_killed_subscriber_connections_cost_only_latency(
    redis_server: PrivateRedis, services: tuple[LockService, LockService]
) -> None:
    """CLIENT KILL TYPE pubsub while a waiter waits, the release right after: the waiter
    acquires within the poll bound; the next waits are woken again on a new connection."""
    holder, waiter = services
    store_key = holder.prefix + "k"
    latencies = []
    for killed in (True, True, False, False, False):
        lease = holder.lock("k", ttl=30)
        thread, outcome = wait_in_thread(waiter, "k", 10)
        assert wait_until(lambda: subscribed(redis_server, store_key), timeout=5.0)
        if killed:
            assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub") == 1
        released = time.monotonic()
        assert lease.release() is ReleaseOutcome.RELEASED
        thread.join(15)
        ((acquired, got),) = outcome  # type: ignore[misc]
        latencies.append(acquired - released)
        got.release()
    assert max(latencies[:2]) <= POLL_MAX + 0.3, latencies
    assert max(latencies[2:]) <= 0.05, latencies


def test_the_server_gone_while_waiting_is_an_error_not_a_hang(
    redis_server: PrivateRedis, services: tuple[LockService, LockService]
) -> None:
    """The server dies while a waiter waits (its subscription breaks with it): the wait
    raises BackendError within the poll bound and a connect, not "not acquired" at its end."""
    holder, waiter = services
    holder.lock("k", ttl=30)
    thread, outcome = wait_in_thread(waiter, "k", 20)
    try:
        assert wait_until(lambda: subscribed(redis_server, holder.prefix + "k"), timeout=5.0)
        redis_server.kill()
        killed = time.monotonic()
        thread.join(15)
        failed = time.monotonic()
    finally:
        redis_server.restart()
    (error,) = outcome
    assert isinstance(error, BackendError), error
    assert failed - killed <= POLL_MAX + 1.0


def test_an_unconfirmed_subscription_is_given_up_and_waiters_poll(
    redis_server: PrivateRedis, services: tuple[LockService, LockService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops answering (CLIENT PAUSE ALL): ``subscribe`` returns unconfirmed
    after SUBSCRIBE_WAIT (the waiter polls), the connection is given up CONFIRM_TIMEOUT
    after the unconfirmed SSUBSCRIBE (the subscription's wait raises), the next ones fail
    at once for STALLED_FOR, and after it subscribing works again."""
    monkeypatch.setattr(_redis_wake, "STALLED_FOR", 1.5)
    holder, waiter = services
    provider = waiter.provider
    assert isinstance(provider, RedisLockProvider)
    opened = provider.subscribe(holder.prefix + "open")  # the connection, made before the pause
    assert redis_server.command("CLIENT", "PAUSE", "1200", "ALL") == b"OK"
    started = time.monotonic()
    unconfirmed = provider.subscribe(holder.prefix + "k")
    assert time.monotonic() - started <= _redis_wake.SUBSCRIBE_WAIT + 0.3
    with pytest.raises(ConnectionError):
        unconfirmed.wait(_redis_wake.CONFIRM_TIMEOUT + 0.5)
    assert _redis_wake.CONFIRM_TIMEOUT <= time.monotonic() - started <= _redis_wake.CONFIRM_TIMEOUT + 0.5
    unconfirmed.close()
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        provider.subscribe(holder.prefix + "k")
    assert time.monotonic() - started < 0.05
    with pytest.raises(ConnectionError):
        opened.wait(0)  # its connection was given up with the unconfirmed subscription
    opened.close()
    lease = holder.lock("k", ttl=30)
    thread, outcome = wait_in_thread(waiter, "k", 10)  # polls: no subscription while stalled
    time.sleep(0.2)
    released = time.monotonic()
    lease.release()
    thread.join(15)
    ((acquired, got),) = outcome  # type: ignore[misc]
    assert acquired - released <= POLL_MAX + 0.3
    got.release()
    time.sleep(1.6)
    again = provider.subscribe(holder.prefix + "k")
    assert holder.lock("k", ttl=30).release() is ReleaseOutcome.RELEASED
    assert again.wait(5.0) is True
    again.close()
