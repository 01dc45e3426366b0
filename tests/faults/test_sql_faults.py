"""Faults of the SQL stores that need no network: statements stalled mid-way (by a trigger
or a delayed statement), the server's ``synchronous_commit``, SQLite across fork and
across wall-clock steps.

Stalls are injected deterministically: a PostgreSQL trigger on the test's own table waits
on an advisory lock the test holds (tests/faults/_pg_stall.py; the table fixture ``pg_table``
is in conftest.py); a SQLAlchemy event delays one statement of the
SQLite / MariaDB refresh. Tables are per test and dropped afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exclusive.providers.base import Grant, Held, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import MYSQL_URL, POSTGRES_URL, drop_lock_table, require_server
from tests.faults._pg_stall import install_stall, psycopg_dsn, waiting_on
from tests.faults.conftest import wait_until
from tests.faults.servers import PrivatePostgres

pytestmark = pytest.mark.timeout(120)


# -- item 1: PostgreSQL fences never go backwards ------------------------------------------------


@pytest.mark.parametrize("case", ["free-key", "dead-row-vanishes", "marker"])
def test_pg_fence_grows_when_an_acquire_stalls_before_its_insert(pg_table: str, case: str) -> None:
    """An acquire stalled between drawing its fence and inserting its row, while another client
    acquires and releases the key, must not then commit a smaller fence than that client's.

    ``dead-row-vanishes``: the stalled acquire found a dead row (the take-over statement) that
    is gone by the time it inserts. ``marker``: the stalled grant is a dedupe marker's
    ``acquire_unless`` (its own statement, the same key lock).
    """
    import psycopg

    dead_row = case == "dead-row-vanishes"

    dsn = psycopg_dsn(POSTGRES_URL)
    lock_id = random.randrange(1, 2**31)
    stalled = SqlLockProvider(POSTGRES_URL, table=pg_table)
    rival = SqlLockProvider(POSTGRES_URL, table=pg_table)
    grants: list[tuple[str, int]] = []  # (who, fence) in the order the acquires returned
    errors: list[BaseException] = []
    try:
        assert isinstance(rival.acquire("warm", "w", 60, 600, "{}"), Grant)  # creates the table
        if dead_row:
            assert isinstance(rival.acquire("k", "old", 0.05, 600, "{}"), Grant)
            time.sleep(0.1)
        install_stall(dsn, pg_table, "stalled", lock_id)
        if dead_row:
            # The row vanishes (its holder's late release) between the acquire statement,
            # which saw it dead, and the take-over, which then inserts.
            run_pg = stalled._run_pg

            def vanishing(op: str, params: dict[str, Any]) -> Any:
                if op == "take_over":
                    assert rival.release("k", "old") is False  # dead, but still its row
                return run_pg(op, params)

            stalled._run_pg = vanishing  # type: ignore[method-assign]
        with psycopg.connect(dsn, autocommit=True) as gate:
            gate.execute("SELECT pg_advisory_lock(%s)", (lock_id,))

            def run_stalled() -> None:
                try:
                    if case == "marker":
                        answer = stalled.acquire_unless("k", "stalled", 60, "{}", blocker="run")
                    else:
                        answer = stalled.acquire("k", "stalled", 60, 600, "{}")
                    if isinstance(answer, Grant):
                        grants.append(("stalled", answer.fence))
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            def run_rival() -> None:
                try:
                    answer = rival.acquire("k", "rival", 60, 600, "{}")
                    if isinstance(answer, Grant):
                        grants.append(("rival", answer.fence))
                        assert rival.release("k", "rival")
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            first = threading.Thread(target=run_stalled, daemon=True)
            first.start()
            assert wait_until(lambda: waiting_on(dsn, lock_id), 10), "the insert never stalled"
            second = threading.Thread(target=run_rival, daemon=True)
            second.start()
            second.join(1.0)  # a correct store makes the rival wait (or refuses it)
            gate.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
            first.join(15)
            second.join(15)
        assert not errors, errors
        assert not first.is_alive()
        assert not second.is_alive()
        # Whoever holds the key now releases it; the next acquisition must still grow.
        for who, provider in (("stalled", stalled), ("rival", rival)):
            provider.release("k", who)
        later = rival.acquire("k", "later", 60, 600, "{}")
        assert isinstance(later, Grant)
        grants.append(("later", later.fence))
        fences = [fence for _, fence in grants]
        assert all(a < b for a, b in itertools.pairwise(fences)), (
            f"fences in acquisition order went backwards: {grants}"
        )
    finally:
        stalled.close()
        rival.close()


def _key_lock_holder(dsn: str, table: str, key: str) -> Any:
    """A session holding the PostgreSQL key lock the provider takes before drawing a fence."""
    import psycopg

    conn = psycopg.connect(dsn)
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s), hashtext(%s))", (table, key))
    return conn


def test_pg_contended_acquire_takes_no_key_lock(pg_table: str) -> None:
    """A refused acquire of a live key neither waits for the fence's key lock nor takes it."""
    dsn = psycopg_dsn(POSTGRES_URL)
    provider = SqlLockProvider(POSTGRES_URL, table=pg_table)
    try:
        assert isinstance(provider.acquire("k", "holder", 60, 600, "{}"), Grant)
        with contextlib.closing(_key_lock_holder(dsn, pg_table, "k")):
            started = time.monotonic()
            for _ in range(20):
                assert isinstance(provider.acquire("k", "other", 60, 600, "{}"), Held)
            assert time.monotonic() - started < 5
    finally:
        provider.close()


