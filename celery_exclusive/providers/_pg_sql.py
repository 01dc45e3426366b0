"""The PostgreSQL store's statements, as SQL text with ``:name`` parameters (see postgres.py).

Every time comparison uses the server's clock; the comments beside each statement say what
it locks, what it writes and how durably it commits.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect, Engine

from celery_exclusive.providers import _pg_listen
from celery_exclusive.providers._sql_common import PRUNE_BATCH, STALE, create_fence, unless_function
from celery_exclusive.providers.base import Diagnosis


def pg_statements(dialect: Dialect, name: str) -> dict[str, str]:
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
    # The key lock, tried first: when a racing grant of the key holds it, the statement
    # still waits for it (so that the caller's next statement sees that grant committed),
    # but ``got`` is false and the statement then writes nothing: no fence drawn, no xid,
    # no WAL (its INSERT's conflict check or its UPDATE's re-check would only refuse it
    # after drawing a fence and, for the UPDATE, taking an xid whose commit writes a commit
    # record: tests/faults/test_pg_takeover_races.py). Those checks stay for a racer that
    # committed before the try (the lock already free again).
    key_args = f"hashtext('{name}'), hashtext(CAST(:key AS varchar))"
    key_lock = (
        f"lk AS MATERIALIZED (SELECT CASE WHEN pg_try_advisory_xact_lock({key_args}) THEN true "
        f"ELSE pg_advisory_xact_lock({key_args}) IS NULL END AS got, {durable} FROM p)"
    )
    # The common case, one cheap statement: a free key (no row) is inserted; an existing row
    # is only read and returned (live or not, see _live), so a contended attempt takes no
    # xid, takes no key lock, writes no WAL and calls no nextval (p, the key found free in
    # the snapshot, is empty: nothing below it runs). A racing inserter holds the key lock
    # until it commits; this statement then writes nothing (no rows come back).
    # Its clock is statement_timestamp(), when the server received it: stable within the
    # statement without a CTE, and never later than the truth, so the lease it grants
    # expires no earlier than the holder's own deadline, which counts from before sending.
    ts = "statement_timestamp()"
    acquire = f"""WITH p AS MATERIALIZED (
  SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM {t} AS c WHERE c.key = :key)),
{key_lock},
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT CAST(:key AS varchar), CAST(:token AS text), {ts} + make_interval(secs => :ttl), {ts},
         {ts} + make_interval(secs => :life), nextval('{seq}'), CAST(:holder AS text)
  FROM lk WHERE lk.got
  ON CONFLICT (key) DO NOTHING
  RETURNING t.fence)
SELECT true, NULL::varchar, NULL::text, fence, NULL::float8, NULL::float8, NULL::float8, NULL::text FROM ins
UNION ALL
SELECT false, {cols("c", ts)} FROM {t} AS c WHERE c.key = :key"""
    # A dead row (its holder crashed or lost it) is taken over by an UPDATE that only
    # matches it while it is dead; if the row was deleted meanwhile, an INSERT ... DO
    # NOTHING takes the key. Neither locks a row it does not change (ON CONFLICT DO UPDATE
    # ... WHERE would lock the row, take an xid and flush a commit, delaying the winner's
    # release), and with the key lock tried first (key_lock) a contender that lost to a
    # racing take-over writes nothing at all; with a live row in its snapshot (p empty)
    # it takes no lock either.
    take_over = f"""{now},
cur AS MATERIALIZED (
  SELECT c.*, ({live("c")} AND c.created_at > n.ts - make_interval(secs => {STALE})) AS live
  FROM {t} AS c CROSS JOIN n WHERE c.key = :key),
p AS MATERIALIZED (SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.live)),
{key_lock},
f AS MATERIALIZED (SELECT nextval('{seq}') AS fence FROM lk WHERE lk.got),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = n.ts + make_interval(secs => :ttl), created_at = n.ts,
    deadline = n.ts + make_interval(secs => :life), fence = f.fence, holder = :holder
  FROM n, f
  WHERE t.key = :key
    AND (t.expires_at <= n.ts OR t.deadline <= n.ts
         OR t.created_at <= n.ts - make_interval(secs => {STALE}))
  RETURNING {returning}),
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT :key, :token, n.ts + make_interval(secs => :ttl), n.ts, n.ts + make_interval(secs => :life),
         f.fence, :holder
  FROM n, f WHERE NOT EXISTS (SELECT 1 FROM upd)
  ON CONFLICT (key) DO NOTHING
  RETURNING {returning})
