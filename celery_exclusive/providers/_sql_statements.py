"""The SQLite and MariaDB/MySQL store's statements: declarative tables, one per dialect.

Each function returns every statement of the store by operation name (``bump``,
``select``, ``insert``, ...), built once per provider from the dialect and the table name;
the provider and its collaborators only ever look statements up by name. Times are on the
store's clock: the server's on MariaDB/MySQL, the bound ``:now`` (the lease clock, see
:class:`._sqlite.LeaseClock`) on SQLite.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from celery_exclusive.providers._sql_common import PRUNE_BATCH, STALE

__all__ = ["generic_statements", "generic_sweep_statements"]


def generic_statements(dialect: Dialect, name: str) -> dict[str, sa.TextClause]:
    """Every statement of the store on SQLite or MariaDB/MySQL, by operation."""
    q = dialect.identifier_preparer.quote
    t, f, k, v = q(name), q(name + "_fence"), q("key"), q("value")
    if dialect.name == "sqlite":
        # The time comes from Python (:now, a Julian day on the boot clock, see LeaseClock);
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
    # The record, unless the stored one is live and of a later attempt: a late writer of an
    # earlier attempt's record (a killed run recorded after its retry finished) must not
    # turn it back. MariaDB's SET runs left to right, each seeing the values set before it:
    # `attempt`, in the condition, is set last but one, `expires_at` last, so every column
    # sees the condition as it was.
    put = (
        f"INTO {d} ({k}, task_id, outcome, attempt, created_at, expires_at) "
        f"VALUES (:key, :task_id, :outcome, :attempt, {stamp('0')}, {stamp(':retain')})"
    )
    if dialect.name == "sqlite":
        done_put = (
            f"INSERT {put} ON CONFLICT ({k}, task_id) DO UPDATE SET outcome = excluded.outcome, "
            "attempt = excluded.attempt, created_at = excluded.created_at, expires_at = excluded.expires_at "
            f"WHERE attempt <= excluded.attempt OR {secs('expires_at')} <= 0"
        )
    else:
        later = f"(attempt <= VALUES(attempt) OR {secs('expires_at')} <= 0)"
        done_put = f"INSERT {put} ON DUPLICATE KEY UPDATE " + ", ".join(
            f"{c} = IF({later}, VALUES({c}), {c})" for c in ("outcome", "created_at", "attempt", "expires_at")
        )
    expired = f"expires_at <= {stamp('0')} AND NOT ({pick})"
    sql.update(
        {
            "done_get": f"SELECT {done_cols} FROM {d} WHERE {pick} AND {secs('expires_at')} > 0",
            "done_put": done_put,
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


def generic_sweep_statements(dialect: Dialect, name: str) -> dict[str, sa.TextClause]:
    """The sweep (``Sweeps``) on SQLite or MariaDB/MySQL: dead leases and expired records
    under a prefix, at most ``:limit`` of each, every condition on the store's clock.

    SQLite deletes in one statement per table (the database is locked for writing anyway).
    MariaDB first reads the candidates' keys without locking (a full scan, as ``scan``
    does), then deletes those rows by key with the condition repeated: the DELETE locks
    only them and judges each on its latest committed version, so a row refreshed or taken
    over meanwhile stays. Fences come from ``<table>_fence``, never from the rows.

    On both, the expired records are found through the ``expires_at`` index (a few reads
    per record, whatever the number of live ones: tests/providers/test_sql_prune.py); the
    leases' part reads the whole lock table (its dead test is an ``OR`` over three
    columns), which holds the live leases and markers plus the dead rows not swept yet:
    see BENCHMARKS.md, the sweep's cost.
    """
    q = dialect.identifier_preparer.quote
    t, d, k = q(name), q(name + "_done"), q("key")
    if dialect.name == "sqlite":
        match = f"substr({k}, 1, length(:prefix)) = :prefix"
        dead = (
            "(julianday(expires_at) < :now OR julianday(deadline) < :now "
            f"OR (:now - julianday(created_at)) * 86400.0 > {STALE})"
        )
        # The records are found through their expires_at index: the bare column compared
        # with :now is an index range, julianday(expires_at) was not, and each sweep read
        # every record under the prefix (800,000 VM steps at 100,000 live records; about
        # 500 now: tests/providers/test_sql_prune.py). Stamps are Julian day REALs; the
        # second range keeps the text stamps of earlier versions sweepable (text sorts
        # after every number, so it reads only those: a MULTI-INDEX OR of two ranges).
        expired = "(expires_at < :now OR (expires_at >= '' AND julianday(expires_at) < :now))"
        texts = {
            "sweep_leases": f"DELETE FROM {t} WHERE rowid IN "
            f"(SELECT rowid FROM {t} WHERE {match} AND {dead} LIMIT :limit)",
            "sweep_done": f"DELETE FROM {d} WHERE rowid IN "
            f"(SELECT rowid FROM {d} WHERE {match} AND {expired} LIMIT :limit)",
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
