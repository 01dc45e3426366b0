"""The hot path calls a provider that takes ``timeout=`` directly (not through
``StoreCalls.call``): its exceptions must still be translated exactly as there."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded

from celery_exclusive import LockService
from celery_exclusive.errors import BackendError
from celery_exclusive.lease import ReleaseOutcome
from celery_exclusive.providers.memory import MemoryLockProvider


class _Flaky(MemoryLockProvider):
    """Raises ``acquire_error`` / ``release_error`` (when set) instead of answering, and
    ``release_error_once`` at the next release only."""

    def __init__(self) -> None:
        super().__init__()
        self.acquire_error: BaseException | None = None
        self.release_error: BaseException | None = None
        self.release_error_once: BaseException | None = None
        self.acquires = 0

    def acquire(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        self.acquires += 1
        if self.acquire_error is not None:
            raise self.acquire_error
        return super().acquire(*args, timeout=timeout, **kwargs)

    def release(self, *args: Any, timeout: float | None = None) -> bool:
        once, self.release_error_once = self.release_error_once, None
        if once is not None:
            raise once
        if self.release_error is not None:
            raise self.release_error
        return super().release(*args, timeout=timeout)


@pytest.fixture
def flaky() -> Any:
    provider = _Flaky()
    service = LockService(provider, prefix="store-errors:")
    yield provider, service
    service.heartbeat._pending_release.clear()
    service.close(release=False)


def test_a_driver_error_on_acquire_is_a_backend_error_chained_from_it_after_one_retry(flaky: Any) -> None:
    provider, service = flaky
    provider.acquire_error = redis.ConnectionError("reset")
    with pytest.raises(BackendError, match="during acquire: ConnectionError") as raised:
        service.lock("k")
    assert raised.value.__cause__ is provider.acquire_error
    assert provider.acquires == 2
    assert service.heartbeat._pending_release  # the token is released in the background


def test_a_bug_in_acquire_propagates_unchanged_and_unretried(flaky: Any) -> None:
    provider, service = flaky
    provider.acquire_error = ValueError("bug")
    with pytest.raises(ValueError, match="bug"):
        service.lock("k")
    assert provider.acquires == 1


def test_a_network_error_on_release_is_unknown_and_retried_in_the_background(flaky: Any) -> None:
    provider, service = flaky
    lease = service.lock("k")
    provider.release_error = ConnectionResetError()
    assert lease.release() is ReleaseOutcome.UNKNOWN
    assert service.heartbeat._pending_release


def test_a_bug_in_release_propagates_unchanged(flaky: Any) -> None:
    provider, service = flaky
    lease = service.lock("k")
    provider.release_error = ValueError("bug")
    with pytest.raises(ValueError, match="bug"):
        lease.release()


@pytest.mark.parametrize("interrupt", [SoftTimeLimitExceeded(), KeyboardInterrupt()], ids=type)
def test_an_interrupted_release_is_finished_in_the_background(flaky: Any, interrupt: BaseException) -> None:
    """A signal handler's exception (Celery's soft time limit, Ctrl-C) raised inside the
    store's release propagates, and the release is retried by the heartbeat: the lease
    used to be marked released and dropped from the heartbeat with the store's copy left
    in place, the key held, kept and released by no one, until its ttl (15 min by default).
    A lock_many refused mid-wait rolls its taken keys back through this same release."""
    provider, service = flaky
    lease = service.lock("k", ttl=30)
    provider.release_error = interrupt
    with pytest.raises(type(interrupt)):
        lease.release()
    assert service.heartbeat._pending_release
    provider.release_error = None
    deadline = time.monotonic() + 5
    while service.peek("k") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.peek("k") is None


def test_an_interrupted_rollback_of_lock_many_still_releases_every_key(flaky: Any) -> None:
    """lock_many refused on its last key rolls the others back; an interrupt in the first
    of those releases must not end the rollback there, or the keys not yet released would
    stay held and kept alive by the heartbeat (until max_lifetime, 24 h) with no LeaseSet
    to release them (many._attempt_once rolls back again on the way out)."""
    provider, service = flaky
    blocker = LockService(provider, prefix=service.prefix)
    blocker.lock("z", ttl=30)
    provider.release_error_once = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        service.lock_many(["a", "b", "z"], ttl=30)
    assert service.held() == []
    deadline = time.monotonic() + 5
    while (service.peek("a") or service.peek("b")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.peek("a") is None
    assert service.peek("b") is None
    blocker.close()


def test_an_interrupted_release_of_a_lease_set_still_releases_every_key(flaky: Any) -> None:
    """A LeaseSet's release (its ``with`` block's exit) interrupted in its first lease's
    release goes on with the others, then raises: they used to stay held, kept alive by the
    heartbeat (until max_lifetime, 24 h) with nothing left to release them."""
    provider, service = flaky
    leases = service.lock_many(["a", "b", "c"], ttl=30)
    provider.release_error_once = SoftTimeLimitExceeded()
    with pytest.raises(SoftTimeLimitExceeded), leases:
        pass
    assert service.held() == []
    deadline = time.monotonic() + 5
    while any(service.peek(key) for key in "abc") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [service.peek(key) for key in "abc"] == [None, None, None]
