"""PostgreSQL lock store (first class), via SQLAlchemy and psycopg 3.

Leases are rows of one table (see :mod:`._sql_common` for the schema, shared with the other
SQL stores); every time comparison uses the server's clock. Fences come from the sequence
``<table>_fence_seq``, drawn under a per-key transaction-scoped advisory lock, so one key's
fences grow in commit order.

Each operation is one autocommit statement. How statements are sent is chosen once, when
the provider is built (:class:`_DirectExecutor` or :class:`_PooledExecutor`): with psycopg 3
on a connection the provider keeps (acquire and release as prepared statements through
libpq directly, see ``_libpq.py``), and a contended acquire writes nothing (no transaction
id, no WAL); with any other driver through SQLAlchemy's pool, the same statements. Taking
over a dead row is the one case that needs a second statement. A semaphore's slot
(``acquire_any``) is taken in one statement, take-over included.

Waiters (``LockService.lock(key, wait=)``) are woken by LISTEN/NOTIFY: the release
statements, when they free a live lease while a waiter is registered on the key, call
``pg_notify`` in the same statement; :meth:`PostgresLockProvider.subscribe` LISTENs on one
connection per provider and process (providers/_pg_listen.py). Behind PgBouncer
(``ce_pgbouncer=true``) and with drivers other than psycopg 3, waiters poll.

Completion records live in ``<table>_done``: the record is written by the release
statement itself and checked by the acquire statement itself; expired records are pruned
by later releases.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect, Engine

from celery_exclusive.errors import BackendError, InvalidArgumentError, LockLost
from celery_exclusive.providers import _deadline, _libpq, _pg_listen
from celery_exclusive.providers._kept import KeptConnections
from celery_exclusive.providers._sql_common import (
    INHERITED,
    PRUNE_BATCH,
    STALE,
    Rows,
    SqlStore,
    check_sweep,
    create_fence,
    info_of,
    like_pattern,
    live,
    prune_suffix,
)
from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
)

#: The hot statements sent through libpq directly, with their result column types.
_LIBPQ_COLUMNS = {
    "acquire": "bttiffft",
    "acquire_once": "bttiffft",
    "acquire_any": "tittiffft",
    "take_over": "bttiffft",
    "release": "b",
    "release_done": "b",
    "release_done_prune": "b",
}
#: Connections the direct executor keeps for itself, out of the pool (more concurrent
#: callers than this use the pool's, which then bounds them).
_KEEP = 4


def _pg_statements(dialect: Dialect, name: str) -> dict[str, str]:
    """Every statement of the store, by operation, as SQL text with ``:name`` parameters."""
    q = dialect.identifier_preparer.quote
    t, seq = q(name), q(name + "_fence_seq")
    now = "WITH n AS MATERIALIZED (SELECT clock_timestamp() AS ts)"

    def live(a: str) -> str:
        return f"{a}.expires_at > n.ts AND {a}.deadline > n.ts"

    def cols(a: str, ts: str = "n.ts") -> str:
        return (
            f"{a}.key, {a}.value, {a}.fence, extract(epoch FROM {ts} - {a}.created_at)::float8, "
            f"extract(epoch FROM {a}.expires_at - {ts})::float8, "
            f"extract(epoch FROM {a}.deadline - {ts})::float8, {a}.holder"
        )

    fields = "key, value, expires_at, created_at, deadline, fence, holder"
    returning = "t." + fields.replace(", ", ", t.")
    # Every statement that can grant the key draws its fence only while holding the key's
    # lock (a transaction-scoped advisory lock on (hashtext(table), hashtext(key)), taken
    # just before the draw and kept until commit), so the fences of one key are drawn in
    # the order their grants commit: a statement that drew a fence and stalled before its
    # insert makes the next acquirer wait for it instead of letting that acquirer take,
    # use and release the key with a larger fence before the stalled insert commits the
    # smaller one. The lock is taken only where a fence is drawn, so a contended acquire
    # (a live row in its snapshot) still takes no lock, no xid and writes no WAL.
    # The same step raises the transaction's synchronous_commit to "on" (keeping
    # remote_apply), so a grant is durable whatever the server's default; the refresh
    # does the same in its "n" step.
    durable = (
        "set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
        "WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true)"
    )
    lock = f"pg_advisory_xact_lock(hashtext('{name}'), hashtext(CAST(:key AS varchar)))"
    key_lock = f"lk AS MATERIALIZED (SELECT {lock}, {durable})"
    fence = f"(SELECT nextval('{seq}') FROM lk)"
    # The common case, one cheap statement: a free key (no row) is inserted; an existing row
    # is only read and returned (live or not, see _live), so a contended attempt takes no
    # xid, takes no key lock, writes no WAL and calls no nextval. A racing inserter holds
    # the key lock until it commits; ON CONFLICT then does nothing (no rows come back).
    # Its clock is statement_timestamp(), when the server received it: stable within the
    # statement without a CTE, and never later than the truth, so the lease it grants
    # expires no earlier than the holder's own deadline, which counts from before sending.
    ts = "statement_timestamp()"
    acquire = f"""WITH {key_lock},
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT CAST(:key AS varchar), CAST(:token AS text), {ts} + make_interval(secs => :ttl), {ts},
         {ts} + make_interval(secs => :life), {fence}, CAST(:holder AS text)
  WHERE NOT EXISTS (SELECT 1 FROM {t} AS c WHERE c.key = :key)
  ON CONFLICT (key) DO NOTHING
  RETURNING t.fence)
