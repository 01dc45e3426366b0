"""PostgreSQL: the release that prunes expired completion records, and the sweep's part for
records, read only the expired records, however many live ones ``<table>_done`` holds and
whichever plan the server cached (issue #16: a prune that read every live record made each
release that pruned slower as the table grew; the sweep scanned them all too).

Counted in buffers the statement's record nodes touch (``EXPLAIN (ANALYZE, BUFFERS)``), never
in time. Real server, a table per test (dropped after).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_exclusive.providers._sql_common import PRUNE_BATCH
from celery_exclusive.providers.base import Completion, Grant
from tests.providers.test_sql_provider import Db, _database, _psycopg_dsn

#: Live records in the table: 100,000 rows fill about 1,100 heap pages.
LIVE = 100_000
#: Buffers the record nodes may touch: a few index pages, and for each row deleted its heap
#: page, its primary-key lookup and its index entries. A scan of the live records touches
#: over 1,000.
BASE, PER_ROW = 8, 8
MODES = ["force_custom_plan", "force_generic_plan"]


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Db]:
    yield from _database("postgresql", tmp_path)


def _nodes(plan: dict[str, Any], ctes: tuple[str, ...]) -> list[dict[str, Any]]:
    """The plan nodes of the CTEs named ``ctes``."""
    found = []
    for sub in plan.get("Plans", []):
        if sub.get("Subplan Name") in {f"CTE {c}" for c in ctes}:
            found.append(sub)
        else:
            found += _nodes(sub, ctes)
    return found


def _touched(
    pg: Db, op: str, values: dict[str, Any], *, mode: str, expired: int, ctes: tuple[str, ...]
) -> int:
    """Buffers the ``ctes`` of the provider's statement ``op`` touch, run as a prepared
    statement in plan cache ``mode`` against ``LIVE`` live and ``expired`` expired records
    (keys under ``app:``), its plan made (and, generic, cached) while the table was empty."""
    import psycopg
    from psycopg import sql

    provider: Any = pg.provider()  # a PostgresProvider: its statements by name
    try:
        # The provider creates the lock table and <table>_done with its own DDL.
        assert isinstance(provider.acquire("app:k", "t", 60, 600, "{}", task_id="first"), Grant)
        assert provider.release("app:k", "t", Completion("first", "success", 0, 3600.0))
        statement = provider._pg_sql[op]
    finally:
        provider.close()
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    done = f'"{pg.table}_done"'
    with psycopg.connect(_psycopg_dsn(pg), autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {done} SET (autovacuum_enabled = false)")  # no ANALYZE meanwhile
        conn.execute(f"SET plan_cache_mode = {mode}")
        conn.execute("PREPARE s AS " + re.sub(r"(?<!:):(\w+)", number, statement))

        def run(i: int, explain: bool = False) -> list[Any]:
            given = {n: v.format(i=i) if isinstance(v, str) else v for n, v in values.items()}
            args = sql.SQL(", ").join(sql.Literal(given[n]) for n in names)  # EXECUTE's are untyped
            head = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " if explain else ""
            return conn.execute(sql.SQL(head + "EXECUTE s({})").format(args)).fetchall()

        for i in range(6):
            run(i)
        insert = f"INSERT INTO {done} (key, task_id, outcome, attempt, created_at, expires_at) "
        conn.execute(
            insert + "SELECT 'app:live:' || i, 'task-' || i, 'success', 0, now(), now() + interval '1 hour' "
            f"FROM generate_series(1, {LIVE}) AS i"
        )
        conn.execute(
            insert + "SELECT 'app:old:' || i, 'task-' || i, 'success', 0, now() - interval '2 s', "
            f"now() - interval '1 s' FROM generate_series(1, {expired}) AS i"
        )
        plan = run(99, explain=True)[0][0][0]["Plan"]
        nodes = _nodes(plan, ctes)
        assert len(nodes) == len(ctes)
        left = conn.execute(f"SELECT count(*) FROM {done} WHERE key LIKE 'app:old:%'").fetchone()
        assert left == (max(0, expired - int(values.get("limit", PRUNE_BATCH))),)
        conn.execute("DEALLOCATE s")
    return sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in nodes)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expired", [0, 100])
def test_pg_prune_reads_only_expired_records(pg: Db, mode: str, expired: int) -> None:
    """With 100,000 live records (and none or 100 expired), the pruning release's prune touches
    a few buffers per row it deletes: in a custom plan, and in a generic plan made while the
    table was empty and kept after it filled (what a server that runs no ANALYZE keeps)."""
    values: dict[str, Any] = {"key": "app:k{i}", "token": "t", "task_id": "t{i}", "outcome": "success"}
    values.update({"attempt": 0, "retain": 3600.0, "channel": "c"})
    touched = _touched(pg, "release_done_prune", values, mode=mode, expired=expired, ctes=("prune",))
    most = BASE + PER_ROW * min(expired, PRUNE_BATCH)
    assert touched <= most, f"the prune touched {touched} buffers ({mode}, {expired} expired)"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("expired", [0, 20])
def test_pg_sweep_reads_only_expired_records(pg: Db, mode: str, expired: int) -> None:
    """The same for the sweep's records (all 100,000 under the swept prefix): it finds the
    expired ones through the expires_at index, not by scanning the prefix's records."""
    values: dict[str, Any] = {"pattern": "app:%", "limit": 500}
    touched = _touched(pg, "sweep", values, mode=mode, expired=expired, ctes=("old", "forgotten"))
    most = BASE + PER_ROW * expired
    assert touched <= most, f"the sweep touched {touched} buffers ({mode}, {expired} expired)"
