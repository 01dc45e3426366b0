"""Leased semaphores (issue #13 item 2): uncontended acquire + release against the single lock.

The ``semaphore`` section of ``python -m benchmarks`` (:func:`run`: Redis and PostgreSQL),
also runnable on its own, with more stores::

    .venv/bin/python -m benchmarks.semaphore [--rounds 15] [--ops 200] [--stores redis,postgres]

Each round runs the approaches back to back, their order rotating every round (interleaved,
:func:`benchmarks.harness.interleave`, so a loaded machine's slow spells hit them alike):
``lock(key)`` (today's lock), ``lock(key, limit=1)`` and ``lock(key, limit=3)``, each followed
by ``release()``, on keys cycled over 64 per approach. The targets are the medians of the
per-round rate ratios against today's lock: limit=1 within 5 % (>= 0.95x) and limit=3
>= 0.8x. limit=3 takes slot 1 of a free key, in one store call on both stores (Redis
``acquire_any.lua``, PostgreSQL the ``acquire_any`` statement).

Keys use a unique prefix and tables a unique name, removed at the end; nothing else is touched.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    RUN_ID,
    TABLE,
    Cleanup,
    Op,
    Plan,
    Report,
    Series,
    drop_pg_tables,
    interleave,
    reachable,
    round_ratios,
    with_table,
)
from celery_exclusive import LockService

SECTION = "semaphore"
KEYS = 64
APPROACHES = ("lock()", "limit=1", "limit=3")
#: The PostgreSQL table of the section (dropped at the end of the run).
SEM_TABLE = f"{TABLE}_sem"
STORES = {
    "redis": (REDIS_URL, REDIS_PREFIX + "sem:"),
    "postgres": (with_table(POSTGRES_URL, SEM_TABLE), f"sem{RUN_ID}:"),
}
ROWS = [f"{store} {approach}" for store in STORES for approach in APPROACHES]
#: (name, bound, op, unit) of the section's targets, two per store.
TARGETS = [
    (f"{store} {approach} vs lock()", bound, ">=", "x")
    for store in STORES
    for approach, bound in (("limit=1", 0.95), ("limit=3", 0.8))
]
#: Extra stores for the standalone run.
URLS = {
    "memory": "memory://",
    "sqlite": "sqlite:////tmp/ce_bench_semaphore.sqlite3",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test?ce_table=ce_bench_semaphore",
}


def cycle(service: LockService, approach: str) -> Op:
    """One acquire + release of ``approach`` on the ``i``-th of its keys."""
    tag = approach.replace("()", "").replace("=", "")
    keys = [f"{tag}:{i}" for i in range(KEYS)]
    if approach == "lock()":
        return lambda i: service.lock(keys[i % KEYS]).release()
    limit = int(approach.split("=")[1])
    return lambda i: service.lock(keys[i % KEYS], limit=limit).release()


def measure(url: str, prefix: str, rounds: int, ops: int) -> dict[str, Series]:
    """Every approach on one store, interleaved."""
    service = LockService(url, prefix=prefix, ttl=900)
    try:
        approaches = {approach: cycle(service, approach) for approach in APPROACHES}
        return interleave(approaches, rounds=rounds, ops=ops, warmup=max(20, ops // 5))
    finally:
        service.close()


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """The ``semaphore`` section: limit=1 and limit=3 against today's lock, Redis and PostgreSQL."""
    for index, (store, (url, prefix)) in enumerate(STORES.items()):
        rows, targets = ROWS[3 * index : 3 * index + 3], TARGETS[2 * index : 2 * index + 2]
        reason = reachable(url)
        if reason:
            report.unavailable(SECTION, rows, targets, reason)
            continue
        if store == "postgres":
            cleanup.add(f"table {SEM_TABLE}", lambda: drop_pg_tables(SEM_TABLE, SEM_TABLE + "_done"))
        ops = plan.redis_ops if store == "redis" else plan.pg_ops
        series = measure(url, prefix, plan.rounds, ops)
        report.series_rows(
            SECTION,
            {f"{store} {name}": s for name, s in series.items()},
            {f"{store} limit=3": "slot 1 of a free key: one store call"},
        )
        note = "quick: too few rounds to judge" if plan.quick else ""
        for (name, bound, op, unit), approach in zip(targets, ("limit=1", "limit=3"), strict=True):
            ratios = round_ratios(series[approach], series["lock()"])
            report.target(name, statistics.median(ratios), bound, op=op, unit=unit, note=note, rounds=ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--stores", default="redis,postgres")
    args = parser.parse_args()
    header = ("store", "lock() µs", "limit=1 µs", "limit=3 µs", "rate l1/lock", "rate l3/lock")
    print(f"{header[0]:9} {header[1]:>10} {header[2]:>11} {header[3]:>11} {header[4]:>13} {header[5]:>13}")
    cleanup = Cleanup()
    try:
        for name in args.stores.split(","):
            url, prefix = STORES.get(name) or (URLS[name], f"bsem{RUN_ID}:")
            if name == "postgres":
                cleanup.add(f"table {SEM_TABLE}", lambda: drop_pg_tables(SEM_TABLE, SEM_TABLE + "_done"))
            series = measure(url, prefix, args.rounds, args.ops)
            ratio1, ratio3 = (
                statistics.median(round_ratios(series[a], series["lock()"])) for a in ("limit=1", "limit=3")
            )
            micros = [1e6 / series[a].rate for a in APPROACHES]
            print(
                f"{name:9} {micros[0]:10.1f} {micros[1]:11.1f} {micros[2]:11.1f} "
                f"{ratio1:12.3f}x {ratio3:12.3f}x"
            )
    finally:
        cleanup.run()


if __name__ == "__main__":
    main()
