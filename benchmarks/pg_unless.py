"""What the fresh re-read costs PostgreSQL's ``acquire_unless`` (an until_done dedupe marker).

``python -m benchmarks.pg_unless [--rounds N] [--ops N]``: the statement the provider sends
(A: once it holds the marker key's lock it re-reads both keys through ``<table>_unless``)
against the same statement without the re-read (B: ``acquire_unless_snapshot``, the one
before the fix), in one process on one connection, blocks of ``--ops`` statements
alternated A/B then B/A over ``--rounds`` rounds: grants (a new key each, so a commit
flushed to disk) and refusals (a live execution key: both forms take the same path).

Two measures per block: the server backend's CPU time (``/proc/<pid>/schedstat``, the
nanoseconds it ran, so a loaded machine stretches it far less than wall time; the server
must run on this machine) and the client's wall time per statement. Then the function
alone: 20,000 calls in one statement against the same statement without them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from benchmarks.harness import drop_pg_tables, psycopg_dsn
from celery_exclusive.providers.sql import SqlLockProvider

POSTGRES_URL = os.environ.get("CE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
FORMS = {"A": "acquire_unless", "B": "acquire_unless_snapshot"}


def _cpu_ns(pid: int) -> int:
    """Nanoseconds backend ``pid`` has run on a CPU (its /proc entry: the server runs here)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def _params(key: str, token: str) -> dict[str, Any]:
    return {"key": key + "#queued", "blocker": key, "token": token, "ttl": 60.0, "life": 60.0, "holder": "{}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ops", type=int, default=200)
    args = parser.parse_args()
    import psycopg

    table = f"ce_bench_unless_{uuid.uuid4().hex[:8]}"
    provider = SqlLockProvider(POSTGRES_URL, table=table)
    try:
        provider.acquire("held", "run", 3600, 3600, "{}")
        sql = provider._psycopg_sql
        with psycopg.connect(psycopg_dsn(), autocommit=True) as conn:
            pid = conn.info.backend_pid

            def run(form: str, params: dict[str, Any], kind: str) -> None:
                rows = conn.execute(sql[FORMS[form]], params, prepare=True).fetchall()
                assert rows[0][0] == kind, rows

            for form in FORMS:  # prepared, and the function compiled, before timing
                run(form, _params(f"warm{form}", "t"), "g")
            cpu: dict[tuple[str, str], list[float]] = {(k, f): [] for k in ("grant", "refuse") for f in FORMS}
            wall: dict[tuple[str, str], list[float]] = {key: [] for key in cpu}
            for r in range(args.rounds):
                for kind in ("grant", "refuse"):
                    for form in "AB" if r % 2 == 0 else "BA":
                        before, started = _cpu_ns(pid), time.perf_counter()
                        for i in range(args.ops):
                            if kind == "grant":
                                run(form, _params(f"g{r}{form}{i}", "t"), "g")
                            else:
                                run(form, _params("held", f"x{i}"), "b")
                        wall[(kind, form)].append((time.perf_counter() - started) / args.ops * 1e6)
                        cpu[(kind, form)].append((_cpu_ns(pid) - before) / args.ops / 1e3)
            for kind in ("grant", "refuse"):
                for name, figures in (("server CPU", cpu), ("wall", wall)):
                    a, b = (statistics.median(figures[(kind, f)]) for f in FORMS)
                    ratios = [x / y for x, y in zip(figures[(kind, "A")], figures[(kind, "B")], strict=True)]
                    print(
                        f"{kind:6} {name:10}: A {a:8.1f} us, B {b:8.1f} us, A-B {a - b:+7.1f} us, "
                        f"A/B {a / b:.3f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
                    )
            calls, without = [], []
            keys = "('k' || i)::varchar, ('b' || i)::varchar"
            series = "SELECT count(*) FROM generate_series(1, 20000) i WHERE"
            for _ in range(5):
                before = _cpu_ns(pid)
                conn.execute(f"{series} {table}_unless({keys})")
                calls.append(_cpu_ns(pid) - before)
                before = _cpu_ns(pid)
                conn.execute(f"{series} ROW({keys}) IS NOT NULL")
                without.append(_cpu_ns(pid) - before)
            per_call = (statistics.median(calls) - statistics.median(without)) / 20000 / 1e3
            print(f"the function alone: {per_call:.2f} us of server CPU a call (median of 5 x 20,000)")
        load = os.getloadavg()
        print(f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.rounds} rounds of {args.ops} per block")
    finally:
        provider.close()
        drop_pg_tables(table)


if __name__ == "__main__":
    main()
