"""SQL lock store on SQLite and MariaDB/MySQL, via SQLAlchemy (PostgreSQL: see ``postgres.py``).

Leases are rows of one table (see :mod:`._sql_common` for the schema, shared with the
PostgreSQL store). Every time comparison uses the database server's clock; SQLite, which
has none, uses the machine's boot clock (see ``_sqlite.LeaseClock``). Fences come from the
one-row table ``<table>_fence``, bumped first in every acquire, which serialises acquirers.
Each operation is one transaction (``_transact``, run by ``_sql_transactions.Transactions``),
retried on MySQL's deadlock errors.

Completion records live in ``<table>_done``: the check is one more column of statements the
acquire runs anyway, and the write one more statement in the release's transaction.

The provider's collaborators, private modules: the statement tables (``_sql_statements``),
the acquire attempts (``_sql_acquire``), MariaDB's multi-statement batches (``_sql_batch``),
the transaction runner (``_sql_transactions``) and SQLite's clock and fork gate (``_sqlite``).

``SqlLockProvider`` is also the historical name of every SQL store: given a PostgreSQL URL
or engine it builds :class:`~celery_exclusive.providers.postgres.PostgresLockProvider`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers import _deadline
from celery_exclusive.providers._sql_acquire import Acquires, done_of
from celery_exclusive.providers._sql_batch import Batches
from celery_exclusive.providers._sql_common import (
    INHERITED,
    SqlStore,
    check_sweep,
    create_counter,
    like_pattern,
    lock_table,
    prune_suffix,
    record_params,
)
from celery_exclusive.providers._sql_statements import generic_statements, generic_sweep_statements
from celery_exclusive.providers._sql_transactions import Transactions, error_code
from celery_exclusive.providers._sqlite import (
    FORK_GATE,
    ForkGate,
    LeaseClock,
    LocalWaiters,
    WaiterMarks,
    busy_timeout,
    check_version,
)
from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    Completion,
    Diagnosis,
    Done,
    Grant,
    Held,
    RefreshRequest,
)

__all__ = ["SqlLockProvider", "lock_table"]

_T = TypeVar("_T")
_Scope = contextlib.AbstractContextManager[None]
_CHUNK = 500
# Kept importable here for code written against the single SQL module.
_create_counter = create_counter
_generic_statements = generic_statements
_generic_sweep_statements = generic_sweep_statements
_LeaseClock = LeaseClock
_ForkGate = ForkGate
_FORK_GATE = FORK_GATE
_busy_timeout = busy_timeout
_Transactions = Transactions
_code = error_code
_done = done_of


def _is_postgres(engine_or_url: object) -> bool:
    if isinstance(engine_or_url, str):
        backend = engine_or_url.partition("://")[0].lower().partition("+")[0]
        return backend in ("postgresql", "postgres")
    return isinstance(engine_or_url, Engine) and engine_or_url.dialect.name == "postgresql"


class SqlLockProvider(LocalWaiters, SqlStore):
    """Leases in an SQL table; see the module docstring. Thread-safe and fork-safe.

    ``SqlLockProvider(url_or_engine)`` of a PostgreSQL URL or engine returns a
    :class:`~celery_exclusive.providers.postgres.PostgresLockProvider`, as does
    ``SqlLockProvider.from_url``, and ``isinstance(that, SqlLockProvider)`` is true.
    """

    _DIALECTS = ("sqlite", "mysql", "mariadb")

    def __new__(
        cls,
        engine_or_url: Engine | str,
        *,
        table: str = "cache_entries",
        create_table: bool = True,
        pgbouncer: bool = False,
    ) -> SqlLockProvider:
        # The signature repeats SqlStore.__init__'s, so type checkers check calls against it.
        if cls is SqlLockProvider and _is_postgres(engine_or_url):
            from celery_exclusive.providers.postgres import PostgresLockProvider

            built = PostgresLockProvider(
                engine_or_url, table=table, create_table=create_table, pgbouncer=pgbouncer
            )
            return cast(SqlLockProvider, built)  # an instance by __subclasshook__; __init__ is not run again
        return super().__new__(cls)

    @classmethod
    def __subclasshook__(cls, subclass: type) -> Any:
        # The PostgreSQL store counts as an SqlLockProvider, the name it was built by.
        if cls is SqlLockProvider and issubclass(subclass, SqlStore):
            return True
        return NotImplemented

    def _bound_schema_call(self, conn: Connection, end: float) -> None:
        # The fence row is a write: on SQLite, wait for another connection's write lock only
        # until the deadline (SQLite's own busy timeout is 30 s).
        if conn.dialect.name == "sqlite":
            busy_timeout(conn, max(end - time.monotonic(), 0.001))

    def _setup(self, *, pgbouncer: bool) -> None:
        sqlite = self._engine.dialect.name == "sqlite"
        if sqlite:
            check_version(self._engine.dialect)
        self._sql = generic_statements(self._engine.dialect, self.table.name)
        self._sql.update(generic_sweep_statements(self._engine.dialect, self.table.name))
        self._tx = Transactions(self._engine, self._sql)
        #: The pools close() replaced (see close).
        self._disposed: list[Any] = []
        self._batches = Batches(self._engine, self._sql)
        self._acquires = Acquires(self._sql, self._tx.now, self._batches)
        if self._owns_engine and self._engine.dialect.name != "sqlite":
            event.listen(self._engine, "do_connect", _deadline.bounded_connect)
        self._clock = self._tx.clock
        self._marks = WaiterMarks.of(self._engine.url.database) if sqlite else None

    # -- the LockProvider operations -------------------------------------------------

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
    ) -> Grant | Held | Done:
        granted = float(min(ttl, max_lifetime))
        params = {"key": key, "token": token, "ttl": granted, "life": float(max_lifetime), "holder": holder}
        if task_id is not None and not self._records_on(timeout):
            task_id = None
        return self._transact(
            "acquire", lambda conn: self._acquires.one(conn, params, granted, task_id), timeout
        )

    def acquire_any(
        self,
        keys: Sequence[str],
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Grant] | Held:
        """A semaphore's first free slot in one transaction (``AcquiresAny``): the acquire of
        :meth:`acquire` over every slot at once, one read of all the slot rows instead of one
        transaction per slot; a refused attempt commits nothing."""
        granted = float(min(ttl, max_lifetime))
        params = {"token": token, "ttl": granted, "life": float(max_lifetime), "holder": holder}
        return self._transact(
            "acquire", lambda conn: self._acquires.first_free(conn, keys, params, granted), timeout
        )

    def acquire_unless(
        self, key: str, token: str, ttl: float, holder: str, *, blocker: str, timeout: float | None = None
    ) -> Grant | Held:
        """``key`` unless ``blocker`` is live (``AcquiresUnless``) in one transaction (see
        ``Acquires.unless``: two batches and the commit on MariaDB/MySQL); refused, it commits nothing."""
        params = {"token": token, "ttl": float(ttl), "life": float(ttl), "holder": holder}
        return self._transact(
            "acquire", lambda conn: self._acquires.unless(conn, key, blocker, params, float(ttl)), timeout
        )

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        wanted = {(r.key, r.token): float(r.ttl) for r in requests}  # a repeated request: the last ttl wins
        if not wanted:
            return []
        answers: dict[tuple[str, str], float] = {}
        self._transact("refresh", lambda conn: self._refresh_in(conn, wanted, answers), timeout)
        return [answers.get((r.key, r.token)) for r in requests]

    def _refresh_in(
        self, conn: Connection, wanted: dict[tuple[str, str], float], answers: dict[tuple[str, str], float]
    ) -> None:
        pairs = sorted(wanted)  # a stable lock order across concurrent refreshers
        now = self._tx.now(conn)  # one instant for both statements on SQLite
        conn.execute(
            self._sql["refresh"], [{"key": k, "token": t, "ttl": wanted[(k, t)], **now} for k, t in pairs]
        )
        keys = sorted({k for k, _ in pairs})
        for start in range(0, len(keys), _CHUNK):
            for key, value, remaining, short in conn.execute(
                self._sql["remaining"], {"keys": keys[start : start + _CHUNK], **now}
            ):
                if (key, value) in wanted:
                    ttl = wanted[(key, value)]
                    # Short of the hard deadline: the store granted exactly ttl from the
                    # refresh's own instant, however late this read comes.
                    answers[(key, value)] = ttl if short else min(float(remaining), ttl)
        conn.commit()

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        params: dict[str, Any] = {"key": key, "token": token}
        if completion is not None and not self._records_on(timeout):
            completion = None
        if completion is not None:
            params.update(record_params(completion))

        def attempt(conn: Connection) -> bool:
            params.update(self._tx.now(conn))
            if completion is not None and self._batches.usable(conn):
                # The DELETE, the tidy-up of our own expired row, the record (and one in
                # _PRUNE_EVERY times the prune): one round trip in the same transaction.
                names = ("release_live", "release_any", "done_put")
                owned = self._batches.run(conn, names + _prune(completion), params)[0][0] == 1
                conn.commit()
                return owned
            owned = conn.execute(self._sql["release_live"], params).rowcount == 1
            if not owned:
                conn.execute(self._sql["release_any"], params)  # our own expired row: tidy it away
            if completion is not None:  # same transaction, so no extra commit
                conn.execute(self._sql["done_put"], params)
                for name in _prune(completion):
                    conn.execute(self._sql[name], params)
            conn.commit()
            return owned

        return self._transact("release", attempt, timeout)

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        if not self._records_on(timeout):
            return False
        params: dict[str, Any] = {"key": key, "task_id": task_id}

        def attempt(conn: Connection) -> bool:
            params.update(self._tx.now(conn))
            found = conn.execute(self._sql["done_get"], params).first() is not None
            conn.execute(self._sql["done_forget"], params)
            conn.commit()
            return found

        return self._transact("forget a record", attempt, timeout)

    def sweep(self, prefix: str, limit: int = SWEEP_LIMIT, *, timeout: float | None = None) -> int:
        """Delete up to ``limit`` dead leases and ``limit`` expired records under ``prefix``
        in one transaction (see ``Sweeps.sweep``); the rows deleted."""
        params: dict[str, Any] = {
            "prefix": check_sweep(prefix, limit),
            "pattern": like_pattern(prefix),
            "limit": int(limit),
        }
        tables = ("leases", "done") if self._records_on(timeout) else ("leases",)

        def attempt(conn: Connection) -> int:
            params.update(self._tx.now(conn))
            removed = sum(
                _sweep_table(conn, self._sql, table, params, self._clock is None) for table in tables
            )
            conn.commit()
            return removed

        return self._transact("sweep", attempt, timeout)

    @property
    def supports_guard(self) -> bool:
        """False: :meth:`guard` needs PostgreSQL (see ``PostgresLockProvider.guard``)."""
        return False

    def guard(self, connection: Any, key: str, token: str, fence: int) -> None:
        """PostgreSQL only: always raises :class:`InvalidArgumentError` here (SQLite and
        MariaDB/MySQL leases cannot fence writes inside the caller's transaction)."""
        raise InvalidArgumentError(
            f"guard() needs a PostgreSQL lock store; this one is {self._engine.dialect.name}, "
            "whose leases cannot fence writes inside your transaction"
        )

    def close(self) -> None:
        """Dispose of the engine's connections if this provider created the engine; each
        close again (a call under way at the first one closes again when it ends) disposes
        of the pools of the earlier closes too: a connection checked out across a close is
        given back to the pool it came from, which ``dispose()`` had already replaced."""
        self._closed = True
        if self._owns_engine:
            with self._tx.gate():
                self._disposed.append(self._engine.pool)
                self._engine.dispose()
                for pool in self._disposed:
                    pool.dispose()

    def diagnose(self, *, timeout: float | None = None) -> list[Diagnosis]:
        """Schema presence, the lease clock (SQLite) or server clock vs this machine's, and
        a read-only server (MariaDB/MySQL). With ``timeout``, a store that does not answer
        by then is a failed ``connect`` finding."""
        findings: list[Diagnosis] = []
        try:
            with self._tx.gate(), self._connected(timeout) as conn:
                exists = self._schema_findings(conn, findings)
                findings.append(_clock_finding(self._clock, conn, self._sql, exists))
                if self._clock is None:  # MariaDB/MySQL
                    read_only = bool(conn.execute(sa.text("SELECT @@read_only")).scalar_one())
                    findings.append(
                        Diagnosis("writable", "fail" if read_only else "ok", f"read-only: {read_only}")
                    )
        except sa_exc.SQLAlchemyError as exc:
            findings.append(Diagnosis("connect", "fail", str(self._error("connect", exc))))
        return findings

    # -- plumbing --------------------------------------------------------------------

    def _session(self) -> contextlib.AbstractContextManager[Any]:
        return self._tx.session()

    def _read(self, op: str, statement: str, params: dict[str, Any], timeout: float | None) -> list[Any]:
        """The rows of one read-only statement."""
        sql = self._sql[statement]

        def read(conn: Connection) -> list[Any]:
            conn.execution_options(ce_read=True)  # SQLite: a deferred transaction (_sqlite_begin)
            return list(conn.execute(sql, {**params, **self._tx.now(conn)}))

        return self._transact(op, read, timeout)

    def _transact(self, op: str, work: Callable[[Connection], _T], timeout: float | None = None) -> _T:
        """Run ``work`` in a transaction (it commits; otherwise rolled back), retrying
        deadlocks, within ``timeout`` seconds (see ``Transactions.run``)."""
        self._ensure_schema(timeout)
        if timeout is None:
            return self._tx.run(self._translated(op), work)
        failed = f"SQL lock store {self._masked} failed to {op}"
        return self._tx.run(self._translated(op), work, timeout, failed)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._tx.after_fork()
        INHERITED.append(self._disposed)  # the parent's connections: never closed here
        self._disposed = []


def _sweep_table(
    conn: Connection, sql: dict[str, sa.TextClause], table: str, params: dict[str, Any], find: bool
) -> int:
    """Sweep ``table`` (``leases`` or ``done``) in ``conn``'s transaction; the rows deleted.
    ``find`` (MariaDB/MySQL): read the candidates' keys first (see ``generic_sweep_statements``);
    SQLite deletes in one statement."""
    if not find:
        return int(conn.execute(sql[f"sweep_{table}"], params).rowcount)
    keys = [
        row[0] for row in conn.execute(sql["sweep_find" if table == "leases" else "sweep_find_done"], params)
    ]
    return int(conn.execute(sql[f"sweep_{table}"], {**params, "keys": keys}).rowcount) if keys else 0


def _prune(completion: Completion) -> tuple[str, ...]:
    """The prune statement when this release is one of the ``_PRUNE_EVERY`` that prune."""
    return ("done_prune",) if prune_suffix(completion) else ()


def _clock_finding(
    clock: LeaseClock | None, conn: Connection, sql: dict[str, sa.TextClause], exists: bool
) -> Diagnosis:
    """The lease clock (SQLite) or the server's clock against this machine's wall clock."""
    if clock is not None:
        if exists:
            clock.setup(conn, sql)
        skew = clock.seconds() - time.time()
        kind = "boot clock" if clock.anchor is not None else "wall clock"
        detail = f"lease clock ({kind}) is {skew:+.3f}s from this machine's wall clock"
    else:
        skew = float(conn.execute(sql["now"]).scalar_one()) - time.time()
        detail = f"server clock is {skew:+.3f}s from ours"
    return Diagnosis("clock", "ok" if abs(skew) < 2 else "warn", detail)
