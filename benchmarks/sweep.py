"""Does the heartbeat's sweep cost the acquire path anything? And MariaDB's record release.

``python -m benchmarks.sweep [--rounds N] [--ops N]``: on PostgreSQL, interleaved rounds of
``LockService.lock()+release()`` with the heartbeat's sweep off, and on at 0.05 s (the
heartbeat wakes at most every 0.25 s, and ran about one sweep a second here: some 60 times
the default frequency; the sweeps are counted and timed), in a table that also holds
``--dead`` dead rows under another prefix (each sweep scans them); the median of per-round
ratios. Each service holds a lease (running its heartbeat) only during its own phase, so
the sweeps run only in the "on" phases: what they cost the server shows in the ratio too.
Then, on MariaDB, ``SqlLockProvider.release`` with and without a completion record,
interleaved, and the commands (round trips) each sends.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from celery_exclusive import LockService
from celery_exclusive.providers.base import Completion
from celery_exclusive.providers.sql import SqlLockProvider

POSTGRES_URL = os.environ.get("CE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("CE_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")


def _drop(url: str, table: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for name in (table, table + "_done", table + "_fence"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text(f"DROP SEQUENCE IF EXISTS {table}_fence_seq"))
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {table}_unless(varchar, varchar)"))
    engine.dispose()


def _cycles(service: LockService, ops: int, latencies: list[float]) -> float:
    """lock()+release() cycles per second over ``ops`` distinct keys; each cycle's seconds
    appended to ``latencies``."""
    clock = time.perf_counter
    start = clock()
    for _ in range(ops):
        began = clock()
        service.release(service.lock(uuid.uuid4().hex))
        latencies.append(clock() - began)
    return ops / (clock() - start)


def _count_sweeps(service: LockService) -> list[float]:
    """The duration of each sweep ``service``'s provider runs from now on (appended)."""
    provider: Any = service.provider
    original = provider.sweep
    spent: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        try:
            return int(original(*args, **kwargs))
        finally:
            spent.append(time.perf_counter() - start)

    provider.sweep = timed
    return spent


def postgres(rounds: int, ops: int, dead: int) -> None:
    table = f"ce_bench_sweep_{uuid.uuid4().hex[:8]}"
    url = f"{POSTGRES_URL}?ce_table={table}"
    try:
        filler = SqlLockProvider(POSTGRES_URL, table=table)
        filler.acquire("warm", "t", 1, 1, "{}")
        with filler._engine.begin() as conn:  # dead rows of another prefix: every sweep scans them
            conn.execute(
                sa.text(
                    f"INSERT INTO {table} (key, value, expires_at, created_at, deadline, fence) "
                    "SELECT 'other:' || g, 't', now() - interval '1 h', now() - interval '2 h', "
                    "now() + interval '1 h', g FROM generate_series(1, :n) AS g"
                ),
                {"n": dead},
            )
        filler.close()
        off = LockService(url, prefix="bench-off:", sweep_interval=None)
        on = LockService(url, prefix="bench-on:", sweep_interval=0.05)
        sweeps = _count_sweeps(on)
        ratios, rates_off, rates_on, swept = [], [], [], []
        cycle: dict[int, list[float]] = {id(off): [], id(on): []}
        for index in range(rounds):
            pair = (off, on) if index % 2 == 0 else (on, off)
            got = {}
            for service in pair:
                # A held lease runs the service's heartbeat, so "on" sweeps during its own
                # phase only (a heartbeat without leases sleeps): the other phase runs with
                # no sweeping anywhere, and the server's share of the sweep counts too.
                held = service.lock("held")
                time.sleep(0.1)
                before = len(sweeps)
                got[id(service)] = _cycles(service, ops, cycle[id(service)])
                if service is on:
                    swept.append(len(sweeps) - before)
                service.release(held)
            rates_off.append(got[id(off)])
            rates_on.append(got[id(on)])
            ratios.append(got[id(on)] / got[id(off)])
        off.close()
        on.close()
        print(
            f"postgres lock()+release(): sweep off {statistics.median(rates_off):,.0f}/s, "
            f"sweep every 0.05 s {statistics.median(rates_on):,.0f}/s; median per-round ratio on/off "
            f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)}); "
            f"cycle p50 off {statistics.median(cycle[id(off)]) * 1e6:.0f} us, on "
            f"{statistics.median(cycle[id(on)]) * 1e6:.0f} us; "
            f"{sum(swept):,} sweeps ran during the 'on' phases ({statistics.median(swept):.0f} per phase, "
            f"median {statistics.median(sweeps) * 1e3:.1f} ms each), each scanning {dead:,} dead rows "
            "of another prefix"
        )
    finally:
        _drop(POSTGRES_URL, table)


def mariadb(rounds: int, ops: int) -> None:
    import pymysql.connections

    sent = [0]
    original = pymysql.connections.Connection._execute_command

    def counted(self: Any, command: int, sql: Any) -> Any:
        sent[0] += 1
        return original(self, command, sql)

    pymysql.connections.Connection._execute_command = counted  # type: ignore[method-assign]
    table = f"ce_bench_rel_{uuid.uuid4().hex[:8]}"
    provider = SqlLockProvider(MYSQL_URL, table=table)
    try:
        provider.acquire("warm", "t", 1, 1, "{}")
        times: dict[bool, list[float]] = {False: [], True: []}
        commands: dict[bool, list[int]] = {False: [], True: []}
        for index in range(rounds):
            for record in (False, True) if index % 2 == 0 else (True, False):
                spent = 0.0
                for i in range(ops):
                    key = uuid.uuid4().hex
                    provider.acquire(key, "t", 30, 60, "{}")
                    before = sent[0]
                    start = time.perf_counter()
                    provider.release(key, "t", Completion(f"id{i}", "success", 0, 60) if record else None)
                    spent += time.perf_counter() - start
                    commands[record].append(sent[0] - before)
                times[record].append(spent / ops * 1e6)
        print(
            f"mariadb release: without record {statistics.median(times[False]):.0f} us, "
            f"{statistics.median(commands[False]):.0f} commands; with record "
            f"{statistics.median(times[True]):.0f} us, {statistics.median(commands[True]):.0f} commands "
            f"(median of {rounds} interleaved rounds of {ops})"
        )
    finally:
        pymysql.connections.Connection._execute_command = original  # type: ignore[method-assign]
        provider.close()
        _drop(MYSQL_URL, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--dead", type=int, default=20_000)
    parser.add_argument("--only", choices=("postgres", "mariadb"), default=None)
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.only in (None, "postgres"):
        postgres(args.rounds, args.ops, args.dead)
    if args.only in (None, "mariadb"):
        mariadb(args.rounds, args.ops)


if __name__ == "__main__":
    main()
