"""``Lease.guard(connection)``: fencing writes inside the caller's PostgreSQL transaction.

Real PostgreSQL (``CE_TEST_POSTGRES_URL``); each test gets its own lock table, data table
and fence sequence, dropped afterwards.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_exclusive import InvalidArgumentError, LockLost, LockService
from celery_exclusive.providers.base import Grant, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import POSTGRES_URL, REDIS_URL, IdleThread, delete_redis_keys, require_server, with_option


@dataclass
class Pg:
    """One isolated lock table and data table on the test PostgreSQL server."""

    url: str
    table: str
    data: str
    engine: sa.Engine
    prefix: str

    def service(self, **kwargs: Any) -> LockService:
        return LockService(with_option(self.url, "table", self.table), prefix=self.prefix, **kwargs)

    def provider(self) -> SqlLockProvider:
        return SqlLockProvider(self.url, table=self.table)

    def data_rows(self) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT id, fence FROM {self.data} ORDER BY id"))]


@pytest.fixture
def pg() -> Iterator[Pg]:
    """A unique lock table and data table on PostgreSQL, dropped afterwards."""
    require_server(POSTGRES_URL)
    suffix = uuid.uuid4().hex[:10]
    engine = sa.create_engine(POSTGRES_URL)
    data = f"ce_guard_data_{suffix}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {data} (id text PRIMARY KEY, fence bigint NOT NULL)"))
    pg = Pg(POSTGRES_URL, f"ce_guard_{suffix}", data, engine, f"g{suffix}:")
    try:
        yield pg
    finally:
        with engine.begin() as conn:
            for name in (pg.table, data):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
            conn.execute(sa.text(f"DROP SEQUENCE IF EXISTS {pg.table}_fence_seq"))
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {pg.table}_unless(varchar, varchar)"))
        engine.dispose()


def _psycopg_dsn() -> str:
    return sa.make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(hide_password=False)


def test_guard_passes_for_a_live_lease_and_the_write_commits(pg: Pg) -> None:
    """A live lease passes the guard on a SQLAlchemy connection, and the guarded write commits."""
    with pg.service() as service, service.lock("job") as lease, pg.engine.begin() as conn:
        lease.guard(conn)
        conn.execute(sa.text(f"INSERT INTO {pg.data} VALUES ('a', :f)"), {"f": lease.fence})
    assert pg.data_rows() == [("a", lease.fence)]


def test_guard_accepts_an_orm_session_and_a_raw_psycopg_connection(pg: Pg) -> None:
    """The guard also works on an ORM Session and on a psycopg 3 connection in a transaction."""
    with pg.service() as service, service.lock("job") as lease:
        with Session(pg.engine) as session, session.begin():
            lease.guard(session)
            session.execute(sa.text(f"INSERT INTO {pg.data} VALUES ('s', :f)"), {"f": lease.fence})
        with psycopg.connect(_psycopg_dsn()) as raw:
            lease.guard(raw)
            raw.execute(f"INSERT INTO {pg.data} VALUES ('r', %s)", (lease.fence,))
    assert pg.data_rows() == [("r", lease.fence), ("s", lease.fence)]


def test_guard_raises_lock_lost_after_a_takeover(pg: Pg) -> None:
    """Once another owner took the key over, the old lease's guard raises LockLost naming its key."""
    with pg.service() as first, pg.service() as second:
        lease = first.lock("job")
        assert second.force_release("job", lease.token)
        newer = second.lock("job")
        assert newer.fence > lease.fence
        with pg.engine.connect() as conn, pytest.raises(LockLost, match="roll back") as lost:
            lease.guard(conn)
        assert lost.value.key == "job"
        assert lost.value.fence == lease.fence
        with pg.engine.begin() as conn:
            newer.guard(conn)


def test_guard_raises_lock_lost_after_expiry_or_for_a_wrong_token_or_fence(pg: Pg) -> None:
    """The store's view decides: an expired row, another token or another fence all fail the guard."""
    provider = pg.provider()
    try:
        answer = provider.acquire("k", "tok", 0.3, 60.0, "{}")
        assert isinstance(answer, Grant)
        with pg.engine.begin() as conn:
            provider.guard(conn, "k", "tok", answer.fence)
            for token, fence in (("other", answer.fence), ("tok", answer.fence + 1)):
                with pytest.raises(LockLost):
                    provider.guard(conn, "k", token, fence)
        time.sleep(0.5)
        with pg.engine.begin() as conn, pytest.raises(LockLost, match="expired"):
            provider.guard(conn, "k", "tok", answer.fence)
    finally:
        provider.close()


