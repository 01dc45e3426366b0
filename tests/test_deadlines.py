"""Per-call deadlines and exception classification, on the memory store (no server needed).

The real-network versions are in tests/faults/test_partitions.py and test_signals.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from celery_exclusive import BackendError, LeaseState, LockService
from celery_exclusive.heartbeat import CALL_TIMEOUT_CAP, MIN_CALL_TIMEOUT, call_timeout, refresh_timeout
from celery_exclusive.providers.base import Grant, Held, RefreshRequest, accepts_timeout
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.service import RELEASE_TIMEOUT, is_store_error
from tests.conftest import TIME_SLACK

#: Scheduling allowance on top of a promised bound, in seconds (0.5 s by default).
SLACK = 0.25 * TIME_SLACK


class StuckProvider(MemoryLockProvider):
    """Refreshes that carry the key ``stuck`` block until ``unblock`` is set; records timeouts."""

    def __init__(self) -> None:
        super().__init__()
        self.unblock = threading.Event()
        self.refreshed: list[tuple[float, str]] = []
        self.timeouts: dict[str, list[float | None]] = {"acquire": [], "refresh": [], "release": []}
        self.stuck_calls = 0

    def acquire(self, *args: Any, timeout: float | None = None) -> Grant | Held:
        self.timeouts["acquire"].append(timeout)
        return super().acquire(*args)

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        self.timeouts["refresh"].append(timeout)
        if any(r.key.endswith("stuck") for r in requests):
            self.stuck_calls += 1
            self.unblock.wait(30)
        answers = super().refresh(requests)
        now = time.monotonic()
        self.refreshed += [(now, r.key) for r, a in zip(requests, answers, strict=True) if a is not None]
        return answers

    def release(self, key: str, token: str, *, timeout: float | None = None) -> bool:
        self.timeouts["release"].append(timeout)
        return super().release(key, token)


class OldStyleProvider:
    """A provider written before the ``timeout`` keyword existed."""

    max_key_length = 1024

    def __init__(self) -> None:
        self.inner = MemoryLockProvider()
        self.refreshes = 0

    def acquire(self, key: str, token: str, ttl: float, max_lifetime: float, holder: str) -> Grant | Held:
        return self.inner.acquire(key, token, ttl, max_lifetime, holder)

    def refresh(self, requests: Sequence[RefreshRequest]) -> list[float | None]:
        self.refreshes += 1
        return self.inner.refresh(requests)

    def release(self, key: str, token: str) -> bool:
        return self.inner.release(key, token)

    def peek(self, key: str) -> Any:
        return self.inner.peek(key)

    def scan(self, prefix: str) -> Any:
        return self.inner.scan(prefix)

    def close(self) -> None:
        pass

    def diagnose(self) -> Any:
        return []


def test_a_stuck_refresh_does_not_starve_the_other_leases() -> None:
    """One refresh call that never returns: a lease taken afterwards is refreshed on schedule,
    the stuck lease is retried (new calls) and goes LOST at its own deadline, not before."""
    provider = StuckProvider()
    service = LockService(provider, ttl=1.0, refresh_interval=0.2)
    try:
        stuck = service.lock("stuck")
        deadline = time.monotonic() + 5
        while provider.stuck_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert provider.stuck_calls == 1, "the stuck lease was never refreshed"
        fresh = service.lock("fresh")
        taken = time.monotonic()
        time.sleep(2.0)
        times = [t for t, key in provider.refreshed if key.endswith("fresh")]
        assert times, "the fresh lease was never refreshed while another call was stuck"
        assert times[0] - (taken + 0.2) <= SLACK, f"first refresh {times[0] - taken:.3f} s after acquiring"
        assert len(times) >= 6, f"only {len(times)} refreshes in 2 s at a 0.2 s interval"
        assert fresh.state is LeaseState.HELD
        assert stuck.state is LeaseState.LOST
        assert provider.stuck_calls >= 2, "the abandoned call was never retried"
        # Each refresh may run on the socket until its lease's local deadline (ttl - margin).
        assert all(t is not None and t <= 0.9 + 1e-9 for t in provider.timeouts["refresh"])
    finally:
        provider.unblock.set()
        service.close()


def test_a_blocking_on_lost_callback_does_not_starve_the_other_leases() -> None:
    """A lease lost at its deadline runs its ``on_lost`` callbacks off the heartbeat thread:
    one that blocks (here until the end) used to stop every refresh, and a healthy lease
    went LOST at its own deadline, about 0.9 s later."""
    provider = MemoryLockProvider()
    service = LockService(provider, ttl=1.0, refresh_interval=0.2)
    unblock = threading.Event()
    called = threading.Event()

    def blocking(_lease: object, _reason: str) -> None:
        called.set()
        unblock.wait(30)

    try:
        ending = service.lock("ending", max_lifetime=1.0)  # never refreshed: LOST at its deadline
        ending.on_lost(blocking)
        healthy = service.lock("healthy")
        assert called.wait(5 * TIME_SLACK), "the ending lease's on_lost was never called"
        time.sleep(2.0)
        assert healthy.state is LeaseState.HELD
        assert ending.state is LeaseState.LOST
    finally:
        unblock.set()
        service.close()


def test_store_calls_get_their_deadlines() -> None:
    """acquire: call_timeout (less what it used); release: at most RELEASE_TIMEOUT."""
    provider = StuckProvider()
    service = LockService(provider, call_timeout=4.0)
    try:
        lease = service.lock("k")
        lease.release()
        (acquire_timeout,) = provider.timeouts["acquire"]
        assert acquire_timeout is not None
        assert 3.5 < acquire_timeout <= 4.0
        assert provider.timeouts["release"] == [min(4.0, RELEASE_TIMEOUT)]
    finally:
        service.close()


def test_refresh_timeout_bounds() -> None:
    class L:
        def __init__(self, interval: float, deadline: float) -> None:
            self.refresh_interval = interval
            self.deadline = deadline

        def _deadline_at(self) -> float:
            return self.deadline

    assert refresh_timeout([L(0.5, 10.0)], 9.0) == 0.5  # type: ignore[list-item]
    assert refresh_timeout([L(5.0, 10.0)], 9.0) == 0.5  # type: ignore[list-item]  # half of what is left
    assert refresh_timeout([L(300.0, 1000.0)], 0.0) == CALL_TIMEOUT_CAP  # type: ignore[list-item]
    assert refresh_timeout([L(0.5, 10.0)], 10.0) == MIN_CALL_TIMEOUT  # type: ignore[list-item]
    assert call_timeout([L(0.5, 10.0)], 9.0) == 1.0  # type: ignore[list-item]  # until the local deadline
    assert call_timeout([L(300.0, 1000.0)], 0.0) == CALL_TIMEOUT_CAP  # type: ignore[list-item]


def test_providers_without_the_timeout_keyword_still_work() -> None:
    provider = OldStyleProvider()
    assert not accepts_timeout(provider.acquire)
    service = LockService(provider, ttl=0.6, refresh_interval=0.1)
    try:
        lease = service.lock("old")
        time.sleep(0.5)
        assert lease.state is LeaseState.HELD
        assert provider.refreshes >= 2
        assert lease.release().value == "released"
    finally:
        service.close()


class _Failing(MemoryLockProvider):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc
        self.calls = 0

    def acquire(self, *args: Any, timeout: float | None = None) -> Grant | Held:
        self.calls += 1
        raise self.exc


@pytest.mark.parametrize("exc", [ValueError("bug"), KeyboardInterrupt(), SystemExit(3)])
def test_exceptions_that_are_not_the_stores_propagate_unretried(exc: BaseException) -> None:
    provider = _Failing(exc)
    service = LockService(provider)
    try:
        with pytest.raises(type(exc)) as raised:
            service.lock("k")
        assert raised.value is exc
        assert provider.calls == 1
        assert service.heartbeat._pending_release, "the interrupted acquire's token is not released"
    finally:
        service.heartbeat._pending_release.clear()
        service.close()


@pytest.mark.parametrize("exc", [ConnectionResetError(), TimeoutError(), OSError("down")])
def test_network_errors_become_backend_errors_and_are_retried_once(exc: BaseException) -> None:
    provider = _Failing(exc)
    service = LockService(provider)
    try:
        with pytest.raises(BackendError):
            service.lock("k")
        assert provider.calls == 2
    finally:
        service.heartbeat._pending_release.clear()
        service.close()


def test_is_store_error() -> None:
    import redis
    from celery.exceptions import SoftTimeLimitExceeded
    from sqlalchemy import exc as sa_exc

    assert is_store_error(redis.ConnectionError("x"))
    assert is_store_error(sa_exc.OperationalError("s", {}, Exception()))
    assert is_store_error(ConnectionRefusedError())
    assert not is_store_error(SoftTimeLimitExceeded())
    assert not is_store_error(KeyboardInterrupt())
    assert not is_store_error(ValueError())


class _SilentOldStyle(OldStyleProvider):
    """An old-style provider (no ``timeout`` keyword) whose store stops answering on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.silent = threading.Event()
        self.unblock = threading.Event()

    def _wait(self) -> None:
        if self.silent.is_set():
            self.unblock.wait(30)

    def acquire(self, key: str, token: str, ttl: float, max_lifetime: float, holder: str) -> Grant | Held:
        self._wait()
        return super().acquire(key, token, ttl, max_lifetime, holder)

    def peek(self, key: str) -> Any:
        self._wait()
        return super().peek(key)

    def scan(self, prefix: str) -> Any:
        self._wait()
        return super().scan(prefix)