# -- item 6: acquire and refresh commit durably whatever the server says ----------------------------


def _install_commit_probe(dsn: str, table: str) -> str:
    """A deferred constraint trigger recording ``synchronous_commit`` as each write commits."""
    import psycopg

    log = f"{table}_probe"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {log} (op text, value text, setting text)")
        conn.execute(
            f"""CREATE FUNCTION {log}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO {log} VALUES (TG_OP, CASE WHEN TG_OP = 'DELETE' THEN OLD.value ELSE NEW.value END,
                            current_setting('synchronous_commit'));
  RETURN NULL;
END $$"""
        )
        conn.execute(
            f"CREATE CONSTRAINT TRIGGER {log} AFTER INSERT OR UPDATE OR DELETE ON {table} "
            f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {log}()"
        )
    return log


@pytest.mark.parametrize("path", ["libpq", "pgbouncer", "sqlalchemy"])
def test_pg_acquire_and_refresh_commit_durably_on_a_server_without_synchronous_commit(
    pg_server: PrivatePostgres, path: str
) -> None:
    """On a server whose default is ``synchronous_commit = off``, the acquire (insert and
    take-over), a dedupe marker's acquire_unless (the same) and the refresh commit with
    ``on``; the release keeps ``off`` (it may come back after a crash, to expire with its ttl;
    never a second holder). ``doctor`` reports it."""
    import psycopg

    assert pg_server.admin("SHOW synchronous_commit") == [("off",)]
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    dsn = psycopg_dsn(pg_server.url)
    if path == "sqlalchemy":
        engine = sa.create_engine(pg_server.url, isolation_level="AUTOCOMMIT")
        provider = SqlLockProvider(engine, table=table)
    else:
        engine = None
        provider = SqlLockProvider(pg_server.url, table=table, pgbouncer=path == "pgbouncer")
    try:
        assert isinstance(provider.acquire("warm", "w", 60, 600, "{}"), Grant)
        log = _install_commit_probe(dsn, table)
        assert isinstance(provider.acquire("k", "first", 0.2, 600, "{}"), Grant)
        assert provider.refresh([RefreshRequest("k", "first", 0.2)])[0] is not None
        time.sleep(0.3)
        assert isinstance(provider.acquire("k", "second", 60, 600, "{}"), Grant)  # takes the dead row over
        assert provider.release("k", "second")
        # A dedupe marker (acquire_unless): its insert and its take-over of a dead marker row.
        assert isinstance(provider.acquire_unless("m", "marker", 0.2, "{}", blocker="k"), Grant)
        time.sleep(0.3)
        assert isinstance(provider.acquire_unless("m", "marker2", 60, "{}", blocker="k"), Grant)
        with psycopg.connect(dsn) as conn:
            seen = conn.execute(f"SELECT op, value, setting FROM {log}").fetchall()
        assert seen == [
            ("INSERT", "first", "on"),
            ("UPDATE", "first", "on"),
            ("UPDATE", "second", "on"),
            ("DELETE", "second", "off"),
            ("INSERT", "marker", "on"),
            ("UPDATE", "marker2", "on"),
        ]
        findings = {d.check: d for d in provider.diagnose()}
        assert "synchronous_commit" in findings
        assert "off" in findings["synchronous_commit"].detail
    finally:
        provider.close()
        if engine is not None:
            engine.dispose()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_probe")
            conn.execute(f"DROP FUNCTION IF EXISTS {table}_probe()")
            conn.execute(f"DROP FUNCTION IF EXISTS {table}_unless(varchar, varchar)")
            conn.execute(f"DROP SEQUENCE IF EXISTS {table}_fence_seq")


# -- item 9: a slow refresh is not mistaken for the max-lifetime clamp -----------------------------


