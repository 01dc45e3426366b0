"""Uncontended acquire + release on PostgreSQL: the package against raw psycopg and other designs."""

from __future__ import annotations

import functools
import gc
import math
import os
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any

from benchmarks import floors
from benchmarks.harness import (
    ORIGIN_TABLE,
    POSTGRES_URL,
    TABLE,
    Cleanup,
    Op,
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
CURSORS = "LockService.lock + release, hot path on psycopg's RawCursor(prepare=True) instead"
ORIGIN = "origin design on SQLAlchemy: DELETE expired; INSERT; SELECT on conflict"
C_FLOOR = "C libpq floor: the package's 2 statements, prepared, its durability"
C_DURABLE = "C libpq: the same 2 statements, both committed durably"
PY_FLOOR = "Python floor: the package's 2 statements, prepared, psycopg.pq with a poll() wait"
WHERE_SERVICE = "where a cycle goes: LockService.lock + release"
WHERE_PROVIDER = "where a cycle goes: provider acquire + release"
WHERE_C = "where a cycle goes: C libpq floor"
C_THINK = "C libpq floor + the service's extra client CPU, busy-waited"
WHERE = [WHERE_SERVICE, WHERE_PROVIDER, WHERE_C, C_THINK]
ROWS = [RAW, ADVISORY, PROVIDER, SERVICE, CURSORS, ORIGIN, C_FLOOR, C_DURABLE, PY_FLOOR, *WHERE]
TARGET_RAW = "postgres: LockService vs raw psycopg (same SQL)"
TARGET_ORIGIN = "postgres: LockService vs origin design"
TARGET_C = "postgres: LockService vs C libpq floor (same statements, same durability)"
TARGETS = [(TARGET_RAW, 0.8, ">=", "x"), (TARGET_ORIGIN, 4.0, ">=", "x"), (TARGET_C, 0.9, ">=", "x")]

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
    from celery_exclusive.providers._pg_listen import channel
    from celery_exclusive.providers.base import encode_holder

    service = LockService(with_table(POSTGRES_URL, TABLE), prefix="svc:", ttl=TTL)
    service.lock("warm-up").release()  # creates the table and its fence sequence
    cursors = cursor_service(prefix="cur:")
    provider: Any = service.provider
    sql = provider._psycopg_sql  # exactly the statements the provider sends
    raw = psycopg.connect(psycopg_dsn(), autocommit=True)
    advisory = psycopg.connect(psycopg_dsn(), autocommit=True)
    engine = sa.create_engine(POSTGRES_URL)  # the origin's engine: SQLAlchemy's defaults
    table = origin_table(sa.MetaData(), ORIGIN_TABLE)
    table.create(engine, checkfirst=True)
    origin = OriginLock(engine, table)
    holder = encode_holder({"host": "benchmark-host", "pid": os.getpid()})
    programs: list[floors.FloorProgram] = []
    python_floor: floors.PgPythonFloor | None = None
    try:

        def raw_sql(i: int) -> None:
            params = {"key": f"raw:{i % KEYS}", "token": secrets.token_hex(16), "ttl": TTL, "life": LIFE}
            rows = raw.execute(sql["acquire"], {**params, "holder": holder}).fetchall()
            if not rows or not rows[0][0]:
                raise RuntimeError("raw: key unexpectedly held")
            raw.execute(sql["release"], {**params, "channel": channel(TABLE, params["key"])}).fetchall()

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

        def on_cursors(i: int) -> None:
            cursors.lock(f"k{i % KEYS}").release()

        def origin_design(i: int) -> None:
            key = f"origin:{i % KEYS}"
            token = origin.try_acquire(key, TTL)
            if token is None:
                raise RuntimeError("origin: key unexpectedly held")
            origin.release(key, token)

        approaches: dict[str, Op] = {
            RAW: raw_sql,
            ADVISORY: advisory_lock,
            PROVIDER: provider_only,
            SERVICE: package,
            CURSORS: on_cursors,
        }
        missing = _c_floors(approaches, programs, provider, cleanup)
        python_floor = _python_floor(approaches, missing, provider, holder)
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
                C_FLOOR: "the floor: acquire committed durably, release asynchronously (as the package)",
                CURSORS: "info (issue #11 item 2): the same service, acquire and release on psycopg's "
                f"supported API; {_vs(series, CURSORS, SERVICE)} the libpq runner's rate, "
                f"{_vs(series, CURSORS, C_FLOOR)} the C floor's",
                C_DURABLE: "info: release without its synchronous_commit=off clause",
                PY_FLOOR: "reference: the least Python can do for the same 2 statements; "
                f"{_vs(series, PY_FLOOR, C_FLOOR)} the C floor's rate, the service "
                f"{_vs(series, SERVICE, PY_FLOOR)} of it",
            },
        )
        for name, reason in missing.items():
            report.row(SECTION, name, note=f"n/a: {reason}")
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
        if C_FLOOR in series:
            vs_c = round_ratios(series[SERVICE], series[C_FLOOR])
            extra = 1e6 / series[SERVICE].rate - 1e6 / series[C_FLOOR].rate
            durable = ""
            if C_DURABLE in series:
                vs_d = median(round_ratios(series[SERVICE], series[C_DURABLE]))
                durable = f"; {vs_d:.2f}x the C client that commits both durably"
            if PY_FLOOR in series:
                vs_py = median(round_ratios(series[PY_FLOOR], series[C_FLOOR]))
                durable += f"; the Python floor is {vs_py:.2f}x the C floor"
            report.target(
                TARGET_C,
                median(vs_c),
                0.9,
                rounds=vs_c,
                note=f"issue #16; {extra:.0f} µs more per cycle than the C floor (median rates){durable}",
            )
        else:
            report.target(TARGET_C, math.nan, 0.9, note=f"n/a: {missing.get(C_FLOOR, '?')}")
        floor = programs[0] if programs and C_FLOOR not in missing else None
        _where_time_goes(
            report, plan, provider, {WHERE_SERVICE: package, WHERE_PROVIDER: provider_only}, floor
        )
    finally:
        for program in programs:
            program.close()
        if python_floor is not None:
            python_floor.close()
        raw.close()
        advisory.close()
        engine.dispose()
        service.close()
        cursors.close()


