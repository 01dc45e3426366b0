"""SQLite and MariaDB/MySQL: the release that prunes expired completion records and the
sweep's part for records read only the expired records, however many live ones
``<table>_done`` holds (issue #16's property, checked on PostgreSQL by test_pg_prune.py).

Counted, never timed: SQLite's virtual machine steps (a progress handler called at every
instruction; a scan costs about 8 per row), MariaDB's ``Handler_read%`` session counters
(rows and index entries the server read). Real databases, a table per test (dropped after).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exclusive.providers._sql_common import PRUNE_BATCH
from celery_exclusive.providers.base import Completion, Grant
from tests.providers.test_sql_provider import Db, _database

#: Live records in the table.
LIVE = 100_000
_UNIX_EPOCH_JD = 2440587.5


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Db]:
    yield from _database("sqlite", tmp_path)


@pytest.fixture
def mariadb(tmp_path: Path) -> Iterator[Db]:
    yield from _database("mariadb", tmp_path)


def _statements(db: Db) -> dict[str, Any]:
    """The provider's statements by name, once it made its tables with its own DDL."""
    provider: Any = db.provider()  # a SqlLockProvider: its statements by name
    try:
        assert isinstance(provider.acquire("app:k", "t", 60, 600, "{}", task_id="first"), Grant)
        assert provider.release("app:k", "t", Completion("first", "success", 0, 3600.0))
        return dict(provider._sql)
    finally:
        provider.close()


# SQLite ---------------------------------------------------------------------------------

#: VM steps a statement may take: its fixed part, and for each row deleted its index range
#: step, its rowid lookup and its deletes. A scan of the live records takes over 800,000.
SQLITE_BASE, SQLITE_PER_ROW = 100, 40


def _sqlite_steps(db: Db, op: str, values: dict[str, Any], *, expired: int) -> tuple[int, int]:
    """VM steps and rows deleted of statement ``op`` against ``LIVE`` live and ``expired``
    expired records (keys under ``app:``), in a transaction rolled back after."""
    statement = str(_statements(db)[op])
    now = _UNIX_EPOCH_JD + time.time() / 86400.0
    conn = sqlite3.connect(db.url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        insert = f"INSERT INTO {db.table}_done VALUES (?, ?, 'success', 0, ?, ?)"
        conn.execute("BEGIN")
        conn.executemany(insert, ((f"app:live:{i}", f"t{i}", now, now + 1 / 24) for i in range(LIVE)))
        conn.executemany(insert, ((f"app:old:{i}", f"t{i}", now, now - 1 / 86400) for i in range(expired)))
        conn.execute("COMMIT")
        steps = [0]

        def step() -> int:
            steps[0] += 1
            return 0

        conn.execute("BEGIN")
        conn.set_progress_handler(step, 1)
        deleted = conn.execute(statement, {"now": now, **values}).rowcount
        conn.set_progress_handler(None, 1)
        conn.execute("ROLLBACK")
        return steps[0], deleted
    finally:
        conn.close()


@pytest.mark.parametrize("expired", [0, 100])
def test_sqlite_prune_reads_only_expired_records(sqlite_db: Db, expired: int) -> None:
    """With 100,000 live records, the pruning release's prune takes a few steps per row."""
    values = {"key": "app:k", "task_id": "other"}
    steps, deleted = _sqlite_steps(sqlite_db, "done_prune", values, expired=expired)
    assert deleted == min(expired, PRUNE_BATCH)
    most = SQLITE_BASE + SQLITE_PER_ROW * deleted
    assert steps <= most, f"the prune took {steps} VM steps ({expired} expired)"


@pytest.mark.parametrize("expired", [0, 20])
def test_sqlite_sweep_reads_only_expired_records(sqlite_db: Db, expired: int) -> None:
    """The sweep's records (all 100,000 under the swept prefix): found through the
    expires_at index, not by scanning the prefix's records (800,000 steps before)."""
    values = {"prefix": "app:", "limit": 500}
    steps, deleted = _sqlite_steps(sqlite_db, "sweep_done", values, expired=expired)
    assert deleted == expired
    most = SQLITE_BASE + SQLITE_PER_ROW * deleted
    assert steps <= most, f"the sweep took {steps} VM steps ({expired} expired)"


def test_sqlite_sweep_still_removes_records_with_text_stamps(sqlite_db: Db) -> None:
    """Stamps written as text (earlier versions) are swept when expired, kept when live:
    the index range for them is the second one of the condition."""
    _statements(sqlite_db)
    provider = sqlite_db.provider()
    try:
        insert = f"INSERT INTO {sqlite_db.table}_done VALUES (:key, 't', 'success', 0, :stamp, :stamp)"
        old = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() - 60))
        live = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() + 3600))
        sqlite_db.execute(insert, key="app:text:old", stamp=old)
        sqlite_db.execute(insert, key="app:text:live", stamp=live)
        assert provider.sweep("app:text:") == 1
        assert provider.completion("app:text:live", "t") is not None
    finally:
        provider.close()
    with sqlite3.connect(sqlite_db.url.removeprefix("sqlite:///")) as conn:
        left = conn.execute(f"SELECT key FROM {sqlite_db.table}_done WHERE key LIKE 'app:text:%'")
        assert left.fetchall() == [("app:text:live",)]


