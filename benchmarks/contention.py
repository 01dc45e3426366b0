"""Contention on PostgreSQL: what a failed acquire costs the server, and throughput under contention.

A failed acquire must write no WAL, take no transaction id and log nothing. Measured three
ways, from exact to indicative:

* exact, per statement: ``EXPLAIN (ANALYZE, WAL)`` of one failed attempt counts the WAL
  records and bytes that statement generated, and ``pg_current_xact_id_if_assigned()`` in
  the same (rolled back) transaction tells whether it took a transaction id;
* exact, server log: the log file's new lines that name this run's tables (every ERROR is
  logged with its statement under the default ``log_min_error_statement = error``), so other
  sessions' lines don't count; nothing is reconfigured;
* global, around a run of failed attempts by 4 processes: ``pg_current_wal_lsn()`` and
  the next transaction id, minus their growth over an idle window of the same length just
  before (other sessions share the server: indicative only). ``pg_stat_database`` error
  counters are not used: backends flush them up to 10 s late.

The raw one-statement upsert and the origin design are measured the same way: they are
the positive controls showing that each method does see WAL, transaction ids and errors.
"""

from __future__ import annotations

import glob
import math
import os
import time
from typing import Any

from benchmarks.harness import (
    ORIGIN_TABLE,
    POSTGRES_URL,
    TABLE,
    UPSERT_TABLE,
    Cleanup,
    Plan,
    Report,
    median,
    psycopg_dsn,
    reachable,
    with_table,
)
from benchmarks.procs import HOLDER, LIFE, TTL, ProcPool, upsert_sql