SELECT true, NULL::varchar, NULL::text, fence, NULL::float8, NULL::float8, NULL::float8, NULL::text FROM ins
UNION ALL
SELECT false, {cols("c", ts)} FROM {t} AS c WHERE c.key = :key"""
    # A dead row (its holder crashed or lost it) is taken over by an UPDATE that only
    # matches it while it is dead; if the row was deleted meanwhile, an INSERT ... DO
    # NOTHING takes the key. Neither locks a row it does not change, so contenders racing
    # a winner wait for its commit and then write nothing (ON CONFLICT DO UPDATE ... WHERE
    # would lock the row, take an xid and flush a commit, delaying the winner's release).
    take_over = f"""{now}, {key_lock},
cur AS MATERIALIZED (
  SELECT c.*, ({live("c")} AND c.created_at > n.ts - make_interval(secs => {STALE})) AS live
  FROM {t} AS c CROSS JOIN n WHERE c.key = :key),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = n.ts + make_interval(secs => :ttl), created_at = n.ts,
    deadline = n.ts + make_interval(secs => :life), fence = {fence}, holder = :holder
  FROM n
  WHERE t.key = :key AND EXISTS (SELECT 1 FROM cur WHERE NOT cur.live)
    AND (t.expires_at <= n.ts OR t.deadline <= n.ts
         OR t.created_at <= n.ts - make_interval(secs => {STALE}))
  RETURNING {returning}),
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT :key, :token, n.ts + make_interval(secs => :ttl), n.ts, n.ts + make_interval(secs => :life),
         {fence}, :holder
  FROM n WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.live) AND NOT EXISTS (SELECT 1 FROM upd)
  ON CONFLICT (key) DO NOTHING
  RETURNING {returning})
SELECT true, {cols("upd")} FROM upd CROSS JOIN n
UNION ALL
SELECT true, {cols("ins")} FROM ins CROSS JOIN n
UNION ALL
SELECT false, {cols("cur")} FROM cur CROSS JOIN n
WHERE cur.live AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins)"""
    d = q(name + "_done")
    done_cols = (
        "outcome, attempt, extract(epoch FROM {ts} - created_at)::float8, "
        "extract(epoch FROM expires_at - {ts})::float8"
    )
    # acquire, but a live completion record of :task_id on the key refuses it (a row whose
    # first column is NULL carries the record: outcome, attempt, age, seconds left).
    # Derived from acquire's text, so the two cannot drift apart: one more CTE first, the
    # insert and the holder's row only without a record, and the record's row.
    head, insert_guard = "WITH ", "WHERE NOT EXISTS (SELECT 1 FROM"
    if not acquire.startswith(head) or insert_guard not in acquire:  # pragma: no cover - a code change
        raise AssertionError("acquire_once cannot be derived from the acquire statement")
    acquire_once = (
        f"WITH d AS (SELECT {done_cols.format(ts=ts)} FROM {d} "
        f"WHERE key = :key AND task_id = :task_id AND expires_at > {ts}),\n" + acquire[len(head) :]
    ).replace(insert_guard, "WHERE NOT EXISTS (SELECT 1 FROM d) AND NOT EXISTS (SELECT 1 FROM", 1)
    acquire_once += (
        " AND NOT EXISTS (SELECT 1 FROM d)\nUNION ALL\nSELECT NULL::bool, d.outcome::varchar, NULL::text, "
        "d.attempt::bigint, d.age, d.left_s, NULL::float8, NULL::text "
        "FROM d AS d(outcome, attempt, age, left_s)"
    )
    clock = "clock_timestamp()"

    def wake(freed_live: str) -> str:
        """``freed_live``, having notified the key's channel when it is true and someone
        waits for the key. A waiter holds a shared session lock on the channel's advisory
        lock (:func:`._pg_listen.waiter_lock`) from before its first attempt: when the try
        below gets the lock exclusively, nobody waits and nothing is sent (a NOTIFY wakes
        every listening backend of the database, so an unconditional one would cost each
        release ~30 µs per listening process). A waiter registering meanwhile blocks on the
        lock until this release commits, so its first attempt sees the key free. CASE
        evaluates its branches in order: the try only for a freed live lease, the notify
        only when the try failed."""
        channel = "CAST(:channel AS text)"
        return (
            f"CASE WHEN NOT ({freed_live}) THEN false "
            f"WHEN {_pg_listen.waiter_lock('try_advisory_xact_lock', channel)} THEN true "
            f"ELSE pg_notify({channel}, '') IS NOT NULL END"
        )

    release_done = f"""WITH rel AS (
  DELETE FROM {t} WHERE key = :key AND value = :token
    AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL
  RETURNING expires_at > {clock} AND deadline > {clock} AS live),
