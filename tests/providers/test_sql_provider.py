"""SqlLockProvider on real servers: PostgreSQL, SQLite and MariaDB (no mocks).

Each test gets its own table (and fence counter), dropped afterwards. A server that is
unreachable skips the test locally and fails it when ``CI=true``.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exclusive.errors import BackendError, ConfigurationError, MissingDriverError
from celery_exclusive.providers import _pg_executor
from celery_exclusive.providers.base import Completion, Done, Grant, Held, LockProvider, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider, lock_table
from tests.conftest import TIME_SLACK, drop_lock_table
from tests.contract._processes import process_context
from tests.providers import _sql_workers

POSTGRES_URL = os.environ.get("CE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("CE_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() == "true"
BACKENDS = ["postgresql", "sqlite", "mariadb"]


def require(url: str) -> None:
    """Skip (locally) or fail (in CI) unless the server behind ``url`` answers a query."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        where = engine.url.render_as_string(hide_password=True)
        message = f"database {where} is unreachable: {str(cause).splitlines()[0]}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    finally:
        engine.dispose()


drop = drop_lock_table


@dataclass
class Db:
    """One database under test and a fresh table name on it."""

    name: str
    url: str
    table: str

    def provider(self, **kwargs: Any) -> SqlLockProvider:
        return SqlLockProvider(self.url, table=self.table, **kwargs)

    def rows(self) -> dict[str, tuple[Any, ...]]:
        """Every row of the table, read directly, by key."""
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(f"SELECT * FROM {self.table}")).all()
            return {row[0]: tuple(row) for row in rows}
        finally:
            engine.dispose()

    def execute(self, sql: str, **params: Any) -> None:
        engine = sa.create_engine(self.url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(sql), params)
        finally:
            engine.dispose()


def _database(name: str, tmp_path: Path) -> Iterator[Db]:
    table = f"ce_test_{uuid.uuid4().hex[:10]}"
    urls = {
        "postgresql": POSTGRES_URL,
        "mariadb": MYSQL_URL,
        "sqlite": f"sqlite:///{tmp_path / 'locks.sqlite3'}",
    }
    require(urls[name])
    yield Db(name, urls[name], table)
    drop(urls[name], table)


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    yield from _database(request.param, tmp_path)


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Db]:
    yield from _database("postgresql", tmp_path)


@pytest.fixture
def provider(db: Db) -> Iterator[SqlLockProvider]:
    p = db.provider()
    yield p
    p.close()


def test_is_a_lock_provider(provider: SqlLockProvider) -> None:
    """The provider satisfies the LockProvider protocol and advertises its key limit."""
    assert isinstance(provider, LockProvider)
    assert provider.max_key_length == 512


