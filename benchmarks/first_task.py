"""First-task latency after a worker starts: ``.venv/bin/python -m benchmarks.first_task``.

For each lock store, a fresh ``celery worker -P prefork -c N -O fair`` is started per
repetition; once it logs ``ready.`` (or a moment later, ``--idle``), N tasks are published
at once, one per pool process, and each task's latency is its body's start minus its
publish time (one clock). Kinds of worker (KINDS): a plain task (Celery's own floor), an
exclusive task with the package's start-up hooks disconnected (the cost before they
existed: driver import and connect in the first task), with only the driver imported in
the main process before it forks, and with the pool processes also connecting at
``worker_process_init`` (what a worker does now). Every worker is killed with its process
group; keys, queues and tables are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.harness import (
    CELERY_BROKER,
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    RUN_ID,
    TABLE,
    delete_redis_keys,
    drop_pg_tables,
    glob_escape,
    median,
    with_table,
)

ROOT = Path(__file__).resolve().parents[1]
KEYPREFIX = f"cebench-{RUN_ID}:"
#: Worker kind -> CE_FIRST_HOOKS (see benchmarks.first_task_app).
KINDS = {
    "plain task": "none",
    "exclusive, no start-up hooks (before)": "none",
    "exclusive, driver imported before fork": "preload",
    "exclusive, + connection at process init (now)": "all",
}


def start_worker(store: str, kind: str, concurrency: int, queue: str) -> tuple[subprocess.Popen[bytes], Path]:
    lock_url = with_table(POSTGRES_URL, TABLE) if store == "postgres" else REDIS_URL
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "CE_BENCH_BROKER": CELERY_BROKER,
        "CE_BENCH_KEYPREFIX": KEYPREFIX,
        "CE_BENCH_QUEUE": queue,
        "CELERY_EXCLUSIVE_URL": lock_url,
        "CELERY_EXCLUSIVE_PREFIX": f"{REDIS_PREFIX}first:",
    }
    env["CE_FIRST_HOOKS"] = KINDS[kind]
    log = Path(tempfile.mkstemp(prefix="cebench-first-", suffix=".log")[1])
    command = [
        sys.executable, "-m", "celery", "-A", "benchmarks.first_task_app", "worker",
        "-P", "prefork", "-c", str(concurrency), "-O", "fair", "-Q", queue,
        "-n", f"first-{RUN_ID}-{queue[-6:]}@bench", "-l", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with log.open("wb") as out:
        popen = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return popen, log


def kill(popen: subprocess.Popen[bytes], log: Path) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(10)
    with contextlib.suppress(OSError):
        log.unlink()


def one(store: str, kind: str, concurrency: int, idle: float, rep: int) -> tuple[float, list[float]]:
    """Start a worker, send one task per pool process: seconds to ``ready.``, task latencies."""
    # Imported here: main() has set the broker and key prefix it reads from the environment.
    from benchmarks.first_task_app import STARTS, exclusive_first, plain_first

    queue = f"cefirst-{RUN_ID}-{store}-{list(KINDS).index(kind)}-{rep}"
    client = redis.Redis.from_url(CELERY_BROKER)
    client.delete(STARTS)
    launched = time.monotonic()
    popen, log = start_worker(store, kind, concurrency, queue)
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.02)
        ready = time.monotonic() - launched
        time.sleep(idle)
        task = plain_first if kind == "plain task" else exclusive_first
        sent = {}
        for index in range(concurrency):
            tag = f"{queue}-{index}"
            sent[tag] = time.time()
            task.apply_async((tag,), queue=queue)
        deadline = time.monotonic() + 60
        while client.llen(STARTS) < concurrency:
            if time.monotonic() > deadline:
                raise RuntimeError(f"tasks did not run:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.01)
        starts = [json.loads(raw) for raw in client.lrange(STARTS, 0, -1)]
        client.delete(STARTS)
        return ready, [s["at"] - sent[s["tag"]] for s in starts]
    finally:
        kill(popen, log)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--idle", type=float, default=0.0, help="seconds between ready. and sending")
    parser.add_argument("--stores", default="redis,postgres")
    args = parser.parse_args()
    os.environ["CE_BENCH_BROKER"] = CELERY_BROKER
    os.environ["CE_BENCH_KEYPREFIX"] = KEYPREFIX
    try:
        print(
            f"| store | worker | first-task latency, median (max) of {args.repeat} starts x "
            f"{args.concurrency} processes, sent {args.idle:g} s after ready | start to ready., median |"
        )
        print("|---|---|---|---|")
        for store in args.stores.split(","):
            for kind in KINDS:
                latencies: list[float] = []
                readies: list[float] = []
                for rep in range(args.repeat):
                    ready, measured = one(store, kind, args.concurrency, args.idle, rep)
                    readies.append(ready)
                    latencies += measured
                p50, worst = median(latencies) * 1000, max(latencies) * 1000
                row = f"| {store} | {kind} | {p50:.0f} ms ({worst:.0f} ms) | {median(readies):.2f} s |"
                print(row, flush=True)
    finally:
        delete_redis_keys(CELERY_BROKER, glob_escape(KEYPREFIX) + "*")
        delete_redis_keys(REDIS_URL, glob_escape(REDIS_PREFIX) + "*")
        drop_pg_tables(TABLE)


if __name__ == "__main__":
    main()
