"""Waiting for a held lock (issue #13 item 1): handover latency and fairness.

Run on its own (not yet a section of ``python -m benchmarks``)::

    .venv/bin/python -m benchmarks.waiting [--seconds 5] [--stores memory,redis,postgres]

* handover: one holder releases, one waiter (another service, ``lock(wait=)``) acquires;
  the release-to-acquired time over 40 trials, p50/p99. Stores that signal releases
  (memory today) hand over on the signal; the others within the poll bound (0.05 s).
* fairness: 8 processes loop ``lock(key, wait=10)`` / hold 5 ms / release on one key for
  ``--seconds``; each process's share of the acquisitions (ideal 12.5 %), and Jain's index
  (1.0 = perfectly even, 1/8 = one process got everything).

Keys use a unique prefix and are released at the end; nothing else is touched.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
import uuid
from typing import Any

from celery_exclusive import LockService

URLS = {
    "memory": "memory://",
    "redis": "redis://127.0.0.1:6379/0",
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test?ce_table=ce_bench_waiting",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test?ce_table=ce_bench_waiting",
}


def handover(url: str, prefix: str, trials: int) -> list[float]:
    holder = LockService(url, prefix=prefix)
    waiter = LockService(holder.provider if url == "memory://" else url, prefix=prefix)
    latencies = []
    try:
        for i in range(trials):
            lease = holder.lock("handover", ttl=30)
            released: list[float] = []

            def release(
                lease: Any = lease, released: list[float] = released, hold: float = 0.02 + (i % 5) * 0.03
            ) -> None:
                time.sleep(hold)
                released.append(time.monotonic())
                lease.release()

            thread = threading.Thread(target=release)
            thread.start()
            got = waiter.lock("handover", ttl=30, wait=10)
            latencies.append(time.monotonic() - released[0] if released else 0.0)
            thread.join()
            got.release()
    finally:
        waiter.close()
        holder.close()
    return latencies


def _contend(url: str, prefix: str, seconds: float, start: Any, results: Any) -> None:
    service = LockService(url, prefix=prefix)
    service.peek("fair")
    count = 0
    start.wait()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            lease = service.try_lock("fair", ttl=30, wait=max(0.0, end - time.monotonic()))
            if lease is None:
                break
            time.sleep(0.005)
            lease.release()
            count += 1
    finally:
        service.close()
    results.put(count)


def fairness(url: str, prefix: str, seconds: float, processes: int = 8) -> list[int]:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_contend, args=(url, prefix, seconds, start, results)) for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    counts = sorted(results.get(timeout=seconds + 120) for _ in procs)
    for proc in procs:
        proc.join(30)
    return counts


def jain(counts: list[int]) -> float:
    total = sum(counts)
    return total * total / (len(counts) * sum(c * c for c in counts)) if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--stores", default="memory,redis,postgres")
    args = parser.parse_args()
    for name in args.stores.split(","):
        url = URLS[name]
        prefix = f"bw{uuid.uuid4().hex[:8]}:"
        lat = sorted(handover(url, prefix, args.trials))
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(
            f"{name:9} handover p50 {statistics.median(lat) * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"
            f"  ({len(lat)} trials)"
        )
        if name == "memory":
            continue  # in-process only: no cross-process fairness to measure
        counts = fairness(url, prefix, args.seconds)
        total = sum(counts)
        shares = " ".join(f"{100 * c / total:4.1f}%" for c in counts) if total else "-"
        print(f"{name:9} fairness 8 procs: {total} acquisitions, shares {shares}, Jain {jain(counts):.3f}")


if __name__ == "__main__":
    main()