class Cursors:
    """The provider's libpq runner's interface (``run(connection, statement, params)``,
    ``run_text(connection, statement, values)``) on psycopg's supported API: per connection
    a kept ``RawCursor`` (``$n`` placeholders, as the runner's statements have them), each
    statement ``execute(..., prepare=True)``. The text values the provider made for
    ``run_text`` are passed as strs (psycopg sends a str untyped: the server reads a
    number's text as the number)."""

    def run_text(
        self, connection: Any, statement: Any, values: list[bytes | None], end: float | None = None
    ) -> list[tuple[Any, ...]]:
        texts = (None if value is None else value.decode() for value in values)
        return self.run(connection, statement, dict(zip(statement.params, texts, strict=True)), end)

    def __init__(self) -> None:
        import psycopg

        self._cursor = psycopg.RawCursor
        self._cursors: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def run(
        self, connection: Any, statement: Any, params: dict[str, Any], end: float | None = None
    ) -> list[tuple[Any, ...]]:
        from celery_exclusive.providers import _deadline

        cursor = self._cursors.get(connection)
        if cursor is None or cursor.closed:
            cursor = self._cursors[connection] = self._cursor(connection)
        # psycopg's wait has no deadline of its own: the call's is the watchdog's, as the
        # provider's statements on psycopg's execute have it.
        ticket = None if end is None else _deadline.arm(connection.pgconn.socket, end)[0]
        try:
            cursor.execute(statement.sql, [params[name] for name in statement.params], prepare=True)
            rows: list[tuple[Any, ...]] = cursor.fetchall()
        finally:
            if ticket is not None:
                _deadline.disarm(ticket)
        return rows


def cursor_service(prefix: str) -> Any:
    """A LockService on the benchmark's table whose provider sends acquire and release
    through psycopg's RawCursor with prepare=True (:class:`Cursors`), not the libpq runner."""
    from celery_exclusive import LockService

    service = LockService(with_table(POSTGRES_URL, TABLE), prefix=prefix, ttl=TTL)
    service.provider._executor.runner = Cursors()  # type: ignore[attr-defined]
    service.lock("warm-up").release()
    return service


