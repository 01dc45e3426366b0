"""The heartbeat: one pass over 1,000 held leases against the raw batched call, and 10,000 leases.

The 1,000-lease pass is driven by hand (``Heartbeat.beat()`` with a manual clock moved past
every lease's refresh time, and no background thread), so it times exactly one pass: the
service's bookkeeping plus the provider's batched round trip. The raw peer sends the same
batched statement (PostgreSQL) or Lua call (Redis) for the same leases with the driver
alone. The 10,000-lease run uses the real thread and clock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    Cleanup,
    Plan,
    Report,
    Series,
    median,
    psycopg_dsn,
    reachable,
    with_table,
)

SECTION = "heartbeat"
STORES = ("postgres", "redis")
HEARTBEAT_THREAD = "celery-exclusive-heartbeat"
RAW_CALL = {"postgres": "UPDATE ... FROM unnest", "redis": "Lua refresh"}


def _names(store: str) -> tuple[str, str, str]:
    return (
        f"{store}: heartbeat pass over 1,000 leases (LockService)",
        f"{store}: raw batched {RAW_CALL[store]} for 1,000 leases",
        f"{store}: 10,000 leases held in one process, one heartbeat thread",
    )


ROWS = [name for store in STORES for name in _names(store)]
TARGETS = [
    t
    for store in STORES
    for t in (
        (f"{store}: round trips per heartbeat pass over 1,000 leases", 1, "==", ""),
        (f"{store}: heartbeat pass cost vs raw batched call", 1.5, "<=", "x"),
        (f"{store}: heartbeat threads keeping 10,000 leases alive", 1, "==", ""),
    )
]


class IdleThread(threading.Thread):
    """A heartbeat thread that never runs: the benchmark calls ``beat()`` itself."""

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass


def manual_heartbeat(**kwargs: Any) -> threading.Thread:
    """Thread factory: the heartbeat thread never runs (the benchmark calls ``beat()``); the
    deadline watcher that a pass starts around its store calls is a real thread."""
    if kwargs.get("name") == HEARTBEAT_THREAD:
        return IdleThread(**kwargs)
    return threading.Thread(**kwargs)


class ManualClock:
    """A monotonic clock the benchmark moves forward."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class CountingProvider:
    """Delegates to a provider and counts its refresh calls (each is one batched round trip)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_key_length = inner.max_key_length
        self.refresh_calls = 0
        self.refreshed = 0

    def refresh(self, requests: Sequence[Any]) -> list[float | None]:
        self.refresh_calls += 1
        answers: list[float | None] = self.inner.refresh(requests)
        self.refreshed += sum(1 for a in answers if a is not None)
        return answers

    def acquire(self, *args: Any) -> Any:
        return self.inner.acquire(*args)

    def release(self, *args: Any) -> Any:
        return self.inner.release(*args)

    def peek(self, key: str) -> Any:
        return self.inner.peek(key)

    def scan(self, prefix: str) -> Any:
        return self.inner.scan(prefix)

    def close(self) -> None:
        self.inner.close()

    def diagnose(self) -> Any:
        return self.inner.diagnose()


def make_provider(store: str) -> Any:
    """The package's provider for ``store``, built from its URL as a user would."""
    from celery_exclusive.providers.redis import RedisLockProvider
    from celery_exclusive.providers.sql import SqlLockProvider

    if store == "redis":
        return RedisLockProvider(REDIS_URL)
    return SqlLockProvider.from_url(with_table(POSTGRES_URL, TABLE))


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """Both stores: the timed 1,000-lease pass, then many leases on the real thread."""
    for store in STORES:
        url = REDIS_URL if store == "redis" else POSTGRES_URL
        reason = reachable(url)
        names = _names(store)
        targets = [t for t in TARGETS if t[0].startswith(store)]
        if reason:
            report.unavailable(SECTION, names, targets, reason)
            continue
        one_pass(report, plan, store, names, targets)
        many_leases(report, plan, store, names[2], targets[2][0])


def one_pass(report: Report, plan: Plan, store: str, names: tuple[str, ...], targets: list[Any]) -> None:
    """Time heartbeat passes and raw batched calls over the same 1,000 leases, interleaved."""
    from celery_exclusive import LockService

    clock = ManualClock()
    provider = CountingProvider(make_provider(store))
    service = LockService(
        provider,
        prefix=f"{REDIS_PREFIX}hb:" if store == "redis" else "hb:",
        ttl=60.0,
        clock=clock,
        thread_factory=manual_heartbeat,
    )
    try:
        leases = [service.lock(f"lease{i}") for i in range(plan.heartbeat_leases)]
        raw_call, close_raw = _raw_refresh(
            store, provider.inner, [(x.store_key, x.token, x.ttl) for x in leases]
        )
        passes: list[float] = []
        calls: list[int] = []
        raw_times: list[float] = []

        def service_pass() -> None:
            clock.now += service.refresh_interval  # every lease is now due
            before_calls, before_rows = provider.refresh_calls, provider.refreshed
            start = time.perf_counter()
            service.heartbeat.beat()
            passes.append(time.perf_counter() - start)
            calls.append(provider.refresh_calls - before_calls)
            if provider.refreshed - before_rows != len(leases):
                raise RuntimeError(f"{store}: a pass refreshed {provider.refreshed - before_rows} leases")

        def raw_pass() -> None:
            start = time.perf_counter()
            refreshed = raw_call()
            raw_times.append(time.perf_counter() - start)
            if refreshed != len(leases):
                raise RuntimeError(f"{store}: the raw call refreshed {refreshed} leases")

        service_pass()  # warm up both (prepared statement, script cache)
        raw_pass()
        passes.clear()
        calls.clear()
        raw_times.clear()
        order: list[Callable[[], None]] = [service_pass, raw_pass]
        for r in range(plan.heartbeat_rounds):
            for step in order[r % 2 :] + order[: r % 2]:
                step()
        close_raw()
        if any(lease.state.value != "held" for lease in leases):
            raise RuntimeError(f"{store}: a lease was lost during the heartbeat passes")
        n = len(leases)
        for name, times in ((names[0], passes), (names[1], raw_times)):
            s = Series(name, rates=[n / t for t in times])
            report.row(
                SECTION,
                name,
                rate=s.rate,
                unit="leases/s",
                p50_us=median(times) * 1e6,
                p99_us=max(times) * 1e6,
                note=f"one pass = {n:,} leases; p50/p99 are per pass",
            )
        ratios = [a / b for a, b in zip(passes, raw_times, strict=True)]
        report.target(
            targets[0][0],
            float(max(calls)),
            1,
            op="==",
            unit="",
            note=f"provider.refresh calls per pass; 1 call = 1 {RAW_CALL[store]} round trip",
        )
        report.target(targets[1][0], median(ratios), 1.5, op="<=", rounds=ratios)
        for lease in leases:
            lease.release()
    finally:
        service.close()


