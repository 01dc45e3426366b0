"""Deterministic stalls inside PostgreSQL statements, for the fault tests of the SQL stores.

A trigger on the test's own lock table waits, for one token's row only, on an advisory lock
the test holds (:func:`install_stall`); the test sees the stall, or another statement's
wait for a key lock, in ``pg_locks`` (:func:`waiting_on`, :func:`waiting_for_key_lock`).
Nothing here touches a table the test did not create; ``pg_table`` (tests/faults/conftest.py)
drops the table and its stall function afterwards.
"""

from __future__ import annotations

import sqlalchemy as sa


def psycopg_dsn(url: str) -> str:
    """The libpq connection string of a SQLAlchemy PostgreSQL URL."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def install_stall(dsn: str, table: str, token: str, lock_id: int, events: str = "INSERT") -> None:
    """A BEFORE ``events`` row trigger that, for ``token``'s row only, waits for advisory lock
    ``lock_id``: the write stalls after its values (the fence included) were computed, with
    the key lock it took first still held (and, for an UPDATE, the row locked)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"""CREATE FUNCTION {table}_stall() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.value = '{token}' THEN
    PERFORM pg_advisory_lock({lock_id});
    PERFORM pg_advisory_unlock({lock_id});
  END IF;
  RETURN NEW;
END $$"""
        )
        conn.execute(
            f"CREATE TRIGGER {table}_stall BEFORE {events} ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {table}_stall()"
        )


def waiting_on(dsn: str, lock_id: int) -> bool:
    """Whether some session waits for the one-key advisory lock ``lock_id`` (a stall)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND classid = 0 AND objid = %s AND objsubid = 1",
            (lock_id,),
        ).fetchone()
    return bool(row and row[0])


def waiting_for_key_lock(dsn: str, table: str, key: str) -> bool:
    """Whether some session waits for the provider's key lock of ``key`` in ``table``
    (``pg_advisory_xact_lock(hashtext(table), hashtext(key))``, drawn before a fence)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 2 "
            "AND classid::int8 = (hashtext(%s)::int8 + 4294967296) %% 4294967296 "
            "AND objid::int8 = (hashtext(%s)::int8 + 4294967296) %% 4294967296",
            (table, key),
        ).fetchone()
    return bool(row and row[0])


def blocked_by(dsn: str, pid: int) -> bool:
    """Whether some session waits for a lock held by backend ``pid`` (a row, a transaction)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)
        ).fetchone()
    return bool(row and row[0])
