"""SQL lock store: PostgreSQL (first class), SQLite and MariaDB/MySQL, via SQLAlchemy.

Leases are rows of one table (``cache_entries`` by default) that may be shared with other
application rows; only the row of the exact key being operated on is ever touched. Every
time comparison uses the database server's clock; SQLite, which has none, uses the
machine's boot clock (see ``_LeaseClock``). Fences come from a counter that survives row
deletion: the sequence ``<table>_fence_seq`` on PostgreSQL (drawn under a per-key
transaction-scoped advisory lock, so one key's fences grow in commit order), the one-row
table ``<table>_fence`` elsewhere (bumped first in every acquire, which serialises them).

On PostgreSQL with psycopg 3 each operation is one autocommit statement on a connection the
provider keeps (acquire and release as prepared statements through libpq directly, see
``libpq.py``), and a contended acquire writes nothing (no transaction id, no WAL). Taking
over a dead row is the one case that needs a second statement.

Completion records (``release(..., completion)``) live in ``<table>_done``, keyed by lock
key and task id, created with the lock table. On PostgreSQL the record is written by the
release statement itself and checked by the acquire statement itself. On SQLite and
MariaDB the check is one more column of statements the acquire runs anyway, and the write
one more statement in the release's transaction. Expired records are pruned by later
releases.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Dialect, Engine, make_url
from sqlalchemy.pool import StaticPool

from celery_exclusive.errors import (
    BackendError,
    ConfigurationError,
    InvalidArgumentError,
    LockLost,
    MissingDriverError,
)
from celery_exclusive.providers import deadline, libpq
from celery_exclusive.providers.base import (
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
    decode_holder,
)
from celery_exclusive.urls import mask_url, split_options, url_secrets
from celery_exclusive.validation import MAX_LIFETIME_CAP

_T = TypeVar("_T")
logger = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_MAX_NAME = 63 - len("_fence_seq")  # derived names must fit PostgreSQL's and MySQL's limits
_BACKENDS = {
    "postgresql": ("psycopg", "postgres"),
    "mysql": ("pymysql", "mysql"),
    "mariadb": ("pymysql", "mysql"),
}
#: pip names of SQLAlchemy drivers the extras do not install.
_PIP_NAMES = {
    "psycopg2": "psycopg2-binary",
    "mysqldb": "mysqlclient",
    "mysqlconnector": "mysql-connector-python",
}
_RETRYABLE = (1213, 1020)  # MySQL deadlock / "record has changed": nothing was committed
_ATTEMPTS = 5
#: libpq options for engines built from a URL: give up on an unanswered connect after 10 s,
#: on unacknowledged data after 30 s, and on a silent peer after 10 + 3 x 5 s of keepalives.
_PG_NETWORK_DEFAULTS = {
    "connect_timeout": 10,
    "tcp_user_timeout": 30_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
#: Connections the PostgreSQL fast path keeps for itself, out of the pool (more concurrent
#: callers than this use the pool's, which then bounds them).
_KEEP = 4

#: In a forked child, the parent's kept connections: never used, never closed (that would
#: end the parent's sessions) and never collected (psycopg would warn they were left open).
_inherited_connections: list[Any] = []
# The origin's staleness threshold: a row older than the 24 h cap is dead whatever it says.
# Never the requester's max_lifetime, or a caller with a short one could steal a long lease.
_STALE = int(MAX_LIFETIME_CAP)
#: The hot statements sent through libpq directly, with their result column types.
_LIBPQ_COLUMNS = {
    "acquire": "bttiffft",
    "acquire_once": "bttiffft",
    "take_over": "bttiffft",
    "release": "b",
    "release_done": "b",
    "release_done_prune": "b",
}
_CHUNK = 500
#: One record-writing release in this many (by task id) also prunes up to _PRUNE_BATCH
#: expired records, so pruning keeps up with far more writes than it costs.
_PRUNE_EVERY = 8
_PRUNE_BATCH = 32


def _prune_suffix(completion: Completion) -> str:
    """``"_prune"`` for the one release in _PRUNE_EVERY (by task id) that prunes expired records."""
    return "_prune" if zlib.crc32(completion.task_id.encode()) % _PRUNE_EVERY == 0 else ""


def _live(info: LockInfo) -> bool:
    """Whether a row read from the store (times relative to the store's clock) is a live lease."""
    return info.expires_in > 0 and info.hard_expires_in > 0 and info.age < _STALE


class _Key(sa.types.TypeDecorator[str]):
    """The key column: on MySQL/MariaDB a binary collation that also keeps trailing spaces.

    'A' and 'a', and 'a' and 'a ' are different keys. ``utf8mb4_bin`` is PAD SPACE (it
    ignores trailing spaces), so the NO PAD binary collation of the connected server is
    used where it has one: MariaDB >= 10.2 ``utf8mb4_nopad_bin``, MySQL 8 ``utf8mb4_0900_bin``.
    """

    impl = sa.String(512)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name not in ("mysql", "mariadb"):
            return dialect.type_descriptor(sa.String(512))
        version = dialect.server_version_info or ()
        if getattr(dialect, "is_mariadb", False):
            collation = "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
        else:
            collation = "utf8mb4_0900_bin" if version >= (8, 0) else "utf8mb4_bin"
        return dialect.type_descriptor(mysql.VARCHAR(512, charset="utf8mb4", collation=collation))


_KEY = _Key()
_TASK_ID = sa.String(200).with_variant(
    mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)
_TOKEN = sa.Text().with_variant(mysql.TEXT(charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb")
_STAMP = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
_Rows = list[tuple[Any, ...]]
_Infos = list[LockInfo]
_Answers = list[float | None]
_Findings = list[Diagnosis]


def lock_table(metadata: sa.MetaData, name: str = "cache_entries") -> sa.Table:
    """The lease table ``name`` in ``metadata``, for Alembic or ``metadata.create_all``.

    Creating it also creates its fence counter and its completion-record table
    ``<name>_done`` (``after_create``), idempotently.
    """
    _check_name(name)
    table = sa.Table(
        name,
        metadata,
        sa.Column("key", _KEY, primary_key=True),
        sa.Column("value", _TOKEN, nullable=False),
        sa.Column("expires_at", _STAMP, nullable=False),
        sa.Column("created_at", _STAMP, nullable=False),
        sa.Column("deadline", _STAMP, nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=True),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )
    # Completion records (task id per lock key) live in a table of their own, so they can
    # never collide with a lease or with another application's rows of a shared table.
    # Like the fence counter it is made with the lock table (after_create), not by the
    # caller's metadata, so create_all() does not try to make it twice.
    done = sa.Table(
        name + "_done",
        sa.MetaData(),
        sa.Column("key", _KEY, primary_key=True),
        sa.Column("task_id", _TASK_ID, primary_key=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", _STAMP, nullable=False),
        sa.Column("expires_at", _STAMP, nullable=False),
        sa.Index(name + "_done_x", "expires_at"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )
    table.info["done"] = done
    event.listen(table, "after_create", _create_fence)
    return table


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > _MAX_NAME:
        raise ConfigurationError(
            f"invalid lock table name {name!r}: use letters, digits and _, "
            f"not starting with a digit, at most {_MAX_NAME} characters"
        )


def _create_fence(table: sa.Table, connection: Connection, **_: Any) -> None:
    done = table.info.get("done")
    if done is not None:
        done.create(connection, checkfirst=True)
    _create_counter(table, connection)


def _create_counter(table: sa.Table, connection: Connection) -> None:
    """The fence counter of ``table``: a sequence on PostgreSQL, a one-row table elsewhere."""
    dialect = connection.dialect
    q = dialect.identifier_preparer.quote
    if dialect.name == "postgresql":
        connection.exec_driver_sql(f"CREATE SEQUENCE IF NOT EXISTS {q(table.name + '_fence_seq')} CACHE 1")
        return
    counter = q(table.name + "_fence")
    sqlite = dialect.name == "sqlite"
    ignore, options = ("OR IGNORE", "") if sqlite else ("IGNORE", " ENGINE=InnoDB")
    connection.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {counter} (id INTEGER PRIMARY KEY, n BIGINT NOT NULL){options}"
    )
    # Seeded from the table so a recreated counter still exceeds every stored fence.
    connection.exec_driver_sql(
        f"INSERT {ignore} INTO {counter} (id, n) SELECT 1, COALESCE(MAX(fence), 0) FROM {q(table.name)}"
    )


def _pg_statements(dialect: Dialect, name: str) -> dict[str, str]:
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
  SELECT c.*, ({live("c")} AND c.created_at > n.ts - make_interval(secs => {_STALE})) AS live
  FROM {t} AS c CROSS JOIN n WHERE c.key = :key),
upd AS (
  UPDATE {t} AS t SET value = :token, expires_at = n.ts + make_interval(secs => :ttl), created_at = n.ts,
    deadline = n.ts + make_interval(secs => :life), fence = {fence}, holder = :holder
  FROM n
  WHERE t.key = :key AND EXISTS (SELECT 1 FROM cur WHERE NOT cur.live)
    AND (t.expires_at <= n.ts OR t.deadline <= n.ts
         OR t.created_at <= n.ts - make_interval(secs => {_STALE}))
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
        # release and the completion record in one statement (data-modifying CTEs all run).
        "release_done": release_done + "\nSELECT live FROM rel",
        # The same, in one release of _PRUNE_EVERY: it also prunes expired records (any key),
        # so the table stays small while the common statement stays cheap to plan.
        "release_done_prune": release_done
        + f""",
prune AS (
  DELETE FROM {d} WHERE (key, task_id) IN (
    SELECT key, task_id FROM {d} WHERE expires_at <= {clock} AND NOT (key = :key AND task_id = :task_id)
    ORDER BY expires_at LIMIT {_PRUNE_BATCH} FOR UPDATE SKIP LOCKED))
SELECT live FROM rel""",
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
        "release": f"DELETE FROM {t} WHERE key = :key AND value = :token "
        "AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL "
        "RETURNING expires_at > clock_timestamp() AND deadline > clock_timestamp()",
        "peek": f"{now} SELECT {cols('t')} FROM {t} AS t CROSS JOIN n WHERE t.key = :key AND {live('t')}",
        "scan": f"{now} SELECT {cols('t')} FROM {t} AS t CROSS JOIN n "
        f"WHERE t.key LIKE :pattern ESCAPE '!' AND {live('t')}",
        # Run on the caller's connection: the share lock makes a takeover or release of
        # this row (an UPDATE or DELETE) wait until the caller's transaction ends.
        "guard": f"SELECT fence FROM {t} WHERE key = :key AND value = :token AND fence = :fence "
        "AND expires_at > clock_timestamp() AND deadline > clock_timestamp() "
        f"AND created_at > clock_timestamp() - make_interval(secs => {_STALE}) FOR SHARE",
    }


def _generic_statements(dialect: Dialect, name: str) -> dict[str, sa.TextClause]:
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
        "delete": f"DELETE FROM {t} WHERE {k} = :key",
        "insert": f"INSERT INTO {t} ({k}, {v}, expires_at, created_at, deadline, fence, holder) "
        f"VALUES (:key, :token, {stamp(':ttl')}, {stamp('0')}, {stamp(':life')}, :fence, :holder)",
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
            # _PRUNE_BATCH: the table stays small at a fraction of a statement per release.
            "done_prune": f"DELETE FROM {d} WHERE rowid IN (SELECT rowid FROM {d} WHERE {expired} "
            f"ORDER BY expires_at LIMIT {_PRUNE_BATCH})"
            if dialect.name == "sqlite"
            else f"DELETE FROM {d} WHERE {expired} ORDER BY expires_at LIMIT {_PRUNE_BATCH}",
            "done_list": f"SELECT {done_cols} FROM {d_scan} WHERE {match} AND {secs('expires_at')} > 0",
            "done_forget": f"DELETE FROM {d} WHERE {pick}",
            "select_once": f"SELECT {cols}, {record} FROM {t} WHERE {k} = :key{lock}",
            "fence_once": f"SELECT n, {record} FROM {f} WHERE id = 1",
        }
    )
    texts = {name: sa.text(s) for name, s in sql.items()}
    texts["remaining"] = texts["remaining"].bindparams(sa.bindparam("keys", expanding=True))
    return texts


def _host_list_as_query(backend: str, rest: str) -> str:
    """PostgreSQL: libpq's ``user@h1:p1,h2:p2/db?q`` as SQLAlchemy's ``user@/db?host=h1:p1&
    host=h2:p2&q`` (psycopg tries them in order, ``target_session_attrs`` decides which fits)."""
    if backend != "postgresql":
        return rest
    before_query, _, query = rest.partition("?")
    authority, _, path = before_query.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if "," not in hosts:
        return rest
    params = [f"host={host}" for host in hosts.split(",")] + ([query] if query else [])
    return f"{userinfo}{at}/{path}?{'&'.join(params)}"


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


def _engine_from_url(raw: str, *, prepare: bool = True) -> Engine:
    scheme, sep, rest = raw.partition("://")
    backend, _, driver = scheme.lower().partition("+")
    backend = "postgresql" if backend == "postgres" else backend
    if not sep or backend not in ("postgresql", "sqlite", "mysql", "mariadb"):
        raise ConfigurationError(f"not an SQL lock store URL: {mask_url(raw)!r}")
    module, extra = _BACKENDS.get(backend, ("sqlite3", "sqlite"))
    driver = driver or (module if backend != "sqlite" else "")
    rest = _host_list_as_query(backend, rest)
    try:
        url = make_url(f"{backend}+{driver}://{rest}" if driver else f"{backend}://{rest}")
    except (sa_exc.ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise ConfigurationError(f"malformed SQL lock store URL {mask_url(raw)!r}: {exc}") from None
    kwargs: dict[str, Any] = {}
    connect_args: dict[str, Any] = {}
    if backend == "postgresql":
        kwargs.update(isolation_level="AUTOCOMMIT", pool_reset_on_return=None)
        # libpq has no read timeout: without these a call on a network that went silent
        # waits for TCP to give up (about 15 minutes on Linux). The URL may override each.
        for option, value in _PG_NETWORK_DEFAULTS.items():
            if option not in url.query:
                connect_args[option] = value
        if not prepare and driver == "psycopg":
            # Behind PgBouncer < 1.21 (transaction pooling) a statement psycopg prepared on
            # one server connection is missing, or already there, on the next one.
            connect_args["prepare_threshold"] = None
    elif backend == "sqlite":
        connect_args["timeout"] = 30
        if url.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool
            connect_args["check_same_thread"] = False
    else:
        kwargs.update(isolation_level="READ COMMITTED", pool_recycle=3600)
        if "connect_timeout" not in url.query:
            connect_args["connect_timeout"] = 10
    try:
        engine = sa.create_engine(url, connect_args=connect_args, **kwargs)
    except (ImportError, sa_exc.NoSuchModuleError) as exc:
        raise _missing_driver(backend, driver, module, extra) from exc
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return engine


def _missing_driver(backend: str, driver: str, module: str, extra: str) -> MissingDriverError:
    if not driver or driver == module:
        return MissingDriverError(extra, module)
    # The URL names a driver the extra does not install: the extra would not help.
    package = _PIP_NAMES.get(driver, driver)
    alternative = f"{backend}+{module}:// (pip install 'celery-exclusive[{extra}]')"
    return MissingDriverError(extra, driver, f"pip install {package}, or use {alternative}")


def _bounded_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    """A connection opened for a call with a deadline gives up connecting by then."""
    timeout = deadline.connect_timeout(cparams.get("connect_timeout"))
    if timeout is not None:
        cparams["connect_timeout"] = timeout


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions are begun by the "begin" event
    with contextlib.suppress(Exception):  # WAL is an optimisation; a busy or read-only file keeps its mode
        dbapi_connection.execute("PRAGMA journal_mode=WAL")


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"option ce_{name} must be true or false, got {value!r}")


class SqlLockProvider:
    """Leases in an SQL table; see the module docstring. Thread-safe and fork-safe."""

    max_key_length = 512

    def __init__(
        self,
        engine_or_url: Engine | str,
        *,
        table: str = "cache_entries",
        create_table: bool = True,
        pgbouncer: bool = False,
    ) -> None:
        _check_name(table)
        if isinstance(engine_or_url, str):
            if split_options(engine_or_url, ("table", "create_table", "pgbouncer"))[1]:
                raise ConfigurationError(
                    f"ce_ options in {mask_url(engine_or_url)!r} are read by SqlLockProvider.from_url() "
                    "(and LockService); the constructor takes table=, create_table= and pgbouncer="
                )
            self._engine, self._owns_engine = _engine_from_url(engine_or_url, prepare=not pgbouncer), True
        elif isinstance(engine_or_url, Engine):
            self._engine, self._owns_engine = engine_or_url, False
        else:
            raise ConfigurationError(
                f"expected an SQLAlchemy Engine or URL, got {type(engine_or_url).__name__}"
            )
        dialect, url = self._engine.dialect, self._engine.url
        if dialect.name not in ("postgresql", "sqlite", "mysql", "mariadb"):
            raise ConfigurationError(f"unsupported SQL dialect {dialect.name!r} for a lock store")
        self.table = lock_table(sa.MetaData(), table)
        self._masked = mask_url(url.render_as_string(hide_password=True))
        self._secrets = url_secrets(url.render_as_string(hide_password=False))
        self._ready = not create_table
        # Whether <table>_done exists: made with the lock table when create_table is on;
        # else looked up on first use (a schema migrated before records existed lacks it).
        self._records: bool | None = True if create_table else None
        self._schema_lock = threading.Lock()
        self._memory = dialect.name == "sqlite" and url.database in (None, "", ":memory:")
        # An in-memory SQLite database is one shared connection: one transaction at a time.
        self._serial: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self._memory else contextlib.nullcontext()
        )
        self._pg = dialect.name == "postgresql"
        self._clock = _LeaseClock() if dialect.name == "sqlite" else None
        self._gate: Callable[[], contextlib.AbstractContextManager[Any]] = (
            _FORK_GATE.call if dialect.name == "sqlite" else contextlib.nullcontext
        )
        if self._pg and self._owns_engine:
            event.listen(self._engine, "do_connect", _bounded_connect)
        self._fast = self._pg and dialect.driver == "psycopg"
        # psycopg connections the fast path owns, detached from the pool: a checkout and
        # check-in cost as much Python time as the SQL. Only for an engine we built.
        self._kept: list[Any] | None = [] if self._fast and self._owns_engine else None
        self._closed = False
        if self._pg:
            self._pg_sql = _pg_statements(dialect, table)
            self._psycopg_sql = {n: libpq.PLACEHOLDER.sub(r"%(\1)s", s) for n, s in self._pg_sql.items()}
        else:
            self._sql = _generic_statements(dialect, table)
        if self._fast:
            import psycopg

            self._libpq = libpq.Runner(prepare=not pgbouncer)
            self._libpq_sql = libpq.statements(self._pg_sql, _LIBPQ_COLUMNS)
            self._pg_error: type[Exception] = psycopg.Error
            self._pg_broken: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    @classmethod
    def from_url(cls, url: str) -> SqlLockProvider:
        """A provider for ``url``; ``?ce_table=name&ce_create_table=false`` are our options.

        ``ce_pgbouncer=true`` sends every statement unprepared (the provider prepares acquire
        and release, psycopg any statement run five times), as PgBouncer before 1.21 (or
        without ``max_prepared_statements``) cannot pool prepared statements.
        """
        base, options = split_options(url, ("table", "create_table", "pgbouncer"))
        create = _parse_bool("create_table", options.get("create_table", "true"))
        pgbouncer = _parse_bool("pgbouncer", options.get("pgbouncer", "false"))
        return cls(
            base, table=options.get("table", "cache_entries"), create_table=create, pgbouncer=pgbouncer
        )

    def __repr__(self) -> str:
        return f"SqlLockProvider({self._masked!r}, table={self.table.name!r})"

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
        if self._pg:
            end = None if timeout is None else time.monotonic() + timeout
            if task_id is None:
                rows = self._pg_call("acquire", params, timeout)
            else:
                rows = self._pg_call("acquire_once", {**params, "task_id": task_id}, timeout)
                if rows and rows[0][0] is None:  # the completion record's row
                    _, outcome, _, tries, age, left, *_ = rows[0]
                    record = CompletionInfo(key, task_id, str(outcome), int(tries), float(age), float(left))
                    return Done(record)
            answer = self._pg_answer(rows, token, granted)
            if answer is None:  # a dead row (its holder crashed or lost it): take it over
                left = None if end is None else max(end - time.monotonic(), 0.001)
                answer = self._pg_answer(self._pg_call("take_over", params, left), token, granted)
            return Held(None) if answer is None else answer

        def attempt(conn: Connection) -> Grant | Held | Done:
            once = task_id is not None
            conn.execute(self._sql["bump"])  # serialises acquirers: no races, no gap-lock deadlocks
            params.update(self._now(conn))
            if once:
                params["task_id"] = task_id
            row = conn.execute(self._sql["select_once" if once else "select"], params).first()
            if row is not None:
                if once and row[-1] is not None:
                    return self._done(key, str(task_id), row[-1])
                info = self._info(row[:7])
                if _live(info):
                    return Grant(info.fence, info.expires_in) if info.token == token else Held(info)
                conn.execute(self._sql["delete"], params)
            found = conn.execute(self._sql["fence_once" if once and row is None else "fence"], params).one()
            if once and row is None and found[1] is not None:
                return self._done(key, str(task_id), found[1])
            fence = int(found[0])
            conn.execute(self._sql["insert"], {**params, "fence": fence})
            conn.commit()
            return Grant(fence, granted)

        return self._transact("acquire", attempt)

    def _pg_answer(self, rows: _Rows, token: str, granted: float) -> Grant | Held | None:
        """What an acquire statement's rows mean; None for a dead row (left to take_over).

        No rows: a concurrent acquirer inserted the key between our read and our insert.
        """
        if not rows:
            return Held(None)
        fresh, *row = rows[0]
        if fresh:
            return Grant(int(row[2]), granted)
        info = self._info(row)
        if not _live(info):
            return None
        return Grant(info.fence, info.expires_in) if info.token == token else Held(info)

    def refresh(self, requests: Sequence[RefreshRequest], *, timeout: float | None = None) -> _Answers:
        wanted = {(r.key, r.token): float(r.ttl) for r in requests}  # a repeated request: the last ttl wins
        if not wanted:
            return []
        pairs = sorted(wanted)  # a stable lock order across concurrent refreshers
        answers: dict[tuple[str, str], float] = {}
        if self._pg:
            params = {
                "keys": [k for k, _ in pairs],
                "tokens": [t for _, t in pairs],
                "ttls": [wanted[p] for p in pairs],
            }
            for index, remaining in self._pg_call("refresh", params, timeout):
                answers[pairs[int(index) - 1]] = float(remaining)
            return [answers.get((r.key, r.token)) for r in requests]

        def attempt(conn: Connection) -> None:
            now = self._now(conn)  # one instant for both statements on SQLite
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

        self._transact("refresh", attempt)
        return [answers.get((r.key, r.token)) for r in requests]

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        params: dict[str, Any] = {"key": key, "token": token}
        if completion is not None and not self._records_on():
            completion = None
        if completion is not None:
            params.update(
                task_id=completion.task_id,
                outcome=completion.outcome,
                attempt=int(completion.attempt),
                retain=float(completion.retain),
            )
        if self._pg:
            op = "release" if completion is None else "release_done" + _prune_suffix(completion)
            return any(bool(live) for (live,) in self._pg_call(op, params, timeout))

        def attempt(conn: Connection) -> bool:
            params.update(self._now(conn))
            owned = conn.execute(self._sql["release_live"], params).rowcount == 1
            if not owned:
                conn.execute(self._sql["release_any"], params)  # our own expired row: tidy it away
            if completion is not None:  # same transaction, so no extra commit
                conn.execute(self._sql["done_put"], params)
                if _prune_suffix(completion):
                    conn.execute(self._sql["done_prune"], params)
            conn.commit()
            return owned

        return self._transact("release", attempt)

    def completion(self, key: str, task_id: str) -> CompletionInfo | None:
        if not self._records_on():
            return None
        params = {"key": key, "task_id": task_id}
        if self._pg:
            rows = self._run_pg("done_get", params)
        else:
            rows = self._transact(
                "read a record",
                lambda conn: list(conn.execute(self._sql["done_get"], {**params, **self._now(conn)})),
            )
        return self._record(rows[0]) if rows else None

    def completions(self, prefix: str) -> list[CompletionInfo]:
        if not self._records_on():
            return []
        pattern = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
        params = {"prefix": prefix, "pattern": pattern}
        if self._pg:
            rows = self._run_pg("done_list", params)
        else:
            rows = self._transact(
                "list records",
                lambda conn: list(conn.execute(self._sql["done_list"], {**params, **self._now(conn)})),
            )
        return sorted((self._record(row) for row in rows), key=lambda r: (r.key, r.task_id))

    def forget(self, key: str, task_id: str) -> bool:
        if not self._records_on():
            return False
        params: dict[str, Any] = {"key": key, "task_id": task_id}
        if self._pg:
            return any(bool(live) for (live,) in self._run_pg("done_forget", params))

        def attempt(conn: Connection) -> bool:
            params.update(self._now(conn))
            live = conn.execute(self._sql["done_get"], params).first() is not None
            conn.execute(self._sql["done_forget"], params)
            conn.commit()
            return live

        return self._transact("forget a record", attempt)

    def peek(self, key: str) -> LockInfo | None:
        if self._pg:
            rows = self._run_pg("peek", {"key": key})
        else:
            rows = self._transact(
                "peek", lambda conn: list(conn.execute(self._sql["peek"], {"key": key, **self._now(conn)}))
            )
        return self._info(rows[0]) if rows else None

    def scan(self, prefix: str) -> _Infos:
        pattern = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
        params = {"prefix": prefix, "pattern": pattern}
        if self._pg:
            rows = self._run_pg("scan", params)
        else:
            rows = self._transact(
                "scan", lambda conn: list(conn.execute(self._sql["scan"], {**params, **self._now(conn)}))
            )
        return sorted((self._info(row) for row in rows), key=lambda info: info.key)

    @property
    def supports_guard(self) -> bool:
        """True on PostgreSQL, the one SQL store where :meth:`guard` works."""
        return self._pg

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
        if not self._pg:
            raise InvalidArgumentError(
                f"guard() needs a PostgreSQL lock store; this one is {self._engine.dialect.name}, "
                "whose leases cannot fence writes inside your transaction"
            )
        params = {"key": key, "token": token, "fence": int(fence)}
        found = self._guard_query(connection, params)
        if not found:
            raise LockLost(
                key,
                fence,
                "guard found no live lease with this token and fence: it expired, was released "
                "or taken over; roll back this transaction",
            )

    def _guard_query(self, connection: Any, params: dict[str, Any]) -> bool:
        """Run the guard statement on the caller's connection; True if the lease row was locked."""
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
            return connection.execute(sa.text(self._pg_sql["guard"]), params).first() is not None
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
            return connection.execute(self._psycopg_sql["guard"], params).fetchone() is not None
        raise InvalidArgumentError(
            "guard() needs the SQLAlchemy Connection or Session (or psycopg connection) of your "
            f"transaction, got {type(connection).__name__}"
        )

    def close(self) -> None:
        """Dispose of the engine's connections if this provider created the engine."""
        self._closed = True
        self._drop_kept()
        if self._owns_engine:
            with self._gate():
                self._engine.dispose()

    def diagnose(self) -> _Findings:
        """Schema presence, server clock vs this machine's, a read-only server, and on
        PostgreSQL the server's ``synchronous_commit`` (which acquire and refresh override)."""
        findings: _Findings = []
        try:
            with self._gate(), self._engine.connect() as conn:
                exists = sa.inspect(conn).has_table(self.table.name)
                status = "ok" if exists else ("warn" if not self._ready else "fail")
                findings.append(Diagnosis("schema", status, f"table {self.table.name!r} exists: {exists}"))
                done = self.table.name + "_done"
                if exists and not sa.inspect(conn).has_table(done):
                    findings.append(
                        Diagnosis(
                            "records", "warn", f"table {done!r} is missing: no completion records are kept"
                        )
                    )
                now_sql = (
                    sa.text("SELECT extract(epoch FROM clock_timestamp())") if self._pg else self._sql["now"]
                )
                if self._clock is not None:
                    if exists:
                        self._clock.setup(conn, self._sql)
                    skew = self._clock.seconds() - time.time()
                    kind = "boot clock" if self._clock.anchor is not None else "wall clock"
                    detail = f"lease clock ({kind}) is {skew:+.3f}s from this machine's wall clock"
                else:
                    skew = float(conn.execute(now_sql).scalar_one()) - time.time()
                    detail = f"server clock is {skew:+.3f}s from ours"
                findings.append(Diagnosis("clock", "ok" if abs(skew) < 2 else "warn", detail))
                if self._pg or self._engine.dialect.name != "sqlite":
                    ro_sql = "SELECT pg_is_in_recovery()" if self._pg else "SELECT @@read_only"
                    read_only = bool(conn.execute(sa.text(ro_sql)).scalar_one())
                    findings.append(
                        Diagnosis("writable", "fail" if read_only else "ok", f"read-only: {read_only}")
                    )
                if self._pg:
                    setting = str(conn.execute(sa.text("SHOW synchronous_commit")).scalar_one())
                    findings.append(
                        Diagnosis(
                            "synchronous_commit",
                            "ok",
                            f"server synchronous_commit is {setting!r}; acquire and refresh commit with "
                            f"{'remote_apply' if setting == 'remote_apply' else 'on'} regardless, "
                            "release with 'off'",
                        )
                    )
        except sa_exc.SQLAlchemyError as exc:
            findings.append(Diagnosis("connect", "fail", str(self._error("connect", exc))))
        return findings

    # -- plumbing --------------------------------------------------------------------

    def _info(self, row: Sequence[Any]) -> LockInfo:
        key, token, fence, age, expires_in, hard, holder = row
        return LockInfo(
            str(key),
            str(token),
            int(fence),
            float(age),
            float(expires_in),
            float(hard),
            decode_holder(holder),
        )

    def _records_on(self) -> bool:
        """Whether the completion-record table is there; warns once if it is not."""
        ready = self._records
        if ready is None:
            self._ensure_schema()
            name = self.table.name + "_done"
            try:
                with self._serial, self._engine.connect() as conn:
                    ready = bool(sa.inspect(conn).has_table(name))
            except sa_exc.SQLAlchemyError as exc:
                raise self._error("look for the completion-record table", exc) from exc
            if not ready:
                logger.warning(
                    "SQL lock store %s: table %r is missing, so no completion records are kept "
                    "(redelivered copies of finished tasks run again); create it with "
                    "lock_table(metadata, %r) and metadata.create_all(), or set done_retention=False",
                    self._masked,
                    name,
                    self.table.name,
                )
            self._records = ready
        return ready

    @staticmethod
    def _done(key: str, task_id: str, packed: Any) -> Done:
        """Done from the ``outcome|attempt|age|seconds left`` column of an acquire statement."""
        outcome, attempt, age, left = str(packed).split("|")
        return Done(CompletionInfo(key, task_id, outcome, int(attempt), float(age), float(left)))

    def _record(self, row: Sequence[Any]) -> CompletionInfo:
        key, task_id, outcome, attempt, age, left = row
        return CompletionInfo(str(key), str(task_id), str(outcome), int(attempt), float(age), float(left))

    def _ensure_schema(self) -> None:
        if self._ready:
            return
        with self._schema_lock:
            for attempt in range(2):
                if self._ready:
                    return
                try:
                    # On PostgreSQL CREATE ... IF NOT EXISTS still races in the catalog (a
                    # unique violation on pg_class), so creators queue on a transaction-scoped
                    # lock (PgBouncer-safe), in a real transaction rather than autocommit.
                    options = {"isolation_level": "READ COMMITTED"} if self._pg else {}
                    with (
                        self._gate(),
                        self._serial,
                        self._engine.connect().execution_options(**options) as conn,
                        conn.begin(),
                    ):
                        if self._pg:
                            conn.execute(
                                sa.text("SELECT pg_advisory_xact_lock(hashtext(:name))"),
                                {"name": f"celery_exclusive.schema.{self.table.name}"},
                            )
                        self.table.create(conn, checkfirst=True)
                        _create_fence(self.table, conn)
                    self._ready = True
                except sa_exc.SQLAlchemyError as exc:
                    # Another process may have created it between our check and our CREATE.
                    lost_race = isinstance(exc, sa_exc.IntegrityError) or "already exists" in str(exc)
                    if attempt or not lost_race:
                        raise self._error("set up the lock table", exc) from exc

    def _run_pg_pooled(self, op: str, params: dict[str, Any]) -> _Rows:
        """``_run_pg`` through SQLAlchemy (a driver other than psycopg)."""
        text = sa.text(self._pg_sql[op])

        def attempt(conn: Connection) -> _Rows:
            rows = [tuple(row) for row in conn.execute(text, params)]
            conn.commit()
            return rows

        return self._transact(op, attempt)

    def _pg_call(self, op: str, params: dict[str, Any], timeout: float | None) -> _Rows:
        """``_run_pg``, passing ``timeout`` only when there is one."""
        if timeout is None:
            return self._run_pg(op, params)
        return self._run_pg(op, params, timeout=timeout)

    def _run_pg(self, op: str, params: dict[str, Any], timeout: float | None = None) -> _Rows:
        """Run one PostgreSQL statement, autocommit, on a kept or pooled connection; its rows.

        With ``timeout`` (psycopg only) the call gives up after about that long: connecting
        is bounded by ``connect_timeout`` (whole seconds, at least 2), the statement by
        :mod:`deadline`'s watchdog, which shuts the socket down; the connection is dropped."""
        self._ensure_schema()
        if not self._fast:
            return self._run_pg_pooled(op, params)
        end = None if timeout is None else time.monotonic() + timeout
        with deadline.connect_budget(timeout):
            fairy, dbapi = self._connection(op)
        left = None if end is None else max(end - time.monotonic(), 0.001)
        watch = None
        try:
            with deadline.watch(-1 if left is None else dbapi.pgconn.socket, left) as watch:
                hot = self._libpq_sql.get(op)
                if hot is not None:  # acquire and release skip psycopg's cursor layer
                    rows: _Rows = self._libpq.run(dbapi, hot, params)
                else:
                    rows = dbapi.execute(self._psycopg_sql[op], params).fetchall()
                if not dbapi.autocommit:  # an engine the caller built without autocommit
                    dbapi.commit()
        except self._pg_error as exc:
            if watch is not None and watch.fired:
                raise self._too_slow(fairy, dbapi, op, watch.timeout) from exc
            self._failed(fairy, dbapi, exc)
            raise self._error(op, exc) from exc
        except BaseException:
            # Interrupted mid-protocol: the connection's state is unknown.
            if fairy is None:
                dbapi.close()
            else:
                fairy.invalidate()
                fairy.close()
            raise
        if watch is not None and watch.fired:  # answered just as its deadline shut the socket
            self._too_slow(fairy, dbapi, op, watch.timeout)
        else:
            self._put_back(fairy, dbapi)
        return rows

    def _put_back(self, fairy: Any, dbapi: Any) -> None:
        """After a statement: keep its connection (detached from the pool while we keep fewer
        than ``_KEEP``), or return it to the pool."""
        if fairy is not None and self._kept is not None and len(self._kept) < _KEEP:
            fairy.detach()  # ours from now on; the pool forgets it
            fairy = None
        if fairy is None:
            self._keep(dbapi)
        else:
            fairy.close()

    def _too_slow(self, fairy: Any, dbapi: Any, op: str, timeout: float) -> BackendError:
        """Drop the connection a call outlived its deadline on; the error to raise. Only this
        call was too slow (a lock wait, a silent network): the other connections fail by their
        own deadlines if they must."""
        if fairy is None:
            dbapi.close()
        else:
            fairy.invalidate()
            fairy.close()
        return BackendError(
            f"SQL lock store {self._masked} failed to {op}: no answer within its {timeout:.3g} s "
            "deadline (connection dropped)"
        )

    def _failed(self, fairy: Any, dbapi: Any, exc: Exception) -> None:
        """Put away the connection a statement failed on (``fairy`` None: a kept one)."""
        if dbapi.closed:
            # The server or the network dropped it, so likely its idle siblings too (a
            # restart, a failover): recycle every connection made before now, as
            # SQLAlchemy does on a disconnect, instead of each failing one more call.
            self._drop_kept()
            if fairy is None:
                self._engine.dispose()
            else:
                self._engine.pool._invalidate(fairy, exc)
        if fairy is not None:
            if isinstance(exc, self._pg_broken) or not dbapi.autocommit:
                fairy.invalidate(exc)
            fairy.close()
        elif dbapi.closed or isinstance(exc, self._pg_broken):
            dbapi.close()
        else:
            self._keep(dbapi)

    def _connection(self, op: str) -> tuple[Any, Any]:
        """``(None, a kept psycopg connection)``, or ``(pool checkout, its connection)``."""
        if self._kept:
            with contextlib.suppress(IndexError):  # another thread took the last one
                return None, self._kept.pop()
        try:
            fairy = self._engine.raw_connection()
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(op, exc) from exc
        return fairy, fairy.driver_connection

    def _keep(self, connection: Any) -> None:
        """Keep an owned connection for the next statement, or close it if we are full or closed."""
        kept = self._kept
        if kept is not None and not self._closed and len(kept) < _KEEP:
            kept.append(connection)
        else:
            connection.close()

    def _drop_kept(self) -> None:
        """Close every kept connection."""
        kept = self._kept
        while kept:
            try:
                connection = kept.pop()
            except IndexError:
                return
            with contextlib.suppress(Exception):  # a dead connection still closes locally
                connection.close()

    def _now(self, conn: Connection) -> dict[str, float]:
        """SQLite: ``{"now": ...}`` on the lease clock, read once the transaction has begun
        (``BEGIN IMMEDIATE``: after any wait for the database). Elsewhere the server's clock
        is used, and this is empty."""
        if self._clock is None:
            return {}
        if not conn.in_transaction():
            conn.begin()
        return {"now": self._clock.julian()}

    def _transact(self, op: str, work: Callable[[Connection], _T]) -> _T:
        """Run ``work`` in a transaction (it commits; otherwise rolled back), retrying deadlocks."""
        self._ensure_schema()
        if self._clock is not None and self._clock.anchor is None and self._clock.boot is not None:
            try:
                with self._gate(), self._serial, self._engine.connect() as conn:
                    self._clock.setup(conn, self._sql)
            except sa_exc.SQLAlchemyError as exc:
                raise self._error(op, exc) from exc
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._gate(), self._serial, self._engine.connect() as conn:
                    return work(conn)
            except sa_exc.DBAPIError as exc:
                code = getattr(exc.orig, "args", (None,))[0] if exc.orig is not None else None
                if attempt < _ATTEMPTS and code in _RETRYABLE:
                    time.sleep(random.uniform(0.005, 0.02) * attempt)
                    continue
                raise self._error(op, exc) from exc
            except sa_exc.SQLAlchemyError as exc:
                raise self._error(op, exc) from exc

    def _error(self, op: str, exc: BaseException) -> BackendError:
        cause = getattr(exc, "orig", None) or exc
        lines = str(cause).strip().splitlines()
        reason = mask_url(lines[0] if lines else "", self._secrets)[:300]  # cut after masking
        return BackendError(f"SQL lock store {self._masked} failed to {op}: {type(cause).__name__}: {reason}")

    def _after_fork(self) -> None:
        self._schema_lock = threading.Lock()
        if self._memory:
            self._serial = threading.RLock()
        # The child never shares the parent's sockets: neither the kept connections nor the
        # pool's (dropped without closing, as SQLAlchemy recommends after fork).
        if self._kept:
            _inherited_connections.extend(self._kept)
            self._kept = []
        if self._clock is not None:
            # Closing an inherited SQLite connection here would drop this process's POSIX
            # locks on the file, those of its new connections included: keep the old pool.
            _inherited_connections.append(self._engine.pool)
        self._engine.dispose(close=False)


def _after_fork(ref: weakref.ReferenceType[SqlLockProvider]) -> None:
    provider = ref()
    if provider is not None:
        provider._after_fork()
