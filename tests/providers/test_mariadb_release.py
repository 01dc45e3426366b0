"""MariaDB: a release that writes a completion record costs no extra round trip (issue 10).

The DELETE, the tidy-up of our own expired row and the record go to the server as one batch
of statements in the release's transaction. Counted here as commands the driver sends (a
count, not a timing); the time is in ``benchmarks/``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import Completion, Grant
from celery_exclusive.providers.sql import SqlLockProvider
from tests.providers.test_sql_provider import Db, _database


@pytest.fixture
def maria(tmp_path: Path) -> Iterator[Db]:
    yield from _database("mariadb", tmp_path)


def _commands(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import pymysql.connections

    sent: list[str] = []
    original = pymysql.connections.Connection._execute_command

    def counted(self: Any, command: int, sql: Any) -> Any:
        sent.append(str(sql)[:40])
        return original(self, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counted)
    return sent


def test_release_with_a_record_sends_as_many_commands_as_without(
    maria: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = maria.provider()
    try:
        provider.acquire("warm", "t", 5, 10, "{}")
        provider.release("warm", "t", Completion("w", "success", 0, 60))
        sent = _commands(monkeypatch)
        counts = []
        for i, record in enumerate([None, Completion("id", "success", 0, 60)] * 8):
            key = f"k{i}"
            assert isinstance(provider.acquire(key, "t", 5, 10, "{}"), Grant)
            sent.clear()
            assert provider.release(key, "t", record) is True
            counts.append(len(sent))
        plain, with_record = set(counts[0::2]), set(counts[1::2])
        assert plain == with_record, (plain, with_record)  # the prune batch included
        assert provider.completion("k1", "id") is not None  # the batch was committed
        assert provider.peek("k1") is None
        # Not owned any more (expired and taken by nobody): False, the record still written.
        provider.acquire("gone", "t", 0.05, 10, "{}")
        import time

        time.sleep(0.2)
        assert provider.release("gone", "t", Completion("late", "failure", 1, 60)) is False
        assert provider.completion("gone", "late") is not None
        assert "gone" not in maria.rows()  # our own expired row was tidied away
    finally:
        provider.close()


def test_a_failing_record_write_rolls_the_release_back_as_a_backend_error(maria: Db) -> None:
    provider = maria.provider()
    try:
        provider.acquire("k", "t", 30, 60, "{}")
        engine = sa.create_engine(maria.url)
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {maria.table}_done MODIFY outcome VARCHAR(2) NOT NULL"))
        engine.dispose()
        with pytest.raises(BackendError):
            provider.release("k", "t", Completion(f"id{uuid.uuid4().hex}", "success", 0, 60))
        assert provider.peek("k") is not None  # one transaction: the DELETE was rolled back too
    finally:
        provider.close()


def test_a_caller_engine_without_multi_statements_still_releases(maria: Db) -> None:
    engine = sa.create_engine(maria.url, isolation_level="READ COMMITTED")
    provider = SqlLockProvider(engine, table=maria.table)
    try:
        provider.acquire("k", "t", 30, 60, "{}")
        assert provider.release("k", "t", Completion("id", "success", 0, 60)) is True
        assert provider.completion("k", "id") is not None
    finally:
        provider.close()
        engine.dispose()


def test_a_semaphore_acquire_is_two_batches_and_a_commit(maria: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    """acquire_any (limit=3) sends one batch to read every slot (UPDATE of the fence counter,
    SELECT) and one to write the free one (INSERT, SELECT of the fence), then COMMIT, whatever
    the limit; refused, only the read (and the pool's ROLLBACK). Counted as commands the
    driver sends; each slot keeps its own fence."""

    def verbs() -> list[str]:
        return [s.removeprefix('b"').removeprefix("b'").split()[0].upper() for s in sent]

    provider = maria.provider()
    keys = ["sem", "{sem}#2", "{sem}#3"]
    try:
        provider.acquire_any(["warm", "{warm}#2"], "w", 5, 10, "{}")
        sent = _commands(monkeypatch)
        granted = []
        for i in range(3):
            sent.clear()
            answer = provider.acquire_any(keys, f"t{i}", 30, 60, "{}")
            assert isinstance(answer, tuple)
            assert answer[0] == i
            granted.append(answer[1].fence)
            assert verbs() == ["UPDATE", "INSERT", "COMMIT", "ROLLBACK"], sent
        assert granted == sorted(set(granted))
        sent.clear()
        held = provider.acquire_any(keys, "other", 30, 60, "{}")
        assert not isinstance(held, tuple)
        assert held.holder is not None
        assert held.holder.token == "t0"
        assert verbs() == ["UPDATE", "ROLLBACK"], sent
        assert sorted(maria.rows()) == sorted(["warm", *keys])
    finally:
        provider.close()


def test_a_marker_unless_is_two_batches_and_a_commit(maria: Db, monkeypatch: pytest.MonkeyPatch) -> None:
    """acquire_unless (a dedupe queued marker unless the run's key is held) sends what
    acquire_any sends: one batch reading both rows after the fence counter's bump, one
    writing the marker (a dead marker row deleted in it), then COMMIT; refused (by the run or
    by a live marker), only the read. Fewer commands than a plain acquire (bump, select,
    fence, insert and the commit)."""

    def verbs() -> list[str]:
        return [s.removeprefix('b"').removeprefix("b'").split()[0].upper() for s in sent]

    provider = maria.provider()
    try:
        provider.acquire_unless("warm#queued", "w", 5, "{}", blocker="warm")
        sent = _commands(monkeypatch)
        assert isinstance(provider.acquire_unless("job#queued", "a", 30, "{}", blocker="job"), Grant)
        assert verbs() == ["UPDATE", "INSERT", "COMMIT", "ROLLBACK"], sent
        sent.clear()
        queued = provider.acquire_unless("job#queued", "b", 30, "{}", blocker="job")
        assert not isinstance(queued, Grant)
        assert queued.holder is not None
        assert queued.holder.token == "a"
        assert verbs() == ["UPDATE", "ROLLBACK"], sent
        assert provider.release("job#queued", "a")
        assert isinstance(provider.acquire("job", "run", 30, 60, "{}"), Grant)
        sent.clear()
        running = provider.acquire_unless("job#queued", "c", 30, "{}", blocker="job")
        assert not isinstance(running, Grant)
        assert running.holder is not None
        assert (running.holder.key, running.holder.token) == ("job", "run")
        assert verbs() == ["UPDATE", "ROLLBACK"], sent
        assert provider.release("job", "run")
        provider.acquire_unless("dead#queued", "old", 0.05, "{}", blocker="dead")
        import time

        time.sleep(0.2)
        sent.clear()
        assert isinstance(provider.acquire_unless("dead#queued", "new", 30, "{}", blocker="dead"), Grant)
        assert verbs() == ["UPDATE", "DELETE", "COMMIT", "ROLLBACK"], sent
        sent.clear()
        provider.acquire("plain", "p", 30, 60, "{}")
        assert len(sent) > 4, sent  # the plain acquire, for comparison
    finally:
        provider.close()