def test_guard_raises_lock_lost_for_a_released_lease(pg: Pg) -> None:
    """A lease released before the guard fails it, without touching the connection."""
    with pg.service() as service:
        lease = service.lock("job")
        lease.release()
        with pg.engine.connect() as conn, pytest.raises(LockLost, match="released"):
            lease.guard(conn)


def test_takeover_waits_until_the_guarding_transaction_commits(pg: Pg) -> None:
    """A competitor taking over an expired guarded lease blocks until the guarding transaction ends."""
    events: list[str] = []
    result: dict[str, Any] = {}
    competitor = pg.provider()
    with pg.service(thread_factory=IdleThread) as service:
        lease = service.lock("job", ttl=0.5, refresh_interval=0.4)  # never refreshed: expires at 0.5 s
        conn = pg.engine.connect()
        try:
            conn.begin()
            lease.guard(conn)
            conn.execute(sa.text(f"INSERT INTO {pg.data} VALUES ('guarded', :f)"), {"f": lease.fence})
            time.sleep(0.8)  # the row has expired on the server's clock; our share lock remains

            def take_over() -> None:
                result["answer"] = competitor.acquire(pg.prefix + "job", "newer", 30.0, 60.0, "{}")
                events.append("taken over")
                with pg.engine.connect() as seen:
                    result["seen"] = seen.execute(sa.text(f"SELECT id FROM {pg.data}")).scalars().all()

            thread = threading.Thread(target=take_over, daemon=True)
            thread.start()
            thread.join(0.7)
            assert thread.is_alive(), "the takeover did not wait for the guarding transaction"
            events.append("commit")
            conn.commit()
        finally:
            conn.close()
        thread.join(10)
        assert not thread.is_alive()
    competitor.close()
    assert events == ["commit", "taken over"]
    answer = result["answer"]
    assert isinstance(answer, Grant)
    assert answer.fence > lease.fence
    assert result["seen"] == ["guarded"]  # the new owner sees the fenced write as already committed


def test_heartbeat_refresh_waits_for_a_guarding_transaction(pg: Pg) -> None:
    """Documented trade-off: a refresh of the guarded row waits until the guarding transaction ends."""
    provider = pg.provider()
    try:
        answer = provider.acquire("k", "tok", 30.0, 60.0, "{}")
        assert isinstance(answer, Grant)
        answers: list[list[float | None]] = []
        with pg.engine.connect() as conn:
            conn.begin()
            provider.guard(conn, "k", "tok", answer.fence)
            thread = threading.Thread(
                target=lambda: answers.append(provider.refresh([RefreshRequest("k", "tok", 30.0)])),
                daemon=True,
            )
            thread.start()
            thread.join(0.5)
            assert thread.is_alive()
            assert not answers
            conn.commit()
        thread.join(10)
        assert len(answers) == 1
        assert answers[0][0] is not None
    finally:
        provider.close()


def test_guard_refuses_connections_that_cannot_hold_the_share_lock(pg: Pg, tmp_path: Path) -> None:
    """Autocommit connections, other databases and non-connections raise InvalidArgumentError."""
    auto = pg.engine.execution_options(isolation_level="AUTOCOMMIT")
    sqlite = sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}")
    with pg.service() as service, service.lock("job") as lease:
        with auto.connect() as conn, pytest.raises(InvalidArgumentError, match="autocommit"):
            lease.guard(conn)
        with (
            psycopg.connect(_psycopg_dsn(), autocommit=True) as raw,
            pytest.raises(InvalidArgumentError, match="autocommit"),
        ):
            lease.guard(raw)
        with sqlite.connect() as conn, pytest.raises(InvalidArgumentError, match="sqlite connection"):
            lease.guard(conn)
        for bad in (None, "postgresql://x", pg.engine):
            with pytest.raises(InvalidArgumentError, match="guard"):
                lease.guard(bad)
    sqlite.dispose()


@pytest.mark.parametrize("store", ["memory", "sqlite", "redis"])
def test_guard_on_other_stores_raises_invalid_argument(store: str, tmp_path: Path) -> None:
    """Leases in memory, SQLite or Redis cannot guard a transaction: InvalidArgumentError says why."""
    url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path / 'l.db'}", "redis": REDIS_URL}[store]
    if store == "redis":
        require_server(REDIS_URL)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'data.db'}")
    prefix = f"g{uuid.uuid4().hex[:10]}:"
    try:
        with LockService(url, prefix=prefix) as service, service.lock("job") as lease:
            with engine.connect() as conn, pytest.raises(InvalidArgumentError, match="needs a PostgreSQL"):
                lease.guard(conn)
            assert lease.held
    finally:
        engine.dispose()
        if store == "redis":
            delete_redis_keys(prefix)
