"""Capacity of one server here: lease refreshes/s and acquire+release/s from 4 client processes.

Clients and server share this machine's CPUs, so these are lower bounds for a dedicated
server. BENCHMARKS.md turns them into what a 1,000-worker deployment needs.
"""

from __future__ import annotations

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_URL,
    Cleanup,
    Plan,
    Report,
    reachable,
)
from benchmarks.procs import ProcPool

SECTION = "capacity"
PROCESSES = 4
BATCH = 1000
STORES = ("postgres", "redis")


def _names(store: str) -> tuple[str, str, str]:
    return (
        f"{store}: lease refreshes/s, {PROCESSES} processes x {BATCH:,}-lease batches",
        f"{store}: refresh calls/s, {PROCESSES} processes x 1-lease batches",
        f"{store}: LockService acquire+release/s, {PROCESSES} processes, distinct keys",
    )


ROWS = [name for store in STORES for name in _names(store)]
TARGETS: list[tuple[str, float, str, str]] = []


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """Saturate each server with batched refreshes, single-lease refreshes, then acquire+release."""
    pool: ProcPool | None = None
    try:
        for store in STORES:
            names = _names(store)
            reason = reachable(REDIS_URL if store == "redis" else POSTGRES_URL)
            if reason:
                report.unavailable(SECTION, names, [], reason)
                continue
            pool = pool or ProcPool(PROCESSES)
            # The quick run (a smoke test) holds 100-lease batches: 4,000 durable acquires
            # on PostgreSQL took most of this section's time there.
            batch = 100 if plan.quick else BATCH
            counts = pool.run("refresh", plan.capacity_seconds, store=store, leases=batch)
            calls = sum(c["ok"] / c["elapsed"] for c in counts)
            rows = calls * batch
            report.row(
                SECTION,
                names[0],
                rate=rows,
                unit="leases/s",
                note=("quick: 100-lease batches; " if plan.quick else "")
                + f"{calls:,.0f} batched calls/s; a budget of {rows * 300:,.0f} leases at the default "
                f"refresh interval (ttl/3 = 300 s), {rows * 10:,.0f} at 10 s",
            )
            counts = pool.run("refresh", plan.capacity_seconds, store=store, leases=1)
            calls = sum(c["ok"] / c["elapsed"] for c in counts)
            report.row(
                SECTION,
                names[1],
                rate=calls,
                unit="calls/s",
                note="the cost of a fleet of processes that hold one lease each",
            )
            counts = pool.run("acquire_release", plan.capacity_seconds, store=store)
            rate = sum(c["ok"] / c["elapsed"] for c in counts)
            report.row(
                SECTION,
                names[2],
                rate=rate,
                unit="ops/s",
                note=f"= {rate:,.0f} exclusive task starts/s ({2 * rate:,.0f} statements/s)",
            )
    finally:
        if pool is not None:
            pool.close()
