"""Run the benchmark suite: ``.venv/bin/python -m benchmarks [--quick] [--only SECTION ...]``.

Prints one table of rates and p50/p99 latencies, then every target of the issue with its
measured ratio and PASS/MISS. ``--quick`` (what CI runs) measures little, so its numbers
are only a smoke test: it checks that every row still runs, and never fails on a MISS.
``--markdown FILE`` writes the tables with the machine's description (for BENCHMARKS.md).
Everything the run creates (tables, keys, queues, worker processes) is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import (
    capacity,
    celery_e2e,
    contention,
    dedupe_send,
    footprint,
    heartbeat,
    pg_locks,
    redis_locks,
    semaphore,
    waiting,
)
from benchmarks.harness import (
    CELERY_BROKER,
    ORIGIN_TABLE,
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    RUN_ID,
    TABLE,
    UPSERT_TABLE,
    Cleanup,
    Plan,
    Report,
    delete_redis_keys,
    drop_pg_tables,
    glob_escape,
    reachable,
    timed,
)

SECTIONS = (
    "redis",
    "postgres",
    "contention",
    "waiting",
    "semaphore",
    "heartbeat",
    "footprint",
    "capacity",
    "celery",
    "dedupe",
)


def all_rows() -> list[str]:
    """The name of every row and target the full suite prints (the quick test checks them)."""
    modules: list[Any] = [
        redis_locks,
        pg_locks,
        contention,
        waiting,
        semaphore,
        heartbeat,
        footprint,
        capacity,
        celery_e2e,
        dedupe_send,
    ]
    names: list[str] = []
    for module in modules:
        names += module.ROWS
        names += [target[0] for target in module.TARGETS]
    return names


def machine() -> str:
    """One paragraph: CPU, memory, load, OS, Python and the versions that matter."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "?"
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            mem = f"{int(info.readline().split()[1]) / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        mem = "?"
    versions = []
    for dist in ("redis", "hiredis", "psycopg", "SQLAlchemy", "celery", "kombu", "python-redis-lock"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} -")
    servers = []
    if not reachable(POSTGRES_URL):
        try:
            import psycopg

            from benchmarks.harness import psycopg_dsn

            with psycopg.connect(psycopg_dsn(), connect_timeout=5) as conn:
                row = conn.execute("SHOW server_version").fetchone()
                servers.append(f"PostgreSQL {row[0] if row else '?'}")
        except Exception:
            servers.append("PostgreSQL ?")
    if not reachable(REDIS_URL):
        try:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            servers.append(f"Redis {client.info('server').get('redis_version', '?')}")
            client.close()
        except Exception:
            servers.append("Redis ?")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} vCPU ({cpu}), {mem} RAM, load average {load}; "
        f"{platform.system()} {platform.release()}; Python {platform.python_version()}; "
        f"{'; '.join(servers)} (loopback); {', '.join(versions)}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections and print the report; 0 unless a section crashed (or --strict MISS)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small counts: a smoke test (CI), no speed checks"
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per comparison")
    parser.add_argument("--celery-tasks", type=int, help="no-op tasks per Celery round (full: 1,000)")
    parser.add_argument("--celery-rounds", type=int, help="Celery throughput rounds (full: 9)")
    parser.add_argument("--markdown", type=Path, help="also write the tables and machine to this file")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--profile", action="store_true", help="also cProfile the service path per store")
    args = parser.parse_args(argv)
    plan = Plan.make(args.quick, args.rounds)
    if args.celery_tasks or args.celery_rounds:
        plan = dataclasses.replace(
            plan,
            celery_tasks=args.celery_tasks or plan.celery_tasks,
            celery_rounds=args.celery_rounds or plan.celery_rounds,
        )
    chosen = args.only or list(SECTIONS)
    report = Report()
    cleanup = Cleanup()
    cleanup.add("redis keys", lambda: _delete_keys(REDIS_URL, f"*{glob_escape(REDIS_PREFIX)}*"))
    cleanup.add("celery broker keys", lambda: _delete_keys(CELERY_BROKER, f"cebench-{RUN_ID}*"))
    cleanup.add("postgres tables", _drop_tables)
    # SIGTERM (a CI timeout, say) unwinds like Ctrl-C, so worker processes and tables go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    description = machine()
    print(f"celery-exclusive benchmarks ({'quick' if plan.quick else 'full'}, run {RUN_ID})\n{description}\n")
    runners: dict[str, Callable[[], None]] = {
        "redis": lambda: redis_locks.run(report, plan, cleanup),
        "postgres": lambda: pg_locks.run(report, plan, cleanup),
        "contention": lambda: contention.run(report, plan, cleanup),
        "waiting": lambda: waiting.run(report, plan, cleanup),
        "semaphore": lambda: semaphore.run(report, plan, cleanup),
        "heartbeat": lambda: heartbeat.run(report, plan, cleanup),
        "footprint": lambda: footprint.run(report, plan),
        "capacity": lambda: capacity.run(report, plan, cleanup),
        "celery": lambda: celery_e2e.run(report, plan, cleanup),
        "dedupe": lambda: dedupe_send.run(report, plan, cleanup),
    }
    failed: list[str] = []
    try:
        for name in chosen:
            with timed(name):
                try:
                    runners[name]()
                except Exception as exc:
                    import traceback

                    traceback.print_exc()
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
        if args.profile:
            from benchmarks.profiling import profile_service

            profile_service(plan)
    finally:
        cleanup.run()
    elapsed = time.perf_counter() - started
    table = report.markdown()
    print(f"\n{table}\n")
    verdicts = [t.verdict for t in report.targets]
    summary = (
        f"benchmark complete in {elapsed:.0f} s: {len(report.rows)} rows, {len(report.targets)} targets, "
        f"{verdicts.count('PASS')} PASS, {verdicts.count('MISS')} MISS, {verdicts.count('n/a')} n/a"
    )
    if failed:
        summary += f"; sections FAILED: {'; '.join(failed)}"
    print(summary)
    if args.markdown:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        mode = "quick" if plan.quick else "full"
        args.markdown.write_text(
            f"Run {RUN_ID}, {stamp}, {mode} mode, {elapsed:.0f} s, at commit {_git_head()}. "
            f"Machine: {description}\n\n{table}\n" + (f"\n{summary}\n" if failed else "")
        )
    if failed:
        return 2
    if args.strict and "MISS" in verdicts:
        return 1
    return 0


def _drop_tables() -> None:
    if reachable(POSTGRES_URL) is None:
        drop_pg_tables(TABLE, ORIGIN_TABLE, UPSERT_TABLE)


def _delete_keys(url: str, pattern: str) -> None:
    if reachable(url) is None:
        delete_redis_keys(url, pattern)


def _git_head() -> str:
    """The commit checked out, marked when the work tree has changes on top of it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, check=False, timeout=5
        ).stdout.strip()
    except OSError:
        return "?"
    return f"{head or '?'}{' + uncommitted changes' if dirty else ''}"


if __name__ == "__main__":
    sys.exit(main())