SECTION = "contention"
PROCESSES = 4
PACKAGE = "celery-exclusive LockService.try_lock, 4 processes, 1 key"
STATEMENT = "the provider's own statements on raw psycopg, 4 processes, 1 key"
UPSERT = "raw one-statement upsert (ON CONFLICT DO UPDATE WHERE expired), 4 processes"
FAIL_PACKAGE = "failed acquire footprint: celery-exclusive"
FAIL_UPSERT = "failed acquire footprint: raw upsert"
FAIL_ORIGIN = "failed acquire footprint: origin design"
ROWS = [PACKAGE, STATEMENT, UPSERT, FAIL_PACKAGE, FAIL_UPSERT, FAIL_ORIGIN]
T_THROUGHPUT = "contention: successful acquisitions/s vs raw upsert (4 processes)"
T_WAL = "contention: WAL bytes written by a failed acquire"
T_XID = "contention: transaction ids taken by a failed acquire"
T_LOG = "contention: server log lines from failed acquires"
TARGETS = [(T_THROUGHPUT, 1.5, ">=", "x"), (T_WAL, 0, "==", " B"), (T_XID, 0, "==", ""), (T_LOG, 0, "==", "")]


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """Footprint of a failed attempt (exact, then global), then the throughput race."""
    reason = reachable(POSTGRES_URL)
    if reason:
        report.unavailable(SECTION, ROWS, TARGETS, reason)
        return
    import psycopg
    import sqlalchemy as sa

    from benchmarks.origin import OriginLock, origin_table
    from celery_exclusive import LockService
    from celery_exclusive.providers.sql import lock_table

    engine = sa.create_engine(POSTGRES_URL)
    metadata = sa.MetaData()
    lock_table(metadata, UPSERT_TABLE)
    origin_tab = origin_table(metadata, ORIGIN_TABLE)
    metadata.create_all(engine)
    service = LockService(with_table(POSTGRES_URL, TABLE), prefix="proc:", ttl=TTL)
    conn = psycopg.connect(psycopg_dsn(), autocommit=True)
    pool = ProcPool(PROCESSES)
    try:
        # Keys held by this process for the whole footprint part: every attempt on them fails.
        held = service.lock("held")
        conn.execute(
            upsert_sql(),
            {"key": "held", "token": "parent", "ttl": TTL, "life": LIFE, "holder": HOLDER},
        )
        origin = OriginLock(engine, origin_tab)
        if origin.try_acquire("held", TTL) is None:
            raise RuntimeError("origin: could not take the held key")
        statements = {
            FAIL_PACKAGE: (service.provider._psycopg_sql["acquire"], "proc:held"),  # type: ignore[attr-defined]
            FAIL_UPSERT: (upsert_sql(), "held"),
        }
        log = ServerLog(conn)
        results: dict[str, dict[str, Any]] = {}
        for name, approach in ((FAIL_PACKAGE, "package"), (FAIL_UPSERT, "upsert"), (FAIL_ORIGIN, "origin")):
            found: dict[str, Any] = {}
            if name in statements:
                sql, key = statements[name]
                found.update(explain_wal(conn, sql, key))
            found.update(global_counters(conn, pool, log, approach, plan.contention_seconds))
            results[name] = found
            report.row(
                SECTION, name, rate=found["attempts_per_s"], unit="failed attempts/s", note=describe(found)
            )
        held.release()
        package = results[FAIL_PACKAGE]
        report.target(
            T_WAL,
            package.get("wal_bytes", math.nan),
            0,
            op="==",
            unit=" B",
            note=f"EXPLAIN (ANALYZE, WAL): {package.get('wal_records')} records; "
            f"raw upsert: {results[FAIL_UPSERT].get('wal_bytes')} B",
        )
        report.target(
            T_XID,
            0 if package.get("xid") is None else 1,
            0,
            op="==",
            unit="",
            note=f"pg_current_xact_id_if_assigned() after the statement: {package.get('xid')}; "
            f"raw upsert: {results[FAIL_UPSERT].get('xid')}",
        )
        report.target(
            T_LOG,
            package["log_lines"],
            0,
            op="==",
            unit="",
            note=f"{log.describe()}; origin design: {results[FAIL_ORIGIN]['log_lines']:.0f} lines "
            f"in {results[FAIL_ORIGIN]['attempts']:,} attempts",
        )
        # The race: every process tries one key; a winner releases at once.
        order = ["package", "statement", "upsert"]
        ok: dict[str, list[float]] = {approach: [] for approach in order}
        tries: dict[str, list[float]] = {approach: [] for approach in order}
        for r in range(plan.contention_rounds):
            for approach in order[r % 3 :] + order[: r % 3]:
                counts = pool.run(
                    "contend", plan.contention_seconds, approach=approach, key=f"race{r}-{approach}"
                )
                ok[approach].append(sum(c["ok"] / c["elapsed"] for c in counts))
                tries[approach].append(sum((c["ok"] + c["failed"]) / c["elapsed"] for c in counts))
        for name, approach in ((PACKAGE, "package"), (STATEMENT, "statement"), (UPSERT, "upsert")):
            report.row(
                SECTION,
                name,
                rate=median(ok[approach]),
                unit="acquisitions/s",
                note=f"{median(tries[approach]):,.0f} attempts/s",
            )
        ratios = [a / b for a, b in zip(ok["package"], ok["upsert"], strict=True) if b > 0]
        report.target(
            T_THROUGHPUT,
            median(ratios),
            1.5,
            rounds=ratios,
            note="failed upserts lock the row (and fsync a commit), so releases queue behind them",
        )
    finally:
        pool.close()
        conn.close()
        service.close()
        engine.dispose()


def explain_wal(conn: Any, sql: str, key: str) -> dict[str, Any]:
    """WAL generated by one execution of ``sql`` (exact), and the transaction id it took."""
    params = {"key": key, "token": "contender", "ttl": TTL, "life": LIFE, "holder": HOLDER}
    conn.execute("BEGIN")
    try:
        plan = conn.execute("EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + sql, params).fetchone()[0]
        xid = conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0]
    finally:
        conn.execute("ROLLBACK")
    nodes: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    # Each node's WAL usage includes its children's: the largest is the statement's.
    return {
        "wal_records": max(int(n.get("WAL Records", 0)) for n in nodes),
        "wal_bytes": max(int(n.get("WAL Bytes", 0)) for n in nodes),
        "xid": None if xid is None else str(xid),
    }