rec AS (
  INSERT INTO {d} AS r (key, task_id, outcome, attempt, created_at, expires_at)
  VALUES (CAST(:key AS varchar), CAST(:task_id AS varchar), CAST(:outcome AS varchar), CAST(:attempt AS int),
          {clock}, {clock} + make_interval(secs => CAST(:retain AS float8)))
  ON CONFLICT (key, task_id) DO UPDATE SET outcome = EXCLUDED.outcome, attempt = EXCLUDED.attempt,
    created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
  RETURNING 1)"""
    return {
        "acquire": acquire,
        "acquire_once": acquire_once,
        "acquire_any": _acquire_any_statement(t, seq, name, durable),
        # release and the completion record in one statement (data-modifying CTEs all run).
        "release_done": release_done + f"\nSELECT {wake('live')} FROM rel",
        # The same, in one release of _PRUNE_EVERY: it also prunes expired records (any key),
        # so the table stays small while the common statement stays cheap to plan.
        "release_done_prune": release_done
        + f""",
prune AS (
  DELETE FROM {d} WHERE (key, task_id) IN (
    SELECT key, task_id FROM {d} WHERE expires_at <= {clock} AND NOT (key = :key AND task_id = :task_id)
    ORDER BY expires_at LIMIT {PRUNE_BATCH} FOR UPDATE SKIP LOCKED))
SELECT {wake("live")} FROM rel""",
        "done_get": f"SELECT key, task_id, {done_cols.format(ts=clock)} FROM {d} "
        f"WHERE key = :key AND task_id = :task_id AND expires_at > {clock}",
        "done_list": f"SELECT key, task_id, {done_cols.format(ts=clock)} FROM {d} "
        f"WHERE key LIKE :pattern ESCAPE '!' AND expires_at > {clock}",
        "done_forget": f"DELETE FROM {d} WHERE key = :key AND task_id = :task_id "
        f"RETURNING expires_at > {clock}",
        "take_over": take_over,
        "refresh": f"""WITH n AS MATERIALIZED (SELECT clock_timestamp() AS ts, {durable} AS durable)
UPDATE {t} AS t SET expires_at = LEAST(n.ts + make_interval(secs => r.ttl), t.deadline)
FROM n, unnest(CAST(:keys AS text[]), CAST(:tokens AS text[]), CAST(:ttls AS float8[]))
  WITH ORDINALITY AS r(key, token, ttl, i)
WHERE t.key = r.key AND t.value = r.token AND {live("t")}
RETURNING r.i, extract(epoch FROM t.expires_at - n.ts)::float8""",
        # The release's commit does not wait for its WAL flush (synchronous_commit off for
        # this one transaction): it halves the release's latency. A server crash in the
        # next ~0.6 s can bring the released row back, to expire with its ttl: a key held
        # longer, never a second holder, since any later acquire's flush covers this WAL.
        # Freeing a live lease also notifies the key's channel (:mod:`._pg_listen`), in the
        # same statement: delivered to LISTENing waiters when the release commits.
        "release": f"DELETE FROM {t} WHERE key = :key AND value = :token "
        "AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL "
        f"RETURNING {wake('expires_at > clock_timestamp() AND deadline > clock_timestamp()')}",
        "peek": f"{now} SELECT {cols('t')} FROM {t} AS t CROSS JOIN n WHERE t.key = :key AND {live('t')}",
        "scan": f"{now} SELECT {cols('t')} FROM {t} AS t CROSS JOIN n "
        f"WHERE t.key LIKE :pattern ESCAPE '!' AND {live('t')}",
        # Run on the caller's connection: the share lock makes a takeover or release of
        # this row (an UPDATE or DELETE) wait until the caller's transaction ends.
        "guard": f"SELECT fence FROM {t} WHERE key = :key AND value = :token AND fence = :fence "
        "AND expires_at > clock_timestamp() AND deadline > clock_timestamp() "
        f"AND created_at > clock_timestamp() - make_interval(secs => {STALE}) FOR SHARE",
    }


def _acquire_any_statement(t: str, seq: str, name: str, durable: str) -> str:
    """A semaphore's first free slot of ``:keys`` (a text array literal, slot order) in one
    statement (``AcquiresAny``); rows ``kind, slot index (1-based), key, value, fence, age,
    expires_in, hard_expires_in, holder``: one ``g`` row (granted: only the index and fence
    are set) if it took a slot, and one row per slot as read (``l`` live, ``f`` absent or
    dead; key and times NULL if absent). No ``g`` row: ``:token`` already holds a live slot
    (a retried call), or every slot was live, or the picked slot was taken by a racing
    acquirer between the statement's read and its write (the caller tries again).

    The single lock's guarantees, per slot key: one snapshot read of every slot picks the
    first that is absent or dead (expired, past its deadline or stale), unless ``:token``
    holds one; only then is that key's advisory lock taken (the same ``(hashtext(table),
    hashtext(key))`` lock as ``acquire`` and ``take_over``, so single and semaphore acquires
    of slot 1 exclude each other) and its fence drawn under it, just before its write, which
    is an INSERT ... ON CONFLICT DO NOTHING for an absent slot and, for a dead one, an
    UPDATE that re-checks the row is still dead on the version it locks (the take_over rule:
    a slot is reclaimed only once its lease is over). With every slot live the pick is
    empty, so nothing below it runs: no lock, no nextval, no xid, no WAL. The grant commits
    with synchronous_commit on (``durable``). Time is ``statement_timestamp()`` throughout,
    as in ``acquire``. Each slot's row is read by its own primary-key lookup (the LATERAL
    subquery, kept apart by ``OFFSET 0``): joined plainly, the planner hashed the slot list
    and scanned the whole table (a refused attempt 80 µs against 49 µs with 300 rows)."""
    ts = "statement_timestamp()"
    lock = f"pg_advisory_xact_lock(hashtext('{name}'), hashtext(p.key))"
    fence = f"(SELECT nextval('{seq}') FROM lk)"
    fields = "key, value, expires_at, created_at, deadline, fence, holder"
    live = (
        f"c.expires_at > {ts} AND c.deadline > {ts} AND c.created_at > {ts} - make_interval(secs => {STALE})"
    )
    row = (
        f"c.key, c.value, c.fence, extract(epoch FROM {ts} - c.created_at)::float8 AS age, "
        f"extract(epoch FROM c.expires_at - {ts})::float8 AS expires_in, "
        f"extract(epoch FROM c.deadline - {ts})::float8 AS hard_in, c.holder"
    )
    granted = "NULL::varchar, NULL::text, g.fence, NULL::float8, NULL::float8, NULL::float8, NULL::text"
    return f"""WITH cur AS MATERIALIZED (
  SELECT s.i, s.key AS slot, c.key IS NOT NULL AS present, COALESCE({live}, false) AS live,
         COALESCE(c.value = :token, false) AS mine, {row}
  FROM unnest(CAST(:keys AS varchar[])) WITH ORDINALITY AS s(key, i)
  LEFT JOIN LATERAL (SELECT * FROM {t} AS c WHERE c.key = s.key OFFSET 0) AS c ON true),
