"""What one ``LockService.peek()`` costs per lock store, its per-call deadline included.

``python -m benchmarks.peek_calls [--calls 2000] [--rounds 5]`` times ``service.peek(key)``
(a held key: the store answers with a lease) on each store: memory, SQLite (a temp file),
PostgreSQL, MariaDB and Redis (the shared servers; a store that cannot be reached is
skipped), and, on the memory store, the same peek through a provider method that does not
take ``timeout`` (a third-party provider written before the keyword: the service then runs
the call in a worker thread it can stop waiting for). Prints the median over rounds of the
mean µs per call. Every table and key carries the run id and is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    delete_redis_keys,
    drop_pg_tables,
    glob_escape,
    reachable,
    with_table,
)
from celery_exclusive import LockService
from celery_exclusive.providers.memory import MemoryLockProvider

MARIADB_URL = os.environ.get(
    "CE_BENCH_MYSQL_URL", os.environ.get("CE_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
)


class _NoTimeout(MemoryLockProvider):
    """The memory store as a provider written before ``timeout=``: its peek lacks the keyword."""

    def peek(self, key: str) -> Any:  # type: ignore[override]
        return super().peek(key)


def per_call_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean µs of ``call()`` over ``calls`` calls."""
    for _ in range(min(calls, 200)):  # connections, statements, scripts, threads warm
        call()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(means)


def measure(store: LockService | str, calls: int, rounds: int) -> float:
    with LockService(store, prefix=f"{REDIS_PREFIX}peek:") as service:
        lease = service.try_lock("held", ttl=600)
        assert lease is not None, "the benchmark key is held by someone else"
        try:
            assert service.peek("held") is not None
            return per_call_us(lambda: service.peek("held"), calls, rounds)
        finally:
            lease.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="peeks per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (median reported)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stores: dict[str, Any] = {
            "memory": MemoryLockProvider(),
            "memory, no timeout=": _NoTimeout(),
            "sqlite": f"sqlite:///{tmp}/peek.db",
            "postgres": with_table(POSTGRES_URL, TABLE),
            "mariadb": with_table(MARIADB_URL, TABLE),
            "redis": REDIS_URL,
        }
        print("store                  µs/peek  (median of rounds; mean per call)")
        try:
            for name, store in stores.items():
                why = reachable(store) if isinstance(store, str) and "://127." in store else None
                if why:
                    print(f"{name:22} n/a ({why})")
                    continue
                us = measure(store, options.calls, options.rounds)
                print(f"{name:22} {us:8.1f}", flush=True)
        finally:
            delete_redis_keys(REDIS_URL, glob_escape(REDIS_PREFIX) + "*")
            if not reachable(POSTGRES_URL):
                drop_pg_tables(TABLE)
            _drop_mariadb_tables(TABLE)


def _drop_mariadb_tables(table: str) -> None:
    import sqlalchemy as sa

    if reachable(MARIADB_URL):
        return
    engine = sa.create_engine(MARIADB_URL)
    try:
        with engine.begin() as conn:
            for name in (table, f"{table}_fence", f"{table}_done"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS `{name}`")
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
