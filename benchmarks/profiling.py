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
from typing import Any

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
    ("providers/_pg_executor.py", "provider: PostgreSQL executor (kept connections, deadlines)"),
    ("providers/postgres.py", "provider: PostgresLockProvider"),
    ("providers/_sql_common.py", "provider: shared SQL plumbing (error translation, rows)"),
    ("providers/sql.py", "provider: SqlLockProvider"),
    ("providers/_sql", "provider: SqlLockProvider"),  # its collaborators, _sqlite.py included
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
    # The Celery layer (celery_layer): the task's own modules, then Celery's tracer.
    *(
        (f"celery_exclusive/{m}.py", "task layer: task, policies, redelivery, observe, runs")
        for m in ("task", "policies", "redelivery", "observe", "_runs", "worker", "_interrupt")
    ),
    ("celery_exclusive/dedupe.py", "dedupe: prerun/postrun receivers"),
    ("site-packages/celery", "Celery: tracer, request, signals"),
    ("site-packages/kombu", "Celery: tracer, request, signals"),
    ("site-packages/opentelemetry", "OpenTelemetry (installed: the current span is looked up)"),
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


def pg_cpu_ladder(n: int = 1500, rounds: int = 5) -> None:
    """Client CPU per PostgreSQL lock + release cycle: the C libpq floor (same statements,
    same durability), the provider and the service on the libpq runner, the service on
    psycopg's RawCursor(prepare=True) (issue #11 item 2)."""
    if reachable(POSTGRES_URL):
        return
    from benchmarks import floors, pg_locks
    from celery_exclusive import LockService
    from celery_exclusive.providers.base import encode_holder

    cleanup = Cleanup()
    service = LockService(with_table(POSTGRES_URL, TABLE), prefix="ladder:", ttl=900.0)
    cursors = pg_locks.cursor_service(prefix="ladder-cur:")
    programs: list[floors.FloorProgram] = []
    try:
        service.lock("warm").release()
        provider: Any = service.provider
        holder = encode_holder({"host": "benchmark-host", "pid": os.getpid()})

        def provider_cycle(i: int) -> None:
            key, token = f"ladder-prov:{i % 256}", secrets.token_hex(16)
            provider.acquire(key, token, 900.0, 86400.0, holder)
            provider.release(key, token)

        layers: dict[str, Callable[[int], None]] = {
            "PostgresLockProvider.acquire + release (libpq runner)": provider_cycle,
            "LockService.lock + release (libpq runner)": lambda i: service.lock(f"k{i % 256}").release(),
            "LockService.lock + release (psycopg RawCursor prepare=True)": lambda i: cursors.lock(
                f"k{i % 256}"
            ).release(),
        }
        c_name = "C libpq floor (same 2 statements, same durability)"
        cpu: dict[str, list[float]] = {name: [] for name in [c_name, *layers]}
        floor_approaches: dict[str, Any] = {}
        missing = pg_locks._c_floors(floor_approaches, programs, provider, cleanup)
        for _ in range(rounds):
            if pg_locks.C_FLOOR not in missing and programs:
                programs[0].batch(n // 5)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                programs[0].batch(n)
                # A child's CPU is counted once it is reaped: measure the C floor by restarting it.
                for program in programs:
                    program.close()
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                cpu[c_name].append(used / (n + n // 5) * 1e6)  # its warm-up batch included
                programs.clear()
                pg_locks._c_floors(floor_approaches, programs, provider, cleanup)
            for name, op in layers.items():
                start = time.process_time()
                for i in range(n):
                    op(i)
                cpu[name].append((time.process_time() - start) / n * 1e6)
        print(
            f"\n== client CPU per PostgreSQL lock + release cycle ({rounds} rounds of {n:,}; load {_load()})"
        )
        for name, values in cpu.items():
            shown = f"{statistics.median(values):6.1f} µs" if values else "   n/a"
            print(f"  {shown}  {name}  (rounds: {', '.join(f'{v:.0f}' for v in values)})")
    finally:
        for program in programs:
            program.close()
        service.close()
        cursors.close()
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
    celery_layer(300 if plan.quick else 2000, 3 if plan.quick else 7)
    pg_cpu_ladder(300 if plan.quick else 1500, 3 if plan.quick else 5)


_LAYER_NAMES = (
    "plain no-op",
    "floor: plain + provider acquire + release",
    "floor_once: the floor with the completion record",
    "service: plain + LockService.lock + release",
    "service_once: the service with the task id, holder and completion record",
    "exclusive no-op (a key per task)",
)


def layer_tasks(app: Any, prefix: str) -> dict[str, Any]:
    """The Celery layer's variants as tasks of ``app`` (named ``<prefix>.<variant>``), each
    body taking ``(i, tag)``: ``plain`` (a no-op), ``floor`` (plain plus one provider acquire +
    release: the lock's own floor), ``floor_once`` (the floor's acquire checking the task id's
    completion record and its release writing one, as an exclusive run's do), ``service``
    (plus ``LockService.lock + release``), ``service_once`` (the same with the task id, the
    holder and the completion record an exclusive run passes, made as the task layer makes
    them) and ``exclusive`` (an exclusive no-op, a key per task)."""
    from celery_exclusive import exclusive_task
    from celery_exclusive._process import HolderTemplate
    from celery_exclusive._records import checked_completion
    from celery_exclusive.providers.base import Completion
    from celery_exclusive.worker import get_lock_service

    def noop(i: int, tag: str) -> None:
        """A no-op task body."""

    # The floors bound their calls as the service bounds every call (its call_timeout, at
    # most 5 s for a release): a deadline is part of what one acquire and one release cost.
    def floor(i: int, tag: str) -> None:
        service = get_lock_service(app)
        key, token = f"{service.prefix}f:{tag}:{i}", secrets.token_hex(16)
        timeout = service.call_timeout
        service.provider.acquire(
            key, token, service.ttl, service.max_lifetime, '{"host":"h","pid":1}', timeout=timeout
        )
        service.provider.release(key, token, timeout=min(timeout, 5.0))

    def floor_once(i: int, tag: str) -> None:
        service = get_lock_service(app)
        key, token, task_id = f"{service.prefix}o:{tag}:{i}", secrets.token_hex(16), f"{tag}-{i}"
        holder, timeout = '{"host":"h","pid":1}', service.call_timeout
        service.provider.acquire(
            key, token, service.ttl, service.max_lifetime, holder, timeout=timeout, task_id=task_id
        )
        service.provider.release(
            key, token, Completion(task_id, "success", 0, 86400.0), timeout=min(timeout, 5.0)
        )

    def locked(i: int, tag: str) -> None:
        get_lock_service(app).lock(f"s:{tag}:{i}").release()

    # What an exclusive run passes the service, made as the task layer makes it.
    holders = HolderTemplate({"task_name": f"{prefix}.service_once", "worker": "instr@bench"}, "task_id")

    def locked_once(i: int, tag: str) -> None:
        task_id = f"{tag}-{i}"
        lease = get_lock_service(app).lock(f"so:{tag}:{i}", task_id=task_id, holder=holders.holder(task_id))
        lease.release(checked_completion(task_id, "success", 0, 86400.0))

    return {
        "plain": app.task(name=f"{prefix}.plain")(noop),
        "floor": app.task(name=f"{prefix}.floor")(floor),
        "floor_once": app.task(name=f"{prefix}.floor_once")(floor_once),
        "service": app.task(name=f"{prefix}.service")(locked),
        "service_once": app.task(name=f"{prefix}.service_once")(locked_once),
        "exclusive": exclusive_task(app=app, name=f"{prefix}.exclusive", key="e:{tag}:{i}")(noop),
    }


def celery_layer(n: int = 2000, rounds: int = 7) -> None:
    """Client CPU per task on Redis, each task run by Celery's own tracer as a pool process runs
    it (``build_tracer``; no broker): a plain no-op, the same plus the provider's acquire +
    release (the lock's floor), plus ``LockService.lock + release``, and an exclusive no-op.
    Exclusive minus service is what the task layer itself costs (issue #16); rounds rotate the
    order, and the exclusive variant is then profiled by layer (CPU clock)."""
    if reachable(REDIS_URL):
        return
    from celery import Celery
    from celery.app.trace import build_tracer

    from celery_exclusive.worker import close_lock_services

    app = Celery("cebench-layer", broker="memory://", set_as_current=False)
    app.conf.update(
        exclusive_url=REDIS_URL, exclusive_prefix=f"{REDIS_PREFIX}layer:", task_ignore_result=True
    )

    tasks = dict(zip(_LAYER_NAMES, layer_tasks(app, "layer").values(), strict=True))
    for name in (_LAYER_NAMES[2], _LAYER_NAMES[4]):  # counted by benchmarks.instructions, not timed here
        del tasks[name]
    app.finalize()
    # The registered task objects, as a worker's tracer gets them (the decorators' return
    # values are proxies: calling one through a proxy costs every exclusive run ~0.5 µs more).
    tracers = {
        name: build_tracer(t.name, app.tasks[t.name], eager=False, hostname="layer@bench", app=app)
        for name, t in tasks.items()
    }

    def batch(name: str, count: int, tag: str) -> float:
        tracer = tracers[name]
        start = time.process_time()
        for i in range(count):
            task_id = f"{tag}-{i}"
            request = {"id": task_id, "args": (i, tag), "kwargs": {}, "hostname": "layer@bench", "retries": 0}
            tracer(task_id, (i, tag), {}, request)
        return (time.process_time() - start) / count * 1e6

    cpu: dict[str, list[float]] = {name: [] for name in tasks}
    try:
        names = list(tasks)
        for name in names:
            batch(name, 100, f"warm{len(name)}")
        for r in range(rounds):
            for name in names[r % 4 :] + names[: r % 4]:
                cpu[name].append(batch(name, n, f"{r}{len(name)}"))
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        batch("exclusive no-op (a key per task)", n, "profiled")
        profiler.disable()
    finally:
        close_lock_services()
    medians = {name: statistics.median(values) for name, values in cpu.items()}
    plain = medians["plain no-op"]
    where = f"Redis store ({rounds} rounds of {n:,}; load {_load()})"
    print(f"\n== client CPU per task run by Celery's tracer, {where}")
    for name, value in medians.items():
        rounds_text = ", ".join(f"{v:.0f}" for v in cpu[name])
        print(f"  {value:6.1f} µs  (+{value - plain:5.1f} over plain)  {name}  (rounds: {rounds_text})")
    own = [e - s for e, s in zip(cpu["exclusive no-op (a key per task)"], cpu[names[2]], strict=True)]
    print(
        f"  {statistics.median(own):6.1f} µs  the task layer's own: exclusive minus service, median of rounds"
    )
    print("-- the exclusive variant by layer (profiler overhead inflates small functions):")
    print(layer_breakdown(pstats.Stats(profiler), n))