def test_table_for_alembic_creates_a_working_schema(db: Db) -> None:
    """lock_table() describes the table; create_all() makes a schema the provider can use as is."""
    metadata = sa.MetaData()
    table = lock_table(metadata, db.table)
    assert [c.name for c in table.columns] == [
        "key",
        "value",
        "expires_at",
        "created_at",
        "deadline",
        "fence",
        "holder",
    ]
    assert [c.name for c in table.primary_key] == ["key"]
    assert table.c.holder.nullable
    assert not table.c.value.nullable
    engine = sa.create_engine(db.url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
    provider = db.provider(create_table=False)
    try:
        assert provider.table.name == db.table
        assert provider.acquire("k", "t", 5, 60, "{}") == Grant(1, 5.0)
    finally:
        provider.close()


def test_without_create_table_a_missing_table_is_a_backend_error(db: Db) -> None:
    """create_table=False never creates anything; using a missing table is an error, not "free"."""
    provider = SqlLockProvider.from_url(f"{db.url}?ce_table={db.table}&ce_create_table=false")
    try:
        with pytest.raises(BackendError):
            provider.peek("k")
        with pytest.raises(BackendError):
            provider.acquire("k", "t", 5, 60, "{}")
    finally:
        provider.close()
    engine = sa.create_engine(db.url)
    try:
        assert not sa.inspect(engine).has_table(db.table)
    finally:
        engine.dispose()


@pytest.mark.parametrize("name", ["", "1abc", "a-b", "a b", "t;drop", "x" * 64, "ütf", 'a"b'])
def test_table_names_are_validated(name: str) -> None:
    """A table name that is not a plain SQL identifier is a configuration error."""
    with pytest.raises(ConfigurationError):
        SqlLockProvider("sqlite://", table=name)
    with pytest.raises(ConfigurationError):
        lock_table(sa.MetaData(), name)


def test_url_options() -> None:
    """ce_table and ce_create_table are read from the URL; unknown ce_ options are refused."""
    provider = SqlLockProvider.from_url("sqlite://?ce_table=my_locks&ce_create_table=false")
    assert provider.table.name == "my_locks"
    provider.close()
    with pytest.raises(ConfigurationError):
        SqlLockProvider.from_url("sqlite://?ce_tabel=x")
    with pytest.raises(ConfigurationError):
        SqlLockProvider.from_url("sqlite://?ce_create_table=maybe")
    with pytest.raises(ConfigurationError):
        SqlLockProvider("oracle://u@h/db")


def test_constructor_refuses_url_options_it_would_not_read() -> None:
    """The constructor takes keyword arguments, not ce_ options: a URL carrying them is
    refused up front (naming from_url), not sent to the driver to fail at first use."""
    with pytest.raises(ConfigurationError, match=r"from_url\(\).*table=") as raised:
        SqlLockProvider("postgresql+psycopg://u:pw-SECRET@127.0.0.1:1/test?ce_table=locks")
    assert "pw-SECRET" not in str(raised.value)


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that is not installed raises MissingDriverError naming the pip extra.

    ``MySQLdb`` is hidden for the test (None in ``sys.modules`` makes its import fail):
    tests/django's settings make PyMySQL pose as it for the rest of an xdist worker's
    session, so whether it imports depended on which files ran first in that worker."""
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    with pytest.raises(MissingDriverError) as raised:
        SqlLockProvider("mysql+mysqldb://root:pw-SECRET@127.0.0.1/test")
    assert raised.value.extra == "mysql"
    assert "pw-SECRET" not in str(raised.value)


def test_repr_masks_the_password() -> None:
    """repr shows the URL with its password masked, and the table name."""
    provider = SqlLockProvider("postgresql://alice:pw-SECRET@127.0.0.1:1/test?password=pw-SECRET")
    try:
        assert "pw-SECRET" not in repr(provider)
        assert "pw-SECRET" not in str(provider)
        assert "postgresql+psycopg://" in repr(provider)
        assert "cache_entries" in repr(provider)
    finally:
        provider.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres:pw-SECRET@127.0.0.1:1/test",
        "postgres://postgres:pw-SECRET@127.0.0.1:1/test",
        "mysql+pymysql://root:pw-SECRET@127.0.0.1:1/test",
        "mariadb://root:pw-SECRET@127.0.0.1:1/test",
        "sqlite:////nonexistent-dir/for/celery-exclusive/locks.sqlite3",
    ],
)
def test_unreachable_store_raises_quickly_without_the_password(url: str) -> None:
    """Every operation on an unreachable store is a BackendError within seconds, password masked."""
    provider = SqlLockProvider(url)
    started = time.monotonic()
    try:
        for call in (
            lambda: provider.acquire("k", "t", 5, 60, "{}"),
            lambda: provider.refresh([RefreshRequest("k", "t", 5)]),
            lambda: provider.release("k", "t"),
            lambda: provider.peek("k"),
            lambda: provider.scan(""),
        ):
            with pytest.raises(BackendError) as raised:
                call()
            assert "pw-SECRET" not in str(raised.value)
            assert "pw-SECRET" not in repr(raised.value)
    finally:
        provider.close()
    assert time.monotonic() - started < 10


def test_fence_grows_across_release_and_expiry(provider: SqlLockProvider) -> None:
    """Every acquisition of a key gets a larger fence, although release deletes the row."""
    fences = []
    for i in range(3):
        grant = provider.acquire("k", f"t{i}", 5, 60, "{}")
        assert isinstance(grant, Grant)
        fences.append(grant.fence)
        assert provider.release("k", f"t{i}")
    short = provider.acquire("k", "short", 0.2, 60, "{}")
    assert isinstance(short, Grant)
    fences.append(short.fence)
    time.sleep(0.35)
    taken = provider.acquire("k", "taker", 5, 60, "{}")
    assert isinstance(taken, Grant)
    fences.append(taken.fence)
    assert fences == sorted(set(fences))


def test_fence_survives_a_new_provider(db: Db) -> None:
    """The counter lives in the store: a new provider continues above the old fences."""
    first = db.provider()
    grant = first.acquire("k", "a", 5, 60, "{}")
    assert isinstance(grant, Grant)
    assert first.release("k", "a")
    first.close()
    second = db.provider()
    try:
        again = second.acquire("k", "b", 5, 60, "{}")
        assert isinstance(again, Grant)
        assert again.fence > grant.fence
    finally:
        second.close()


def test_retry_with_own_token_returns_the_existing_lease(db: Db, provider: SqlLockProvider) -> None:
    """A retried acquire by the holder returns the same fence and leaves the row unchanged."""
    first = provider.acquire("k", "mine", 5, 60, '{"pid":1}')
    assert isinstance(first, Grant)
    before = db.rows()["k"]
    again = provider.acquire("k", "mine", 30, 600, '{"pid":2}')
    assert isinstance(again, Grant)
    assert again.fence == first.fence
    assert 0 < again.ttl <= 5
    assert db.rows()["k"] == before


def test_live_foreign_row_is_untouched_and_a_dead_one_replaced(db: Db, provider: SqlLockProvider) -> None:
    """A live lease is reported with its holder and not modified; an expired one is taken over.
    The lease is 0.5 s x TIME_SLACK (1 s by default): at 0.5 s a busy MariaDB took that long
    for the grant, the read and the refused acquire. The takeover waits out what the store
    said was left of it."""
    ttl = 0.5 * TIME_SLACK
    first = provider.acquire("k", "a", ttl, 60, '{"host":"h1","pid":7}')
    assert isinstance(first, Grant)
    before = db.rows()["k"]
    held = provider.acquire("k", "b", 5, 60, "{}")
    assert isinstance(held, Held)
    assert held.holder is not None
    assert (held.holder.token, held.holder.fence, held.holder.holder) == (
        "a",
        first.fence,
        {"host": "h1", "pid": 7},
    )
    assert 0 < held.holder.expires_in <= ttl
    assert held.holder.age >= 0
    assert db.rows()["k"] == before
    time.sleep(held.holder.expires_in + 0.2)
    taken = provider.acquire("k", "b", 5, 60, "{}")
    assert isinstance(taken, Grant)
    assert taken.fence > first.fence
    assert db.rows()["k"][1] == "b"


_MINUS_25_HOURS = {
    "postgresql": "created_at - interval '25 hours'",
    "mariadb": "created_at - INTERVAL 25 HOUR",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', created_at, '-25 hours')",
}


def test_a_row_older_than_the_24_hour_cap_is_swept(db: Db, provider: SqlLockProvider) -> None:
    """A row created more than 24 h ago is dead whatever its expiry says (the origin's sweep)."""
    assert isinstance(provider.acquire("k", "old", 60, 600, "{}"), Grant)
    assert isinstance(provider.acquire("k", "new", 5, 600, "{}"), Held)
    key = "`key`" if db.name == "mariadb" else '"key"'
    db.execute(f"UPDATE {db.table} SET created_at = {_MINUS_25_HOURS[db.name]} WHERE {key} = 'k'")
    taken = provider.acquire("k", "new", 5, 600, "{}")
    assert isinstance(taken, Grant)
    info = provider.peek("k")
    assert info is not None
    assert info.token == "new"


def test_other_application_rows_are_never_touched(db: Db, provider: SqlLockProvider) -> None:
    """Rows of other keys in the shared table, live or long expired, survive every operation."""
    provider.peek("warm-up")  # creates the table
    long_ago, soon = "2000-01-01 00:00:00.000", "2999-01-01 00:00:00.000"
    key_column = "`key`" if db.name == "mariadb" else "key"
    for key, value, stamp in [("app:1", "data", long_ago), ("lock:b", "x", long_ago), ("LOCK:a", "y", soon)]:
        db.execute(
            f"INSERT INTO {db.table} ({key_column}, value, expires_at, created_at, deadline, fence, holder) "
            "VALUES (:key, :value, :stamp, :stamp, :stamp, 99, NULL)",
            key=key,
            value=value,
            stamp=stamp,
        )
    before = db.rows()
    assert isinstance(provider.acquire("lock:a", "t", 5, 60, "{}"), Grant)
    assert provider.refresh([RefreshRequest("lock:a", "t", 9), RefreshRequest("lock:b", "x", 9)]) == [
        pytest.approx(9, abs=0.1),
        None,
    ]
    assert [info.key for info in provider.scan("lock:")] == ["lock:a"]
    assert provider.peek("lock:b") is None
    assert provider.release("lock:a", "t")
    assert not provider.release("app:1", "other")
    assert db.rows() == before


def test_expiry_is_decided_by_the_store(provider: SqlLockProvider) -> None:
    """A lease of 0.75 s x TIME_SLACK (1.5 s by default) is held just after its grant and free
    a third of its ttl after its end (a commit stalled by a busy neighbour on the disk can
    take a few hundred ms of a short lease)."""
    ttl = 0.75 * TIME_SLACK
    assert isinstance(provider.acquire("k", "a", ttl, 60, "{}"), Grant)
    granted = time.monotonic()  # the lease ends at most ttl after this
    assert isinstance(provider.acquire("k", "b", 5, 60, "{}"), Held)
    assert provider.peek("k") is not None
    time.sleep(max(0.0, ttl * 4 / 3 - (time.monotonic() - granted)))
    assert provider.peek("k") is None
    assert provider.scan("") == []
    assert provider.refresh([RefreshRequest("k", "a", 5)]) == [None]  # not revived
    assert not provider.release("k", "a")
    assert isinstance(provider.acquire("k", "b", 5, 60, "{}"), Grant)


def test_refresh_caps_at_the_hard_deadline(provider: SqlLockProvider) -> None:
    """A refresh extends by ttl but never past max_lifetime; duplicates get the same answer."""
    assert isinstance(provider.acquire("k", "a", 0.5, 2, "{}"), Grant)
    answers = provider.refresh([RefreshRequest("k", "a", 60), RefreshRequest("k", "a", 60)])
    assert answers[0] is not None
    assert 1.5 < answers[0] <= 2
    assert answers[1] == answers[0]
    assert provider.refresh([]) == []


def test_keys_are_case_sensitive_and_exact(provider: SqlLockProvider) -> None:
    """'A' and 'a' are different locks, and scan() treats % _ ! literally."""
    assert isinstance(provider.acquire("A", "1", 5, 60, "{}"), Grant)
    assert isinstance(provider.acquire("a", "2", 5, 60, "{}"), Grant)
    for key in ("p_x", "p%x", "p!x", "pyx", "p", "p\\x"):
        assert isinstance(provider.acquire(key, "t", 5, 60, "{}"), Grant)
    assert [i.key for i in provider.scan("p_")] == ["p_x"]
    assert [i.key for i in provider.scan("p%")] == ["p%x"]
    assert [i.key for i in provider.scan("p!")] == ["p!x"]
    assert [i.key for i in provider.scan("p\\")] == ["p\\x"]
    assert [i.key for i in provider.scan("")] == sorted(["A", "a", "p_x", "p%x", "p!x", "pyx", "p", "p\\x"])
    long_key = "k" * 512
    assert isinstance(provider.acquire(long_key, "t", 5, 60, "{}"), Grant)
    assert provider.peek(long_key) is not None


def test_processes_race_exactly_one_winner_per_key(db: Db) -> None:
    """Eight processes create the table together and race for each key: one winner, no errors."""
    ctx = process_context()
    start, results = ctx.Barrier(8), ctx.Queue()
    keys = [f"race:{i}" for i in range(25)]
    procs = [
        ctx.Process(target=_sql_workers.race, args=(db.url, db.table, keys, start, results)) for _ in range(8)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert [kind for kind, _ in outcomes] == ["ok"] * 8, outcomes
    winners = sorted(key for _, won in outcomes for key in won)
    assert winners == sorted(keys)


def test_fork_child_gets_its_own_connections(pg: Db) -> None:
    """After fork the child never reuses the parent's pooled connection."""
    provider = pg.provider()
    try:
        assert isinstance(provider.acquire("k", "parent", 30, 60, "{}"), Grant)
        assert provider._kept is not None
        (kept,) = provider._kept  # the connection the parent's next statement will use
        parent_pid = kept.info.backend_pid
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            status = 1
            try:
                answer = provider.acquire("k", "child", 30, 60, "{}")
                pid = provider._kept[0].info.backend_pid
                os.write(write, f"{isinstance(answer, Held)} {pid}".encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        _, status = os.waitpid(child, 0)
        child_held, child_pid = os.read(read, 100).decode().split()
        os.close(read)
        assert status == 0
        assert child_held == "True"
        assert int(child_pid) != parent_pid
        assert provider.release("k", "parent")  # the parent's connection still works
        assert provider._kept == [kept]
    finally:
        provider.close()


def _assert_contended_attempts_write_no_wal(conn: Any, attempt: Callable[[int], object]) -> None:
    """``attempt(i)`` (an acquire, refused: Held) 50 times in a window: some window must show
    no WAL growth (other sessions may write meanwhile: any quiet window proves we wrote nothing;
    short windows are likelier to be quiet on a shared server)."""
    growth = []
    for _ in range(20):
        before = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        for i in range(50):
            assert isinstance(attempt(i), Held)
        after = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", before).fetchone()
        growth.append(after[0] if after else None)
        if growth[-1] == 0:
            return
    pytest.skip(f"WAL grew in every window (other writers on the server?): {growth}")


def _psycopg_dsn(pg: Db) -> str:
    return sa.make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)


def test_pg_contention_takes_no_transaction_id_and_writes_no_wal(pg: Db) -> None:
    """A refused acquire (and a retry by the holder) assigns no xid and writes no WAL."""
    import psycopg

    provider = pg.provider()
    try:
        assert isinstance(provider.acquire("k", "holder", 60, 600, "{}"), Grant)
        with psycopg.connect(_psycopg_dsn(pg)) as conn:
            for token in ("other", "holder"):
                params = {"key": "k", "token": token, "ttl": 5.0, "life": 60.0, "holder": "{}"}
                rows = conn.execute(provider._psycopg_sql["acquire"], params).fetchall()
                assert rows
                assert rows[0][2] == "holder"
                assert conn.execute("SELECT txid_current_if_assigned()").fetchone() == (None,)
                conn.rollback()
            conn.autocommit = True
            _assert_contended_attempts_write_no_wal(
                conn, lambda i: provider.acquire("k", f"x{i}", 5, 60, "{}")
            )
    finally:
        provider.close()


def test_pg_semaphore_grant_answers_with_its_one_row(pg: Db) -> None:
    """A granting acquire_any statement returns only its grant row (slot index and fence),
    not every slot as read: the rows a grant does not need cost the client their parsing."""
    provider = pg.provider()
    keys = ("one", "{one}#2", "{one}#3")
    sent: list[Any] = []
    run = provider._run_pg

    def recorded(op: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        sent.append(rows := run(op, params, timeout))
        return rows

    provider._run_pg = recorded  # type: ignore[method-assign]
    try:
        assert provider.acquire_any(keys, "a", 60, 600, "{}") == (0, Grant(1, 60.0))
        assert provider.acquire_any(keys, "b", 60, 600, "{}") == (1, Grant(2, 60.0))
        assert [[row[:2] for row in rows] for rows in sent] == [[("g", 1)], [("g", 2)]]
        assert [rows[0][4] for rows in sent] == [1, 2]
    finally:
        provider.close()


def test_pg_contended_semaphore_takes_no_lock_or_transaction_id_and_writes_no_wal(pg: Db) -> None:
    """A limit=3 acquire_any on three live slots (and a retry by a holder) takes no advisory
    lock, assigns no xid and writes no WAL: the single lock's contended guarantee."""
    import psycopg

    from celery_exclusive.providers.postgres import _text_array

    provider = pg.provider()
    keys = ["sem", "{sem}#2", "{sem}#3"]
    try:
        for i in range(3):
            assert provider.acquire_any(keys, f"holder{i}", 60, 600, "{}") == (i, Grant(i + 1, 60.0))
        with psycopg.connect(_psycopg_dsn(pg)) as conn:
            for token in ("other", "holder1"):
                params = {
                    "keys": _text_array(tuple(keys)),
                    "token": token,
                    "ttl": 5.0,
                    "life": 60.0,
                    "holder": "{}",
                }
                rows = conn.execute(provider._psycopg_sql["acquire_any"], params).fetchall()
                assert sorted(row[:2] for row in rows) == [("l", 1), ("l", 2), ("l", 3)]  # no grant
                assert conn.execute("SELECT txid_current_if_assigned()").fetchone() == (None,)
                advisory = (
                    "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
                )
                assert conn.execute(advisory).fetchone() == (0,)
                conn.rollback()
            conn.autocommit = True
            _assert_contended_attempts_write_no_wal(
                conn, lambda i: provider.acquire_any(keys, f"x{i}", 5, 60, "{}")
            )
    finally:
        provider.close()


def test_pg_refreshes_ten_thousand_leases_in_one_call(pg: Db) -> None:
    """refresh() handles 10,000 leases, answering each in order; foreign tokens get None."""
    provider = pg.provider()
    try:
        provider.peek("k")
        pg.execute(
            f"INSERT INTO {pg.table} (key, value, expires_at, created_at, deadline, fence, holder) "
            "SELECT 'k' || i, 't' || i, clock_timestamp() + interval '10 s', clock_timestamp(), "
            "clock_timestamp() + interval '1 h', i, NULL FROM generate_series(0, 9999) AS i"
        )
        requests = [RefreshRequest(f"k{i}", f"t{i}" if i % 10 else "wrong", 30) for i in range(10_000)]
        started = time.monotonic()
        answers = provider.refresh(requests)
        elapsed = time.monotonic() - started
        assert len(answers) == 10_000
        assert all(a is None for a in answers[::10])
        assert all(a is not None and 29 < a <= 30 for i, a in enumerate(answers) if i % 10)
        assert elapsed < 5
    finally:
        provider.close()


@pytest.mark.parametrize("op", ["peek", "acquire"])  # psycopg's cursor path; libpq's direct path
def test_pg_broken_connection_is_replaced(pg: Db, op: str) -> None:
    """A kept connection killed by the server costs one BackendError; the next call reconnects."""
    provider = pg.provider()
    call = {"peek": lambda: provider.peek("k"), "acquire": lambda: provider.acquire("k", "t", 5, 60, "{}")}[
        op
    ]
    try:
        provider.peek("k")
        assert provider._kept is not None
        (kept,) = provider._kept  # the connection the next statement will use
        pg.execute("SELECT pg_terminate_backend(:pid)", pid=kept.info.backend_pid)
        time.sleep(0.1)
        with pytest.raises(BackendError):
            call()
        assert kept.closed
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}"), Grant)
        assert provider._kept
        assert provider._kept[0] is not kept
    finally:
        provider.close()


def test_pg_acquire_is_one_statement_unless_it_takes_over_a_dead_lease(pg: Db) -> None:
    """A free key and a held key (contention) cost one statement; only a dead lease (its
    holder crashed) costs a second, the take-over, which also raises the fence."""
    provider = pg.provider()
    sent: list[str] = []
    # Every statement goes through one of them (acquire's own text parameters through run_text).
    run, run_text = provider._executor.run, provider._run_text
    assert run_text is not None

    def counting(op: str, params: dict[str, Any], timeout: float | None) -> Any:
        sent.append(op)
        return run(op, params, timeout)

    def counting_text(op: str, values: list[bytes | None], timeout: float | None) -> Any:
        sent.append(op)
        return run_text(op, values, timeout)

    provider._executor.run = counting  # type: ignore[method-assign]
    provider._run_text = counting_text
    try:
        first = provider.acquire("k", "a", 0.3, 60, "{}")
        assert isinstance(first, Grant)
        assert sent == ["acquire"]
        sent.clear()
        assert isinstance(provider.acquire("k", "b", 5, 60, "{}"), Held)
        assert sent == ["acquire"]
        sent.clear()
        time.sleep(0.4)
        taken = provider.acquire("k", "b", 5, 60, "{}")
        assert isinstance(taken, Grant)
        assert taken.fence > first.fence
        assert sent == ["acquire", "take_over"]
    finally:
        provider.close()


def test_pg_a_release_s_record_parameters_are_made_afresh_for_every_kind_of_record(pg: Db) -> None:
    """The provider keeps the record parameters it made last per outcome: each release sends
    the text a mapping of record_params() makes (attempt by int(), retain by float()),
    however the attempt, retention or outcome change between releases, and the record
    reads back as written."""
    from celery_exclusive.providers import _libpq, postgres
    from celery_exclusive.providers._sql_common import record_params

    provider = pg.provider()
    sent: list[list[bytes | None]] = []
    run_text = provider._run_text
    assert run_text is not None

    def keeping(op: str, values: list[bytes | None], timeout: float | None) -> Any:
        if op.startswith("release_done"):
            sent.append(values)
        return run_text(op, values, timeout)

    provider._run_text = keeping
    kinds: list[tuple[Any, str, Any]] = [
        (0, "success", 86400.0),
        (2, "success", 86400.0),
        (0, "success", 60.0),
        (0, "success", 86400),
        (1, "failure", 86400.0),
        (True, "success", 86400.0),
        (1, "success", 1.5),
        *((0, f"outcome-{i}", 30.0) for i in range(20)),
    ]
    try:
        for i, (attempt, outcome, retain) in enumerate(kinds * 2):
            key, record = f"k{i}", Completion(f"t-{i}", outcome, attempt, retain)
            assert isinstance(provider.acquire(key, "tok", 5, 60, "{}", task_id=record.task_id), Grant)
            assert provider.release(key, "tok", record) is True
            channel = postgres._channel(pg.table, key)
            made = _libpq.utf8_text(tuple(record_params(record).values()))
            assert sent.pop() == [key.encode(), b"tok", *made, channel.encode()], (attempt, outcome, retain)
            stored = provider.completion(key, record.task_id)
            assert stored is not None
            assert (stored.outcome, stored.attempt) == (outcome, int(attempt))
            assert float(retain) - 5 < stored.expires_in <= float(retain)
        assert len(postgres._RECORDS) <= 16
    finally:
        provider.close()


def test_pg_hot_statements_use_the_connection_encoding(pg: Db) -> None:
    """The libpq path encodes parameters and decodes results in the session's client
    encoding, as psycopg does: a LATIN1 session stores and reports the same text."""
    provider = SqlLockProvider(f"{pg.url}?client_encoding=latin1", table=pg.table)
    try:
        assert isinstance(provider.acquire("café", "jeton-é", 5, 60, '{"host":"hôte"}'), Grant)
        held = provider.acquire("café", "autre", 5, 60, "{}")
        assert isinstance(held, Held)
        assert held.holder is not None
        assert (held.holder.key, held.holder.token, held.holder.holder) == (
            "café",
            "jeton-é",
            {"host": "hôte"},
        )
        assert provider._kept is not None
        assert provider._kept[0].info.encoding == "iso8859-1"
        assert pg.rows()["café"][1] == "jeton-é"  # read back through a UTF-8 session
        assert provider.release("café", "jeton-é")
    finally:
        provider.close()


def test_pg_hot_statements_take_str_subclasses_through_the_parameter_mapping(pg: Db) -> None:
    """acquire and release (with and without a completion record) make their statements'
    text parameters themselves for plain strs only; a str subclass (or anything else) goes
    through the runner's mapping, with the same answers."""

    class Text(str):
        pass

    provider = pg.provider()
    try:
        assert isinstance(provider.acquire(Text("k"), Text("t"), 5, 60, Text('{"pid":1}')), Grant)
        held = provider.acquire("k", "u", 5, 60, "{}")
        assert isinstance(held, Held)
        assert held.holder is not None
        assert (held.holder.token, held.holder.holder) == ("t", {"pid": 1})
        assert provider.release(Text("k"), "u") is False
        assert provider.release("k", Text("t")) is True
        assert pg.rows() == {}
        # The completion record's statements too: acquire_once and release_done.
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}", task_id=Text("id-1")), Grant)
        assert provider.release("k", "t", Completion(Text("id-1"), Text("success"), 2, 60.0)) is True
        done = provider.acquire("k", "u", 5, 60, "{}", task_id="id-1")
        assert isinstance(done, Done)
        assert (done.record.outcome, done.record.attempt) == ("success", 2)
    finally:
        provider.close()


def test_pg_hot_statements_survive_a_session_that_lost_them(pg: Db) -> None:
    """acquire and release run as statements prepared on each connection; a session that
    dropped them (DISCARD ALL from a pooler, say) prepares them again, unnoticed."""
    provider = pg.provider()
    try:
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}"), Grant)
        assert provider._kept is not None
        (kept,) = provider._kept
        names = {row[0] for row in kept.execute("SELECT name FROM pg_prepared_statements").fetchall()}
        assert provider._executor.statements["acquire"].name.decode() in names
        kept.execute("DISCARD ALL")
        assert kept.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
        assert provider.release("k", "t")
        assert isinstance(provider.acquire("k", "u", 5, 60, "{}"), Grant)
        assert provider._kept == [kept]  # the same connection, not replaced
    finally:
        provider.close()


def _kept_connection(provider: Any) -> Any:
    """The provider's one kept connection, made by a first call."""
    provider.peek("k")
    assert provider._kept is not None
    (kept,) = provider._kept
    return kept


def test_pg_runner_sends_none_as_null_and_other_values_as_their_text(pg: Db) -> None:
    """The libpq runner's parameters: None is SQL NULL (not the text 'None'), a number is
    sent as its text, and a statement with a single parameter takes it like the others."""
    from celery_exclusive.providers import _libpq

    provider = pg.provider()
    try:
        kept = _kept_connection(provider)
        runner = _libpq.Runner(prepare=True)
        both = _libpq.Statement.build("SELECT CAST(:a AS text) IS NULL, CAST(:b AS float8), :a::text", "bft")
        assert runner.run(kept, both, {"a": None, "b": 1.25}) == [(True, 1.25, None)]
        assert runner.run(kept, both, {"a": "x", "b": 7}) == [(False, 7.0, "x")]
        one = _libpq.Statement.build("SELECT CAST(:n AS bigint) + 1", "i")
        assert runner.run(kept, one, {"n": 41}) == [(42,)]
    finally:
        provider.close()


def test_pg_runner_converts_every_row_with_and_without_nulls(pg: Db) -> None:
    """The libpq runner's rows: every row of a result, each column converted by its type
    letter whether or not the row has a NULL (a NULL stays None), none for no row, and a
    one-column result's NULL too."""
    from celery_exclusive.providers import _libpq

    provider = pg.provider()
    try:
        kept = _kept_connection(provider)
        runner = _libpq.Runner(prepare=True)
        rows = _libpq.Statement.build(
            "SELECT n % 2 = 0, n, n / 4.0, 'r' || n, CASE WHEN n = CAST(:null_at AS int) THEN NULL "
            "ELSE n END FROM generate_series(1, CAST(:n AS int)) AS s(n) ORDER BY s.n",
            "bifti",
        )
        assert runner.run(kept, rows, {"n": 3, "null_at": 2}) == [
            (False, 1, 0.25, "r1", 1),
            (True, 2, 0.5, "r2", None),
            (False, 3, 0.75, "r3", 3),
        ]
        assert runner.run(kept, rows, {"n": 2, "null_at": 0}) == [
            (False, 1, 0.25, "r1", 1),
            (True, 2, 0.5, "r2", 2),
        ]
        assert runner.run(kept, rows, {"n": 0, "null_at": 0}) == []
        one = _libpq.Statement.build(
            "SELECT NULLIF(n, 2) FROM generate_series(1, CAST(:n AS int)) AS s(n) ORDER BY s.n", "i"
        )
        assert runner.run(kept, one, {"n": 3}) == [(1,), (None,), (3,)]
    finally:
        provider.close()


def test_pg_runner_reads_a_grant_row_for_its_grant_column_only(pg: Db) -> None:
    """A statement built with ``grant``: a one-row result whose first column is true comes
    back as that column's int alone (what the acquire's grant row holds, and all its reader
    uses); any other result (first column false or NULL, several rows, no row) is
    converted whole."""
    from celery_exclusive.providers import _libpq

    provider = pg.provider()
    try:
        kept = _kept_connection(provider)
        runner = _libpq.Runner(prepare=True)
        sql = (
            "SELECT CAST(:flag AS bool), 'x' || n, n * 10, n / 4.0 "
            "FROM generate_series(1, CAST(:n AS int)) AS s(n) ORDER BY s.n"
        )
        granted = _libpq.Statement.build(sql, "btif", grant=2)
        whole = _libpq.Statement.build(sql, "btif")
        assert runner.run(kept, granted, {"flag": True, "n": 1}) == 10
        assert runner.run(kept, whole, {"flag": True, "n": 1}) == [
            (True, "x1", 10, 0.25)
        ]  # same shape, own builder
        assert runner.run(kept, granted, {"flag": False, "n": 1}) == [(False, "x1", 10, 0.25)]
        assert runner.run(kept, granted, {"flag": None, "n": 1}) == [(None, "x1", 10, 0.25)]
        assert runner.run(kept, granted, {"flag": True, "n": 2}) == [
            (True, "x1", 10, 0.25),
            (True, "x2", 20, 0.5),
        ]
        assert runner.run(kept, granted, {"flag": True, "n": 0}) == []
        with pytest.raises(ValueError, match="grant column"):
            _libpq.Statement.build(sql, "btif", grant=0)
        with pytest.raises(ValueError, match="grant column"):
            _libpq.Statement.build(sql, "tbif", grant=2)
        with pytest.raises(ValueError, match="grant column"):
            _libpq.Statement.build(sql, "btif", grant=1)
    finally:
        provider.close()


def test_pg_hot_statements_keep_their_deadline_without_the_watchdog(
    pg: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acquire and release with a deadline arm no watchdog (the runner's wait for the reply
    enforces it, see test_inspect_deadlines); the statements on psycopg's cursors still do."""
    from celery_exclusive.providers import _deadline

    provider = pg.provider()
    armed: list[int] = []
    arm = _deadline.arm

    def counted(fd: int, deadline: float) -> Any:
        armed.append(fd)
        return arm(fd, deadline)

    monkeypatch.setattr(_deadline, "arm", counted)
    try:
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}", timeout=5), Grant)
        assert provider.release("k", "t", timeout=5)
        assert armed == []
        assert provider.peek("k", timeout=5) is None
        assert len(armed) == 1
    finally:
        provider.close()


def test_pg_hot_statement_errors_are_backend_errors(pg: Db) -> None:
    """A server error on the libpq path is a BackendError naming it (an outage, never
    "held"), chained from the psycopg error with psycopg's diagnostics; the connection
    stays in use, and the statement works again once it can."""
    import psycopg

    provider = pg.provider()
    try:
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}"), Grant)
        assert provider._kept is not None
        (kept,) = provider._kept
        pg.execute(f"ALTER TABLE {pg.table} RENAME TO {pg.table}_away")
        with pytest.raises(BackendError, match=r"UndefinedTable.*does not exist") as raised:
            provider.acquire("k2", "t", 5, 60, "{}")
        cause = raised.value.__cause__
        assert isinstance(cause, psycopg.errors.UndefinedTable)
        assert cause.sqlstate == cause.diag.sqlstate == "42P01"
        assert cause.diag.severity_nonlocalized == "ERROR"
        assert "does not exist" in str(cause.diag.message_primary)
        with pytest.raises(BackendError, match="UndefinedTable"):
            provider.release("k", "t")
        assert provider._kept == [kept]
        pg.execute(f"ALTER TABLE {pg.table}_away RENAME TO {pg.table}")
        assert isinstance(provider.acquire("k", "u", 5, 60, "{}"), Held)
        assert provider.release("k", "t")
    finally:
        provider.close()


