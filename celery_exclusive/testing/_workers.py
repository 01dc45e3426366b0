"""Functions run in separate processes by the contract suite (importable under spawn).

``url`` is a store URL or a picklable provider factory (see ContractStore.target).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from celery_exclusive import LockProvider, LockService


def _connect(target: str | Callable[[], LockProvider], prefix: str) -> LockService:
    return LockService(target if isinstance(target, str) else target(), prefix=prefix)


def race_once(
    url: str | Callable[[], LockProvider],
    prefix: str,
    key: str,
    barriers: tuple[Barrier, Barrier],
    results: Any,
) -> None:
    """Try the key once when every racer is ready; hold it until every racer has tried."""
    start, done = barriers
    service = _connect(url, prefix)
    try:
        start.wait()
        lease = service.try_lock(key, ttl=30)
        results.put(lease is not None)
        done.wait()
        if lease is not None:
            lease.release()
    finally:
        service.close()


def increment_under_lock(
    url: str | Callable[[], LockProvider], prefix: str, key: str, counter: str, times: int
) -> None:
    """Unprotected read-modify-write of a counter file, ``times`` times, each under the lock."""
    service = _connect(url, prefix)
    path = Path(counter)
    try:
        done = 0
        while done < times:
            lease = service.try_lock(key, ttl=30)
            if lease is None:
                time.sleep(0.001)
                continue
            with lease:
                value = int(path.read_text())
                time.sleep(0.0005)  # widen the window a lost update would need
                path.write_text(str(value + 1))
            done += 1
    finally:
        service.close()
