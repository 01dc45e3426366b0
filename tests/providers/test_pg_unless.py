"""PostgreSQL ``acquire_unless`` (a dedupe queued marker unless a run holds the execution key):
one statement, refused attempts write nothing, and a statement that met a grant of its key in
flight writes nothing on its old snapshot (the interleaving where a run starts meanwhile).

Real server, a table per test (dropped after).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_exclusive.providers.base import Grant, Held
from tests.faults.conftest import wait_until
from tests.providers.test_sql_provider import (
    Db,
    _assert_contended_attempts_write_no_wal,
    _database,
    _psycopg_dsn,
)


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Db]:
    yield from _database("postgresql", tmp_path)


def _params(key: str, blocker: str, token: str) -> dict[str, Any]:
    return {"key": key, "blocker": blocker, "token": token, "ttl": 60.0, "life": 60.0, "holder": "{}"}


@pytest.mark.parametrize("held", ["blocker", "marker"])
def test_pg_refused_marker_takes_no_lock_or_transaction_id_and_writes_no_wal(pg: Db, held: str) -> None:
    """Refused by a live execution key or a live marker, the statement assigns no xid, takes
    no advisory lock and writes no WAL (the acquire's contended guarantee)."""
    import psycopg

    provider = pg.provider()
    try:
        taken = provider.acquire("job", "run", 60, 600, "{}") if held == "blocker" else None
        marked = provider.acquire_unless("job#queued", "queued", 60, "{}", blocker="job")
        assert isinstance(marked, Held if held == "blocker" else Grant)
        assert taken is None or isinstance(taken, Grant)
        with psycopg.connect(_psycopg_dsn(pg)) as conn:
            rows = conn.execute(
                provider._psycopg_sql["acquire_unless"], _params("job#queued", "job", "other")
            ).fetchall()
            assert [row[0] for row in rows] == ["b" if held == "blocker" else "q"]
            assert conn.execute("SELECT txid_current_if_assigned()").fetchone() == (None,)
            advisory = "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
            assert conn.execute(advisory).fetchone() == (0,)
            conn.rollback()
            conn.autocommit = True
            _assert_contended_attempts_write_no_wal(
                conn, lambda i: provider.acquire_unless("job#queued", f"x{i}", 5, "{}", blocker="job")
            )
    finally:
        provider.close()


def _waiting_for_key_lock(dsn: str, table: str, key: str) -> bool:
    """Whether a session waits for the provider's key lock on ``key`` (the two-int advisory
    lock ``(hashtext(table), hashtext(key))``, shown as unsigned oids)."""
    import psycopg

    unsigned = "(hashtext(%s)::bigint + 4294967296) %% 4294967296"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 2 "
            f"AND classid::text::bigint = {unsigned} AND objid::text::bigint = {unsigned}",
            (table, key),
        ).fetchone()
    return bool(row and row[0])


def test_pg_marker_that_waited_for_a_grant_in_flight_writes_nothing_on_its_old_snapshot(pg: Db) -> None:
    """The interleaving a single statement must survive: the marker statement reads both keys
    free, then finds the marker key's lock held (a grant in flight, here a session holding it),
    and while it waits a run takes the execution key. Inserting on its old snapshot would
    leave a marker queued while the run holds the key; it must write nothing and, asked again,
    answer the run."""
    import psycopg

    dsn = _psycopg_dsn(pg)
    provider, rival = pg.provider(), pg.provider()
    answers: list[Any] = []
    try:
        assert isinstance(rival.acquire("warm", "w", 60, 600, "{}"), Grant)  # creates the table
        gate = psycopg.connect(dsn)
        with contextlib.closing(gate):
            gate.execute("SELECT pg_advisory_xact_lock(hashtext(%s), hashtext(%s))", (pg.table, "job#queued"))
            sender = threading.Thread(
                target=lambda: answers.append(
                    provider.acquire_unless("job#queued", "late", 60, '{"task_id": "late"}', blocker="job")
                ),
                daemon=True,
            )
            sender.start()
            assert wait_until(lambda: _waiting_for_key_lock(dsn, pg.table, "job#queued"), 10), (
                "the marker never waited"
            )
            run = rival.acquire("job", "run", 60, 600, '{"task_id": "running"}')
            assert isinstance(run, Grant)  # the execution key is not behind the marker's lock
            gate.rollback()  # the grant in flight ends; the sender wakes on its old snapshot
            sender.join(15)
        assert not sender.is_alive()
        assert len(answers) == 1
        answer = answers[0]
        assert isinstance(answer, Held), answer
        assert answer.holder is not None
        assert (answer.holder.key, answer.holder.holder) == ("job", {"task_id": "running"})
        assert provider.peek("job#queued") is None, "a marker was queued while the run held the key"
    finally:
        provider.close()
        rival.close()


def test_pg_marker_takes_a_dead_marker_row_over_and_ignores_a_dead_execution_row(pg: Db) -> None:
    """Dead rows (expired, never swept) count as free on both keys, in the same statement:
    the dead marker row is updated in place with a larger fence."""
    import time

    provider = pg.provider()
    try:
        first = provider.acquire_unless("job#queued", "old", 0.05, "{}", blocker="job")
        run = provider.acquire("job", "oldrun", 0.05, 600, "{}")
        assert isinstance(first, Grant)
        assert isinstance(run, Grant)
        time.sleep(0.2)
        assert set(pg.rows()) >= {"job", "job#queued"}
        again = provider.acquire_unless("job#queued", "new", 60, "{}", blocker="job")
        assert isinstance(again, Grant)
        assert again.fence > run.fence > first.fence
        info = provider.peek("job#queued")
        assert info is not None
        assert (info.token, info.fence) == ("new", again.fence)
    finally:
        provider.close()