def test_the_service_enforces_the_deadline_of_calls_without_a_timeout_keyword() -> None:
    """peek, locks and lock on a provider that cannot take ``timeout=``: the service stops
    waiting at call_timeout (BackendError), and answers again once the store does."""
    provider = _SilentOldStyle()
    service = LockService(provider, call_timeout=0.3)
    try:
        assert service.peek("k") is None
        provider.silent.set()
        for call in (lambda: service.peek("k"), service.locks, lambda: service.lock("k", ttl=1.0)):
            started = time.monotonic()
            with pytest.raises(BackendError, match="no answer"):
                call()
            assert time.monotonic() - started <= 0.3 + SLACK
        provider.silent.clear()
        provider.unblock.set()
        # The abandoned acquire may take "k" when the store answers at last, after its
        # background release was answered already: then "k" is free at its ttl (1 s).
        until = time.monotonic() + 5
        while service._calls._stuck and time.monotonic() < until:  # the abandoned calls end
            time.sleep(0.01)
        while service.peek("k") is not None and time.monotonic() < until:
            time.sleep(0.05)
        assert service.lock("k").release().value == "released"
    finally:
        provider.unblock.set()
        service.heartbeat._pending_release.clear()
        service.close()


class _Recording(_SilentOldStyle):
    """Remembers which thread ran each peek."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []  # kept, so no two can share an id

    def peek(self, key: str) -> Any:
        self.threads.append(threading.current_thread())
        return super().peek(key)


def test_calls_without_a_timeout_keyword_reuse_a_worker_thread() -> None:
    """Calls on a provider without ``timeout=`` run on a reused worker thread, not one new
    thread each; a worker stuck past its deadline gets no new call until its own ends."""
    provider = _Recording()
    service = LockService(provider, call_timeout=0.3)
    try:
        for _ in range(50):
            assert service.peek("k") is None
        assert len({id(t) for t in provider.threads}) == 1
        worker = provider.threads[-1]
        provider.silent.set()
        with pytest.raises(BackendError, match="no answer"):
            service.peek("k")
        provider.silent.clear()
        assert service.peek("k") is None  # on another thread: the first is still stuck
        assert provider.threads[-1] is not worker
        provider.unblock.set()
        until = time.monotonic() + 5
        while service._calls.stuck and time.monotonic() < until:
            time.sleep(0.01)
        assert service._calls.stuck == 0
        for _ in range(20):
            service.peek("k")
        assert len({id(t) for t in provider.threads[-20:]}) == 1
    finally:
        provider.unblock.set()
        service.close()