@pytest.fixture(params=["sqlite", "mariadb"])
def generic(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlLockProvider]:
    """A SQLite or MariaDB provider whose refresh's second statement is delayed by 0.3 s."""
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    if request.param == "mariadb":
        require_server(MYSQL_URL)
        url = MYSQL_URL
    else:
        url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    provider = SqlLockProvider(url, table=table)

    @sa.event.listens_for(provider._engine, "before_cursor_execute")
    def delay(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and getattr(provider, "_slow", False):
            time.sleep(0.3)

    yield provider
    provider.close()
    drop_lock_table(url, table)


def test_slow_refresh_is_not_taken_for_the_clamp(generic: SqlLockProvider) -> None:
    """A refresh whose statements are 0.3 s apart still answers the ttl it granted (10 s), so
    the heartbeat does not take it for the max-lifetime clamp; a clamped one answers the time
    to the hard deadline, never more."""
    assert isinstance(generic.acquire("k", "t", 10, 600, "{}"), Grant)
    assert isinstance(generic.acquire("c", "t", 10, 2, "{}"), Grant)
    generic._slow = True  # type: ignore[attr-defined]
    granted, clamped = generic.refresh([RefreshRequest("k", "t", 10), RefreshRequest("c", "t", 10)])
    generic._slow = False  # type: ignore[attr-defined]
    assert granted is not None
    assert clamped is not None
    assert granted >= 10 * 0.99 - 1e-3, f"a healthy slow refresh looks clamped: granted {granted:.3f} s"
    assert granted <= 10
    assert clamped < 2, clamped
    info = generic.peek("c")
    assert info is not None
    assert info.expires_in <= clamped


# -- item 4: SQLite leases do not follow wall-clock steps --------------------------------------------

_TRY_ACQUIRE = """
import json, sys
from celery_exclusive.providers.base import Grant
from celery_exclusive.providers.sql import SqlLockProvider
url, table, key = sys.argv[1:4]
provider = SqlLockProvider(url, table=table)
answer = provider.acquire(key, "stepped", 30, 600, "{}")
info = provider.peek(key)
print(json.dumps({"granted": isinstance(answer, Grant), "expires_in": info and info.expires_in}))
provider.close()
"""


def _acquire_with_clock_offset(offset: str, url: str, table: str, key: str) -> dict[str, Any]:
    """Try ``key`` from a process whose wall clock is shifted by ``offset`` (libfaketime)."""
    import json
    import subprocess
    import sys

    from tests.faults.conftest import ROOT, faketime_wrapper, unavailable

    wrapper = faketime_wrapper(offset)
    if wrapper is None:
        unavailable("faketime (libfaketime) is not installed; .ci/services installs it")
    assert wrapper is not None
    done = subprocess.run(
        [*wrapper, sys.executable, "-c", _TRY_ACQUIRE, url, table, key],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_sqlite_lease_survives_a_wall_clock_step_forward(tmp_path: Path) -> None:
    """A process whose wall clock is an hour ahead neither takes a live lease nor sees it
    shortened: SQLite leases run on the machine's boot clock, which does not step."""
    url, table = f"sqlite:///{tmp_path / 'locks.sqlite3'}", "ce_fault_clock"
    provider = SqlLockProvider(url, table=table)
    try:
        assert isinstance(provider.acquire("k", "holder", 30, 600, "{}"), Grant)
        seen = _acquire_with_clock_offset("+1h", url, table, "k")
        assert not seen["granted"], "a rival took a live lease after a wall-clock step forward"
        assert 25 < seen["expires_in"] <= 30
    finally:
        provider.close()


def test_sqlite_dead_lease_is_not_revived_by_a_wall_clock_step_back(tmp_path: Path) -> None:
    """A lease that expired is free for a process whose wall clock is an hour behind."""
    url, table = f"sqlite:///{tmp_path / 'locks.sqlite3'}", "ce_fault_clock"
    provider = SqlLockProvider(url, table=table)
    try:
        assert isinstance(provider.acquire("k", "holder", 0.3, 600, "{}"), Grant)
        time.sleep(0.5)
        seen = _acquire_with_clock_offset("-1h", url, table, "k")
        assert seen["granted"], "an expired lease stayed live for a process whose clock stepped back"
        info = provider.peek("k")
        assert info is not None
        assert info.token == "stepped"
        assert 25 < info.expires_in <= 30
    finally:
        provider.close()


def test_sqlite_reads_and_writes_stamps_earlier_versions_understand(tmp_path: Path) -> None:
    """Rows of earlier versions (wall-clock text stamps) keep their meaning, and the Julian day
    stamps written now read correctly through ``julianday()`` as earlier versions read them."""
    url, table = f"sqlite:///{tmp_path / 'locks.sqlite3'}", "ce_fault_compat"
    provider = SqlLockProvider(url, table=table)
    engine = sa.create_engine(url)
    try:
        assert isinstance(provider.acquire("new", "t", 60, 600, "{}"), Grant)
        stamp = "strftime('%Y-%m-%d %H:%M:%f', julianday('now') + {} / 86400.0)"
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"INSERT INTO {table} VALUES ('old', 'o', {stamp.format(60)}, {stamp.format(0)}, "
                    f"{stamp.format(600)}, 99, NULL)"
                )
            )
            left = conn.execute(
                sa.text(
                    f"SELECT (julianday(expires_at) - julianday('now')) * 86400 "
                    f"FROM {table} WHERE key = 'new'"
                )
            ).scalar_one()
        assert 55 < left <= 60  # what an earlier version's statements compute for our row
        info = provider.peek("old")
        assert info is not None
        assert 55 < info.expires_in <= 60
        assert isinstance(provider.acquire("old", "x", 60, 600, "{}"), Held)
    finally:
        provider.close()
        engine.dispose()