def test_pg_fast_path_keeps_its_own_connections(pg: Db) -> None:
    """Statements reuse connections the provider keeps out of the pool, at most ``_KEEP``
    of them however many threads call at once; the rest go back to the pool, and close()
    closes the kept ones."""
    provider = pg.provider()
    pool = provider._engine.pool
    try:
        provider.peek("k")
        assert provider._kept is not None
        (kept,) = provider._kept
        for _ in range(3):
            assert provider.peek("k") is None
        assert provider._kept == [kept]  # the same connection every time, no checkout
        assert pool.checkedout() == 0

        start = threading.Barrier(8)

        def hammer() -> None:
            start.wait()
            for _ in range(30):
                provider.peek("k")

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert 1 <= len(provider._kept) <= _pg_executor.KEEP
        assert pool.checkedout() == 0

        def detached() -> Any:
            fairy = provider._engine.raw_connection()
            connection = fairy.driver_connection
            fairy.detach()
            return connection

        while len(provider._kept) < _pg_executor.KEEP:
            provider._executor.keep(detached())
        one_too_many = detached()
        provider._executor.keep(one_too_many)
        assert one_too_many.closed
        kept_now = list(provider._kept)
        assert len(kept_now) == _pg_executor.KEEP
        provider.close()
        assert provider._kept == []
        assert all(connection.closed for connection in kept_now)
    finally:
        provider.close()