def _vs(series: dict[str, Any], a: str, b: str) -> str:
    """``0.93x``: the median per-round ratio of ``a``'s rate to ``b``'s (``n/a`` without ``b``)."""
    if a not in series or b not in series:
        return "n/a x"
    return f"{median(round_ratios(series[a], series[b])):.2f}x"


def _c_floors(
    approaches: dict[str, Op], programs: list[floors.FloorProgram], provider: Any, cleanup: Cleanup
) -> dict[str, str]:
    """Add the C libpq floors to ``approaches`` (started, in ``programs``); why each is n/a."""
    statements = getattr(getattr(provider, "_executor", None), "statements", None)
    if not statements or "acquire" not in statements or "release" not in statements:
        reason = "the provider's libpq statements (acquire, release) are not where they were"
        return {C_FLOOR: reason, C_DURABLE: reason}
    program = floors.build("pg_floor", cleanup)
    if isinstance(program, str):
        return {C_FLOOR: program, C_DURABLE: program}
    from celery_exclusive.providers.base import encode_holder

    acquire, release = statements["acquire"], statements["release"]
    holder = encode_holder({"host": "benchmark-host", "pid": os.getpid()})
    dsn = psycopg_dsn()
    missing = {}
    variants = [(C_FLOOR, "cfloor:", release.sql), (C_DURABLE, "cdurable:", floors.durable(release.sql))]
    for name, prefix, release_sql in variants:
        if release_sql is None:
            missing[name] = "the package's release no longer turns synchronous_commit off"
            continue
        program_run = floors.pg_floor(
            program,
            dsn,
            key_prefix=prefix,
            ttl=TTL,
            life=LIFE,
            holder=holder,
            acquire=(acquire.sql, acquire.params),
            # The release notifies a channel when it frees the lease: the key's name serves
            # (the cost of pg_notify does not depend on the channel's name).
            release=(release_sql, tuple("key" if p == "channel" else p for p in release.params)),
        )
        programs.append(program_run)
        approaches[name] = program_run.as_approach()
    return missing


def _python_floor(
    approaches: dict[str, Op], missing: dict[str, str], provider: Any, holder: str
) -> floors.PgPythonFloor | None:
    """Add the Python floor to ``approaches`` (beside the C floor, on the same statements);
    None, and a reason in ``missing``, where the provider's statements are not found."""
    statements = getattr(getattr(provider, "_executor", None), "statements", None)
    if not statements or "acquire" not in statements or "release" not in statements:
        missing[PY_FLOOR] = "the provider's libpq statements (acquire, release) are not where they were"
        return None
    acquire, release = statements["acquire"], statements["release"]
    floor = floors.PgPythonFloor(
        psycopg_dsn(),
        key_prefix="pyfloor:",
        ttl=TTL,
        life=LIFE,
        holder=holder,
        acquire=(acquire.sql, acquire.params),
        release=(release.sql, release.params),
    )
    approaches[PY_FLOOR] = floor.op
    return floor


def _where_time_goes(
    report: Report,
    plan: Plan,
    provider: Any,
    ops: dict[str, Any],
    floor: floors.FloorProgram | None,
) -> None:
    """Rows splitting a cycle's wall time (issue #16): the client's CPU time, the server
    process's CPU time, the time each waited runnable for a CPU, and how often each slept
    (voluntary context switches), per cycle, from Linux's /proc (medians over rounds); then
    the C floor again with the service's extra client CPU time busy-waited before each
    statement, interleaved with the service: if the service runs at ~1.0x that, its gap to
    the floor is its own CPU time and what that does to scheduling, nothing else."""
    why = _why_no_breakdown(provider, floor)
    if why:
        for name in WHERE:
            report.row(SECTION, name, note=f"n/a: {why}")
        return
    assert floor is not None
    me = os.getpid()
    ours = sorted({c.pgconn.backend_pid for c in provider._kept})
    c_backend = int(floor.ask("backend"))
    # name: (run n cycles, client pid, server pids)
    sides: dict[str, tuple[Callable[[int], object], int, list[int]]] = {
        name: (functools.partial(_cycles, op), me, ours) for name, op in ops.items()
    }
    sides[WHERE_C] = (floor.batch, floor.popen.pid, [c_backend])
    n = plan.pg_ops
    found = _accounted(sides, plan.rounds, n)
    extra_ns = max(0.0, found[WHERE_SERVICE]["client"] - found[WHERE_C]["client"])
    think = int(extra_ns / 2)  # two statements per cycle: before each, half of it
    paired = _accounted(
        {
            WHERE_SERVICE: sides[WHERE_SERVICE],
            C_THINK: (functools.partial(floor.batch, think_ns=think), floor.popen.pid, [c_backend]),
        },
        plan.rounds,
        n,
    )
    for name in (WHERE_SERVICE, WHERE_PROVIDER, WHERE_C):
        report.row(SECTION, name, rate=found[name]["rate"], note=_split(found[name]))
    vs = median(paired["ratios"]) if paired["ratios"] else math.nan
    report.row(
        SECTION,
        C_THINK,
        rate=paired[C_THINK]["rate"],
        note=f"{think / 1000:.1f} µs busy-waited before each statement; LockService at {vs:.2f}x "
        f"its rate in the same rounds; {_split(paired[C_THINK])}",
    )