# -- item 3: SQLite across fork ---------------------------------------------------------------------

_CHILD_TIMEOUT = 20.0


def _in_child(work: Any) -> int:
    """Fork; run ``work()`` in the child (exit 0 if it returns True); the child's exit status,
    or -1 if it had not finished after 20 s (then killed)."""
    import os
    import signal

    with pytest.warns(DeprecationWarning, match="fork") if _fork_warns() else contextlib.nullcontext():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            code = 0 if work() else 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + _CHILD_TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def _fork_warns() -> bool:
    import sys

    return sys.version_info >= (3, 12)


@pytest.mark.parametrize("which", ["new-provider", "inherited-provider"])
def test_sqlite_child_forked_while_a_thread_is_mid_call_can_use_the_store(tmp_path: Path, which: str) -> None:
    """A process forked while another thread of its parent is inside a SQLite lock-store call
    (its write transaction open) can use the store at once: a new provider, or the one it
    inherited. The fork waits for the call in flight to end."""
    url, table = f"sqlite:///{tmp_path / 'locks.sqlite3'}", "ce_fault_fork"
    provider = SqlLockProvider(url, table=table)
    entered, go = threading.Event(), threading.Event()

    @sa.event.listens_for(provider._engine, "after_cursor_execute")
    def stall(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.current_thread().name == "ce-mid-call" and "n = n + 1" in statement:
            entered.set()
            go.wait(10)

    try:
        assert isinstance(provider.acquire("warm", "w", 60, 600, "{}"), Grant)
        busy = threading.Thread(
            target=lambda: provider.acquire("busy", "b", 60, 600, "{}"), name="ce-mid-call", daemon=True
        )
        busy.start()
        assert entered.wait(10)
        threading.Timer(0.5, go.set).start()  # the call in flight ends half a second later

        def child() -> bool:
            store = SqlLockProvider(url, table=table) if which == "new-provider" else provider
            return isinstance(store.acquire("child", "c", 5, 60, "{}"), Grant) and store.release("child", "c")

        status = _in_child(child)
        busy.join(10)
        assert status == 0, f"the child could not use the store (exit status {status}; -1: hung for 20 s)"
        assert isinstance(provider.acquire("after", "a", 5, 60, "{}"), Grant)  # the parent still can
    finally:
        go.set()
        provider.close()


def test_sqlite_children_forked_under_load_can_use_the_store(tmp_path: Path) -> None:
    """Forks at random moments while a thread hammers the store: every child can use it
    (the at-fork wait covers SQLite's own mutexes, not just its file locks). 8 forks (100
    with ``CE_LONG=1``)."""
    from tests.faults.conftest import LONG

    url, table = f"sqlite:///{tmp_path / 'locks.sqlite3'}", "ce_fault_fork"
    provider = SqlLockProvider(url, table=table)
    stop = threading.Event()

    def hammer(name: str) -> None:
        while not stop.is_set():
            provider.acquire(name, "t", 5, 60, "{}")
            provider.refresh([RefreshRequest(name, "t", 5)])
            provider.release(name, "t")

    threads = [threading.Thread(target=hammer, args=("h",), daemon=True)]
    for thread in threads:
        thread.start()
    statuses = []
    try:
        for index in range(100 if LONG else 8):
            time.sleep(random.uniform(0, 0.05))

            def child(index: int = index) -> bool:
                store = SqlLockProvider(url, table=table)
                return isinstance(store.acquire(f"c{index}", "c", 5, 60, "{}"), Grant)

            statuses.append(_in_child(child))
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        provider.close()
    assert statuses == [0] * len(statuses), f"children's exit statuses (-1: hung): {statuses}"
