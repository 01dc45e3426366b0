"""A PostgreSQL semaphore slot lost between the ``acquire_any`` statement's read and its write.

The statement reads every slot in its snapshot, picks the first absent or dead one, then
waits for that slot's key lock before writing. Here a rival takes the same slot and is
stalled inside its write (a trigger waits on an advisory lock the test holds,
tests/faults/_pg_stall.py) with the key lock held; the late acquirer's snapshot does not see
the rival's row, so it picks that slot and waits for the key lock (seen in ``pg_locks``).
The test then lets the rival commit: the late statement must take nothing (its INSERT ...
ON CONFLICT DO NOTHING finds the rival's row; its take-over UPDATE re-checks the row the
rival revived and skips it), and the provider must try again: the next free slot, or
Held when none is left. Never two holders of a slot, no write by the loser, each slot key's
fences in grant order.

Redis and the other SQL stores have no such window: ``acquire_any.lua`` runs atomically
(nothing else runs on the server between its reads and its writes), and SQLite and MariaDB
take the slot in one transaction that first bumps the fence counter row, which serialises
acquirers (the read of the slots happens under that lock, and only acquirers create or
revive rows); see celery_exclusive/semaphore.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_exclusive.providers.base import Grant, Held
from celery_exclusive.providers.postgres import _text_array
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import POSTGRES_URL
from tests.faults._pg_stall import blocked_by, install_stall, psycopg_dsn, waiting_for_key_lock, waiting_on
from tests.faults.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

KEYS = ["sem", "{sem}#2", "{sem}#3"]


class Race:
    """The rival stalled inside its write of slot 1, the late acquirer waiting for slot 1's key
    lock; :meth:`finish` lets the rival commit and returns both answers."""

    def __init__(self, table: str, keys: list[str], dead: bool) -> None:
        self.dsn = psycopg_dsn(POSTGRES_URL)
        self.table, self.keys = table, keys
        self.gate_id = random.randrange(1, 2**31)
        self.rival = SqlLockProvider(POSTGRES_URL, table=table)
        self.late = SqlLockProvider(POSTGRES_URL, table=table)
        #: (op, rows) of every statement the late acquirer sent.
        self.sent: list[tuple[str, list[tuple[Any, ...]]]] = []
        self.answers: dict[str, Any] = {}
        self.errors: list[BaseException] = []
        self.fences: dict[str, list[tuple[str, int]]] = {key: [] for key in keys}  # per slot key
        assert isinstance(self.rival.acquire("warm", "w", 60, 600, "{}"), Grant)  # creates the table
        if dead:  # slot 1's holder died: its lease ran out
            old = self.rival.acquire_any(keys, "old", 0.05, 600, "{}")
            assert isinstance(old, tuple)
            self.fences[keys[0]].append(("old", old[1].fence))
            time.sleep(0.15)
        install_stall(self.dsn, table, "rival", self.gate_id, "INSERT OR UPDATE")
        run_pg = self.late._run_pg

        def recorded(op: str, params: dict[str, Any], timeout: float | None = None) -> Any:
            rows = run_pg(op, params, timeout)
            self.sent.append((op, rows))
            return rows

        self.late._run_pg = recorded  # type: ignore[method-assign]

    def _thread(self, name: str, call: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                self.answers[name] = call()
            except BaseException as exc:  # pragma: no cover - reported by finish()
                self.errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def run(self) -> tuple[Any, Any]:
        """Stage the race and let it finish: ``(rival's answer, late acquirer's answer)``."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as gate:
            gate.execute("SELECT pg_advisory_lock(%s)", (self.gate_id,))
            rival = self._thread("rival", lambda: self.rival.acquire_any(self.keys, "rival", 60, 600, "{}"))
            assert wait_until(lambda: waiting_on(self.dsn, self.gate_id), 10), (
                "the rival's write never stalled"
            )
            late = self._thread("late", lambda: self.late.acquire_any(self.keys, "late", 60, 600, "{}"))
            assert wait_until(lambda: waiting_for_key_lock(self.dsn, self.table, self.keys[0]), 10), (
                "the late acquirer never waited for slot 1's key lock (it did not pick slot 1?)"
            )
            assert "late" not in self.answers
            gate.execute("SELECT pg_advisory_unlock(%s)", (self.gate_id,))
            rival.join(15)
            late.join(15)
        assert not self.errors, self.errors
        assert not rival.is_alive()
        assert not late.is_alive()
        return self.answers["rival"], self.answers["late"]

    def run_unlocked(self) -> tuple[int, Any]:
        """The window the key lock does not cover: a writer that changes slot 1 without the
        key lock (as a racer that committed just before the late acquirer tried the lock
        would have) and commits only once the late acquirer's write waits for its row.
        ``(that writer's fence, the late acquirer's answer)``."""
        import psycopg

        t, now = self.table, "clock_timestamp()"
        live = f"{now} + interval '60 s', {now}, {now} + interval '600 s', nextval('{t}_fence_seq')"
        with psycopg.connect(self.dsn) as racer:
            if self.fences[self.keys[0]]:  # slot 1 is dead: revive it
                sql = f"UPDATE {t} SET (value, expires_at, created_at, deadline, fence) = ('racer', {live}) "
                found = racer.execute(sql + "WHERE key = %s RETURNING fence", (self.keys[0],)).fetchone()
            else:
                sql = f"INSERT INTO {t} (key, value, expires_at, created_at, deadline, fence, holder) "
                found = racer.execute(
                    sql + f"VALUES (%s, 'racer', {live}, '{{}}') RETURNING fence", (self.keys[0],)
                ).fetchone()
            assert found is not None
            late = self._thread("late", lambda: self.late.acquire_any(self.keys, "late", 60, 600, "{}"))
            assert wait_until(lambda: blocked_by(self.dsn, racer.info.backend_pid), 10), (
                "the late acquirer never waited for the racer's row"
            )
            racer.commit()
            late.join(15)
        assert not self.errors, self.errors
        assert not late.is_alive()
        return int(found[0]), self.answers["late"]

    def rows(self) -> dict[str, tuple[str, int, Any]]:
        """Every slot row now: key -> (value, fence, xmin)."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            found = conn.execute(
                f"SELECT key, value, fence, xmin::text FROM {self.table} WHERE key = ANY(%s)", (self.keys,)
            ).fetchall()
        return {key: (value, fence, xmin) for key, value, fence, xmin in found}

    def close(self) -> None:
        self.rival.close()
        self.late.close()


@pytest.fixture
def race(pg_table: str, request: pytest.FixtureRequest) -> Iterator[Race]:
    keys, dead = request.param
    staged = Race(pg_table, keys, dead)
    try:
        yield staged
    finally:
        staged.close()


def _grant_order_fences_grow(race: Race, holders: dict[str, str]) -> None:
    """Release ``holders`` (slot key -> token) and take each slot again: every slot key's
    fences, in grant order, strictly increase."""
    for key, token in holders.items():
        assert race.rival.release(key, token)
    for key in race.keys:
        again = race.rival.acquire(key, "again", 60, 600, "{}")
        assert isinstance(again, Grant)
        race.fences[key].append(("again", again.fence))
    for key, fences in race.fences.items():
        assert all(a[1] < b[1] for a, b in itertools.pairwise(fences)), f"{key}: {fences}"


@pytest.mark.parametrize(
    "race", [(KEYS, False), (KEYS, True)], ids=["absent-slot", "dead-slot"], indirect=True
)
def test_pg_a_slot_lost_to_a_racing_acquirer_is_retried_on_the_next_free_slot(race: Race) -> None:
    """The late acquirer read slot 1 free (absent, or dead: its holder's lease ran out) and
    lost it to the rival: its first statement takes nothing, and its retry takes slot 2."""
    rival, late = race.run()
    assert rival == (0, Grant(rival[1].fence, 60.0))
    assert late == (1, Grant(late[1].fence, 60.0))
    race.fences[KEYS[0]].append(("rival", rival[1].fence))
    race.fences[KEYS[1]].append(("late", late[1].fence))
    ops = [op for op, _ in race.sent]
    assert ops == ["acquire_any", "acquire_any"], ops
    lost = race.sent[0][1]
    assert all(kind != "g" for kind, *_ in lost), lost  # the first statement took nothing
    assert sorted((kind, index) for kind, index, *_ in lost) == [("f", 1), ("f", 2), ("f", 3)]
    rows = race.rows()
    assert {key: value for key, (value, _, _) in rows.items()} == {KEYS[0]: "rival", KEYS[1]: "late"}
    assert rows[KEYS[0]][1] == rival[1].fence  # the rival's row as it committed it
    _grant_order_fences_grow(race, {KEYS[0]: "rival", KEYS[1]: "late"})


@pytest.mark.parametrize(
    "race", [(KEYS[:2], False), (KEYS[:2], True)], ids=["absent-slot", "dead-slot"], indirect=True
)
def test_pg_a_lost_slot_with_no_other_free_is_reported_held_and_writes_nothing(race: Race) -> None:
    """limit=2, slot 2 held: the late acquirer loses slot 1 to the rival and its retry finds
    both slots live, so it answers Held naming slot 1's holder (the rival), and neither of its
    statements wrote a row (the rows and their xmin are the rival's and slot 2's holder's)."""
    other = race.rival.acquire(KEYS[1], "other", 60, 600, "{}")
    assert isinstance(other, Grant)
    race.fences[KEYS[1]].append(("other", other.fence))
    rival, late = race.run()
    assert rival == (0, Grant(rival[1].fence, 60.0))
    race.fences[KEYS[0]].append(("rival", rival[1].fence))
    committed = race.rows()
    assert isinstance(late, Held)
    assert late.holder is not None
    assert (late.holder.key, late.holder.token) == (KEYS[0], "rival")
    assert [op for op, _ in race.sent] == ["acquire_any", "acquire_any"]
    kinds = [sorted((kind, index) for kind, index, *_ in rows) for _, rows in race.sent]
    assert kinds == [[("f", 1), ("l", 2)], [("l", 1), ("l", 2)]], kinds
    assert race.rows() == committed
    assert {key: value for key, (value, _, _) in committed.items()} == {KEYS[0]: "rival", KEYS[1]: "other"}
    _grant_order_fences_grow(race, {KEYS[0]: "rival", KEYS[1]: "other"})


@pytest.mark.parametrize(
    "race", [(KEYS, False), (KEYS, True)], ids=["absent-slot", "dead-slot"], indirect=True
)
def test_pg_a_slot_changed_after_the_key_lock_was_tried_is_not_taken(race: Race) -> None:
    """The late acquirer got slot 1's key lock at once, but its snapshot predates a write of
    slot 1 still in flight: its INSERT's conflict check (absent) or its UPDATE's re-check of
    the revived row (dead) waits for that write, then takes nothing; the retry takes slot 2."""
    fence, late = race.run_unlocked()
    race.fences[KEYS[0]].append(("racer", fence))
    assert late == (1, Grant(late[1].fence, 60.0))
    race.fences[KEYS[1]].append(("late", late[1].fence))
    assert [op for op, _ in race.sent] == ["acquire_any", "acquire_any"]
    assert all(kind != "g" for kind, *_ in race.sent[0][1])
    rows = race.rows()
    assert {key: value for key, (value, _, _) in rows.items()} == {KEYS[0]: "racer", KEYS[1]: "late"}
    assert rows[KEYS[0]][1] == fence
    _grant_order_fences_grow(race, {KEYS[0]: "racer", KEYS[1]: "late"})


@pytest.mark.parametrize(
    "race", [(KEYS, False), (KEYS, True)], ids=["absent-slot", "dead-slot"], indirect=True
)
def test_pg_the_losing_statement_writes_nothing(race: Race) -> None:
    """The lost statement itself, run in a transaction the test keeps open: no grant row, no
    tuple inserted, updated or deleted (``pg_stat_xact_user_tables``), no fence drawn (the
    sequence's last value is still the rival's fence) and no transaction id (so its commit
    would write no WAL). It waited for the key lock, and the rival's row is as it committed it."""
    import psycopg

    late = psycopg.connect(race.dsn)
    params = {
        "keys": _text_array(tuple(race.keys)),
        "token": "late",
        "ttl": 60.0,
        "life": 600.0,
        "holder": "{}",
    }
    seen: dict[str, Any] = {}

    def lose() -> list[tuple[Any, ...]]:
        rows = late.execute(race.late._psycopg_sql["acquire_any"], params).fetchall()
        seen["tuples"] = late.execute(
            "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_xact_user_tables WHERE relname = %s",
            (race.table,),
        ).fetchone()
        seen["xid"] = late.execute("SELECT txid_current_if_assigned()").fetchone()
        seq, table = f"{race.table}_fence_seq", race.table
        seen["fence drawn since the rival's"] = late.execute(
            f"SELECT last_value - (SELECT fence FROM {table} WHERE key = %s) FROM {seq}",
            (race.keys[0],),
        ).fetchone()
        late.rollback()
        return rows

    race.late.acquire_any = lambda *args, **kwargs: lose()  # type: ignore[method-assign]
    try:
        rival, rows = race.run()
    finally:
        late.close()
    assert rival == (0, Grant(rival[1].fence, 60.0))
    assert sorted((kind, index) for kind, index, *_ in rows) == [("f", 1), ("f", 2), ("f", 3)], rows
    assert seen == {"tuples": (0, 0, 0), "xid": (None,), "fence drawn since the rival's": (0,)}
    assert race.rows()[KEYS[0]][:2] == ("rival", rival[1].fence)
