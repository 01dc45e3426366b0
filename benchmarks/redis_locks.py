"""Uncontended acquire + release on Redis: the package against the raw floor and other locks."""

from __future__ import annotations

import functools
import math
import secrets
from typing import Any

from benchmarks import floors
from benchmarks.harness import (
    REDIS_PREFIX,
    REDIS_URL,
    Batch,
    Cleanup,
    Op,
    Plan,
    Report,
    interleave,
    median,
    reachable,
    round_ratios,
)

SECTION = "redis"
FLOOR = "raw redis-py: SET NX PX + EVALSHA compare-and-delete"
WIRE = "wire floor: the same 2 commands on one raw connection"
REDIS_PY_LOCK = "redis-py Lock (acquire(blocking=False) + release)"
PY_REDIS_LOCK = "python-redis-lock (auto_renewal=False)"
PROVIDER = "celery-exclusive RedisLockProvider.acquire + release"
SERVICE = "celery-exclusive LockService.lock + release (public API)"
C_FLOOR = "C floor: the package's 2 EVALSHAs, hand-written RESP, raw socket"
PY_FLOOR = "Python floor: the package's 2 EVALSHAs, hand-written RESP, raw socket"
#: Busy-waited before each of the C floor's 2 commands for the amplification row.
THINK_US = 25
C_THINK = f"C floor + {THINK_US} µs busy-waited per command (this machine's cost of client CPU)"
ROWS = [FLOOR, WIRE, REDIS_PY_LOCK, PY_REDIS_LOCK, PROVIDER, SERVICE, C_FLOOR, PY_FLOOR, C_THINK]
TARGET_FLOOR = "redis: LockService vs raw redis-py floor"
TARGET_LOCK = "redis: LockService vs redis-py Lock"
TARGET_C = "redis: LockService vs C raw-socket floor (same 2 commands)"
TARGETS = [
    (TARGET_FLOOR, 0.95, ">=", "x"),
    (TARGET_LOCK, 1.15, ">=", "x"),
    (TARGET_C, 0.5, ">=", "x"),
]