p AS MATERIALIZED (
  SELECT slot AS key, i, present FROM cur
  WHERE NOT live AND NOT EXISTS (SELECT 1 FROM cur AS m WHERE m.live AND m.mine) ORDER BY i LIMIT 1),
lk AS MATERIALIZED (SELECT {lock}, {durable} FROM p),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = {ts} + make_interval(secs => :ttl), created_at = {ts},
    deadline = {ts} + make_interval(secs => :life), fence = {fence}, holder = :holder
  FROM p
  WHERE p.present AND t.key = p.key
    AND (t.expires_at <= {ts} OR t.deadline <= {ts} OR t.created_at <= {ts} - make_interval(secs => {STALE}))
  RETURNING t.fence),
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT p.key, :token, {ts} + make_interval(secs => :ttl), {ts}, {ts} + make_interval(secs => :life),
         {fence}, :holder
  FROM p WHERE NOT p.present
  ON CONFLICT (key) DO NOTHING
  RETURNING t.fence)
SELECT 'g'::text, p.i, {granted}
FROM (SELECT fence FROM upd UNION ALL SELECT fence FROM ins) AS g CROSS JOIN p
UNION ALL
SELECT CASE WHEN live THEN 'l' ELSE 'f' END, i, key, value, fence, age, expires_in, hard_in, holder
FROM cur"""


def _pg_sweep_statements(dialect: Dialect, name: str) -> dict[str, str]:
    """The sweep (``Sweeps``): at most ``:limit`` dead leases and ``:limit`` expired
    completion records under ``:pattern``, deleted in one statement; counts of each.

    A row is chosen only while dead at the statement's clock and locked ``FOR UPDATE SKIP
    LOCKED`` (a row an acquire or refresh is changing is skipped, not waited for); the lock
    re-checks a row changed since the snapshot, and the DELETE repeats the condition, so a
    lease that is live (or revived by a takeover) is never deleted. Fences come from the
    sequence, so a deleted key's next fence still exceeds all earlier ones.
    """
    q = dialect.identifier_preparer.quote
    t, d = q(name), q(name + "_done")

    def dead(a: str) -> str:
        return (
            f"({a}.expires_at < n.ts OR {a}.deadline < n.ts "
            f"OR {a}.created_at < n.ts - make_interval(secs => {STALE}))"
        )

    leases = f"""WITH n AS MATERIALIZED (SELECT clock_timestamp() AS ts),
dead AS (
  SELECT c.key FROM {t} AS c CROSS JOIN n WHERE c.key LIKE :pattern ESCAPE '!' AND {dead("c")}
  LIMIT :limit FOR UPDATE OF c SKIP LOCKED),
