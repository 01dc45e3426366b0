"""SQL lock store on SQLite and MariaDB/MySQL, via SQLAlchemy (PostgreSQL: see ``postgres.py``).

Leases are rows of one table (see :mod:`._sql_common` for the schema, shared with the
PostgreSQL store). Every time comparison uses the database server's clock; SQLite, which
has none, uses the machine's boot clock (see ``_LeaseClock``). Fences come from the one-row
table ``<table>_fence``, bumped first in every acquire, which serialises acquirers. Each
operation is one transaction (``_transact``), retried on MySQL's deadlock errors.

Completion records live in ``<table>_done``: the check is one more column of statements the
acquire runs anyway, and the write one more statement in the release's transaction.

``SqlLockProvider`` is also the historical name of every SQL store: given a PostgreSQL URL
or engine it builds :class:`~celery_exclusive.providers.postgres.PostgresLockProvider`.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect, Engine

from celery_exclusive.errors import BackendError, InvalidArgumentError
from celery_exclusive.providers import _deadline
from celery_exclusive.providers._libpq import PLACEHOLDER
from celery_exclusive.providers._sql_common import (
    INHERITED,
    MYSQL_MULTI_STATEMENTS,
    PRUNE_BATCH,
    STALE,
    SqlStore,
    check_sweep,
    create_counter,
    info_of,
    like_pattern,
    live,
    lock_table,
    logger,
    prune_suffix,
    record_params,
)
from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    RefreshRequest,
)

__all__ = ["SqlLockProvider", "lock_table"]

_T = TypeVar("_T")
_Scope = contextlib.AbstractContextManager[None]
_RETRYABLE = (1213, 1020)  # MySQL deadlock / "record has changed": nothing was committed
_ATTEMPTS = 5
_CHUNK = 500
# Kept importable here for code written against the single SQL module.
_create_counter = create_counter


def _generic_statements(dialect: Dialect, name: str) -> dict[str, sa.TextClause]:
    """Every statement of the store on SQLite or MariaDB/MySQL, by operation."""
    q = dialect.identifier_preparer.quote
    t, f, k, v = q(name), q(name + "_fence"), q("key"), q("value")
    if dialect.name == "sqlite":
        # The time comes from Python (:now, a Julian day on the boot clock, see _LeaseClock);
        # stamps are stored as Julian day REALs, which julianday() reads back as they are,
        # as it reads the text stamps of earlier versions (and they read ours).
        least, lock, before = "min", "", "julianday(expires_at) < julianday(deadline)"
        match = f"substr({k}, 1, length(:prefix)) = :prefix"  # LIKE ignores case in SQLite
        t_scan = t

        def secs(c: str) -> str:
            return f"((julianday({c}) - :now) * 86400.0)"

        def stamp(p: str) -> str:
            return f"(:now + {p} / 86400.0)"

        deadline = "julianday(deadline)"
    else:
        now, least, lock, before = "UTC_TIMESTAMP(6)", "LEAST", " FOR UPDATE", "expires_at < deadline"
        # Not through the key index: MariaDB's range for LIKE 'p%' on this PAD SPACE binary
        # collation misses keys whose next character sorts below a space or above U+FFFF.
        match = f"{k} LIKE :pattern ESCAPE '!'"
        t_scan = f"{t} IGNORE INDEX (PRIMARY)"

        def secs(c: str) -> str:
            return f"(TIMESTAMPDIFF(MICROSECOND, {now}, {c}) / 1e6)"

        def stamp(p: str) -> str:
            return f"({now} + INTERVAL ROUND({p} * 1000000) MICROSECOND)"

        deadline = "deadline"

    live = f"{secs('expires_at')} > 0 AND {secs('deadline')} > 0"
    cols = f"{k}, {v}, fence, -{secs('created_at')}, {secs('expires_at')}, {secs('deadline')}, holder"
    sql = {
        "bump": f"UPDATE {f} SET n = n + 1 WHERE id = 1",
        "fence": f"SELECT n FROM {f} WHERE id = 1",
        "select": f"SELECT {cols} FROM {t} WHERE {k} = :key{lock}",
        "select_any": f"SELECT {cols} FROM {t} WHERE {k} IN :keys{lock}",
        "delete": f"DELETE FROM {t} WHERE {k} = :key",
        "insert": f"INSERT INTO {t} ({k}, {v}, expires_at, created_at, deadline, fence, holder) "
        f"VALUES (:key, :token, {stamp(':ttl')}, {stamp('0')}, {stamp(':life')}, :fence, :holder)",
        # insert with the fence read in the statement (for a batch, where the insert cannot
        # wait for the fence's round trip): the counter row this transaction bumped and locked.
        "insert_fenced": f"INSERT INTO {t} ({k}, {v}, expires_at, created_at, deadline, fence, holder) "
        f"SELECT :key, :token, {stamp(':ttl')}, {stamp('0')}, {stamp(':life')}, n, :holder "
        f"FROM {f} WHERE id = 1",
        "refresh": f"UPDATE {t} SET expires_at = {least}({stamp(':ttl')}, {deadline}) "
        f"WHERE {k} = :key AND {v} = :token AND {live}",
        # Whether the refresh stopped short of the hard deadline (it then granted exactly
        # the ttl asked for), read with the row: never inferred from the time left, which
        # shrinks with any delay between the two statements.
        "remaining": f"SELECT {k}, {v}, {secs('expires_at')}, {before} FROM {t} "
        f"WHERE {k} IN :keys AND {live}",
        "release_live": f"DELETE FROM {t} WHERE {k} = :key AND {v} = :token AND {live}",
        "release_any": f"DELETE FROM {t} WHERE {k} = :key AND {v} = :token",
        "peek": f"SELECT {cols} FROM {t} WHERE {k} = :key AND {live}",
        "scan": f"SELECT {cols} FROM {t_scan} WHERE {match} AND {live}",
        "now": "SELECT :now"
        if dialect.name == "sqlite"
        else "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) / 1e6",
    }
    if dialect.name == "sqlite":  # the boot clock's anchor, one row per boot (negative ids)
        sql["anchor_put"] = f"INSERT OR IGNORE INTO {f} (id, n) VALUES (:boot, :base)"
        sql["anchor_get"] = f"SELECT n FROM {f} WHERE id = :boot"
        sql["anchor_gc"] = f"DELETE FROM {f} WHERE id < 0 AND id <> :boot"
    d = q(name + "_done")
    done_cols = f"{k}, task_id, outcome, attempt, -{secs('created_at')}, {secs('expires_at')}"
    d_scan = d if dialect.name == "sqlite" else f"{d} IGNORE INDEX (PRIMARY)"
    # The record check of an acquire, as one more column of a statement it runs anyway:
    # 'outcome|attempt|age|seconds left' of a live record of :task_id, or NULL.
    parts = ["outcome", "attempt", f"-{secs('created_at')}", secs("expires_at")]
    joined = " || '|' || ".join(parts) if dialect.name == "sqlite" else f"CONCAT_WS('|', {', '.join(parts)})"
    record = (
        f"(SELECT {joined} FROM {d} WHERE {k} = :key AND task_id = :task_id AND {secs('expires_at')} > 0)"
    )
    pick = f"{k} = :key AND task_id = :task_id"
    expired = f"expires_at <= {stamp('0')} AND NOT ({pick})"
    sql.update(
        {
            "done_get": f"SELECT {done_cols} FROM {d} WHERE {pick} AND {secs('expires_at')} > 0",
            "done_put": f"REPLACE INTO {d} ({k}, task_id, outcome, attempt, created_at, expires_at) "
            f"VALUES (:key, :task_id, :outcome, :attempt, {stamp('0')}, {stamp(':retain')})",
            # One release in _PRUNE_EVERY also removes expired records (any key), up to
            # PRUNE_BATCH: the table stays small at a fraction of a statement per release.
            "done_prune": f"DELETE FROM {d} WHERE rowid IN (SELECT rowid FROM {d} WHERE {expired} "
            f"ORDER BY expires_at LIMIT {PRUNE_BATCH})"
            if dialect.name == "sqlite"
            else f"DELETE FROM {d} WHERE {expired} ORDER BY expires_at LIMIT {PRUNE_BATCH}",
            "done_list": f"SELECT {done_cols} FROM {d_scan} WHERE {match} AND {secs('expires_at')} > 0",
            "done_forget": f"DELETE FROM {d} WHERE {pick}",
            "select_once": f"SELECT {cols}, {record} FROM {t} WHERE {k} = :key{lock}",
            "fence_once": f"SELECT n, {record} FROM {f} WHERE id = 1",
        }
    )
    texts = {name: sa.text(s) for name, s in sql.items()}
    texts["remaining"] = texts["remaining"].bindparams(sa.bindparam("keys", expanding=True))
    texts["select_any"] = texts["select_any"].bindparams(sa.bindparam("keys", expanding=True))
    return texts


def _generic_sweep_statements(dialect: Dialect, name: str) -> dict[str, sa.TextClause]:
    """The sweep (``Sweeps``) on SQLite or MariaDB/MySQL: dead leases and expired records
    under a prefix, at most ``:limit`` of each, every condition on the store's clock.

    SQLite deletes in one statement per table (the database is locked for writing anyway).
    MariaDB first reads the candidates' keys without locking (a full scan, as ``scan``
    does), then deletes those rows by key with the condition repeated: the DELETE locks
    only them and judges each on its latest committed version, so a row refreshed or taken
    over meanwhile stays. Fences come from ``<table>_fence``, never from the rows.
    """
    q = dialect.identifier_preparer.quote
    t, d, k = q(name), q(name + "_done"), q("key")
    if dialect.name == "sqlite":
        match = f"substr({k}, 1, length(:prefix)) = :prefix"
        dead = (
            "(julianday(expires_at) < :now OR julianday(deadline) < :now "
            f"OR (:now - julianday(created_at)) * 86400.0 > {STALE})"
        )
        texts = {
            "sweep_leases": f"DELETE FROM {t} WHERE rowid IN "
            f"(SELECT rowid FROM {t} WHERE {match} AND {dead} LIMIT :limit)",
            "sweep_done": f"DELETE FROM {d} WHERE rowid IN "
            f"(SELECT rowid FROM {d} WHERE {match} AND julianday(expires_at) < :now LIMIT :limit)",
        }
        return {op: sa.text(text) for op, text in texts.items()}
    now = "UTC_TIMESTAMP(6)"
    match = f"{k} LIKE :pattern ESCAPE '!'"
    dead = f"(expires_at < {now} OR deadline < {now} OR created_at < {now} - INTERVAL {STALE} SECOND)"
    texts = {
        "sweep_find": f"SELECT {k} FROM {t} IGNORE INDEX (PRIMARY) WHERE {match} AND {dead} LIMIT :limit",
        "sweep_leases": f"DELETE FROM {t} WHERE {k} IN :keys AND {dead}",
        "sweep_find_done": f"SELECT DISTINCT {k} FROM {d} IGNORE INDEX (PRIMARY) "
        f"WHERE {match} AND expires_at < {now} LIMIT :limit",
        "sweep_done": f"DELETE FROM {d} WHERE {k} IN :keys AND expires_at < {now} LIMIT :limit",
    }
    out = {op: sa.text(text) for op, text in texts.items()}
    for op in ("sweep_leases", "sweep_done"):
        out[op] = out[op].bindparams(sa.bindparam("keys", expanding=True))
    return out


_UNIX_EPOCH_JD = 2440587.5
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class _LeaseClock:
    """SQLite's lease clock: ``CLOCK_BOOTTIME`` plus a per-boot anchor every process shares.

    The wall clock steps (an operator, NTP at boot, a VM resumed): leases measured on it
    expire early after a step forward and outlive their holder after a step back. The boot
    clock of Linux never steps (NTP only slews it) and is the same for every process of
    the machine, containers included (not across time namespaces, which can offset it).
    The first process of each boot stores ``anchor = wall clock - boot clock`` in the fence
    table (row ``id`` derived from the boot id, negative, so ``id = 1`` stays the counter);
    every process reads it back and measures ``anchor + boot clock``: close to the wall
    clock, so stamps stay readable and comparable with rows of earlier versions, but
    unaffected by any later step. Without a boot clock (not Linux) it is the wall clock.
    """

    def __init__(self) -> None:
        self.boot: int | None = None
        self.anchor: float | None = None
        if hasattr(time, "CLOCK_BOOTTIME"):
            with contextlib.suppress(OSError, ValueError), open(_BOOT_ID, encoding="ascii") as source:
                self.boot = -1 - (uuid.UUID(source.read().strip()).int >> 66)

    def setup(self, conn: Connection, sql: dict[str, sa.TextClause]) -> None:
        """Agree on this boot's anchor through the store (first writer wins), once."""
        if self.boot is None or self.anchor is not None:
            return
        base = round((time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)) * 1e6)
        conn.execute(sql["anchor_put"], {"boot": self.boot, "base": base})
        stored = int(conn.execute(sql["anchor_get"], {"boot": self.boot}).scalar_one())
        conn.execute(sql["anchor_gc"], {"boot": self.boot})
        conn.commit()
        self.anchor = stored / 1e6

    def seconds(self) -> float:
        """Now on the lease clock, in seconds since the Unix epoch (approximately)."""
        if self.boot is None or self.anchor is None:
            return time.time()
        return self.anchor + time.clock_gettime(time.CLOCK_BOOTTIME)

    def julian(self) -> float:
        """Now on the lease clock as a Julian day, SQLite's time format."""
        return _UNIX_EPOCH_JD + self.seconds() / 86400.0