TTL = 900.0
KEYS = 256  # distinct keys cycled through by each approach
COMPARE_AND_DELETE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """Interleave the approaches (the floors too); rows for each, and the targets."""
    reason = reachable(REDIS_URL)
    if reason:
        report.unavailable(SECTION, ROWS, TARGETS, reason)
        return
    import redis
    import redis_lock

    from celery_exclusive import LockService

    # The floor's client is built as the provider builds its own (hiredis parser, same timeouts).
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=10.0, socket_connect_timeout=5.0)
    service = LockService(REDIS_URL, prefix=REDIS_PREFIX + "svc:", ttl=TTL)
    provider: Any = service.provider
    c_floor: floors.FloorProgram | None = None
    resp: floors.RespClient | None = None
    try:
        sha = client.script_load(COMPARE_AND_DELETE)
        ttl_ms = int(TTL * 1000)
        keys = {
            name: [f"{REDIS_PREFIX}{tag}:{i}" for i in range(KEYS)]
            for name, tag in (("floor", "floor"), ("wire", "wire"), ("lock", "rpl"), ("prov", "prov"))
        }
        # python-redis-lock names its keys "lock:<name>" and "lock-signal:<name>".
        prl_names = [f"{REDIS_PREFIX}prl:{i}" for i in range(KEYS)]
        svc_keys = [f"k{i}" for i in range(KEYS)]
        wire: Any = client.connection_pool.get_connection()

        def floor(i: int) -> None:
            key, token = keys["floor"][i % KEYS], secrets.token_hex(16)
            if not client.set(key, token, nx=True, px=ttl_ms):
                raise RuntimeError("floor: key unexpectedly held")
            client.evalsha(sha, 1, key, token)

        def wire_floor(i: int) -> None:
            key, token = keys["wire"][i % KEYS], secrets.token_hex(16)
            wire.send_command("SET", key, token, "NX", "PX", ttl_ms)
            if wire.read_response() is None:
                raise RuntimeError("wire: key unexpectedly held")
            wire.send_command("EVALSHA", sha, 1, key, token)
            wire.read_response()

        def redis_py_lock(i: int) -> None:
            lock = client.lock(keys["lock"][i % KEYS], timeout=TTL)
            if not lock.acquire(blocking=False):
                raise RuntimeError("redis-py Lock: key unexpectedly held")
            lock.release()

        def python_redis_lock(i: int) -> None:
            lock = redis_lock.Lock(client, prl_names[i % KEYS], expire=int(TTL))
            if not lock.acquire(blocking=False):
                raise RuntimeError("python-redis-lock: key unexpectedly held")
            lock.release()

        def provider_only(i: int) -> None:
            key, token = keys["prov"][i % KEYS], secrets.token_hex(16)
            provider.acquire(key, token, TTL, TTL, "{}")
            provider.release(key, token)

        def package(i: int) -> None:
            service.lock(svc_keys[i % KEYS]).release()

        approaches: dict[str, Op] = {
            FLOOR: floor,
            WIRE: wire_floor,
            REDIS_PY_LOCK: redis_py_lock,
            PY_REDIS_LOCK: python_redis_lock,
            PROVIDER: provider_only,
            SERVICE: package,
        }
        # The floors send exactly what lock() + release() was just seen to send.
        commands = floors.capture_redis_commands(service)
        missing: dict[str, str] = {}
        if isinstance(commands, str):
            missing = {C_FLOOR: commands, PY_FLOOR: commands, C_THINK: commands}
        else:
            program = floors.build("redis_floor", cleanup)
            if isinstance(program, str):
                missing[C_FLOOR] = missing[C_THINK] = program
            else:
                c_floor = floors.redis_floor(program, REDIS_URL, f"{REDIS_PREFIX}cfloor:", commands)
                approaches[C_FLOOR] = c_floor.as_approach()
                approaches[C_THINK] = Batch(functools.partial(c_floor.batch, think_ns=THINK_US * 1000))
            resp = floors.RespClient(REDIS_URL)
            approaches[PY_FLOOR] = floors.python_floor(
                resp, [f"{REDIS_PREFIX}pyfloor:{i}" for i in range(KEYS)], commands
            )
        series = interleave(
            approaches,
            rounds=plan.rounds,
            ops=plan.redis_ops,
            warmup=max(50, plan.redis_ops // 5),
        )
        client.connection_pool.release(wire)
        py_vs_c = round_ratios(series[PY_FLOOR], series[C_FLOOR]) if C_FLOOR in series else []
        py_note = f"; {median(py_vs_c):.2f}x the C floor" if py_vs_c else ""
        think_note = ""
        if C_THINK in series and C_FLOOR in series:
            added = 1e6 / series[C_THINK].rate - 1e6 / series[C_FLOOR].rate
            think_note = (
                f"; {added:.0f} µs more per cycle for {2 * THINK_US} µs of CPU:"
                f" {added / (2 * THINK_US):.1f} µs of cycle per µs of client CPU (median rates;"
                " 1.2 on a quiet machine, 2-3 at load 6-8 on 2 vCPUs: BENCHMARKS.md, branch wakeup)"
            )
        report.series_rows(
            SECTION,
            series,
            {
                FLOOR: "baseline: what the issue calls the floor (same redis-py client)",
                WIRE: "info: no pool checkout, no command wrapper",
                SERVICE: "token, holder JSON, Lease, heartbeat registration, 2 Lua scripts",
                C_FLOOR: "the physical floor: one connection, sequential, timed inside the C program",
                PY_FLOOR: "reference: the least Python can do for the same 2 commands" + py_note,
                C_THINK: "info: how much a µs of client CPU costs here" + think_note,
            },
        )
        for name, reason in missing.items():
            report.row(SECTION, name, note=f"n/a: {reason}")
        vs_floor = round_ratios(series[SERVICE], series[FLOOR])
        vs_lock = round_ratios(series[SERVICE], series[REDIS_PY_LOCK])
        report.target(TARGET_FLOOR, median(vs_floor), 0.95, rounds=vs_floor)
        report.target(TARGET_LOCK, median(vs_lock), 1.15, rounds=vs_lock)
        if C_FLOOR in series:
            vs_c = round_ratios(series[SERVICE], series[C_FLOOR])
            extra = 1e6 / series[SERVICE].rate - 1e6 / series[C_FLOOR].rate
            report.target(
                TARGET_C,
                median(vs_c),
                0.5,
                rounds=vs_c,
                note=f"issue #16; {extra:.0f} µs more per cycle than the C floor (median rates)",
            )
        else:
            report.target(TARGET_C, math.nan, 0.5, note=f"n/a: {missing.get(C_FLOOR, '?')}")
    finally:
        if c_floor is not None:
            c_floor.close()
        if resp is not None:
            resp.close()
        service.close()
        client.close()