def test_pg_caller_engine_connections_always_go_back_to_its_pool(pg: Db) -> None:
    """With an engine the caller built (its pool's reset and pre-ping rules apply), no
    connection stays checked out between statements."""
    engine = sa.create_engine(pg.url, pool_pre_ping=True)
    provider = SqlLockProvider(engine, table=pg.table)
    try:
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}"), Grant)
        assert provider._kept is None
        assert engine.pool.checkedout() == 0
    finally:
        provider.close()
        engine.dispose()


def test_pg_connections_give_up_on_a_silent_network(pg: Db) -> None:
    """Engines built from a URL bound how long a dead network can block a call (libpq's
    keepalives and tcp_user_timeout reach the live connection); the URL overrides each."""
    for url, idle in ((pg.url, "10"), (f"{pg.url}?keepalives_idle=7", "7")):
        provider = SqlLockProvider(url, table=pg.table)
        try:
            provider.peek("k")
            assert provider._kept is not None
            params = provider._kept[0].info.get_parameters()
            assert params["tcp_user_timeout"] == "30000"
            assert (params["keepalives"], params["keepalives_idle"]) == ("1", idle)
            assert (params["keepalives_interval"], params["keepalives_count"]) == ("5", "3")
        finally:
            provider.close()


def test_pg_engine_without_autocommit_commits(pg: Db) -> None:
    """A caller's engine (no autocommit) works: writes are committed and nothing stays open."""
    engine = sa.create_engine(pg.url)
    provider = SqlLockProvider(engine, table=pg.table)
    try:
        assert isinstance(provider.acquire("k", "t", 5, 60, "{}"), Grant)
        assert pg.rows()["k"][1] == "t"
        assert provider.release("k", "t")
        assert "k" not in pg.rows()
    finally:
        provider.close()
        engine.dispose()


