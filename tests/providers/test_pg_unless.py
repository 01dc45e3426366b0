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
from tests.faults._pg_stall import waiting_on
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


@pytest.mark.parametrize("held", ["blocker", "marker"])
def test_pg_marker_calls_its_fresh_read_only_once_it_holds_the_lock(pg: Db, held: str) -> None:
    """The re-read function runs only on the way to a grant (the key lock taken): a statement
    refused on its snapshot never calls it; one that grants calls it once (counted by the
    server's per-transaction function statistics, track_functions)."""
    import psycopg

    provider = pg.provider()
    try:
        taken = provider.acquire("job", "run", 60, 600, "{}") if held == "blocker" else None
        marked = provider.acquire_unless("job#queued", "queued", 60, "{}", blocker="job")
        assert taken is None or isinstance(taken, Grant)
        assert isinstance(marked, Held if held == "blocker" else Grant)
        calls = (
            f"SELECT pg_stat_get_xact_function_calls(to_regprocedure('{pg.table}_unless(varchar,varchar)'))"
        )
        with psycopg.connect(_psycopg_dsn(pg), autocommit=True) as conn:
            try:  # outside a transaction: a rollback would undo it
                conn.execute("SET track_functions = 'pl'")
            except psycopg.errors.InsufficientPrivilege:
                pytest.skip("track_functions needs a superuser")
            conn.autocommit = False
            statement = provider._psycopg_sql["acquire_unless"]
            rows = conn.execute(statement, _params("job#queued", "job", "other")).fetchall()
            assert [row[0] for row in rows] == ["b" if held == "blocker" else "q"]
            assert conn.execute(calls).fetchone() in ((None,), (0,))
            conn.rollback()
            rows = conn.execute(statement, _params("free#queued", "free", "other")).fetchall()
            assert [row[0] for row in rows] == ["g"]
            assert conn.execute(calls).fetchone() == (1,)
            conn.rollback()
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


@contextlib.contextmanager
def _stalled_before_lock_try(pg: Db, key: str) -> Iterator[tuple[str, int]]:
    """A schema whose ``pg_try_advisory_xact_lock(int, int)`` shadows the built-in on a search
    path that puts it before ``pg_catalog``; for ``key``'s lock in ``pg.table`` it first waits
    on advisory lock ``gate`` (which the test holds), then tries the real one. A statement sent
    with that search path stalls after its snapshot and before its try of the key's lock:
    the point where a descheduled backend would be. Yields ``(URL with that search path,
    gate)``; the schema is dropped after."""
    import random
    from urllib.parse import quote

    import psycopg

    dsn = _psycopg_dsn(pg)
    schema, gate = f"ce_stall_{pg.table}", random.randrange(1, 2**31)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(
            f"""CREATE FUNCTION {schema}.pg_try_advisory_xact_lock(integer, integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF $1 = pg_catalog.hashtext('{pg.table}') AND $2 = pg_catalog.hashtext('{key}') THEN
    PERFORM pg_catalog.pg_advisory_lock({gate});
    PERFORM pg_catalog.pg_advisory_unlock({gate});
  END IF;
  RETURN pg_catalog.pg_try_advisory_xact_lock($1, $2);
END $$"""
        )
    try:
        options = quote(f"-csearch_path={schema},pg_catalog,public")
        yield f"{pg.url}{'&' if '?' in pg.url else '?'}options={options}", gate
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.parametrize(
    ("execution_row", "path"),
    [("absent", "libpq"), ("dead", "libpq"), ("absent", "pgbouncer"), ("absent", "engine")],
)
def test_pg_marker_descheduled_before_its_lock_try_queues_nothing_after_a_whole_cycle(
    pg: Db, execution_row: str, path: str
) -> None:
    """The window between the statement's snapshot and its try of the marker key's lock: the
    statement reads both keys free and is descheduled there (stalled on a gate); meanwhile
    another sender takes the marker and commits, and a run takes the execution key and ends
    that marker. The statement then finds the marker key's lock free. It must not queue a
    marker while the run holds the key (one extra message, breaking until_done); asked again,
    it answers the run. With the execution key's row absent (never taken) and dead (a run
    that crashed: the new run takes it over); prepared (libpq), unprepared (PgBouncer), and
    on the caller's SQLAlchemy engine."""
    import psycopg
    import sqlalchemy as sa

    from celery_exclusive.providers.sql import SqlLockProvider

    rival = pg.provider()
    answers: list[Any] = []
    sent: list[list[tuple[Any, ...]]] = []
    try:
        assert isinstance(rival.acquire("warm", "w", 60, 600, "{}"), Grant)  # creates the schema
        if execution_row == "dead":
            assert isinstance(rival.acquire("job", "crashed", 0.05, 600, "{}"), Grant)
            wait_until(lambda: rival.peek("job") is None, 5)
            assert "job" in pg.rows()
        with _stalled_before_lock_try(pg, "job#queued") as (url, gate):
            store: Any = sa.create_engine(url, isolation_level="AUTOCOMMIT") if path == "engine" else url
            late = SqlLockProvider(store, table=pg.table, create_table=False, pgbouncer=path == "pgbouncer")
            run_pg = late._run_pg

            def recorded(op: str, params: dict[str, Any], timeout: float | None = None) -> Any:
                rows = run_pg(op, params, timeout)
                sent.append(rows)
                return rows

            late._run_pg = recorded  # type: ignore[method-assign]
            try:
                with psycopg.connect(_psycopg_dsn(pg), autocommit=True) as holder:
                    holder.execute("SELECT pg_advisory_lock(%s)", (gate,))
                    sender = threading.Thread(
                        target=lambda: answers.append(
                            late.acquire_unless(
                                "job#queued", "late", 60, '{"task_id": "late"}', blocker="job"
                            )
                        ),
                        daemon=True,
                    )
                    sender.start()
                    assert wait_until(lambda: waiting_on(_psycopg_dsn(pg), gate), 10), (
                        "the marker never stalled"
                    )
                    # A whole cycle while the statement is descheduled: a marker sent and
                    # committed, its run takes the execution key and only then ends the marker.
                    first = rival.acquire_unless(
                        "job#queued", "first", 60, '{"task_id": "first"}', blocker="job"
                    )
                    assert isinstance(first, Grant)
                    run = rival.acquire("job", "run", 60, 600, '{"task_id": "first"}')
                    assert isinstance(run, Grant)
                    assert rival.release("job#queued", "first")
                    assert not answers
                    holder.execute("SELECT pg_advisory_unlock(%s)", (gate,))
                    sender.join(15)
                assert not sender.is_alive()
            finally:
                late.close()
                if path == "engine":
                    store.dispose()
        assert len(answers) == 1
        answer = answers[0]
        assert rival.peek("job#queued") is None, f"a marker was queued while the run held the key: {answer}"
        assert isinstance(answer, Held), answer
        assert answer.holder is not None
        assert (answer.holder.key, answer.holder.holder) == ("job", {"task_id": "first"})
        # The descheduled statement wrote nothing and returned nothing; the retry saw the run.
        assert [len(rows) for rows in sent] == [0, 1], sent
    finally:
        rival.close()


