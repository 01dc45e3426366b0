"""What a completion record costs on the hot path: acquire + release with and without it.

``python -m benchmarks.completion_records [--rounds 10] [--per-round 40]`` runs, per store,
rounds of ``lock(key) + release()`` against ``lock(key, task_id=...) + release(Completion)``
(the order alternates by round) and prints the median latency of each and the median of the
per-round differences. Its tables and keys carry the run id and are dropped at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness import POSTGRES_URL, REDIS_PREFIX, REDIS_URL, TABLE, reachable, with_table
from celery_exclusive import LockService
from celery_exclusive.providers.base import Completion

MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/test"


def _pair(service: LockService, key: str, record: bool) -> float:
    task_id = uuid.uuid4().hex
    start = time.perf_counter()
    if record:
        service.lock(key, task_id=task_id).release(Completion(task_id, "success", 0, 3600.0))
    else:
        service.lock(key).release()
    return (time.perf_counter() - start) * 1e6


def measure(url: str, rounds: int, per_round: int) -> tuple[float, float, float]:
    """Median µs of a plain pair, of a pair with a record, and of the per-round differences."""
    service = LockService(url, prefix=f"{REDIS_PREFIX}rec:", ttl=30)
    try:
        for i in range(30):
            _pair(service, f"warm{i % 4}", i % 2 == 0)
        plain: list[float] = []
        recorded: list[float] = []
        deltas: list[float] = []
        for index in range(rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            medians = {}
            for record in order:
                samples = [_pair(service, f"k{i % 16}", record) for i in range(per_round)]
                (recorded if record else plain).extend(samples)
                medians[record] = statistics.median(samples)
            deltas.append(medians[True] - medians[False])
        return statistics.median(plain), statistics.median(recorded), statistics.median(deltas)
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=40)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stores = {
            "postgres": with_table(POSTGRES_URL, TABLE),
            "redis": REDIS_URL,
            "mariadb": with_table(MYSQL_URL, TABLE),
            "sqlite": f"sqlite:///{Path(tmp) / 'rec.sqlite3'}",
            "memory": "memory://",
        }
        print(f"{'store':9} {'plain µs':>9} {'record µs':>10} {'delta µs':>9}")
        for name, url in stores.items():
            why = None if url.startswith(("sqlite", "memory")) else reachable(url)
            if why:
                print(f"{name:9} n/a ({why})")
                continue
            plain, recorded, delta = measure(url, options.rounds, options.per_round)
            print(f"{name:9} {plain:9.0f} {recorded:10.0f} {delta:+9.0f}", flush=True)
    _drop()


def _drop() -> None:
    """Drop what the run made: its lock tables (with fence counter, records) and Redis keys."""
    import redis
    import sqlalchemy as sa

    for url in (POSTGRES_URL, MYSQL_URL):
        if reachable(url):
            continue
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                for suffix in ("", "_fence", "_done"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {TABLE}{suffix}"))
                if engine.dialect.name == "postgresql":
                    conn.execute(sa.text(f"DROP SEQUENCE IF EXISTS {TABLE}_fence_seq"))
        finally:
            engine.dispose()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{REDIS_PREFIX}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


if __name__ == "__main__":
    main()