def test_pg_statements_also_run_through_sqlalchemy(pg: Db) -> None:
    """The path for PostgreSQL drivers other than psycopg 3 runs the same statements."""
    provider = pg.provider()
    provider._executor = _pg_executor.PooledExecutor(provider._engine, provider._pg_sql)
    provider._run_text = None  # as _setup leaves it for this executor
    try:
        first = provider.acquire("k", "a", 5, 60, '{"pid":1}')
        assert isinstance(first, Grant)
        held = provider.acquire("k", "b", 5, 60, "{}")
        assert isinstance(held, Held)
        assert held.holder is not None
        assert held.holder.holder == {"pid": 1}
        assert provider.refresh([RefreshRequest("k", "a", 9)]) == [pytest.approx(9, abs=0.1)]
        assert [i.key for i in provider.scan("")] == ["k"]
        assert provider.release("k", "a")
    finally:
        provider.close()


def test_mixed_case_table_name_is_quoted_consistently(db: Db) -> None:
    """A table name with capitals works: DDL and every statement quote it the same way."""
    provider = SqlLockProvider(db.url, table="CE_Mixed" + db.table[-10:])
    q = provider._engine.dialect.identifier_preparer.quote
    try:
        first = provider.acquire("k", "a", 5, 60, "{}")
        assert isinstance(first, Grant)
        assert provider.release("k", "a")
        second = provider.acquire("k", "b", 5, 60, "{}")
        assert isinstance(second, Grant)
        assert second.fence > first.fence
        assert [i.key for i in provider.scan("")] == ["k"]
    finally:
        with provider._engine.begin() as conn:
            name = provider.table.name
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {q(name)}")
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {q(name + '_fence')}")
            if db.name == "postgresql":
                conn.exec_driver_sql(f"DROP SEQUENCE IF EXISTS {q(name + '_fence_seq')}")
                conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {q(name + '_unless')}(varchar, varchar)")
        provider.close()


