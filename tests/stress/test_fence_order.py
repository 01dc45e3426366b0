"""Every lock store under contention, without Celery: the stress checker's exclusion and
fence-order checks on each of memory, SQLite, PostgreSQL, MariaDB and Redis.

Four processes (threads of one process for the in-memory store) take two keys over and
over for a few seconds and log each critical section (key, fence, wall-clock start and
end, taken right after the acquire returned and right before the release). The checker
then requires, per key, no overlap and fences strictly increasing in acquisition order.

Short mode (CI): 2 s per store, 4 contenders. ``CE_LONG=1``: 30 s, 16 contenders.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
import warnings
from typing import Any

import pytest

from celery_exclusive import LockService
from tests.conftest import Store
from tests.stress import checker

LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
SECONDS = 30.0 if LONG else 2.0
CONTENDERS = 16 if LONG else 4
KEYS = ("fence:a", "fence:b")

pytestmark = pytest.mark.timeout(int(SECONDS * 4 + 120))


def contend(service: LockService, seconds: float, tag: str) -> list[dict[str, Any]]:
    """Take the keys over and over for ``seconds``; one ``run`` event per critical section."""
    runs: list[dict[str, Any]] = []
    rng = random.Random()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        key = rng.choice(KEYS)
        lease = service.try_lock(key, ttl=30)
        if lease is None:
            continue
        start = time.time()
        time.sleep(rng.uniform(0, 0.002))
        end = time.time()
        runs.append(
            {
                "event": "run",
                "key": key,
                "fence": lease.fence,
                "start": start,
                "end": end,
                "task_id": f"{tag}-{len(runs)}",
            }
        )
        lease.release()
    return runs


def _process(url: str, prefix: str, seconds: float, barrier: Any, out: Any) -> None:
    service = LockService(url, prefix=prefix)
    try:
        barrier.wait()
        out.put(("ok", contend(service, seconds, str(os.getpid()))))
    except Exception as exc:
        out.put(("error", repr(exc)))
    finally:
        service.close()


def test_fences_increase_in_acquisition_order_on_every_store(store: Store) -> None:
    """Per key, critical sections never overlap and each has a larger fence than the one before."""
    service = store.service()
    runs: list[dict[str, Any]] = []
    if not store.cross_process:
        results: list[list[dict[str, Any]]] = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(contend(service, SECONDS, f"t{i}")))
            for i in range(CONTENDERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SECONDS + 60)
        runs = [run for part in results for run in part]
    else:
        prefix = service.prefix
        # Forked (every store is fork-safe), so the contenders start without re-importing.
        ctx = multiprocessing.get_context("fork")
        barrier, out = ctx.Barrier(CONTENDERS), ctx.Queue()
        procs = [
            ctx.Process(target=_process, args=(store.url, prefix, SECONDS, barrier, out))
            for _ in range(CONTENDERS)
        ]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            for proc in procs:
                proc.start()
        outcomes = [out.get(timeout=SECONDS + 120) for _ in procs]
        for proc in procs:
            proc.join(30)
        assert [kind for kind, _ in outcomes] == ["ok"] * CONTENDERS, outcomes
        runs = [run for _, part in outcomes for run in part]
    assert len(runs) > 20, f"too few critical sections to check: {len(runs)}"
    violations = checker.check_exclusion(runs) + checker.check_fences(runs)
    print(f"fence order on {store.name}: {len(runs)} critical sections, {len(violations)} violations")
    assert not violations, "\n".join(violations[:20])