def _has_function(pg: Db) -> bool:
    import psycopg

    with psycopg.connect(_psycopg_dsn(pg), autocommit=True) as conn:
        row = conn.execute("SELECT to_regprocedure(%s) IS NOT NULL", (f"{pg.table}_unless(varchar,varchar)",))
        return bool(row.fetchone() == (True,))


def _drop_function(pg: Db) -> None:
    pg.execute(f"DROP FUNCTION {pg.table}_unless(varchar, varchar)")


def test_pg_a_table_of_an_earlier_version_gets_the_marker_function_when_set_up(pg: Db) -> None:
    """A lock table made before the marker function existed (here: the function dropped) gets
    it from the next provider that sets the schema up (create_table on), which then marks
    with the re-read."""
    first = pg.provider()
    try:
        assert isinstance(first.acquire("warm", "w", 60, 600, "{}"), Grant)
        assert _has_function(pg)
        _drop_function(pg)
    finally:
        first.close()
    provider = pg.provider()
    try:
        assert isinstance(provider.acquire_unless("job#queued", "q", 60, "{}", blocker="job"), Grant)
        assert _has_function(pg)
        assert provider._unless_op(None) == "acquire_unless"
    finally:
        provider.close()


def test_pg_a_schema_without_the_marker_function_still_marks_and_says_so(
    pg: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """With create_table off on a schema that lacks the function, acquire_unless still works
    (on its snapshot alone), the store warns once, and diagnose() reports it."""
    first = pg.provider()
    try:
        assert isinstance(first.acquire("warm", "w", 60, 600, "{}"), Grant)
        _drop_function(pg)
    finally:
        first.close()
    provider = pg.provider(create_table=False)
    try:
        with caplog.at_level("WARNING", logger="celery_exclusive.providers.postgres"):
            assert isinstance(provider.acquire_unless("job#queued", "q", 60, "{}", blocker="job"), Grant)
            assert isinstance(provider.acquire_unless("job#queued", "r", 60, "{}", blocker="job"), Held)
        warned = [r for r in caplog.records if "_unless" in r.getMessage()]
        assert len(warned) == 1, caplog.records
        assert "until_done" in warned[0].getMessage()
        assert not _has_function(pg)  # create_table off: nothing made
        findings = {d.check: d for d in provider.diagnose()}
        assert findings["marker_function"].status == "warn"
    finally:
        provider.close()
