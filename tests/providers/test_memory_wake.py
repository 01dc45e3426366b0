"""The memory store's release signals (``WakesWaiters``), which the wait path relies on."""

from __future__ import annotations

import threading
import time

from celery_exclusive.providers.base import Grant, WakesWaiters
from celery_exclusive.providers.memory import MemoryLockProvider


def take(provider: MemoryLockProvider, key: str, token: str) -> None:
    assert isinstance(provider.acquire(key, token, 30.0, 60.0, "{}"), Grant)


def test_a_release_before_the_wait_is_not_lost_and_other_keys_do_not_signal() -> None:
    provider = MemoryLockProvider()
    assert isinstance(provider, WakesWaiters)
    take(provider, "k", "t1")
    take(provider, "other", "t2")
    subscription = provider.subscribe("k")
    assert provider.release("other", "t2") is True
    assert provider.release("k", "not-the-owner") is False  # no release, no signal
    started = time.monotonic()
    assert subscription.wait(0.05) is False
    assert time.monotonic() - started >= 0.05
    assert provider.release("k", "t1") is True
    assert subscription.wait(0) is True  # sent before wait(): kept
    assert subscription.wait(0) is False  # and consumed
    subscription.close()
    subscription.close()  # idempotent


def test_a_release_wakes_every_waiter_at_once() -> None:
    provider = MemoryLockProvider()
    take(provider, "k", "t1")
    subscriptions = [provider.subscribe("k") for _ in range(4)]
    woken: list[float] = []
    threads = [
        threading.Thread(target=lambda s=s: woken.append(time.monotonic()) if s.wait(5) else None)
        for s in subscriptions
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    released = time.monotonic()
    assert provider.release("k", "t1") is True
    for thread in threads:
        thread.join(5)
    assert len(woken) == 4
    assert max(woken) - released < 0.5
    for subscription in subscriptions:
        subscription.close()
    assert provider._watched == {}  # no listener is left behind