# MariaDB/MySQL --------------------------------------------------------------------------

#: Handler reads a statement may make: a first index read, and for each row found its index
#: step (and for the sweep's DISTINCT, the temporary table's read back). A scan of the live
#: records makes over 100,000.
MARIADB_BASE, MARIADB_PER_ROW = 4, 3


def _mariadb_reads(db: Db, ops: dict[str, dict[str, Any]], *, expired: int) -> dict[str, int]:
    """Handler reads of each statement in ``ops`` (by name, with its values) against ``LIVE``
    live and ``expired`` expired records (keys under ``app:``), each rolled back after."""
    sql = _statements(db)
    done = f"{db.table}_done"
    engine = sa.create_engine(db.url)
    try:
        with engine.begin() as conn:
            # The rows made by the server from MariaDB's sequence engine (seq_0_to_N), in two
            # statements: sent one by one (the driver's executemany), 100,000 took 70 s of CI.
            for kind, count, ahead in (("live", LIVE, 3600), ("old", expired, -1)):
                if count:
                    conn.execute(
                        sa.text(
                            f"INSERT INTO {done} (`key`, task_id, outcome, attempt, created_at, expires_at) "
                            f"SELECT CONCAT('app:{kind}:', seq), CONCAT('t', seq), 'success', 0, "
                            f"UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL {ahead} SECOND "
                            f"FROM seq_0_to_{count - 1}"
                        )
                    )
        reads = {}
        with engine.connect() as conn:

            def counted() -> int:
                status = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Handler_read%'"))
                return sum(int(value) for _, value in status)

            for op, values in ops.items():
                before = counted()
                conn.execute(sql[op], values)
                reads[op] = counted() - before
                conn.rollback()
        return reads
    finally:
        engine.dispose()


@pytest.mark.parametrize("expired", [0, 20])
def test_mariadb_prune_and_sweep_read_only_expired_records(mariadb: Db, expired: int) -> None:
    """With 100,000 live records, the pruning release's prune and the sweep's two statements
    for records read a few index entries per expired record, through the expires_at index
    (the sweep's lease part reads the lock table whole: see BENCHMARKS.md)."""
    keys = [f"app:old:{i}" for i in range(expired)] or ["app:none"]
    ops = {
        "done_prune": {"key": "app:k", "task_id": "other"},
        "sweep_find_done": {"pattern": "app:%", "limit": 500},
        "sweep_done": {"keys": keys, "limit": 500},
    }
    reads = _mariadb_reads(mariadb, ops, expired=expired)
    most = MARIADB_BASE + MARIADB_PER_ROW * expired
    assert all(n <= most for n in reads.values()), f"handler reads {reads} ({expired} expired)"
