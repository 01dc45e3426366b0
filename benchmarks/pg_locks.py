"""Uncontended acquire + release on PostgreSQL: the package against raw psycopg and other designs."""

from __future__ import annotations

import os
import secrets
from typing import Any

from benchmarks.harness import (
    ORIGIN_TABLE,
    POSTGRES_URL,
    TABLE,
    Cleanup,
    Plan,
    Report,
    interleave,
    median,
    psycopg_dsn,
    reachable,
    round_ratios,
    with_table,
)

SECTION = "postgres"
RAW = "raw psycopg: the provider's one-statement SQL, autocommit, 1 connection"
ADVISORY = "advisory lock: pg_try_advisory_lock + pg_advisory_unlock"
PROVIDER = "celery-exclusive SqlLockProvider.acquire + release"
SERVICE = "celery-exclusive LockService.lock + release (public API)"
ORIGIN = "origin design on SQLAlchemy: DELETE expired; INSERT; SELECT on conflict"
ROWS = [RAW, ADVISORY, PROVIDER, SERVICE, ORIGIN]
TARGET_RAW = "postgres: LockService vs raw psycopg (same SQL)"
TARGET_ORIGIN = "postgres: LockService vs origin design"
TARGETS = [(TARGET_RAW, 0.8, ">=", "x"), (TARGET_ORIGIN, 4.0, ">=", "x")]

TTL = 900.0
LIFE = 86400.0
KEYS = 256


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """Interleave the five approaches; rows for each, and the two targets."""
    reason = reachable(POSTGRES_URL)
    if reason:
        report.unavailable(SECTION, ROWS, TARGETS, reason)
        return
    import psycopg
    import sqlalchemy as sa

    from benchmarks.origin import OriginLock, origin_table
    from celery_exclusive import LockService
    from celery_exclusive.providers.base import encode_holder

    service = LockService(with_table(POSTGRES_URL, TABLE), prefix="svc:", ttl=TTL)
    service.lock("warm-up").release()  # creates the table and its fence sequence
    provider: Any = service.provider
    sql = provider._psycopg_sql  # exactly the statements the provider sends
    raw = psycopg.connect(psycopg_dsn(), autocommit=True)
    advisory = psycopg.connect(psycopg_dsn(), autocommit=True)
    engine = sa.create_engine(POSTGRES_URL)  # the origin's engine: SQLAlchemy's defaults
    table = origin_table(sa.MetaData(), ORIGIN_TABLE)
    table.create(engine, checkfirst=True)
    origin = OriginLock(engine, table)
    holder = encode_holder({"host": "benchmark-host", "pid": os.getpid()})
    try:

        def raw_sql(i: int) -> None:
            params = {"key": f"raw:{i % KEYS}", "token": secrets.token_hex(16), "ttl": TTL, "life": LIFE}
            rows = raw.execute(sql["acquire"], {**params, "holder": holder}).fetchall()
            if not rows or not rows[0][0]:
                raise RuntimeError("raw: key unexpectedly held")
            raw.execute(sql["release"], params).fetchall()

        def advisory_lock(i: int) -> None:
            key = f"{TABLE}:adv:{i % KEYS}"
            if not advisory.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (key,)
            ).fetchone()[0]:  # type: ignore[index]
                raise RuntimeError("advisory: key unexpectedly held")
            advisory.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (key,)).fetchone()

        def provider_only(i: int) -> None:
            key, token = f"prov:{i % KEYS}", secrets.token_hex(16)
            provider.acquire(key, token, TTL, LIFE, holder)
            provider.release(key, token)

        def package(i: int) -> None:
            service.lock(f"k{i % KEYS}").release()

        def origin_design(i: int) -> None:
            key = f"origin:{i % KEYS}"
            token = origin.try_acquire(key, TTL)
            if token is None:
                raise RuntimeError("origin: key unexpectedly held")
            origin.release(key, token)

        approaches = {RAW: raw_sql, ADVISORY: advisory_lock, PROVIDER: provider_only, SERVICE: package}
        series = interleave(approaches, rounds=plan.rounds, ops=plan.pg_ops, warmup=max(20, plan.pg_ops // 5))
        # The origin is 3-4x slower: its own (smaller) batches, interleaved with the service's.
        slow = interleave(
            {SERVICE: package, ORIGIN: origin_design},
            rounds=plan.rounds,
            ops=plan.origin_ops,
            warmup=max(10, plan.origin_ops // 5),
        )
        report.series_rows(
            SECTION,
            {**series, ORIGIN: slow[ORIGIN]},
            {
                RAW: "baseline: same statements, prepared by psycopg after 5 uses",
                ADVISORY: "info: session locks, no row, no WAL, no fsync; no ttl, no fence",
                SERVICE: "a kept connection; acquire and release prepared, sent through libpq directly",
                ORIGIN: "3 transactions (BEGIN; statement; COMMIT): 9 round trips per acquire+release",
            },
        )
        vs_raw = round_ratios(series[SERVICE], series[RAW])
        vs_origin = round_ratios(slow[SERVICE], slow[ORIGIN])
        report.target(TARGET_RAW, median(vs_raw), 0.8, rounds=vs_raw)
        report.target(
            TARGET_ORIGIN,
            median(vs_origin),
            4.0,
            rounds=vs_origin,
            note="a WAL flush per acquire+release for the package (its release commits without "
            "waiting for one), two for the origin, plus its 9 round trips",
        )
    finally:
        raw.close()
        advisory.close()
        engine.dispose()
        service.close()
