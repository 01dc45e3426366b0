"""What a completion record costs on the hot path: acquire + release with and without it.

``python -m benchmarks.completion_records [--pairs 400]`` times, per store, the provider's
``acquire`` without and with ``task_id`` (the record check) and ``release`` without and with
a ``Completion`` (the record write), alternating one pair of each, and prints the medians.
Its tables and keys carry the run id and are dropped at the end.
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


def measure(url: str, pairs: int) -> dict[str, float]:
    """Median µs of acquire and release at the provider, without and with a record.

    Plain and recorded pairs alternate one by one, so drift in the machine's load hits both
    alike (the shared 2-vCPU machine moves absolute numbers by 2x within minutes).
    """
    service = LockService(url, prefix=f"{REDIS_PREFIX}rec:", ttl=30)
    provider, prefix = service.provider, service.prefix
    samples: dict[str, list[float]] = {"acquire": [], "acquire+id": [], "release": [], "release+record": []}
    try:
        for index in range(pairs + 20):
            key, token, task_id = f"{prefix}k{index % 16}", uuid.uuid4().hex, uuid.uuid4().hex
            record = index % 2 == 1
            once = {"task_id": task_id} if record else {}
            start = time.perf_counter()
            provider.acquire(key, token, 30.0, 60.0, "{}", **once)
            took = (time.perf_counter() - start) * 1e6
            done = (Completion(task_id, "success", 0, 3600.0),) if record else ()
            start = time.perf_counter()
            provider.release(key, token, *done)
            freed = (time.perf_counter() - start) * 1e6
            if index >= 20:  # warm-up: connections, prepared statements, tables
                samples["acquire+id" if record else "acquire"].append(took)
                samples["release+record" if record else "release"].append(freed)
        return {name: statistics.median(values) for name, values in samples.items()}
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=400, help="acquire+release pairs per store")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stores = {
            "postgres": with_table(POSTGRES_URL, TABLE),
            "redis": REDIS_URL,
            "mariadb": with_table(MYSQL_URL, TABLE),
            "sqlite": f"sqlite:///{Path(tmp) / 'rec.sqlite3'}",
            "memory": "memory://",
        }
        print("store      acquire  +task_id  release  +record  pair delta   (median µs)")
        for name, url in stores.items():
            why = None if url.startswith(("sqlite", "memory")) else reachable(url)
            if why:
                print(f"{name:9} n/a ({why})")
                continue
            m = measure(url, options.pairs)
            delta = m["acquire+id"] + m["release+record"] - m["acquire"] - m["release"]
            print(
                f"{name:9} {m['acquire']:8.0f} {m['acquire+id']:9.0f} {m['release']:8.0f} "
                f"{m['release+record']:8.0f} {delta:+11.0f}",
                flush=True,
            )
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
                    conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {TABLE}_unless(varchar, varchar)"))
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
