"""How the PostgreSQL store sends its statements, chosen once when the provider is built.

:class:`DirectExecutor` (psycopg 3): statements on connections the provider keeps out of
the pool (providers/_kept.py), acquire and release through the libpq runner (_libpq.py),
per-call deadlines (_deadline.py). :class:`PooledExecutor` (any other driver): the same
statements through SQLAlchemy's pool. Driver errors are re-raised for the provider to
translate.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from celery_exclusive.errors import BackendError
from celery_exclusive.providers import _deadline, _libpq
from celery_exclusive.providers._kept import KeptConnections
from celery_exclusive.providers._sql_common import INHERITED, Rows

_monotonic = time.monotonic  # one global read per call, not a global and an attribute
#: The hot statements sent through libpq directly, with their result column types.
LIBPQ_COLUMNS = {
    "acquire": "bttiffft",
    "acquire_once": "bttiffft",
    "acquire_any": "tittiffft",
    "acquire_unless": "tttiffft",
    "acquire_unless_snapshot": "tttiffft",
    "take_over": "bttiffft",
    "release": "i",
    "release_done": "i",
    "release_done_prune": "i",
}
#: The statements whose one-row grant (first column true) is answered as its fence alone
#: (column 3, an int): the acquire statements set nothing else in a grant's row
#: (providers/_pg_sql.py), and the provider reads nothing else of it.
LIBPQ_GRANTS = {"acquire": 3, "acquire_once": 3}
#: Which of the server sessions given by pid still exist (:meth:`DirectExecutor.settled`).
ALIVE = "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%(pids)s)"
#: Most dropped sessions remembered for it (the oldest forgotten first): a process whose
#: calls keep timing out, and never retries a release, does not grow the list forever.
ABANDONED_MAX = 256
#: Connections the direct executor keeps for itself, out of the pool (more concurrent
#: callers than this use the pool's, which then bounds them).
KEEP = 4


class PooledExecutor:
    """Statements through SQLAlchemy's pool (``text()``): PostgreSQL drivers other than psycopg 3.

    ``timeout`` is not enforced here: the driver's own network timeouts apply."""

    kept: KeptConnections[Any] | None = None

    def __init__(self, engine: Engine, sql: dict[str, str]) -> None:
        self._engine = engine
        self._texts = {op: sa.text(text) for op, text in sql.items()}
        self.errors: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError,)

    def run(self, op: str, params: dict[str, Any], timeout: float | None) -> Rows:
        with self._engine.connect() as conn:
            rows = [tuple(row) for row in conn.execute(self._texts[op], params)]
            conn.commit()
        return rows

    def close(self, *, final: bool = False) -> None:
        return None

    def settled(self, timeout: float | None) -> bool:
        """No session of this executor's is tracked (the driver's own timeouts apply)."""
        return True