def test_diagnose(provider: SqlLockProvider) -> None:
    """diagnose() reports the schema and the server clock; an unreachable store is a finding."""
    provider.peek("k")
    findings = {d.check: d for d in provider.diagnose()}
    assert findings["schema"].status == "ok"
    assert findings["clock"].status == "ok"
    dead = SqlLockProvider("postgresql://postgres:pw-SECRET@127.0.0.1:1/test")
    try:
        (finding,) = dead.diagnose()
        assert finding.status == "fail"
        assert "pw-SECRET" not in finding.detail
    finally:
        dead.close()


def test_a_schema_without_the_record_table_keeps_working_without_records(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """A table migrated before completion records existed (create_table=False, no
    <table>_done): leases work as before, records are skipped with one warning, doctor warns."""
    metadata = sa.MetaData()
    lock_table(metadata, db.table)
    engine = sa.create_engine(db.url)
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {db.table}_done"))
    finally:
        engine.dispose()
    provider = db.provider(create_table=False)
    try:
        with caplog.at_level("WARNING", logger="celery_exclusive"):
            assert isinstance(provider.acquire("k", "t", 5, 60, "{}", task_id="id-1"), Grant)
            assert provider.release("k", "t", Completion("id-1", "success", 0, 60.0)) is True
            assert isinstance(provider.acquire("k", "t2", 5, 60, "{}", task_id="id-1"), Grant)
        assert sum(f"{db.table}_done" in r.getMessage() for r in caplog.records) == 1
        assert provider.completions("") == []
        assert provider.completion("k", "id-1") is None
        assert provider.forget("k", "id-1") is False
        assert any(d.check == "records" and d.status == "warn" for d in provider.diagnose())
    finally:
        provider.close()


def test_a_slow_first_set_up_does_not_shorten_the_first_lease(tmp_path: Path) -> None:
    """The first lock() creates the tables before its lease's clock starts: with the
    database write-locked elsewhere for longer than the ttl, the lease still begins with
    its whole ttl once the set-up gets through (it used to be granted already expired)."""
    from celery_exclusive import LockService

    path = tmp_path / "locks.db"
    rival = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    rival.execute("BEGIN IMMEDIATE")
    threading.Timer(1.5, rival.close).start()  # the set-up waits this long for the write lock
    with LockService(f"sqlite:///{path}", call_timeout=10) as service:
        lease = service.lock("first", ttl=1.0)
        try:
            assert lease.held
            assert lease.expires_in > 0.6, lease.expires_in
        finally:
            lease.release()


def test_sqlite_waiter_marks_are_seen_across_processes_and_die_with_them(tmp_path: Path) -> None:
    """A SQLite waiter's mark (a shared fcntl lock on ``<db>-waiters``) is seen by a
    releaser in another process, and gone once that process is SIGKILLed: a dead waiter
    never makes anyone give way."""
    from tests.contract import _wait_workers

    url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    provider = SqlLockProvider(url)
    ctx = process_context()
    ready = ctx.Queue()
    proc = ctx.Process(target=_wait_workers.mark_waiting_until_killed, args=(url, "p:k", ready))
    proc.start()
    try:
        assert ready.get(timeout=60)
        assert provider.had_waiters("p:k") is True
        assert provider.had_waiters("p:other") is False
        with provider.mark_waiting("p:mine"):  # this process's own waiters count too
            assert provider.had_waiters("p:mine") is True
        assert provider.had_waiters("p:mine") is False
    finally:
        assert proc.pid is not None
        os.kill(proc.pid, 9)
        proc.join(30)
    assert provider.had_waiters("p:k") is False
    provider.close()


def test_an_sqlite_library_too_old_for_the_store_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SQLite before 3.24 has no conditional upsert (the completion records' write): the
    store refuses it when made, naming both versions, before any file is created or
    opened, instead of failing its first recorded release with a syntax error."""
    monkeypatch.setattr(sqlite3.dbapi2, "sqlite_version_info", (3, 22, 0))  # what SQLAlchemy reads
    database = tmp_path / "old.db"
    with pytest.raises(ConfigurationError, match=r"3\.24\.0 or later.*3\.22\.0"):
        SqlLockProvider(f"sqlite:///{database}")
    assert not database.exists()
