"""``--profile``: where LockService.lock + release spends its time, per store (cProfile).

Splits the service path (token, holder JSON, validation, Lease, heartbeat registration,
signals) from the provider's round trips; the numbers behind the service-layer changes
described in BENCHMARKS.md. On Redis it also prints the client CPU per cycle of each layer,
from the C floor up (issue #16): CPU time moves far less with the machine's load than
wall time does, and a layer's CPU is what an optimisation of that layer can remove.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import resource
import secrets
import statistics
import time
from collections.abc import Callable

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    Cleanup,
    Plan,
    reachable,
    with_table,
)

#: Where a sample of own (CPU) time belongs, by the file of its function; first match wins.
_LAYERS = (
    ("recv_into", "socket recv (syscall)"),
    ("sendall", "socket sendall (syscall)"),
    ("site-packages/redis", "redis-py connection + hiredis parser"),
    ("hiredis", "redis-py connection + hiredis parser"),
    ("providers/redis.py", "provider: wire, scripts, acquire, release"),
    ("providers/_redis_", "provider: wire, scripts, acquire, release"),
    ("providers/_kept.py", "provider: wire, scripts, acquire, release"),
    ("providers/_libpq.py", "provider: libpq runner (PQexecPrepared and its wait included)"),
    ("providers/postgres.py", "provider: PostgresLockProvider"),
    ("providers/_sql_common.py", "provider: shared SQL plumbing (error translation, rows)"),
    ("providers/sql.py", "provider: SqlLockProvider"),
    ("psycopg", "psycopg"),
    ("heartbeat.py", "heartbeat registration"),
    ("threading.py", "heartbeat registration"),
    ("secrets.py", "token"),
    ("urandom", "token"),
    ("lease.py", "Lease object"),
    ("<string>", "Lease object"),
    ("validation.py", "key validation"),
    ("keys.py", "key validation"),
    ("signals.py", "signals"),
    ("service.py", "service: lock, _take, _call, release"),
)


def _layer(where: tuple[str, int, str]) -> str:
    text = f"{where[0]} {where[2]}"
    return next((layer for needle, layer in _LAYERS if needle in text), "other builtins")


def cpu_ladder(n: int = 1500, rounds: int = 5) -> None:
    """Client CPU per Redis lock + release cycle: C floor, Python RESP floor, provider, service."""
    if reachable(REDIS_URL):
        return
    from benchmarks import floors
    from celery_exclusive import LockService

    cleanup = Cleanup()
    service = LockService(REDIS_URL, prefix=f"{REDIS_PREFIX}ladder:", ttl=900.0)
    resp: floors.RespClient | None = None
    try:
        commands = floors.capture_redis_commands(service)
        if isinstance(commands, str):
            print(f"\n== client CPU ladder: n/a ({commands})")
            return
        holder = commands[0][-1]
        provider = service.provider
        resp = floors.RespClient(REDIS_URL)
        keys = [f"{REDIS_PREFIX}ladder-py:{i}" for i in range(256)]

        def provider_cycle(i: int) -> None:
            key, token = f"{REDIS_PREFIX}ladder-prov:{i % 256}", secrets.token_hex(16)
            provider.acquire(key, token, 900.0, 86400.0, holder)
            provider.release(key, token)

        def service_cycle(i: int) -> None:
            service.lock(f"k{i % 256}").release()

        layers: dict[str, Callable[[int], None]] = {
            "Python floor (hand-written RESP, same 2 commands)": floors.python_floor(resp, keys, commands),
            "RedisLockProvider.acquire + release": provider_cycle,
            "LockService.lock + release": service_cycle,
        }
        cpu: dict[str, list[float]] = {name: [] for name in ["C floor (same 2 commands)", *layers]}
        program = floors.build("redis_floor", cleanup)
        c_floor = None
        if not isinstance(program, str):
            c_floor = floors.redis_floor(program, REDIS_URL, f"{REDIS_PREFIX}ladder-c:", commands)
            c_floor.batch(n // 5)
        for _ in range(rounds):
            if c_floor is not None:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                c_floor.batch(n)
                # A child's CPU is counted once it is reaped: measure the C floor by restarting it.
                c_floor.close()
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                cpu["C floor (same 2 commands)"].append(used / n * 1e6)
                c_floor = floors.redis_floor(program, REDIS_URL, f"{REDIS_PREFIX}ladder-c:", commands)
            for name, op in layers.items():
                start = time.process_time()
                for i in range(n):
                    op(i)
                cpu[name].append((time.process_time() - start) / n * 1e6)
        if c_floor is not None:
            c_floor.close()
        print(f"\n== client CPU per Redis lock + release cycle ({rounds} rounds of {n:,}; load {_load()})")
        for name, values in cpu.items():
            shown = f"{statistics.median(values):6.1f} µs" if values else "   n/a"
            print(f"  {shown}  {name}  (rounds: {', '.join(f'{v:.0f}' for v in values)})")
    finally:
        service.close()
        if resp is not None:
            resp.close()
        cleanup.run()


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def layer_breakdown(stats: pstats.Stats, cycles: int) -> str:
    """Own time grouped by layer (see ``_LAYERS``), per cycle and as a share."""
    groups: collections.Counter[str] = collections.Counter()
    for where, row in stats.stats.items():  # type: ignore[attr-defined]
        groups[_layer(where)] += row[2]
    total = sum(groups.values()) or 1.0
    return "\n".join(
        f"  {t / cycles * 1e6:7.1f} µs {100 * t / total:5.1f}%  {name}" for name, t in groups.most_common()
    )


def profile_service(plan: Plan) -> None:
    """Print the top functions by own time for lock + release on each reachable store."""
    from celery_exclusive import LockService

    n = 500 if plan.quick else 5000
    for store, url, prefix in (
        ("redis", REDIS_URL, f"{REDIS_PREFIX}prof:"),
        ("postgres", with_table(POSTGRES_URL, TABLE), "prof:"),
    ):
        if reachable(url):
            continue
        service = LockService(url, prefix=prefix)
        try:
            for i in range(50):
                service.lock(f"w{i}").release()
            # The CPU clock: waiting for the server costs nothing, so the split is the client's.
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            for i in range(n):
                service.lock(f"k{i % 256}").release()
            profiler.disable()
        finally:
            service.close()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(18)
        print(f"\n== cProfile (CPU clock): {n:,} x LockService.lock + release on {store} (by own time)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
        print(f"-- by layer (profiler overhead inflates small functions; load {_load()}):")
        print(layer_breakdown(stats, n))
    cpu_ladder(300 if plan.quick else 1500, 3 if plan.quick else 5)