#: How long a fork waits for the SQLite calls in flight (past SQLite's 30 s busy timeout).
_FORK_WAIT = 40.0


class _ForkGate:
    """Holds ``fork()`` back while any thread of this process is inside a SQLite call.

    SQLite keeps process-wide state: its mutexes, and per database file the locks this
    process holds (which every connection of the process to that file shares). A child
    forked mid-call inherits them held, by a thread it does not have: even a brand-new
    connection then hangs, or waits out its busy timeout with "database is locked". So
    every SQLite call of every provider runs inside :meth:`call`, and the at-fork hook
    waits for the calls in flight to end (new ones wait for the fork). A fork from inside
    a call (never done here) does not wait for itself.
    """

    def __init__(self) -> None:
        self._reset()
        self._local = threading.local()

    def _reset(self) -> None:
        self._lock = threading.Lock()  # taken directly on the hot path; the condition's lock
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._forking = False

    def call(self) -> _ForkGate:
        """The gate as a context manager around one SQLite call (re-entrant per thread)."""
        return self

    def __enter__(self) -> None:
        local = self._local
        depth: int = getattr(local, "depth", 0)
        if not depth:
            with self._lock:
                while self._forking:
                    self._cond.wait()
                self._active += 1
        local.depth = depth + 1

    def __exit__(self, *_: object) -> None:
        local = self._local
        local.depth -= 1
        if not local.depth:
            with self._lock:
                self._active -= 1
                if not self._active and self._forking:
                    self._cond.notify_all()

    def before_fork(self) -> None:
        if getattr(self._local, "depth", 0):
            return
        with self._cond:
            self._forking = True
            if not self._cond.wait_for(lambda: not self._active, _FORK_WAIT):
                logger.warning(
                    "fork() went ahead with %d SQLite lock-store call(s) still in flight after %.0f s: "
                    "the child may not be able to use that SQLite database",
                    self._active,
                    _FORK_WAIT,
                )

    def after_fork_in_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def after_fork_in_child(self) -> None:
        self._reset()  # the threads that were waiting or in a call do not exist here


_FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_FORK_GATE.before_fork,
        after_in_parent=_FORK_GATE.after_fork_in_parent,
        after_in_child=_FORK_GATE.after_fork_in_child,
    )


def _is_postgres(engine_or_url: object) -> bool:
    if isinstance(engine_or_url, str):
        backend = engine_or_url.partition("://")[0].lower().partition("+")[0]
        return backend in ("postgresql", "postgres")
    return isinstance(engine_or_url, Engine) and engine_or_url.dialect.name == "postgresql"


class SqlLockProvider(SqlStore):
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

    def _setup(self, *, pgbouncer: bool) -> None:
        self._sql = _generic_statements(self._engine.dialect, self.table.name)
        self._sql.update(_generic_sweep_statements(self._engine.dialect, self.table.name))
        self._tx = _Transactions(self._engine, self._sql)
        self._batches: dict[tuple[str, ...], str] = {}
        if self._owns_engine and self._engine.dialect.name != "sqlite":
            event.listen(self._engine, "do_connect", _deadline.bounded_connect)
        self._clock = self._tx.clock

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
        if task_id is not None and not self._records_on():
            task_id = None
        return self._transact(
            "acquire", lambda conn: self._acquire_in(conn, params, granted, task_id), timeout
        )

    def _acquire_in(
        self, conn: Connection, params: dict[str, Any], granted: float, task_id: str | None
    ) -> Grant | Held | Done:
        """One acquire attempt in ``conn``'s transaction (committed if it grants)."""
        once = task_id is not None
        conn.execute(self._sql["bump"])  # serialises acquirers: no races, no gap-lock deadlocks
        params.update(self._tx.now(conn))
        if once:
            params["task_id"] = task_id
        row = conn.execute(self._sql["select_once" if once else "select"], params).first()
        if row is not None:
            answer = self._existing(conn, row, params, task_id)
            if answer is not None:
                return answer
        found = conn.execute(self._sql["fence_once" if once and row is None else "fence"], params).one()
        if once and row is None and found[1] is not None:
            return _done(params["key"], str(task_id), found[1])
        fence = int(found[0])
        conn.execute(self._sql["insert"], {**params, "fence": fence})
        conn.commit()
        return Grant(fence, granted)

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
        params = {
            "keys": list(keys),
            "token": token,
            "ttl": granted,
            "life": float(max_lifetime),
            "holder": holder,
        }
        return self._transact(
            "acquire", lambda conn: self._acquire_any_in(conn, keys, params, granted), timeout
        )

    def _acquire_any_in(
        self, conn: Connection, keys: Sequence[str], params: dict[str, Any], granted: float
    ) -> tuple[int, Grant] | Held:
        """One acquire_any attempt in ``conn``'s transaction (committed if it grants). On
        pymysql with multi-statements (MariaDB/MySQL engines built from a URL) its statements
        go as two batches, a read and a write: two round trips and the commit."""
        batched = self._batched(conn)
        params.update(self._tx.now(conn))
        if batched:  # bump: serialises acquirers, as in _acquire_in
            rows = self._batch(conn, ("bump", "select_any"), params)[1][1]
        else:
            conn.execute(self._sql["bump"])
            rows = list(conn.execute(self._sql["select_any"], params))
        found = {str(row[0]): info_of(row[:7]) for row in rows}
        infos = [found.get(key) for key in keys]
        for index, info in enumerate(infos):
            if info is not None and live(info) and info.token == params["token"]:
                return index, Grant(info.fence, info.expires_in)
        free = next((i for i, info in enumerate(infos) if info is None or not live(info)), None)
        if free is None:
            return Held(infos[0])
        slot = {**params, "key": keys[free]}
        dead = ("delete",) if infos[free] is not None else ()  # a dead lease: its ttl is over
        if batched:
            fence = int(self._batch(conn, (*dead, "insert_fenced", "fence"), slot)[-1][1][0][0])
        else:
            for name in dead:
                conn.execute(self._sql[name], slot)
            fence = int(conn.execute(self._sql["fence"], params).one()[0])
            conn.execute(self._sql["insert"], {**slot, "fence": fence})
        conn.commit()
        return free, Grant(fence, granted)

    def _existing(
        self, conn: Connection, row: Sequence[Any], params: dict[str, Any], task_id: str | None
    ) -> Grant | Held | Done | None:
        """What the key's row answers (a record, the holder, our own grant); None once a
        dead row was deleted, for the caller to insert ours."""
        if task_id is not None and row[-1] is not None:
            return _done(params["key"], task_id, row[-1])
        info = info_of(row[:7])
        if live(info):
            return Grant(info.fence, info.expires_in) if info.token == params["token"] else Held(info)
        conn.execute(self._sql["delete"], params)
        return None

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
        if completion is not None and not self._records_on():
            completion = None
        if completion is not None:
            params.update(record_params(completion))

        def attempt(conn: Connection) -> bool:
            params.update(self._tx.now(conn))
            if completion is not None and self._batched(conn):
                owned = self._release_batch(conn, params, prune=bool(prune_suffix(completion)))
                conn.commit()
                return owned
            owned = conn.execute(self._sql["release_live"], params).rowcount == 1
            if not owned:
                conn.execute(self._sql["release_any"], params)  # our own expired row: tidy it away
            if completion is not None:  # same transaction, so no extra commit
                conn.execute(self._sql["done_put"], params)
                if prune_suffix(completion):
                    conn.execute(self._sql["done_prune"], params)
            conn.commit()
            return owned

        return self._transact("release", attempt, timeout)

    def _batched(self, conn: Connection) -> bool:
        """Whether ``conn`` (pymysql with multi-statements, as engines built from a URL are)
        can send a record-writing release as one batch."""
        if self._clock is not None or self._engine.dialect.driver != "pymysql":
            return False
        flag = getattr(conn.connection.driver_connection, "client_flag", 0)
        return bool(flag & MYSQL_MULTI_STATEMENTS)

    def _release_batch(self, conn: Connection, params: dict[str, Any], *, prune: bool) -> bool:
        """The release's DELETE, the tidy-up of our own expired row and the completion
        record (and one in _PRUNE_EVERY times the prune) in one round trip, as one batch of
        statements in the release's transaction; True if the lease was still ours."""
        names = ("release_live", "release_any", "done_put") + (("done_prune",) if prune else ())
        return self._batch(conn, names, params)[0][0] == 1

    def _batch(
        self, conn: Connection, names: tuple[str, ...], params: dict[str, Any]
    ) -> list[tuple[int, list[Any]]]:
        """The statements ``names`` in one round trip, as one batch in ``conn``'s transaction
        (:meth:`_batched` must hold); each one's ``(rowcount, rows)``."""
        errors = self._engine.dialect.loaded_dbapi.Error
        batch = self._batches.get(names)
        if batch is None:
            batch = "; ".join(PLACEHOLDER.sub(r"%(\1)s", self._sql[n].text) for n in names)
            self._batches[names] = batch
        if not conn.in_transaction():
            conn.begin()  # so that the caller's commit() commits (pymysql sends nothing here)
        dbapi: Any = conn.connection.driver_connection
        cursor = dbapi.cursor()
        results: list[tuple[int, list[Any]]] = []
        try:
            cursor.execute(batch, params)
            while True:
                results.append((cursor.rowcount, list(cursor.fetchall() or ())))
                if not cursor.nextset():  # an error in a later statement is raised here
                    break
        except errors as exc:
            raise sa_exc.DBAPIError.instance(batch, params, exc, errors) from exc
        finally:
            cursor.close()
        return results

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        if not self._records_on():
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
        tables = ("leases", "done") if self._records_on() else ("leases",)

        def attempt(conn: Connection) -> int:
            params.update(self._tx.now(conn))
            removed = 0
            for table in tables:
                if self._clock is not None:  # SQLite: one statement per table
                    removed += conn.execute(self._sql[f"sweep_{table}"], params).rowcount
                    continue
                find = "sweep_find" if table == "leases" else "sweep_find_done"
                keys = [row[0] for row in conn.execute(self._sql[find], params)]
                if keys:
                    removed += conn.execute(self._sql[f"sweep_{table}"], {**params, "keys": keys}).rowcount
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
        """Dispose of the engine's connections if this provider created the engine."""
        self._closed = True
        if self._owns_engine:
            with self._tx.gate():
                self._engine.dispose()

    def diagnose(self) -> list[Diagnosis]:
        """Schema presence, the lease clock (SQLite) or server clock vs this machine's, and
        a read-only server (MariaDB/MySQL)."""
        findings: list[Diagnosis] = []
        try:
            with self._tx.gate(), self._engine.connect() as conn:
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
        return self._transact(
            op, lambda conn: list(conn.execute(sql, {**params, **self._tx.now(conn)})), timeout
        )

    def _transact(self, op: str, work: Callable[[Connection], _T], timeout: float | None = None) -> _T:
        """Run ``work`` in a transaction (it commits; otherwise rolled back), retrying
        deadlocks, within ``timeout`` seconds (see :meth:`_Transactions.run`)."""
        self._ensure_schema(timeout)
        if timeout is None:
            return self._tx.run(self._translated(op), work)
        failed = f"SQL lock store {self._masked} failed to {op}"
        return self._tx.run(self._translated(op), work, timeout, failed)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._tx.after_fork()


