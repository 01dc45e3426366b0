"""Footprint: memory per held lease (tracemalloc), what a released Redis key leaves behind, and
what ``import celery_exclusive`` loads."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    Plan,
    Report,
    reachable,
    with_table,
)

SECTION = "footprint"
MEMORY = "memory per held lease (tracemalloc over 10,000 leases)"
IMPORT = "import celery_exclusive in a fresh interpreter"
RETAINED = "Redis memory left per released distinct key (MEMORY USAGE)"
ROWS = [MEMORY, RETAINED, IMPORT]
T_MEMORY = "footprint: bytes of Python memory per held lease"
T_RETAINED = "footprint: Redis retention, MiB per 1 M distinct keys a day"
T_IMPORT = "footprint: drivers imported by `import celery_exclusive` (redis, psycopg, pymysql)"
TARGETS = [(T_MEMORY, 2048, "<=", " B"), (T_RETAINED, 20, "<=", " MiB"), (T_IMPORT, 0, "==", "")]
DRIVERS = ("redis", "psycopg", "pymysql")

_PROBE = """
import json, sys, time
start = time.perf_counter()
import celery_exclusive
elapsed = time.perf_counter() - start
names = ("redis", "psycopg", "pymysql", "hiredis", "sqlalchemy", "celery", "kombu")
print(json.dumps({"seconds": elapsed, "loaded": [n for n in names if n in sys.modules]}))
"""


def run(report: Report, plan: Plan) -> None:
    """Every measurement."""
    memory(report, plan)
    retained(report, plan)
    imports(report)


def memory(report: Report, plan: Plan) -> None:
    """Traced Python memory growth from holding ``plan.many_leases`` leases, per lease."""
    from benchmarks.heartbeat import IdleThread
    from celery_exclusive import LockService

    if reachable(REDIS_URL) is None:
        url, prefix, store = REDIS_URL, f"{REDIS_PREFIX}mem:", "redis"
    elif reachable(POSTGRES_URL) is None:
        url, prefix, store = with_table(POSTGRES_URL, TABLE), "mem:", "postgres"
    else:
        report.unavailable(SECTION, [MEMORY], [TARGETS[0]], "no lock server reachable")
        return
    # No heartbeat thread: its refreshes would allocate transient objects mid-measurement.
    service = LockService(url, prefix=prefix, ttl=900.0, thread_factory=IdleThread)
    try:
        service.lock("warm-up").release()  # connections, scripts, statement caches
        n = plan.many_leases
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        base = tracemalloc.get_traced_memory()[0]
        leases = [service.lock(f"l{i}") for i in range(n)]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
        top = tracemalloc.take_snapshot().compare_to(before, "lineno")[:4]
        tracemalloc.stop()
        per_lease = grown / n
        where = ", ".join(
            f"{Path(stat.traceback[0].filename).name}:{stat.traceback[0].lineno} {stat.size_diff / n:.0f} B"
            for stat in top
        )
        report.row(
            SECTION,
            MEMORY,
            rate=per_lease,
            unit="B/lease",
            note=f"{n:,} leases on {store}, list of leases included; largest: {where}",
        )
        report.target(T_MEMORY, per_lease, 2048, op="<=", unit=" B", note="our bound for 'small': 2 KiB")
        for lease in leases:
            lease.release()
    finally:
        service.close()


def _usage(client: Any, keys: list[str]) -> int:
    """Bytes ``MEMORY USAGE`` gives for ``keys`` (absent keys count 0), pipelined."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    return sum(int(n or 0) for n in pipe.execute())


def retained(report: Report, plan: Plan) -> None:
    """Acquire and release ``plan.many_leases`` distinct keys (the per-object key idiom), then sum
    ``MEMORY USAGE`` of what they left (the keys under this run's prefix, found by SCAN) and of
    the fence high-water keys the store keeps (a fixed cost, counted whole here): per key.

    Only this run's own keys are measured: never ``INFO`` (a shared server's other clients
    would be counted) and never a flush."""
    import redis

    from celery_exclusive import LockService

    why = reachable(REDIS_URL)
    if why is not None:
        report.unavailable(SECTION, [RETAINED], [TARGETS[1]], why)
        return
    prefix = f"{REDIS_PREFIX}ret:"
    service = LockService(REDIS_URL, prefix=prefix, ttl=60.0)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        n = plan.many_leases
        for i in range(n):
            service.lock(f"object-{i}").release()
        left = [k.decode() for k in client.scan_iter(match=prefix + "*", count=1000)]
        fixed = [k.decode() for k in client.scan_iter(match="celery-exclusive:fences*", count=1000)]
        kept, hwm = _usage(client, left), _usage(client, fixed)
        per_key = (kept + hwm) / n
        per_million_mib = per_key * 1_000_000 / 2**20
        report.row(
            SECTION,
            RETAINED,
            rate=per_key,
            unit="B/key",
            note=(
                f"{n:,} keys acquired and released; {len(left):,} keys left ({kept:,} B), "
                f"{len(fixed):,} fence high-water keys ({hwm:,} B, a fixed cost); "
                f"= {per_million_mib:.1f} MiB per 1 M keys a day"
            ),
        )
        report.target(T_RETAINED, per_million_mib, 20, op="<=", unit=" MiB", note="issue #16")
    finally:
        mine = list(client.scan_iter(match=prefix + "*", count=1000))
        for start in range(0, len(mine), 1000):
            client.delete(*mine[start : start + 1000])
        client.close()
        service.close()


def imports(report: Report) -> None:
    """Which modules a fresh ``import celery_exclusive`` loads, and how long it takes."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    drivers = [name for name in found["loaded"] if name in DRIVERS]
    report.row(
        SECTION,
        IMPORT,
        rate=found["seconds"] * 1000,
        unit="ms",
        note=f"loaded: {', '.join(found['loaded']) or 'none of the listed'}",
    )
    report.target(
        T_IMPORT, float(len(drivers)), 0, op="==", unit="", note=", ".join(drivers) or "none loaded"
    )
