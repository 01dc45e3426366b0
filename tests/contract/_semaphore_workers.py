"""Functions the semaphore contract tests run in spawned processes."""

from __future__ import annotations

import time
from typing import Any

from celery_exclusive import LockService


def count_under_semaphore(
    url: str, prefix: str, key: str, *, limit: int, iterations: int, counters: Any, start: Any, results: Any
) -> None:
    """Take ``key`` with ``limit`` ``iterations`` times (waiting up to 10 s each), counting the
    holders in ``counters`` (shared memory, outside the lock store: [now, most ever]) while held.
    Reports (acquisitions, timeouts, fences seen per slot key)."""
    service = LockService(url, prefix=prefix, ttl=10)
    service.peek(key)  # connect before the start line
    start.wait()
    acquired = timeouts = 0
    fences: dict[str, list[int]] = {}
    try:
        for _ in range(iterations):
            lease = service.try_lock(key, limit=limit, wait=10.0)
            if lease is None:
                timeouts += 1
                continue
            with lease:
                with counters.get_lock():
                    counters[0] += 1
                    counters[1] = max(counters[1], counters[0])
                time.sleep(0.02)  # long enough for 3 to overlap on a serialising store (SQLite)
                with counters.get_lock():
                    counters[0] -= 1
            acquired += 1
            fences.setdefault(lease.store_key, []).append(lease.fence)
    finally:
        service.close()
    results.put((acquired, timeouts, fences))


def hold_slot_until_killed(url: str, prefix: str, key: str, *, limit: int, ttl: float, ready: Any) -> None:
    """Take a slot of ``key`` with a short ttl, say which, then hang (the test SIGKILLs this)."""
    service = LockService(url, prefix=prefix, ttl=ttl)
    lease = service.lock(key, limit=limit)
    ready.put(lease.store_key)
    time.sleep(600)
