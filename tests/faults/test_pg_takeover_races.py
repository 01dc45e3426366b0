"""A PostgreSQL single-lock grant lost to a racing grant of the same key writes nothing.

The key is absent (the ``acquire`` statement's INSERT) or dead, its holder's lease run out
(the ``take_over`` statement's UPDATE). A rival's grant is stalled inside its write (a
trigger waits on an advisory lock the test holds, tests/faults/_pg_stall.py) with the key
lock held; the late acquirer's statement, whose snapshot does not see the rival's write,
waits for the key lock (seen in ``pg_locks``). Once the rival commits, the late statement
must have taken nothing and written nothing: no tuple, no fence drawn from the sequence, no
transaction id (whose commit would write and flush WAL). The contended acquire that finds
a live row never gets that far (tests/providers/test_sql_provider.py); this is the race.
The late acquire then answers Held naming the rival, and the key's fences grow in grant
order.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from celery_exclusive.providers.base import Grant, Held
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import POSTGRES_URL
from tests.faults._pg_stall import install_stall, psycopg_dsn, waiting_for_key_lock, waiting_on
from tests.faults.conftest import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dead", [False, True], ids=["absent-key", "dead-lease"])
def test_pg_a_grant_lost_to_a_racer_draws_no_fence_takes_no_xid_and_writes_nothing(
    pg_table: str, dead: bool
) -> None:
    import psycopg

    dsn = psycopg_dsn(POSTGRES_URL)
    rival = SqlLockProvider(POSTGRES_URL, table=pg_table)
    late = SqlLockProvider(POSTGRES_URL, table=pg_table)
    key, gate_id = "k", random.randrange(1, 2**31)
    fences: list[int] = []
    try:
        assert isinstance(rival.acquire("warm", "w", 60, 600, "{}"), Grant)  # creates the table
        if dead:
            old = rival.acquire(key, "old", 0.05, 600, "{}")
            assert isinstance(old, Grant)
            fences.append(old.fence)
            time.sleep(0.15)  # its lease ran out: a dead row
        install_stall(dsn, pg_table, "rival", gate_id, "INSERT OR UPDATE")
        op = "take_over" if dead else "acquire"
        params = {"key": key, "token": "late", "ttl": 60.0, "life": 600.0, "holder": "{}"}
        answers: dict[str, Any] = {}
        seen: dict[str, Any] = {}

        def lose(conn: Any) -> None:
            """The late statement in a transaction kept open until its effects were read."""
            seen["rows"] = conn.execute(late._psycopg_sql[op], params).fetchall()
            seen["tuples"] = conn.execute(
                "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_xact_user_tables WHERE relname = %s",
                (pg_table,),
            ).fetchone()
            seen["xid"] = conn.execute("SELECT txid_current_if_assigned()").fetchone()
            fence_of = f"(SELECT fence FROM {pg_table} WHERE key = %s)"
            seen["fence drawn since the rival's"] = conn.execute(
                f"SELECT last_value - {fence_of} FROM {pg_table}_fence_seq", (key,)
            ).fetchone()
            conn.rollback()

        with psycopg.connect(dsn, autocommit=True) as gate, psycopg.connect(dsn) as conn:
            gate.execute("SELECT pg_advisory_lock(%s)", (gate_id,))
            racing = threading.Thread(
                target=lambda: answers.setdefault("rival", rival.acquire(key, "rival", 60, 600, "{}"))
            )
            racing.start()
            assert wait_until(lambda: waiting_on(dsn, gate_id), 10), "the rival's write never stalled"
            losing = threading.Thread(target=lose, args=(conn,))
            losing.start()
            assert wait_until(lambda: waiting_for_key_lock(dsn, pg_table, key), 10), (
                "the late statement never waited for the key lock"
            )
            gate.execute("SELECT pg_advisory_unlock(%s)", (gate_id,))
            racing.join(15)
            losing.join(15)
        assert not racing.is_alive()
        assert not losing.is_alive()
        won = answers["rival"]
        assert isinstance(won, Grant)
        fences.append(won.fence)
        assert seen == {
            "rows": [],  # no grant, and the rival's row is not in its snapshot
            "tuples": (0, 0, 0),
            "xid": (None,),
            "fence drawn since the rival's": (0,),
        }, seen
        held = late.acquire(key, "late", 60, 600, "{}")
        assert isinstance(held, Held)
        assert held.holder is not None
        assert held.holder.token == "rival"
        assert rival.release(key, "rival") is True
        again = late.acquire(key, "late", 60, 600, "{}")
        assert isinstance(again, Grant)
        fences.append(again.fence)
        assert fences == sorted(fences), fences
        assert len(set(fences)) == len(fences), fences
    finally:
        rival.close()
        late.close()
