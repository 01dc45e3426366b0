"""The SQLite and MariaDB/MySQL store's acquire: a key, a semaphore's free slot, a key unless another is held.

Private to :mod:`celery_exclusive.providers.sql`. Each method is one attempt inside a
transaction the caller runs (and retries): it bumps the fence counter first, which
serialises acquirers (no races, no gap-lock deadlocks), reads the row(s), deletes a dead
row, inserts ours, and commits only if it grants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_exclusive.providers._sql_batch import Batches
from celery_exclusive.providers._sql_common import info_of, live
from celery_exclusive.providers.base import CompletionInfo, Done, Grant, Held, LockInfo

__all__ = ["Acquires", "done_of"]


class Acquires:
    """Acquire attempts on the statements ``sql``; ``now(conn)`` gives the parameters of the
    store's clock (see ``Transactions.now``); ``batches`` sends MariaDB's in one round trip."""

    def __init__(
        self,
        sql: dict[str, sa.TextClause],
        now: Callable[[Connection], dict[str, float]],
        batches: Batches,
    ) -> None:
        self._sql = sql
        self._now = now
        self._batches = batches

    def one(
        self, conn: Connection, params: dict[str, Any], granted: float, task_id: str | None
    ) -> Grant | Held | Done:
        """One acquire attempt in ``conn``'s transaction (committed if it grants)."""
        once = task_id is not None
        conn.execute(self._sql["bump"])  # serialises acquirers: no races, no gap-lock deadlocks
        params.update(self._now(conn))
        if once:
            params["task_id"] = task_id
        row = conn.execute(self._sql["select_once" if once else "select"], params).first()
        if row is not None:
            answer = self._existing(conn, row, params, task_id)
            if answer is not None:
                return answer
        found = conn.execute(self._sql["fence_once" if once and row is None else "fence"], params).one()
        if once and row is None and found[1] is not None:
            return done_of(params["key"], str(task_id), found[1])
        fence = int(found[0])
        conn.execute(self._sql["insert"], {**params, "fence": fence})
        conn.commit()
        return Grant(fence, granted)

    def first_free(
        self, conn: Connection, keys: Sequence[str], params: dict[str, Any], granted: float
    ) -> tuple[int, Grant] | Held:
        """One acquire_any attempt in ``conn``'s transaction (committed if it grants). On
        pymysql with multi-statements (MariaDB/MySQL engines built from a URL) its statements
        go as two batches, a read and a write: two round trips and the commit."""
        infos = self._read(conn, keys, params)
        for index, info in enumerate(infos):
            if info is not None and live(info) and info.token == params["token"]:
                return index, Grant(info.fence, info.expires_in)
        free = next((i for i, info in enumerate(infos) if info is None or not live(info)), None)
        if free is None:
            return Held(infos[0])
        return free, self._write(conn, {**params, "key": keys[free]}, infos[free] is not None, granted)

    def unless(
        self, conn: Connection, key: str, blocker: str, params: dict[str, Any], granted: float
    ) -> Grant | Held:
        """One acquire_unless attempt in ``conn``'s transaction (committed if it grants): the
        rows of ``key`` and ``blocker`` read together after the fence counter's bump, which
        every acquire of either key waits for, so both are judged at one instant and neither
        can be granted to anyone else before this commits. Batched as ``first_free``."""
        found, blocking = self._read(conn, (key, blocker), params)
        if blocking is not None and live(blocking):
            return Held(blocking)
        if found is not None and live(found):
            return Grant(found.fence, found.expires_in) if found.token == params["token"] else Held(found)
        return self._write(conn, {**params, "key": key}, found is not None, granted)

    def _read(self, conn: Connection, keys: Sequence[str], params: dict[str, Any]) -> list[LockInfo | None]:
        """The fence counter bumped (serialises acquirers, as in one()), then the rows of
        ``keys`` (locked on MariaDB/MySQL), in ``keys``' order (None: no row): one batch on
        pymysql with multi-statements."""
        params.update(self._now(conn))
        params["keys"] = list(keys)
        if self._batches.usable(conn):
            rows = self._batches.run(conn, ("bump", "select_any"), params)[1][1]
        else:
            conn.execute(self._sql["bump"])
            rows = list(conn.execute(self._sql["select_any"], params))
        found = {str(row[0]): info_of(row[:7]) for row in rows}
        return [found.get(key) for key in keys]

    def _write(self, conn: Connection, slot: dict[str, Any], dead: bool, granted: float) -> Grant:
        """Take ``slot["key"]`` (its ``dead`` row deleted first: its ttl is over) with the fence
        the bump left in the counter, and commit: one batch on pymysql with multi-statements."""
        deleting = ("delete",) if dead else ()
        if self._batches.usable(conn):
            fence = int(self._batches.run(conn, (*deleting, "insert_fenced", "fence"), slot)[-1][1][0][0])
        else:
            for name in deleting:
                conn.execute(self._sql[name], slot)
            fence = int(conn.execute(self._sql["fence"], slot).one()[0])
            conn.execute(self._sql["insert"], {**slot, "fence": fence})
        conn.commit()
        return Grant(fence, granted)

    def _existing(
        self, conn: Connection, row: Sequence[Any], params: dict[str, Any], task_id: str | None
    ) -> Grant | Held | Done | None:
        """What the key's row answers (a record, the holder, our own grant); None once a
        dead row was deleted, for the caller to insert ours."""
        if task_id is not None and row[-1] is not None:
            return done_of(params["key"], task_id, row[-1])
        info = info_of(row[:7])
        if live(info):
            return Grant(info.fence, info.expires_in) if info.token == params["token"] else Held(info)
        conn.execute(self._sql["delete"], params)
        return None


def done_of(key: str, task_id: str, packed: Any) -> Done:
    """Done from the ``outcome|attempt|age|seconds left`` column of an acquire statement."""
    outcome, attempt, age, left = str(packed).split("|")
    return Done(CompletionInfo(key, task_id, outcome, int(attempt), float(age), float(left)))
