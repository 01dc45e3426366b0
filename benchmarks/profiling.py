"""``--profile``: where LockService.lock + release spends its time, per store (cProfile).

Splits the service path (token, holder JSON, validation, Lease, heartbeat registration,
signals) from the provider's round trips; the numbers behind the service-layer changes
described in BENCHMARKS.md.
"""

from __future__ import annotations

import cProfile
import io
import pstats

from benchmarks.harness import POSTGRES_URL, REDIS_PREFIX, REDIS_URL, TABLE, Plan, reachable, with_table


def profile_service(plan: Plan) -> None:
    """Print the top functions by own time for lock + release on each reachable store."""
    from celery_exclusive import LockService

    n = 500 if plan.quick else 5000
    for store, url, prefix in (
        ("redis", REDIS_URL, f"{REDIS_PREFIX}prof:"),
        ("postgres", with_table(POSTGRES_URL, TABLE), "prof:"),
    ):
        if reachable(url):
            continue
        service = LockService(url, prefix=prefix)
        try:
            for i in range(50):
                service.lock(f"w{i}").release()
            profiler = cProfile.Profile()
            profiler.enable()
            for i in range(n):
                service.lock(f"k{i % 256}").release()
            profiler.disable()
        finally:
            service.close()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
        print(f"\n== cProfile: {n:,} x LockService.lock + release on {store} (sorted by own time)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
