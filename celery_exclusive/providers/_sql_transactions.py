"""How the SQLite and MariaDB/MySQL store runs its work: one transaction per call.

Private to :mod:`celery_exclusive.providers.sql`. :class:`Transactions` owns the engine's
use: the SQLite fork gate and lease clock, the in-memory database's one-at-a-time rule,
MySQL's deadlock retries, and each call's deadline (SQLite's busy timeout, the MariaDB
socket watchdog of :mod:`._deadline`).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from celery_exclusive.errors import BackendError
from celery_exclusive.providers import _deadline
from celery_exclusive.providers._sql_common import INHERITED, error_code
from celery_exclusive.providers._sqlite import FORK_GATE, LeaseClock, busy_timeout

__all__ = ["Transactions", "error_code"]

_T = TypeVar("_T")
_RETRYABLE = (1213, 1020)  # MySQL deadlock / "record has changed": nothing was committed
_ATTEMPTS = 5


class Transactions:
    """How the store's work runs: one transaction per call; on SQLite inside the fork gate,
    on the lease clock, and (an in-memory database, one shared connection) one at a time;
    MySQL's deadlocks retried."""

    def __init__(self, engine: Engine, sql: dict[str, sa.TextClause]) -> None:
        self._engine = engine
        self._sql = sql
        sqlite = engine.dialect.name == "sqlite"
        self._memory = sqlite and engine.url.database in (None, "", ":memory:")
        # An in-memory SQLite database is one shared connection: one transaction at a time.
        self._serial: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self._memory else contextlib.nullcontext()
        )
        self.clock = LeaseClock() if sqlite else None
        self.gate: Callable[[], contextlib.AbstractContextManager[Any]] = (
            FORK_GATE.call if sqlite else contextlib.nullcontext
        )

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Held around every use of a connection: the fork gate, then the serial lock."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.gate())
        stack.enter_context(self._serial)
        return stack

    def now(self, conn: Connection) -> dict[str, float]:
        """SQLite: ``{"now": ...}`` on the lease clock, read once the transaction has begun
        (``BEGIN IMMEDIATE``: after any wait for the database). Elsewhere the server's clock
        is used, and this is empty."""
        if self.clock is None:
            return {}
        if not conn.in_transaction():
            conn.begin()
        return {"now": self.clock.julian()}

    def run(
        self,
        translated: contextlib.AbstractContextManager[None],
        work: Callable[[Connection], _T],
        timeout: float | None = None,
        failed: str = "SQL lock store failed",
    ) -> _T:
        """``work(conn)`` in a transaction, driver errors translated by ``translated``.

        With ``timeout`` (seconds) the call ends by about then. SQLite: its busy timeout
        (waiting for another connection's write lock, the one way a SQLite call blocks) is
        lowered to what is left; disk I/O is not bounded. MariaDB/MySQL: connecting is
        bounded by ``connect_timeout`` (whole seconds, at least 2; engines this store built;
        PyMySQL's greeting and login by the time left, see ``_deadline.bounded_connect``)
        and the statements by :mod:`._deadline`'s watchdog, which shuts the socket down at
        the deadline: the connection is dropped and the call raises BackendError. Deadlock
        retries stop at the deadline.
        """
        end = None if timeout is None else time.monotonic() + timeout
        clock = self.clock
        if clock is not None and clock.anchor is None and clock.boot is not None:
            with translated, self.session(), self._engine.connect() as conn:
                if end is not None:  # the anchor is a write: wait for the write lock only that long
                    busy_timeout(conn, max(end - time.monotonic(), 0.001))
                clock.setup(conn, self._sql)
        attempt = 0
        while True:
            attempt += 1
            with translated:
                try:
                    if end is None:
                        with self.session(), self._engine.connect() as conn:
                            if clock is not None:
                                busy_timeout(conn, None)
                            return work(conn)
                    return self._within(work, end, failed)
                except sa_exc.DBAPIError as exc:
                    if attempt >= _ATTEMPTS or error_code(exc) not in _RETRYABLE:
                        raise
                    if end is not None and time.monotonic() >= end:
                        raise
            time.sleep(random.uniform(0.005, 0.02) * attempt)

    def _within(self, work: Callable[[Connection], _T], end: float, failed: str) -> _T:
        """``work(conn)`` by monotonic ``end`` (see :meth:`run`)."""
        with self.session():
            with _deadline.connect_budget(max(end - time.monotonic(), 0.001)):
                conn = self._engine.connect()
            with conn:
                left = max(end - time.monotonic(), 0.001)
                if self.clock is not None:  # SQLite
                    busy_timeout(conn, left)
                    return work(conn)
                sock = getattr(conn.connection.driver_connection, "_sock", None)  # PyMySQL's
                if sock is None:  # another driver: its own timeouts apply
                    return work(conn)
                with _deadline.watch(sock.fileno(), left) as watch:
                    try:
                        answer = work(conn)
                    except sa_exc.DBAPIError as exc:
                        if watch is not None and watch.fired:
                            conn.invalidate(exc)
                            raise BackendError(
                                f"{failed}: no answer within its {left:.3g} s deadline (connection dropped)"
                            ) from exc
                        raise
                if watch is not None and watch.fired:  # answered as its deadline shut the socket
                    conn.invalidate()
                return answer

    def after_fork(self) -> None:
        if self._memory:
            self._serial = threading.RLock()
        if self.clock is not None:
            # Closing an inherited SQLite connection here would drop this process's POSIX
            # locks on the file, those of its new connections included: keep the old pool.
            INHERITED.append(self._engine.pool)
        self._engine.dispose(close=False)