gone AS (
  DELETE FROM {t} AS t USING n WHERE t.key IN (SELECT key FROM dead) AND {dead("t")} RETURNING 1)"""
    records = f""",
old AS (
  SELECT r.key, r.task_id FROM {d} AS r CROSS JOIN n WHERE r.key LIKE :pattern ESCAPE '!'
    AND r.expires_at < n.ts LIMIT :limit FOR UPDATE OF r SKIP LOCKED),
forgotten AS (
  DELETE FROM {d} AS r USING n WHERE (r.key, r.task_id) IN (SELECT key, task_id FROM old)
    AND r.expires_at < n.ts RETURNING 1)"""
    return {
        "sweep": leases + records + "\nSELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM forgotten)",
        "sweep_leases": leases + "\nSELECT (SELECT count(*) FROM gone), 0",
    }


_bounded_connect = _deadline.bounded_connect  # its old name here


class _PooledExecutor:
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


class _DirectExecutor:
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
    ) -> None:
        import psycopg

        self._engine = engine
        self._sql = psycopg_sql
        self._masked = masked
        # A forked child never closes its parent's connections (psycopg's close sends libpq's
        # Terminate, which would end the parent's session): they are only kept referenced.
        self.kept: KeptConnections[Any] | None = (
            KeptConnections(_KEEP, on_fork=INHERITED.extend) if keep else None
        )
        self.runner = _libpq.Runner(prepare=prepare)
        self.statements = _libpq.statements(sql, _LIBPQ_COLUMNS)
        self.errors: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError, psycopg.Error)
        self._broken: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)

    def run(self, op: str, params: dict[str, Any], timeout: float | None) -> Rows:
        """One statement, autocommit, on a kept or pooled connection; its rows.

        With ``timeout`` the call gives up after about that long: connecting is bounded by
        ``connect_timeout`` (whole seconds, at least 2), the statement by :mod:`._deadline`'s
        watchdog, which shuts the socket down; the connection is dropped."""
        end = None if timeout is None else time.monotonic() + timeout
        with _deadline.connect_budget(timeout):
            fairy, dbapi = self._connection()
        left = None if end is None else max(end - time.monotonic(), 0.001)
        watch = None
        try:
            with _deadline.watch(-1 if left is None else dbapi.pgconn.socket, left) as watch:
                rows = self._send(dbapi, op, params)
        except self.errors as exc:
            if watch is not None and watch.fired:
                raise self._too_slow(fairy, dbapi, op, watch.timeout) from exc
            self._failed(fairy, dbapi, exc)
            raise
        except BaseException:
            self._abandon(fairy, dbapi)  # interrupted mid-protocol: the connection's state is unknown
            raise
        if watch is not None and watch.fired:  # answered just as its deadline shut the socket
            self._too_slow(fairy, dbapi, op, watch.timeout)
        else:
            self._put_back(fairy, dbapi)
        return rows

    def _send(self, dbapi: Any, op: str, params: dict[str, Any]) -> Rows:
        hot = self.statements.get(op)
        if hot is not None:  # acquire and release skip psycopg's cursor layer
            rows: Rows = self.runner.run(dbapi, hot, params)
        else:
            rows = dbapi.execute(self._sql[op], params).fetchall()
        if not dbapi.autocommit:  # an engine the caller built without autocommit
            dbapi.commit()
        return rows

    def _connection(self) -> tuple[Any, Any]:
        """``(None, a kept psycopg connection)``, or ``(pool checkout, its connection)``."""
        if self.kept is not None:
            kept = self.kept.take()
            if kept is not None:
                return None, kept[0]
        fairy = self._engine.raw_connection()
        return fairy, fairy.driver_connection

    def _put_back(self, fairy: Any, dbapi: Any) -> None:
        """After a statement: keep its connection (detached from the pool while we keep fewer
        than ``_KEEP``), or return it to the pool."""
        if fairy is not None and self.kept is not None and self.kept.has_room():
            fairy.detach()  # ours from now on; the pool forgets it
            fairy = None
        if fairy is None:
            self.keep(dbapi)
        else:
            fairy.close()

    def keep(self, dbapi: Any) -> None:
        """Keep an owned connection for the next statement, or close it if full or closed."""
        if self.kept is None or not self.kept.give(dbapi):
            dbapi.close()

    @staticmethod
    def _abandon(fairy: Any, dbapi: Any) -> None:
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
                self._engine.pool._invalidate(fairy, exc)
        if fairy is not None:
            if isinstance(exc, self._broken) or not dbapi.autocommit:
                fairy.invalidate(exc)
            fairy.close()
        elif dbapi.closed or isinstance(exc, self._broken):
            dbapi.close()
        else:
            self.keep(dbapi)

    def close(self, *, final: bool = False) -> None:
        """Close every kept connection (``final``: and keep none from now on)."""
        if self.kept is not None:
            for connection in self.kept.close() if final else self.kept.drain():
                with contextlib.suppress(Exception):  # a dead connection still closes locally
                    connection.close()


def _answer(rows: Rows, token: str, granted: float) -> Grant | Held | None:
    """What an acquire statement's rows mean; None for a dead row (left to take_over).

    No rows: a concurrent acquirer inserted the key between our read and our insert.
    """
    if not rows:
        return Held(None)
    fresh, *row = rows[0]
    if fresh:
        return Grant(int(row[2]), granted)
    info = info_of(row)
    if not live(info):
        return None
    return Grant(info.fence, info.expires_in) if info.token == token else Held(info)


def _text_array(values: Sequence[str]) -> str:
    """``values`` as a PostgreSQL array literal (every element quoted), for ``CAST(... AS varchar[])``."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _guard_connection(connection: Any) -> tuple[Connection | None, Any]:
    """``(SQLAlchemy connection, None)`` or ``(None, psycopg connection)`` of a guard() call,
    checked to be inside a transaction on PostgreSQL."""
    from sqlalchemy.orm import Session

    if isinstance(connection, Session):
        connection = connection.connection()
    if isinstance(connection, Connection):
        if connection.dialect.name != "postgresql":
            raise InvalidArgumentError(
                f"guard() needs a connection to the PostgreSQL lock database, got a "
                f"{connection.dialect.name} connection"
            )
        if getattr(connection.connection.driver_connection, "autocommit", False) is True:
            raise InvalidArgumentError(
                "guard() needs a connection inside a transaction, not in autocommit mode: "
                "the share lock would end with the statement"
            )
        return connection, None
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is how PostgreSQL is reached
        psycopg = None  # type: ignore[assignment]
    if psycopg is not None and isinstance(connection, psycopg.Connection):
        if connection.autocommit:
            raise InvalidArgumentError(
                "guard() needs a psycopg connection inside a transaction, not in autocommit "
                "mode: the share lock would end with the statement"
            )
        return None, connection
    raise InvalidArgumentError(
        "guard() needs the SQLAlchemy Connection or Session (or psycopg connection) of your "
        f"transaction, got {type(connection).__name__}"
    )