def _raw_refresh(
    store: str, inner: Any, leases: list[tuple[str, str, float]]
) -> tuple[Callable[[], int], Callable[[], None]]:
    """The driver-only batched refresh of ``leases``: a callable returning how many were refreshed."""
    if store == "redis":
        import redis

        from celery_exclusive.providers.redis import REFRESH

        client = redis.Redis.from_url(REDIS_URL)
        sha = client.script_load(REFRESH)
        args = (
            [k for k, _, _ in leases] + [t for _, t, _ in leases] + [int(ttl * 1000) for _, _, ttl in leases]
        )

        def redis_call() -> int:
            return sum(1 for ms in client.evalsha(sha, len(leases), *args) if ms >= 0)

        return redis_call, client.close
    import psycopg

    sql = inner._psycopg_sql["refresh"]  # exactly the provider's statement
    conn = psycopg.connect(psycopg_dsn(), autocommit=True)
    params = {
        "keys": [k for k, _, _ in leases],
        "tokens": [t for _, t, _ in leases],
        "ttls": [x for _, _, x in leases],
    }

    def pg_call() -> int:
        return len(conn.execute(sql, params).fetchall())

    return pg_call, conn.close


def many_leases(report: Report, plan: Plan, store: str, name: str, target: str) -> None:
    """Hold ``plan.many_leases`` leases on the real heartbeat thread through two refresh cycles."""
    from celery_exclusive import LockService, signals

    ttl, interval = 4.0, 1.5
    service = LockService(
        make_provider(store),
        prefix=f"{REDIS_PREFIX}many:" if store == "redis" else "many:",
        ttl=ttl,
        refresh_interval=interval,
    )
    counts: dict[int, int] = {}
    durations: list[float] = []

    def refreshed(sender: Any = None, leases: Sequence[Any] = (), duration: float = 0.0, **_: Any) -> None:
        if sender is service:
            durations.append(duration)
            for lease in leases:
                counts[id(lease)] = counts.get(id(lease), 0) + 1

    signals.lock_refreshed.connect(refreshed, weak=False)
    threads_before = threading.active_count()
    most = {"heartbeat": 0, "extra": 0}

    def count_threads() -> None:
        names = [t.name for t in threading.enumerate()]
        most["heartbeat"] = max(most["heartbeat"], names.count(HEARTBEAT_THREAD))
        most["extra"] = max(most["extra"], len(names) - threads_before)

    try:
        start = time.perf_counter()
        leases = []
        for i in range(plan.many_leases):
            leases.append(service.lock(f"m{i}"))
            if i % 500 == 0:
                count_threads()
        acquire_s = time.perf_counter() - start
        deadline = time.monotonic() + 4 * interval + 6
        want = 1 if plan.quick else 2
        while time.monotonic() < deadline and min(counts.get(id(x), 0) for x in leases) < want:
            count_threads()
            time.sleep(0.02)
        refreshes = [counts.get(id(x), 0) for x in leases]
        lost = sum(1 for x in leases if not x.held)
        start = time.perf_counter()
        for lease in leases:
            lease.release()
        release_s = time.perf_counter() - start
        report.row(
            SECTION,
            name,
            rate=len(leases) / acquire_s,
            unit="acquisitions/s",
            note=(
                f"{len(leases):,} leases (ttl {ttl:g} s, refresh every {interval:g} s): "
                f"{most['heartbeat']} heartbeat thread (at most {most['extra']} extra threads: the "
                "deadline watcher lives during a refresh pass), "
                f"each refreshed >= {min(refreshes)} times, {lost} lost, "
                f"refresh call p50 {median(durations) * 1e3:.1f} ms, "
                f"max {max(durations, default=math.nan) * 1e3:.1f} ms "
                f"({len(durations)} calls of <= 1,000 leases); releasing all took {release_s:.2f} s"
            ),
        )
        ok = lost == 0 and min(refreshes) >= want
        report.target(
            target,
            float(most["heartbeat"]) if ok else -1.0,
            1,
            op="==",
            unit="",
            note=f"{len(leases):,} leases"
            + ("" if ok else f"; FAILED: {lost} lost, min refreshes {min(refreshes)}"),
        )
    finally:
        signals.lock_refreshed.disconnect(refreshed)
        service.close()