def _why_no_breakdown(provider: Any, floor: floors.FloorProgram | None) -> str:
    """Why the per-cycle split cannot be taken here ("" if it can)."""
    if floor is None:
        return "no C floor"
    if not getattr(provider, "_kept", None):
        return "the provider keeps no connection"
    if floors.sched(os.getpid()) is None:
        return "no /proc/<pid>/task/*/schedstat (Linux only)"
    backends = [c.pgconn.backend_pid for c in provider._kept]
    if not all(floors.is_postgres(pid) for pid in backends):
        return "the server is not on this machine (its processes are not in /proc)"
    return ""


def _cycles(op: Callable[[int], object], n: int) -> None:
    for i in range(n):
        op(i)


def _accounted(
    sides: dict[str, tuple[Callable[[int], object], int, list[int]]], rounds: int, n: int
) -> dict[str, Any]:
    """Per side, medians over ``rounds`` of ``n`` cycles each (sides taking turns): its rate,
    and per cycle in ns its client's CPU (``client``) and wait for a CPU (``client_wait``),
    its server processes' (``server``, ``server_wait``), and both sides' sleeps; with
    exactly two sides, ``ratios``: the first's rate over the second's, per round."""
    names = list(sides)
    per: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, client, servers = sides[name]
            gc.collect()
            before = _sched_of(client, servers)
            start = time.perf_counter_ns()
            run(n)
            elapsed = time.perf_counter_ns() - start
            after = _sched_of(client, servers)
            per[name].append(
                [n / (elapsed / 1e9)] + [(b - a) / n for a, b in zip(before, after, strict=True)]
            )
    keys = ["rate", "client", "client_wait", "client_sleeps", "server", "server_wait", "server_sleeps"]
    found: dict[str, Any] = {
        name: dict(zip(keys, (median(list(column)) for column in zip(*rows, strict=True)), strict=True))
        for name, rows in per.items()
    }
    if len(names) == 2:
        found["ratios"] = [a[0] / b[0] for a, b in zip(per[names[0]], per[names[1]], strict=True)]
    return found


def _sched_of(client: int, servers: list[int]) -> list[int]:
    """:func:`floors.sched` of the client and of its server processes summed (zeros if gone)."""
    mine = floors.sched(client) or (0, 0, 0)
    theirs = [floors.sched(pid) or (0, 0, 0) for pid in servers]
    return [*mine, *(sum(t[i] for t in theirs) for i in range(3))]


def _split(found: dict[str, float]) -> str:
    """One row's note: the per-cycle split."""
    wall = 1e9 / found["rate"]
    return (
        f"per cycle {wall / 1000:.0f} µs: client CPU {found['client'] / 1000:.1f} µs "
        f"(+{found['client_wait'] / 1000:.1f} waiting for a CPU, {found['client_sleeps']:.2f} sleeps), "
        f"server CPU {found['server'] / 1000:.1f} µs (+{found['server_wait'] / 1000:.1f}, "
        f"{found['server_sleeps']:.2f} sleeps)"
    )