class PostgresLockProvider(SqlStore):
    """Leases in a PostgreSQL table; see the module docstring. Thread-safe and fork-safe.

    ``SqlLockProvider`` builds this class for a PostgreSQL URL or engine, and
    ``isinstance(provider, SqlLockProvider)`` holds for it.
    """

    _DIALECTS = ("postgresql",)
    _kind = "PostgreSQL "

    def _setup(self, *, pgbouncer: bool) -> None:
        if self._owns_engine:
            event.listen(self._engine, "do_connect", _bounded_connect)
        self._pg_sql = _pg_statements(self._engine.dialect, self.table.name)
        self._pg_sql.update(_pg_sweep_statements(self._engine.dialect, self.table.name))
        self._psycopg_sql = {n: _libpq.PLACEHOLDER.sub(r"%(\1)s", s) for n, s in self._pg_sql.items()}
        # How statements are sent, chosen once: psycopg 3 directly, else SQLAlchemy's pool.
        self._executor: _DirectExecutor | _PooledExecutor
        if self._engine.dialect.driver == "psycopg":
            self._executor = _DirectExecutor(
                self._engine,
                self._psycopg_sql,
                self._pg_sql,
                keep=self._owns_engine,
                prepare=not pgbouncer,
                masked=self._masked,
            )
        else:
            self._executor = _PooledExecutor(self._engine, self._pg_sql)
        self._driver_errors = self._executor.errors
        # Waiters are woken by LISTEN/NOTIFY (:mod:`._pg_listen`) on psycopg 3 connected to
        # the server itself; behind PgBouncer in transaction mode (no session to LISTEN on)
        # and with other drivers ``subscribe`` refuses and waiters poll. The release
        # statements notify whatever the driver, for waiters in other processes.
        self._listener: _pg_listen.Listener | None = None
        self._listen_lock = threading.Lock()
        self._no_wake: str | None = None
        if pgbouncer:
            self._no_wake = "behind PgBouncer (ce_pgbouncer=true) there is no session to LISTEN on"
        elif self._engine.dialect.driver != "psycopg":
            self._no_wake = f"the {self._engine.dialect.driver} driver is not psycopg 3"

    @property
    def _kept(self) -> list[Any] | None:
        """The connections kept out of the pool (None: the engine is the caller's, or the
        driver not psycopg 3)."""
        kept = self._executor.kept
        return None if kept is None else [connection for connection, _ in kept.idle]

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
        end = None if timeout is None else time.monotonic() + timeout
        if task_id is None:
            rows = self._call("acquire", params, timeout)
        else:
            rows = self._call("acquire_once", {**params, "task_id": task_id}, timeout)
            if rows and rows[0][0] is None:  # the completion record's row
                _, outcome, _, tries, age, left, *_ = rows[0]
                return Done(CompletionInfo(key, task_id, str(outcome), int(tries), float(age), float(left)))
        answer = _answer(rows, token, granted)
        if answer is None:  # a dead row (its holder crashed or lost it): take it over
            left = None if end is None else max(end - time.monotonic(), 0.001)
            answer = _answer(self._call("take_over", params, left), token, granted)
        return Held(None) if answer is None else answer

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
        """A semaphore's first free slot in one statement (:func:`_acquire_any_statement`);
        a contended attempt (every slot live) writes nothing. A slot lost to a racing
        acquirer between the statement's read and its write is tried again, at most once
        per slot."""
        granted = float(min(ttl, max_lifetime))
        params = {
            "keys": _text_array(keys),
            "token": token,
            "ttl": granted,
            "life": float(max_lifetime),
            "holder": holder,
        }
        end = None if timeout is None else time.monotonic() + timeout
        for _ in keys:
            left = None if end is None else max(end - time.monotonic(), 0.001)
            rows = self._call("acquire_any", params, left)
            slots: list[tuple[int, LockInfo]] = []
            raced = False
            for kind, index, *row in rows:
                if kind == "g":
                    return int(index) - 1, Grant(int(row[2]), granted)
                if kind == "f":
                    raced = True
                else:
                    slots.append((int(index), info_of(row)))
            mine = [(index, info) for index, info in slots if info.token == token]
            if mine:
                index, info = min(mine)
                return index - 1, Grant(info.fence, info.expires_in)
            if not raced:
                return Held(min(slots)[1])
        return Held(None)  # every attempt lost its slot to a racing acquirer

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        wanted = {(r.key, r.token): float(r.ttl) for r in requests}  # a repeated request: the last ttl wins
        if not wanted:
            return []
        pairs = sorted(wanted)  # a stable lock order across concurrent refreshers
        params = {
            "keys": [k for k, _ in pairs],
            "tokens": [t for _, t in pairs],
            "ttls": [wanted[p] for p in pairs],
        }
        answers = {
            pairs[int(index) - 1]: float(left) for index, left in self._call("refresh", params, timeout)
        }
        return [answers.get((r.key, r.token)) for r in requests]

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        params: dict[str, Any] = {
            "key": key,
            "token": token,
            "channel": _pg_listen.channel(self.table.name, key),
        }
        if completion is not None and not self._records_on():
            completion = None
        if completion is None:
            op = "release"
        else:
            op = "release_done" + prune_suffix(completion)
            params.update(
                task_id=completion.task_id,
                outcome=completion.outcome,
                attempt=int(completion.attempt),
                retain=float(completion.retain),
            )
        return any(bool(alive) for (alive,) in self._call(op, params, timeout))

    def subscribe(self, key: str) -> _pg_listen.Subscription:
        """Listen for releases of ``key`` (``WakesWaiters``): ``LISTEN`` on the key's channel,
        notified by the release statement, on one connection per provider and process
        (providers/_pg_listen.py). Returns once listening or shortly after (see there).
        Raises SignalsLost behind PgBouncer (``ce_pgbouncer=true``) and with drivers other
        than psycopg 3: the waiter then polls."""
        return self.subscribe_any([key])

    def subscribe_any(self, keys: Sequence[str]) -> _pg_listen.Subscription:
        """Listen for releases of any of ``keys`` (``WakesOnAny``: a semaphore's slots), one
        channel per key LISTENed in one batch; otherwise as :meth:`subscribe`."""
        if self._no_wake is not None:
            raise _pg_listen.SignalsLost(f"no release signals: {self._no_wake}; waiters poll")
        listener = self._listener
        if listener is None or listener.pid != os.getpid():  # a child never uses its parent's
            with self._listen_lock:
                listener = self._listener
                if listener is None or listener.pid != os.getpid():
                    if self._closed:
                        raise _pg_listen.SignalsLost("the provider is closed")
                    listener = self._listener = _pg_listen.Listener(self._listen_connection, self.table.name)
        return listener.subscribe_any([_pg_listen.channel(self.table.name, key) for key in keys])

    def _listen_connection(self) -> Any:
        """A psycopg connection of the engine's, detached from its pool: the listener's own."""
        fairy = self._engine.raw_connection()
        connection = fairy.driver_connection
        fairy.detach()
        return connection

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        if not self._records_on():
            return False
        rows = self._call("done_forget", {"key": key, "task_id": task_id}, timeout)
        return any(bool(alive) for (alive,) in rows)

    def sweep(self, prefix: str, limit: int = SWEEP_LIMIT, *, timeout: float | None = None) -> int:
        """Delete up to ``limit`` dead leases and ``limit`` expired records under ``prefix``
        in one statement (see ``Sweeps.sweep``); the rows deleted."""
        params = {"pattern": like_pattern(check_sweep(prefix, limit)), "limit": int(limit)}
        op = "sweep" if self._records_on() else "sweep_leases"
        rows = self._call(op, params, timeout)
        return sum(int(n) for n in rows[0]) if rows else 0

    @property
    def supports_guard(self) -> bool:
        """True: PostgreSQL is the one SQL store where :meth:`guard` works."""
        return True

    def guard(self, connection: Any, key: str, token: str, fence: int) -> None:
        """Check, inside the caller's transaction, that ``token`` holds ``key`` with ``fence``.

        PostgreSQL only. ``connection`` is the caller's SQLAlchemy ``Connection`` (or ORM
        ``Session``), or a psycopg 3 connection, to the database that holds the lock table,
        with a transaction open (autocommit is refused: the check would end with the
        statement). The live row is locked ``FOR SHARE`` until that transaction ends, and
        a takeover or release must UPDATE or DELETE it, so it waits: the caller's writes
        in the same transaction commit only while the lease is current. Raises
        :class:`LockLost` if the lease expired, was released or taken over (the caller
        should roll back). The caller's own driver errors are not translated.

        Trade-off: the heartbeat's refresh of that row waits too (and with it the whole
        batched refresh of the service's leases), so keep guarded transactions well
        shorter than the ttl minus its safety margin, and end them before releasing the
        lease (a release waits for them). Under REPEATABLE READ or SERIALIZABLE, acquire
        the lease before the transaction takes its snapshot; a concurrent refresh or
        takeover then makes this statement fail with a serialization error (retry the
        transaction).
        """
        params = {"key": key, "token": token, "fence": int(fence)}
        alchemy, psycopg_connection = _guard_connection(connection)
        if alchemy is not None:
            found = alchemy.execute(sa.text(self._pg_sql["guard"]), params).first() is not None
        else:
            found = psycopg_connection.execute(self._psycopg_sql["guard"], params).fetchone() is not None
        if not found:
            raise LockLost(
                key,
                fence,
                "guard found no live lease with this token and fence: it expired, was released "
                "or taken over; roll back this transaction",
            )

    def close(self) -> None:
        """Dispose of the engine's connections if this provider created the engine."""
        self._closed = True
        with self._listen_lock:
            listener, self._listener = self._listener, None
        if listener is not None and listener.pid == os.getpid():
            listener.close()
        self._executor.close(final=True)
        if self._owns_engine:
            self._engine.dispose()

    def diagnose(self) -> list[Diagnosis]:
        """Schema presence, server clock vs this machine's, a read-only server, and the
        server's ``synchronous_commit`` (which acquire and refresh override)."""
        findings: list[Diagnosis] = []
        try:
            with self._engine.connect() as conn:
                self._schema_findings(conn, findings)
                now = float(
                    conn.execute(sa.text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one()
                )
                skew = now - time.time()
                detail = f"server clock is {skew:+.3f}s from ours"
                findings.append(Diagnosis("clock", "ok" if abs(skew) < 2 else "warn", detail))
                read_only = bool(conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar_one())
                findings.append(
                    Diagnosis("writable", "fail" if read_only else "ok", f"read-only: {read_only}")
                )
                setting = str(conn.execute(sa.text("SHOW synchronous_commit")).scalar_one())
                kept = "remote_apply" if setting == "remote_apply" else "on"
                detail = (
                    f"server synchronous_commit is {setting!r}; acquire and refresh commit with "
                    f"{kept} regardless, release with 'off'"
                )
                findings.append(Diagnosis("synchronous_commit", "ok", detail))
        except sa_exc.SQLAlchemyError as exc:
            findings.append(Diagnosis("connect", "fail", str(self._error("connect", exc))))
        return findings

    # -- plumbing --------------------------------------------------------------------

    def _create_schema(self) -> None:
        # CREATE ... IF NOT EXISTS still races in the catalog (a unique violation on
        # pg_class), so creators queue on a transaction-scoped lock (PgBouncer-safe), in a
        # real transaction rather than autocommit.
        options = {"isolation_level": "READ COMMITTED"}
        with self._engine.connect().execution_options(**options) as conn, conn.begin():
            conn.execute(
                sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
                {"name": f"celery_exclusive.schema.{self.table.name}"},
            )
            self.table.create(conn, checkfirst=True)
            create_fence(self.table, conn)

    def _call(self, op: str, params: dict[str, Any], timeout: float | None) -> Rows:
        """``_run_pg``, passing ``timeout`` only when there is one."""
        if timeout is None:
            return self._run_pg(op, params)
        return self._run_pg(op, params, timeout=timeout)

    def _read(self, op: str, statement: str, params: dict[str, Any], timeout: float | None) -> Rows:
        return self._call(statement, params, timeout)

    def _run_pg(self, op: str, params: dict[str, Any], timeout: float | None = None) -> Rows:
        """Run one statement through the executor; its rows (driver errors translated)."""
        self._ensure_schema(timeout)
        with self._translated(op):
            return self._executor.run(op, params, timeout)

    def _after_fork(self) -> None:
        super()._after_fork()
        # The child never shares the parent's sockets: the kept connections see the fork
        # themselves (providers/_kept.py), the pool's are dropped without closing, as
        # SQLAlchemy recommends after fork.
        self._engine.dispose(close=False)
        listener, self._listener = self._listener, None
        if listener is not None:  # the parent's: its connection and thread are not ours
            INHERITED.append(listener)
        self._listen_lock = threading.Lock()