class DirectExecutor:
    """Statements on psycopg 3 connections: acquire and release through the libpq runner,
    the others through psycopg's ``execute``; kept connections (for an engine the provider
    built), per-call deadlines. Driver errors are re-raised for the provider to translate,
    after the connection they happened on was put away."""

    def __init__(
        self,
        engine: Engine,
        psycopg_sql: dict[str, str],
        sql: dict[str, str],
        *,
        keep: bool,
        prepare: bool,
        masked: str,
        track: bool = True,
    ) -> None:
        import psycopg

        self._engine = engine
        self._sql = {**psycopg_sql, "alive": ALIVE}
        # Backend pids of the sessions dropped mid-statement (_abandon), which the server may
        # still be executing (a stalled disk, a stopped backend): see settled(). Not tracked
        # behind PgBouncer (``track`` False), whose backend pid is not the server's.
        self._track = track
        self.abandoned: list[int] = []
        self._abandoned_mutex = threading.Lock()
        self._masked = masked
        # A forked child never closes its parent's connections (psycopg's close sends libpq's
        # Terminate, which would end the parent's session): they are only kept referenced.
        self.kept: KeptConnections[Any] | None = (
            KeptConnections(KEEP, on_fork=INHERITED.extend) if keep else None
        )
        self.runner = _libpq.Runner(prepare=prepare)
        self.statements = _libpq.statements(sql, LIBPQ_COLUMNS, LIBPQ_GRANTS)
        self.errors: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError, psycopg.Error)
        self._broken: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)

    def run(self, op: str, params: dict[str, Any], timeout: float | None) -> _libpq.Answer:
        """One statement, autocommit, on a kept or pooled connection; its rows (a grant row
        of a statement in :data:`LIBPQ_GRANTS`: its fence, an int).

        With ``timeout`` the call gives up after about that long: connecting is bounded by
        ``connect_timeout`` (whole seconds, at least 2); acquire and release by the libpq
        runner's own wait for the reply (_libpq.py), the other statements by
        :mod:`._deadline`'s watchdog, which shuts the socket down; the connection is dropped."""
        hot = self.statements.get(op)
        if hot is None:
            return self._run_cursor(op, params, timeout)
        return self.run_text(op, _libpq.utf8_text(hot.values(params)), timeout)

    def run_text(self, op: str, values: Sequence[bytes | None], timeout: float | None) -> _libpq.Answer:
        """:meth:`run` of a libpq statement (``statements``) whose parameters the caller
        made: UTF-8 text in the statement's order (``statements[op].params``), None as NULL
        (as :func:`._libpq.utf8_text` makes them); the provider's acquire and release skip
        the parameter mapping that way."""
        hot = self.statements[op]
        if timeout is None:
            now = end = None
        else:
            now = _monotonic()
            end = now + timeout
        kept = self.kept
        taken = None if kept is None else kept.take()  # _connection's first step inline
        if taken is not None:
            fairy, dbapi = None, taken[0]
        else:
            fairy, dbapi = self._connection(timeout)
        try:
            rows = self.runner.run_text(dbapi, hot, values, end)
            # A pooled connection of an engine the caller built without autocommit: commit
            # what psycopg began. The session's transaction status first (a C getter;
            # psycopg's ``autocommit`` is a Python property): idle, there is nothing to
            # commit (psycopg's commit() returns then too), as after every statement the
            # runner sends on its own. A kept connection is in autocommit (see keep()).
            if fairy is not None and dbapi.pgconn.transaction_status and not dbapi.autocommit:
                dbapi.commit()
        except _libpq.TooSlow:
            raise self._too_slow(fairy, dbapi, op, timeout or 0.0) from None
        except self.errors as exc:
            self._failed(fairy, dbapi, exc)
            raise
        except BaseException:
            self._abandon(fairy, dbapi)  # interrupted mid-protocol: the connection's state is unknown
            raise
        # _put_back's usual case inline: a kept connection goes back, its last use the call's
        # start (no second clock read: nothing reads a PostgreSQL connection's last use).
        if fairy is None and kept is not None and kept.give(dbapi, now):
            return rows
        self._put_back(fairy, dbapi)
        return rows

    def _run_cursor(self, op: str, params: dict[str, Any], timeout: float | None) -> Rows:
        """:meth:`run` for a statement sent through psycopg's ``execute`` (the watchdog's
        deadline)."""
        end = None if timeout is None else time.monotonic() + timeout
        fairy, dbapi = self._connection(timeout)
        # Armed and disarmed directly, not through _deadline.watch's context manager;
        # disarmed before a failure is handled, so the watchdog never shuts down a
        # descriptor the handling closed and the OS reused.
        ticket, watch = (None, None) if end is None else _deadline.arm(dbapi.pgconn.socket, end)
        try:
            try:
                rows: Rows = dbapi.execute(self._sql[op], params).fetchall()
                if not dbapi.autocommit:
                    dbapi.commit()
            finally:
                if ticket is not None:
                    _deadline.disarm(ticket)
        except self.errors as exc:
            if watch is not None and watch.fired:
                raise self._too_slow(fairy, dbapi, op, watch.timeout) from exc
            self._failed(fairy, dbapi, exc)
            raise
        except BaseException:
            self._abandon(fairy, dbapi)
            raise
        self._done(fairy, dbapi, op, watch)
        return rows

    def _connection(self, timeout: float | None) -> tuple[Any, Any]:
        """``(None, a kept psycopg connection)``, or ``(pool checkout, its connection)``
        (only a new connection needs the connect budget)."""
        taken = None if self.kept is None else self.kept.take()
        if taken is not None:
            return None, taken[0]
        with _deadline.connect_budget(timeout):
            fairy = self._engine.raw_connection()
        return fairy, fairy.driver_connection

    def _done(self, fairy: Any, dbapi: Any, op: str, watch: _deadline.Watch | None) -> None:
        """After a statement that answered: put its connection away, unless its deadline
        shut the socket just as the answer came (then drop it; the answer stands)."""
        if watch is not None and watch.fired:
            self._too_slow(fairy, dbapi, op, watch.timeout)
        else:
            self._put_back(fairy, dbapi)

    def _put_back(self, fairy: Any, dbapi: Any) -> None:
        """After a statement: keep its connection (detached from the pool while we keep fewer
        than ``KEEP``), or return it to the pool."""
        if fairy is not None and self.kept is not None and self.kept.has_room():
            fairy.detach()  # ours from now on; the pool forgets it
            fairy = None
        if fairy is None:
            self.keep(dbapi)
        else:
            fairy.close()

    def keep(self, dbapi: Any) -> None:
        """Keep an owned connection for the next statement, or close it if full or closed.

        Only a connection in autocommit is kept (every one of the engine a provider builds,
        the only engine whose connections are kept, is): :meth:`run_text` commits nothing on
        a kept connection."""
        if self.kept is None or not dbapi.autocommit or not self.kept.give(dbapi):
            dbapi.close()

    def _abandon(self, fairy: Any, dbapi: Any) -> None:
        """Drop a connection whose statement may still be running on the server (its pid is
        remembered for :meth:`settled`)."""
        if self._track:
            with contextlib.suppress(Exception), self._abandoned_mutex:
                self.abandoned.append(int(dbapi.pgconn.backend_pid))
                if len(self.abandoned) > ABANDONED_MAX:
                    del self.abandoned[0]
        if fairy is None:
            dbapi.close()
        else:
            fairy.invalidate()
            fairy.close()

    def _too_slow(self, fairy: Any, dbapi: Any, op: str, timeout: float) -> BackendError:
        """Drop the connection a call outlived its deadline on; the error to raise. Only this
        call was too slow (a lock wait, a silent network): the other connections fail by their
        own deadlines if they must."""
        self._abandon(fairy, dbapi)
        return BackendError(
            f"SQL lock store {self._masked} failed to {op}: no answer within its {timeout:.3g} s "
            "deadline (connection dropped)"
        )

    def _failed(self, fairy: Any, dbapi: Any, exc: BaseException) -> None:
        """Put away the connection a statement failed on (``fairy`` None: a kept one)."""
        if dbapi.closed:
            # The server or the network dropped it, so likely its idle siblings too (a
            # restart, a failover): recycle every connection made before now, as
            # SQLAlchemy does on a disconnect, instead of each failing one more call.
            self.close()
            if fairy is None:
                self._engine.dispose()
            else:
                self._engine.pool._invalidate(fairy, exc)  # the pool's and this one's
        if fairy is not None:
            # Not invalidated twice (SQLAlchemy warns "Can't invalidate an already-closed
            # connection"): the pool's _invalidate above invalidated it already.
            if fairy.is_valid and (isinstance(exc, self._broken) or not dbapi.autocommit):
                fairy.invalidate(exc)
            fairy.close()
        elif dbapi.closed or isinstance(exc, self._broken):
            dbapi.close()
        else:
            self.keep(dbapi)

    def settled(self, timeout: float | None) -> bool:
        """True once no session this executor dropped mid-statement still exists on the
        server (so none can still record a lease); one query while some were dropped, none
        otherwise. A pid the server reused for another session only delays the answer."""
        with self._abandoned_mutex:
            pids = list(self.abandoned)
        if not pids:
            return True
        alive = {row[0] for row in self._run_cursor("alive", {"pids": pids}, timeout)}
        with self._abandoned_mutex:
            self.abandoned = [pid for pid in self.abandoned if pid in alive or pid not in pids]
        return not alive

    def close(self, *, final: bool = False) -> None:
        """Close every kept connection (``final``: and keep none from now on)."""
        if self.kept is not None:
            for connection in self.kept.close() if final else self.kept.drain():
                with contextlib.suppress(Exception):  # a dead connection still closes locally
                    connection.close()


def detached(engine: Engine) -> Any:
    """A new psycopg connection of ``engine``'s, detached from its pool: the caller's own."""
    fairy = engine.raw_connection()
    connection = fairy.driver_connection
    fairy.detach()
    return connection


def for_engine(
    engine: Engine,
    psycopg_sql: dict[str, str],
    sql: dict[str, str],
    *,
    keep: bool,
    pgbouncer: bool,
    masked: str,
) -> DirectExecutor | PooledExecutor:
    """The executor for ``engine``: direct on psycopg 3 (keeping connections if ``keep``;
    unnamed statements behind PgBouncer), else through SQLAlchemy's pool. ``masked``: the
    URL without its secrets, for errors."""
    if engine.dialect.driver != "psycopg":
        return PooledExecutor(engine, sql)
    return DirectExecutor(
        engine, psycopg_sql, sql, keep=keep, prepare=not pgbouncer, masked=masked, track=not pgbouncer
    )