SELECT true, {cols("upd")} FROM upd CROSS JOIN n
UNION ALL
SELECT true, {cols("ins")} FROM ins CROSS JOIN n
UNION ALL
SELECT false, {cols("cur")} FROM cur CROSS JOIN n WHERE cur.live"""
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
        """0 unless ``freed_live``; else 1, or 2 having notified the key's channel because
        someone waits for the key (the releaser then gives way: ``KnowsWaiters``). A waiter
        holds a shared session lock on the channel's advisory lock
        (:func:`._pg_listen.waiter_lock`) from its first refusal until its wait ends:
        when the try below gets the lock exclusively, nobody waits and nothing is sent (a
        NOTIFY wakes every listening backend of the database, so an unconditional one would
        cost each release ~30 µs per listening process). A waiter registering meanwhile
        blocks on the lock until this release commits, so its next attempt sees the key
        free. CASE evaluates its branches in order: the try only for a freed live lease, the
        notify only when the try failed (``pg_notify`` returns void, never NULL)."""
        channel = "CAST(:channel AS text)"
        return (
            f"CASE WHEN NOT ({freed_live}) THEN 0 "
            f"WHEN {_pg_listen.waiter_lock('try_advisory_xact_lock', channel)} THEN 1 "
            f"ELSE 1 + (pg_notify({channel}, '') IS NOT NULL)::int END"
        )

    # The record replaces a stored one of the same or an earlier attempt, or an expired one,
    # never a live one of a later attempt: a late writer of an earlier attempt's record (a
    # killed run recorded after the retry it had sent finished) must not turn it back.
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
    WHERE r.attempt <= EXCLUDED.attempt OR r.expires_at <= EXCLUDED.created_at
  RETURNING 1)"""
    return {
        "acquire": acquire,
        "acquire_once": acquire_once,
        "acquire_any": _acquire_any_statement(t, seq, name, durable),
        "acquire_unless": _acquire_unless_statement(t, seq, name, durable, q(unless_function(name))),
        # The same without the fresh re-read, for a schema that lacks the function (made by an
        # earlier version, create_table off): the window described there stays open.
        "acquire_unless_snapshot": _acquire_unless_statement(t, seq, name, durable, None),
        # release and the completion record in one statement (data-modifying CTEs all run).
        "release_done": release_done + f"\nSELECT {wake('live')} FROM rel",
        # The same, in one release of _PRUNE_EVERY: it also prunes expired records (any key),
        # so the table stays small while the common statement stays cheap to plan. The prune
        # must read only the expired records, whatever the table holds and whatever plan the
        # server cached (issue #16: with clock_timestamp() as its bound, volatile and so only
        # a filter, each prune read every live record to find none; and a generic plan made
        # while the table was nearly empty, kept for good where no ANALYZE runs, sorted a
        # sequential scan of it: the pruning release took 0.25 ms at 2,000 records, 1.9 ms
        # at 20,000). So its bound is statement_timestamp() (stable, so an index condition;
        # never later than the clock, so a record is still pruned only once expired), with
        # an always-true lower bound that makes the planner estimate a bounded range rather
        # than a third of a table without statistics: it scans the expires_at index and
        # deletes the <= PRUNE_BATCH rows it picked by their primary key (a nested loop), not
        # by a hash join over a sequential scan (tests/providers/test_pg_prune.py).
        "release_done_prune": release_done
        + f""",
prune AS (
  DELETE FROM {d} WHERE (key, task_id) IN (
    SELECT key, task_id FROM {d} WHERE expires_at <= {ts} AND expires_at > '-infinity'
      AND NOT (key = :key AND task_id = :task_id)
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
    expires_in, hard_expires_in, holder``: the one ``g`` row (granted: only the index and
    fence are set) if it took a slot, else one row per slot as read (``l`` live, ``f`` absent
    or dead; key and times NULL if absent). No ``g`` row: ``:token`` already holds a live slot
    (a retried call), or every slot was live, or the picked slot was being taken by a racing
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
    and scanned the whole table (a refused attempt 80 µs against 49 µs with 300 rows).

    A racing acquirer of the picked slot holds its key lock until it commits. The lock is
    first tried without waiting (``won``); when that fails the statement still waits for
    the lock, so that the caller's retry sees the racer's commit, but then writes nothing:
    its snapshot predates the racer's write, and the INSERT's conflict check or the
    UPDATE's re-check would only refuse it after drawing a fence (and, for the UPDATE,
    taking a transaction id whose commit writes and flushes WAL: tests/faults/
    test_pg_semaphore_races.py). Those checks stay for a racer that committed before the
    try (lock already free again)."""
    ts = "statement_timestamp()"
    key_lock = f"(hashtext('{name}'), hashtext(p.key))"
    won = (
        f"CASE WHEN pg_try_advisory_xact_lock{key_lock} THEN true "
        f"WHEN pg_advisory_xact_lock{key_lock} IS NULL THEN NULL ELSE false END"
    )
    fence = f"(SELECT nextval('{seq}') FROM lk)"
    fields = "key, value, expires_at, created_at, deadline, fence, holder"
    live = (
        f"c.expires_at > {ts} AND c.deadline > {ts} AND c.created_at > {ts} - make_interval(secs => {STALE})"
    )
    row = (
        f"key, value, fence, extract(epoch FROM {ts} - created_at)::float8, "
        f"extract(epoch FROM expires_at - {ts})::float8, extract(epoch FROM deadline - {ts})::float8, holder"
    )
    granted = "NULL::varchar, NULL::text, g.fence, NULL::float8, NULL::float8, NULL::float8, NULL::text"
    return f"""WITH cur AS MATERIALIZED (
  SELECT s.i, s.key AS slot, c.key IS NOT NULL AS present, COALESCE({live}, false) AS live,
         COALESCE(c.value = :token, false) AS mine,
         c.key, c.value, c.fence, c.created_at, c.expires_at, c.deadline, c.holder
  FROM unnest(CAST(:keys AS varchar[])) WITH ORDINALITY AS s(key, i)
  LEFT JOIN LATERAL (SELECT * FROM {t} AS c WHERE c.key = s.key OFFSET 0) AS c ON true),
p AS MATERIALIZED (
  SELECT slot AS key, i, present FROM cur
  WHERE NOT live AND NOT EXISTS (SELECT 1 FROM cur AS m WHERE m.live AND m.mine) ORDER BY i LIMIT 1),
lk AS MATERIALIZED (SELECT {won} AS won, {durable} FROM p),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = {ts} + make_interval(secs => :ttl), created_at = {ts},
    deadline = {ts} + make_interval(secs => :life), fence = {fence}, holder = :holder
  FROM p
  WHERE (SELECT won FROM lk) AND p.present AND t.key = p.key
    AND (t.expires_at <= {ts} OR t.deadline <= {ts} OR t.created_at <= {ts} - make_interval(secs => {STALE}))
  RETURNING t.fence),
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT p.key, :token, {ts} + make_interval(secs => :ttl), {ts}, {ts} + make_interval(secs => :life),
         {fence}, :holder
  FROM p WHERE (SELECT won FROM lk) AND NOT p.present
  ON CONFLICT (key) DO NOTHING
  RETURNING t.fence),
g AS (SELECT fence FROM upd UNION ALL SELECT fence FROM ins)
SELECT 'g'::text, p.i, {granted} FROM g CROSS JOIN p
UNION ALL
SELECT CASE WHEN live THEN 'l' ELSE 'f' END, i, {row} FROM cur WHERE NOT EXISTS (SELECT 1 FROM g)"""


def _acquire_unless_statement(t: str, seq: str, name: str, durable: str, fresh: str | None) -> str:
    """``:key`` unless ``:blocker`` has a live lease, in one statement (``AcquiresUnless``: a
    dedupe queued marker, refused while a run holds the execution key); rows ``kind, key,
    value, fence, age, expires_in, hard_expires_in, holder``: one ``g`` row (granted: only the
    fence is set) if it took the key, a ``b`` row for a live blocker, a ``q`` row for a live
    lease on ``:key``. No row: the key was being taken meanwhile (the caller asks again).

    One snapshot reads both rows, so the two are judged at one instant. Only when both are
    absent or dead (expired, past the deadline or stale) does it take ``:key``'s lock, the
    advisory lock of ``acquire``, ``take_over`` and ``acquire_any`` (so every grant of the key
    draws its fence under it, in commit order, committed with synchronous_commit on); with a
    live row the pick is empty and nothing below runs: no lock, no nextval, no xid, no WAL.
    The lock is tried first: if another grant of ``:key`` holds it, the statement waits for
    that grant to commit and then writes nothing (no row comes back), because its snapshot
    is older than that grant and than whatever followed it (the run that took the execution
    key and released the marker): the caller's next statement sees them.

    When the try succeeds the snapshot may still be that old: a backend descheduled between
    its snapshot and the try can wake after another sender's marker committed and its run
    took the execution key and released the marker, all unseen, with the lock free again.
    So once it holds the lock the statement re-reads both keys with a new snapshot, through
    ``fresh`` (the table's ``<table>_unless(key, blocker)`` function: a VOLATILE PL/pgSQL
    function takes a snapshot per query under READ COMMITTED, see
    ``_sql_common.unless_function_ddl``), and writes only if neither is live *now*; else it
    writes nothing and the caller asks again. Every later grant of ``:key`` waits for the
    lock, and a run takes the execution key only while its message's marker is live, so
    what the re-read found free stays so until this grant commits. Refused on its snapshot,
    the statement never calls it (``fresh`` None: the statement without the re-read).
    The write is an INSERT ... ON CONFLICT DO NOTHING for an absent key, an UPDATE
    re-checking the row is still dead for a dead one. Time is ``statement_timestamp()``, as
    in ``acquire`` (and in the function)."""
    ts = "statement_timestamp()"
    key = "CAST(:key AS varchar)"
    lock = f"hashtext('{name}'), hashtext({key})"
    fields = "key, value, expires_at, created_at, deadline, fence, holder"
    live = (
        f"c.expires_at > {ts} AND c.deadline > {ts} AND c.created_at > {ts} - make_interval(secs => {STALE})"
    )
    row = (
        f"c.key, c.value, c.fence, extract(epoch FROM {ts} - c.created_at)::float8 AS age, "
        f"extract(epoch FROM c.expires_at - {ts})::float8 AS expires_in, "
        f"extract(epoch FROM c.deadline - {ts})::float8 AS hard_in, c.holder"
    )
    cols = "key, value, fence, age, expires_in, hard_in, holder"
    granted = "NULL::varchar, NULL::text, g.fence, NULL::float8, NULL::float8, NULL::float8, NULL::text"
    now_free = "true" if fresh is None else f"{fresh}({key}, CAST(:blocker AS varchar))"
    return f"""WITH b AS MATERIALIZED (
  SELECT {row} FROM {t} AS c WHERE c.key = CAST(:blocker AS varchar) AND {live}),
cur AS MATERIALIZED (SELECT {row}, {live} AS live FROM {t} AS c WHERE c.key = {key}),
p AS MATERIALIZED (
  SELECT EXISTS (SELECT 1 FROM cur) AS present
  WHERE NOT EXISTS (SELECT 1 FROM b) AND NOT EXISTS (SELECT 1 FROM cur WHERE cur.live)),
lk AS MATERIALIZED (
  SELECT p.present, CASE WHEN pg_try_advisory_xact_lock({lock}) THEN {now_free}
                         ELSE pg_advisory_xact_lock({lock}) IS NULL END AS got, {durable}
  FROM p),
f AS MATERIALIZED (SELECT lk.present, nextval('{seq}') AS fence FROM lk WHERE lk.got),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = {ts} + make_interval(secs => :ttl), created_at = {ts},
    deadline = {ts} + make_interval(secs => :life), fence = f.fence, holder = :holder
  FROM f
  WHERE f.present AND t.key = {key}
    AND (t.expires_at <= {ts} OR t.deadline <= {ts} OR t.created_at <= {ts} - make_interval(secs => {STALE}))
  RETURNING t.fence),
ins AS (
  INSERT INTO {t} AS t ({fields})
  SELECT {key}, :token, {ts} + make_interval(secs => :ttl), {ts}, {ts} + make_interval(secs => :life),
         f.fence, :holder
  FROM f WHERE NOT f.present
  ON CONFLICT (key) DO NOTHING
  RETURNING t.fence)
SELECT 'g'::text, {granted} FROM (SELECT fence FROM upd UNION ALL SELECT fence FROM ins) AS g
UNION ALL
SELECT 'b', {cols} FROM b
UNION ALL
SELECT 'q', {cols} FROM cur WHERE cur.live"""


def pg_sweep_statements(dialect: Dialect, name: str) -> dict[str, str]:
    """The sweep (``Sweeps``): at most ``:limit`` dead leases and ``:limit`` expired
    completion records under ``:pattern``, deleted in one statement; counts of each.

    A row is chosen only while dead at the statement's clock and locked ``FOR UPDATE SKIP
    LOCKED`` (a row an acquire or refresh is changing is skipped, not waited for); the lock
    re-checks a row changed since the snapshot, and the DELETE repeats the condition, so a
    lease that is live (or revived by a takeover) is never deleted. Fences come from the
    sequence, so a deleted key's next fence still exceeds all earlier ones.

    The records are found through their ``expires_at`` index, so a sweep reads the expired
    records, not every record under the prefix (issue #16: with the bound ``n.ts`` of a
    join it was only a filter, and a sweep scanned the whole table: 16 ms at 100,000 live
    records). The bound is the clock read once, as a scalar subquery (a parameter the index
    condition takes), with an always-true lower bound so that the planner estimates a
    bounded range rather than a third of a table without statistics (as in the prune of
    ``release_done_prune``). The leases' part scans: see BENCHMARKS.md, the sweep's cost.
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
  SELECT r.key, r.task_id FROM {d} AS r
  WHERE r.expires_at < (SELECT ts FROM n) AND r.expires_at > '-infinity' AND r.key LIKE :pattern ESCAPE '!'
  LIMIT :limit FOR UPDATE OF r SKIP LOCKED),
forgotten AS (
  DELETE FROM {d} AS r USING n WHERE (r.key, r.task_id) IN (SELECT key, task_id FROM old)
    AND r.expires_at < n.ts RETURNING 1)"""
    return {
        "sweep": leases + records + "\nSELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM forgotten)",
        "sweep_leases": leases + "\nSELECT (SELECT count(*) FROM gone), 0",
    }


def create_schema(engine: Engine, table: sa.Table) -> None:
    """Create the lock table, its fence sequence and its marker function if missing (on an
    existing table too: how a schema of an earlier version gets the function), safe against
    concurrent creators."""
    # CREATE ... IF NOT EXISTS still races in the catalog (a unique violation on pg_class),
    # so creators queue on a transaction-scoped lock (PgBouncer-safe), in a real
    # transaction rather than autocommit.
    options = {"isolation_level": "READ COMMITTED"}
    with engine.connect().execution_options(**options) as conn, conn.begin():
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
            {"name": f"celery_exclusive.schema.{table.name}"},
        )
        table.create(conn, checkfirst=True)
        create_fence(table, conn)


def server_findings(conn: Connection) -> list[Diagnosis]:
    """The server's clock vs this machine's, whether it is read-only, and its
    ``synchronous_commit`` (which acquire and refresh override)."""
    now = float(conn.execute(sa.text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    skew = now - time.time()
    findings = [
        Diagnosis("clock", "ok" if abs(skew) < 2 else "warn", f"server clock is {skew:+.3f}s from ours")
    ]
    read_only = bool(conn.execute(sa.text("SELECT pg_is_in_recovery()")).scalar_one())
    findings.append(Diagnosis("writable", "fail" if read_only else "ok", f"read-only: {read_only}"))
    setting = str(conn.execute(sa.text("SHOW synchronous_commit")).scalar_one())
    kept = "remote_apply" if setting == "remote_apply" else "on"
    detail = (
        f"server synchronous_commit is {setting!r}; acquire and refresh commit with "
        f"{kept} regardless, release with 'off'"
    )
    findings.append(Diagnosis("synchronous_commit", "ok", detail))
    return findings