COUNTERS = "SELECT pg_current_wal_lsn(), pg_snapshot_xmax(pg_current_snapshot())::text::bigint"


def _counters(conn: Any) -> tuple[int, int]:
    lsn, xid = conn.execute(COUNTERS).fetchone()
    return _lsn(lsn), int(xid)


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def global_counters(
    conn: Any, pool: ProcPool, log: ServerLog, approach: str, seconds: float
) -> dict[str, Any]:
    """Server-wide WAL, xid and rollback growth over failed attempts, minus an idle window's."""
    idle_before = _counters(conn)
    time.sleep(seconds)
    idle_after = _counters(conn)
    mark = log.mark()
    before = _counters(conn)
    counts = pool.run("contend", seconds, approach=approach, key="held")
    after = _counters(conn)
    attempts = sum(c["failed"] for c in counts)
    if any(c["ok"] for c in counts):
        raise RuntimeError(f"{approach}: a contender took the held key")
    elapsed = max(c["elapsed"] for c in counts)
    background = [(b - a) / seconds * elapsed for a, b in zip(idle_before, idle_after, strict=True)]
    growth = [b - a - bg for a, b, bg in zip(before, after, background, strict=True)]
    per = max(attempts, 1)
    return {
        "attempts": attempts,
        "attempts_per_s": sum(c["failed"] / c["elapsed"] for c in counts),
        "global_wal_per_attempt": growth[0] / per,
        "global_xid_per_attempt": growth[1] / per,
        "log_lines": log.lines_since(mark),
    }


def describe(found: dict[str, Any]) -> str:
    """One cell: the exact measures, then the global ones."""
    parts = []
    if "wal_bytes" in found:
        parts.append(
            f"EXPLAIN: {found['wal_records']} WAL records, {found['wal_bytes']} B; "
            f"xid {'none' if found['xid'] is None else 'taken'}"
        )
    parts.append(f"server log: {found['log_lines']:.0f} lines")
    parts.append(
        f"server-wide per attempt (minus idle window): {found['global_wal_per_attempt']:+.1f} WAL B, "
        f"{found['global_xid_per_attempt']:+.3f} xids"
    )
    return "; ".join(parts)


class ServerLog:
    """The server's log file, if this machine can read it; counts lines naming this run's tables."""

    def __init__(self, conn: Any) -> None:
        self.path = self._find(conn)
        self.needle = TABLE.encode()

    @staticmethod
    def _find(conn: Any) -> str | None:
        explicit = os.environ.get("CE_BENCH_PG_LOG")
        if explicit:
            return explicit
        try:
            current = conn.execute("SELECT pg_current_logfile()").fetchone()[0]
            if current:
                directory = conn.execute("SHOW data_directory").fetchone()[0]
                path = current if os.path.isabs(current) else os.path.join(directory, current)
                if os.access(path, os.R_OK):
                    return str(path)
            major = conn.execute("SHOW server_version_num").fetchone()[0][:-4]
        except Exception:
            return None
        # Debian's pg_ctlcluster sends stderr here when the logging collector is off.
        candidates = [
            p for p in glob.glob(f"/var/log/postgresql/postgresql-{major}-*.log") if os.access(p, os.R_OK)
        ]
        return max(candidates, key=os.path.getmtime) if candidates else None

    def mark(self) -> int:
        """The log's current size (where new lines will start)."""
        return os.path.getsize(self.path) if self.path else 0

    def lines_since(self, mark: int) -> float:
        """Lines written after ``mark`` that name this run's tables (NaN without a log)."""
        if not self.path:
            return math.nan
        time.sleep(0.2)  # let the server finish writing
        with open(self.path, "rb") as log:
            log.seek(mark)
            return float(sum(1 for line in log.read().splitlines() if self.needle in line))

    def describe(self) -> str:
        """Where the log was read."""
        return f"log file {self.path}" if self.path else "server log not readable here (set CE_BENCH_PG_LOG)"