class _Transactions:
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
        self.clock = _LeaseClock() if sqlite else None
        self.gate: Callable[[], contextlib.AbstractContextManager[Any]] = (
            _FORK_GATE.call if sqlite else contextlib.nullcontext
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
        bounded by ``connect_timeout`` (whole seconds, at least 2; engines this store built)
        and the statements by :mod:`._deadline`'s watchdog, which shuts the socket down at
        the deadline: the connection is dropped and the call raises BackendError. Deadlock
        retries stop at the deadline.
        """
        end = None if timeout is None else time.monotonic() + timeout
        clock = self.clock
        if clock is not None and clock.anchor is None and clock.boot is not None:
            with translated, self.session(), self._engine.connect() as conn:
                clock.setup(conn, self._sql)
        attempt = 0
        while True:
            attempt += 1
            with translated:
                try:
                    if end is None:
                        with self.session(), self._engine.connect() as conn:
                            if clock is not None:
                                _busy_timeout(conn, None)
                            return work(conn)
                    return self._within(work, end, failed)
                except sa_exc.DBAPIError as exc:
                    if attempt >= _ATTEMPTS or _code(exc) not in _RETRYABLE:
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
                    _busy_timeout(conn, left)
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


def _busy_timeout(conn: Connection, timeout: float | None) -> None:
    """SQLite's busy timeout on ``conn`` for one call: at most ``timeout`` seconds (rounded
    up to 0.1 s, so a steady deadline sets it once per connection), or the connection's own
    (``timeout`` None: put back if an earlier call lowered it)."""
    info = conn.info  # the pooled connection's, kept across checkouts
    base = info.get("ce_busy_base")
    if base is None:
        if timeout is None:
            return
        dbapi: Any = conn.connection.driver_connection
        base = info["ce_busy_base"] = int(dbapi.execute("PRAGMA busy_timeout").fetchone()[0])
        info["ce_busy"] = base
    wanted = base if timeout is None else min(base, math.ceil(timeout * 10) * 100)
    if info["ce_busy"] != wanted:
        cast(Any, conn.connection.driver_connection).execute(f"PRAGMA busy_timeout = {wanted}")
        info["ce_busy"] = wanted


def _clock_finding(
    clock: _LeaseClock | None, conn: Connection, sql: dict[str, sa.TextClause], exists: bool
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


def _code(exc: sa_exc.DBAPIError) -> Any:
    """The driver's error code (MySQL's number), or None."""
    return getattr(exc.orig, "args", (None,))[0] if exc.orig is not None else None


def _done(key: str, task_id: str, packed: Any) -> Done:
    """Done from the ``outcome|attempt|age|seconds left`` column of an acquire statement."""
    outcome, attempt, age, left = str(packed).split("|")
    return Done(CompletionInfo(key, task_id, outcome, int(attempt), float(age), float(left)))
