"""Waiting for a held lock (issue #13 item 1): handover latency and fairness.

Run on its own::

    .venv/bin/python -m benchmarks.waiting [--seconds 5] [--stores memory,redis,postgres]
    .venv/bin/python -m benchmarks.waiting --breakdown [--trials 40]   # the PostgreSQL handover's steps

* handover: one holder releases, one waiter (another service, ``lock(wait=)``) acquires;
  the release-to-acquired time over 40 trials, p50/p99. Stores that signal releases
  (memory, Redis and PostgreSQL) hand over on the signal, and are measured once more with the
  signals hidden (``polled``: the waiter sees a store without ``subscribe``), which is what
  the other stores do: hand over within the poll bound (0.05 s).
* fairness: 8 processes loop ``lock(key, wait=10)`` / hold 5 ms / release on one key for
  ``--seconds``; each process's share of the acquisitions (ideal 12.5 %), and Jain's index
  (1.0 = perfectly even, 1/8 = one process got everything).

The Redis and PostgreSQL handovers, woken and polled, are also the ``waiting`` section of
``python -m benchmarks`` (:func:`run`; targets: woken p50 <= 2 ms).

Keys use a unique prefix and are released at the end; nothing else is touched.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

from benchmarks.harness import (
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    Cleanup,
    Plan,
    Report,
    drop_pg_tables,
    percentile,
    psycopg_dsn,
    reachable,
    with_table,
)
from celery_exclusive import LockService
from celery_exclusive.providers.base import WakesWaiters

SECTION = "waiting"
#: The PostgreSQL row beside the handover: what the waiter's durable commit waits for.
PG_FLUSH = "postgres commit flush"
ROWS = [
    "redis handover woken",
    "redis handover polled",
    "postgres handover woken",
    "postgres handover polled",
    PG_FLUSH,
]
#: (name, bound, op, unit) of the section's targets.
TARGETS = [
    ("redis woken handover p50", 2.0, "<=", " ms"),
    ("postgres woken handover p50", 2.0, "<=", " ms"),
]
#: The PostgreSQL table of the section (dropped at the end of the run).
WAIT_TABLE = f"{TABLE}_wait"
#: How each store's release signals its waiters (the woken row's note).
SIGNALS = {"redis": "SPUBLISH from release.lua", "postgres": "pg_notify from the release statement, LISTEN"}

URLS = {
    "memory": "memory://",
    "redis": "redis://127.0.0.1:6379/0",
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test?ce_table=ce_bench_waiting",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test?ce_table=ce_bench_waiting",
}


class Polled:
    """A provider seen without its release signals (no ``subscribe``): its waiters poll."""

    def __init__(self, provider: object) -> None:
        self._provider = provider

    def __getattr__(self, name: str) -> Any:
        if name == "subscribe":
            raise AttributeError(name)
        return getattr(self._provider, name)


def handover(
    url: str, prefix: str, trials: int, *, polled: bool = False, between: Callable[[], None] | None = None
) -> list[float]:
    """Release-to-acquired seconds of ``trials`` handovers; ``polled`` hides the signals;
    ``between`` is called after each trial (untimed)."""
    holder = LockService(url, prefix=prefix)
    if url == "memory://":
        waiter = LockService(Polled(holder.provider) if polled else holder.provider, prefix=prefix)
    elif polled:
        waiter = LockService(Polled(LockService(url).provider), prefix=prefix)
    else:
        waiter = LockService(url, prefix=prefix)
    latencies = []
    try:
        for i in range(trials):
            lease = holder.lock("handover", ttl=30)
            released: list[float] = []

            def release(
                lease: Any = lease, released: list[float] = released, hold: float = 0.02 + (i % 5) * 0.03
            ) -> None:
                time.sleep(hold)
                released.append(time.monotonic())
                lease.release()

            thread = threading.Thread(target=release)
            thread.start()
            got = waiter.lock("handover", ttl=30, wait=10)
            latencies.append(time.monotonic() - released[0] if released else 0.0)
            thread.join()
            got.release()
            if between is not None:
                between()
    finally:
        waiter.close()
        holder.close()
    return latencies


class CommitFlush:
    """The disk's share of a durable commit, sampled between handover trials: a 1-row
    UPDATE committed with ``synchronous_commit`` on, then off, on a connection of its own
    (the waiter's acquire commits with it on, the release with it off). ``on - off`` at the
    median is the WAL flush the handover's acquire waits for.

    It also counts the whole server's commits and WAL flushes (``pg_stat_database``,
    ``pg_stat_wal``) from its start to :meth:`traffic`: a durable commit that arrives while
    another session's WAL flush runs waits for it (the ``WALWrite`` lock) and then, unless
    that flush covered it, flushes again, so on a server busy with other sessions' commits
    the acquire's commit costs up to about two flushes (BENCHMARKS.md, *Waiting*)."""

    def __init__(self, url: str, table: str) -> None:
        import psycopg

        self._conn = psycopg.connect(psycopg_dsn(url), autocommit=True, connect_timeout=10)
        self._table = table
        self._conn.execute(f'CREATE TABLE IF NOT EXISTS "{table}" (id int PRIMARY KEY, n bigint)')
        self._conn.execute(f'INSERT INTO "{table}" VALUES (1, 0) ON CONFLICT DO NOTHING')
        self.timings: dict[str, list[float]] = {"on": [], "off": []}
        self._counted = self._counters()
        #: :meth:`traffic` when closed.
        self.seen: tuple[float, float] | None = None

    def _counters(self) -> tuple[float, int, int] | None:
        """(now, commits, WAL flushes) of the whole server; None where not readable
        (PostgreSQL < 14 has no pg_stat_wal)."""
        try:
            row = self._conn.execute(
                "SELECT (SELECT sum(xact_commit) FROM pg_stat_database)::bigint, wal_sync FROM pg_stat_wal"
            ).fetchone()
        except Exception:
            return None
        return (time.monotonic(), int(row[0]), int(row[1])) if row else None

    def traffic(self) -> tuple[float, float] | None:
        """(commits/s, WAL flushes/s) of the whole server, every session's, since this
        sampler started (ours included: about three durable commits per trial); None if
        the server does not say (cumulative statistics are updated by each backend every
        second or so, so a short run reads low)."""
        now = self._counters()
        if now is None or self._counted is None or now[0] <= self._counted[0]:
            return None
        seconds = now[0] - self._counted[0]
        return (now[1] - self._counted[1]) / seconds, (now[2] - self._counted[2]) / seconds

    def __call__(self) -> None:
        for mode in ("on", "off"):
            self._conn.execute(f"SET synchronous_commit = {mode}")
            t0 = time.perf_counter()
            self._conn.execute(f'UPDATE "{self._table}" SET n = n + 1 WHERE id = 1', prepare=True)
            self.timings[mode].append(time.perf_counter() - t0)

    def flush(self) -> float:
        """Seconds: median synchronous minus median asynchronous commit."""
        return percentile(self.timings["on"], 0.5) - percentile(self.timings["off"], 0.5)

    def close(self) -> None:
        """Close the connection; :attr:`seen` keeps :meth:`traffic` up to now."""
        self.seen = self.traffic()
        self._conn.close()


def _contend(
    url: str, prefix: str, seconds: float, start: Any, results: Any, *, polled: bool = False
) -> None:
    service = LockService(Polled(LockService(url).provider) if polled else url, prefix=prefix)
    service.peek("fair")
    count = 0
    start.wait()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            lease = service.try_lock("fair", ttl=30, wait=max(0.0, end - time.monotonic()))
            if lease is None:
                break
            time.sleep(0.005)
            lease.release()
            count += 1
    finally:
        service.close()
    results.put(count)


def fairness(url: str, prefix: str, seconds: float, processes: int = 8, *, polled: bool = False) -> list[int]:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_contend, args=(url, prefix, seconds, start, results), kwargs={"polled": polled})
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    counts = sorted(results.get(timeout=seconds + 120) for _ in procs)
    for proc in procs:
        proc.join(30)
    return counts


def jain(counts: list[int]) -> float:
    total = sum(counts)
    return total * total / (len(counts) * sum(c * c for c in counts)) if total else 0.0


#: The steps of a PostgreSQL woken handover :func:`breakdown` times, in order (its stamps).
STEPS = (
    "release sent",
    "release reply",
    "notify read",
    "dispatched",
    "waiter running",
    "acquire sent",
    "acquire reply",
    "lock returned",
)


def breakdown(url: str, trials: int) -> tuple[list[dict[str, float]], CommitFlush]:
    """Timestamps (seconds after ``lease.release()`` was called) of each step of ``trials``
    PostgreSQL woken handovers (:data:`STEPS`), taken by wrapping the holder's and the
    waiter's statement executors, the listener's ``select`` and dispatch, and the waiter's
    subscription; and the disk's commit flush sampled between the trials. Diagnostic only
    (the wrappers add a few microseconds per step); ``python -m benchmarks.waiting --breakdown``."""
    import select as real_select

    from celery_exclusive.providers import _pg_listen, _signals

    stamps: dict[str, float] = {}
    now = time.perf_counter

    class Select:
        def select(self, r: Any, w: Any, x: Any, t: float | None = None) -> Any:
            out = real_select.select(r, w, x, t)
            if r and r[0] in out[0]:  # the connection's socket (listed first), not the pipe
                stamps.setdefault("notify read", now())
            return out

    dispatch, wait = _pg_listen.Listener._dispatch, _signals.Subscription.wait

    def stamped_dispatch(self: Any, name: str) -> None:
        stamps.setdefault("dispatched", now())
        dispatch(self, name)

    def stamped_wait(self: Any, timeout: float) -> bool:
        woken = wait(self, timeout)
        if woken:
            stamps.setdefault("waiter running", now())
        return woken

    def wrap(executor: Any, op: str, sent: str, reply: str) -> None:
        run = executor.run

        def stamped(name: str, params: Any, timeout: Any) -> Any:
            if name != op:
                return run(name, params, timeout)
            t0 = now()
            rows = run(name, params, timeout)
            if rows and rows[0][0]:  # the release freed the lease / the acquire was granted
                stamps[sent], stamps[reply] = t0, now()
            return rows

        executor.run = stamped

    listen = cast(Any, _pg_listen)
    select_module = listen.select
    listen.select = Select()
    _pg_listen.Listener._dispatch = stamped_dispatch  # type: ignore[method-assign]
    _signals.Subscription.wait = stamped_wait  # type: ignore[method-assign]
    prefix = f"bd{uuid.uuid4().hex[:8]}:"
    holder, waiter = LockService(url, prefix=prefix), LockService(url, prefix=prefix)
    wrap(cast(Any, holder.provider)._executor, "release", "release sent", "release reply")
    wrap(cast(Any, waiter.provider)._executor, "acquire", "acquire sent", "acquire reply")
    flush = CommitFlush(url, WAIT_TABLE + "_flush")
    rows = []
    try:
        for i in range(trials):
            lease = holder.lock("handover", ttl=30)
            started: list[float] = []

            def release(
                lease: Any = lease, started: list[float] = started, hold: float = 0.02 + (i % 5) * 0.03
            ) -> None:
                time.sleep(hold)
                stamps.clear()
                started.append(now())
                lease.release()

            thread = threading.Thread(target=release)
            thread.start()
            got = waiter.lock("handover", ttl=30, wait=10)
            stamps["lock returned"] = now()
            thread.join()
            got.release()
            flush()
            rows.append({step: stamps.get(step, math.nan) - started[0] for step in STEPS})
    finally:
        listen.select = select_module
        _pg_listen.Listener._dispatch = dispatch  # type: ignore[method-assign]
        _signals.Subscription.wait = wait  # type: ignore[method-assign]
        flush.close()
        waiter.close()
        holder.close()
        drop_pg_tables(WAIT_TABLE + "_flush")
    return rows, flush


def print_breakdown(url: str, trials: int) -> None:
    rows, flush = breakdown(url, trials)
    print(f"postgres woken handover, {trials} trials: medians in ms after lease.release() was called")
    previous = None
    for step in STEPS:
        at = statistics.median(row[step] for row in rows) * 1000
        took = "" if previous is None else statistics.median(row[step] - row[previous] for row in rows) * 1000
        print(f"  {step:15} at {at:6.3f}" + ("" if took == "" else f"  step {took:6.3f}"))
        previous = step
    on, off = (statistics.median(flush.timings[m]) * 1000 for m in ("on", "off"))
    print(f"  commit flush between trials: {on - off:.3f} ms ({on:.3f} sync - {off:.3f} async)")
    traffic = flush.seen
    if traffic is not None:
        print(
            f"  the server meanwhile, every session: {traffic[0]:.0f} commits/s,"
            f" {traffic[1]:.0f} WAL flushes/s (a durable commit may wait for another's flush)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--stores", default="memory,redis,postgres")
    parser.add_argument(
        "--breakdown", action="store_true", help="time the steps of the PostgreSQL woken handover"
    )
    args = parser.parse_args()
    if args.breakdown:
        print_breakdown(with_table(POSTGRES_URL, WAIT_TABLE), args.trials)
        return
    for name in args.stores.split(","):
        url = URLS[name]
        prefix = f"bw{uuid.uuid4().hex[:8]}:"
        probe = LockService(url, prefix=prefix)
        woken = isinstance(probe.provider, WakesWaiters)
        probe.close()
        for polled in (False, True) if woken else (False,):
            lat = sorted(handover(url, prefix, args.trials, polled=polled))
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            how = "polled" if polled or not woken else "woken"
            print(
                f"{name:9} handover {how:6} p50 {statistics.median(lat) * 1000:7.1f} ms"
                f"  p99 {p99 * 1000:7.1f} ms  ({len(lat)} trials)"
            )
        if name == "memory":
            continue  # in-process only: no cross-process fairness to measure
        for polled in (False, True) if woken else (False,):
            counts = fairness(url, prefix, args.seconds, polled=polled)
            total = sum(counts)
            shares = " ".join(f"{100 * c / total:4.1f}%" for c in counts) if total else "-"
            how = "polled" if polled or not woken else "woken"
            print(
                f"{name:9} fairness {how:6} 8 procs: {total} acquisitions, shares {shares},"
                f" Jain {jain(counts):.3f}"
            )


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """The ``waiting`` section: Redis and PostgreSQL handover woken by the release vs a
    polling waiter; on PostgreSQL also the disk's commit flush, sampled between the woken
    trials (the woken acquire commits durably: its flush is part of the handover)."""
    trials = 5 if plan.quick else 40
    stores = {
        "redis": (REDIS_URL, REDIS_PREFIX + "wait:"),
        "postgres": (with_table(POSTGRES_URL, WAIT_TABLE), "wait:"),
    }
    for index, (store, (url, prefix)) in enumerate(stores.items()):
        rows, targets = ROWS[2 * index : 2 * index + 2], TARGETS[index : index + 1]
        reason = reachable(url)
        if reason:
            report.unavailable(SECTION, rows + ([PG_FLUSH] if store == "postgres" else []), targets, reason)
            continue
        flush = None
        if store == "postgres":
            cleanup.add(f"table {WAIT_TABLE}", lambda: drop_pg_tables(WAIT_TABLE, WAIT_TABLE + "_done"))
            cleanup.add(f"table {WAIT_TABLE}_flush", lambda: drop_pg_tables(WAIT_TABLE + "_flush"))
            flush = CommitFlush(POSTGRES_URL, WAIT_TABLE + "_flush")
        p50s = {}
        try:
            for name, polled in zip(rows, (False, True), strict=True):
                lat = handover(url, prefix, trials, polled=polled, between=None if polled else flush)
                p50s[name] = percentile(lat, 0.5)
                report.row(
                    SECTION,
                    name,
                    p50_us=p50s[name] * 1e6,
                    p99_us=percentile(lat, 0.99) * 1e6,
                    note=f"release to acquired, {trials} trials"
                    + ("; signals hidden, poll bound 50 ms" if polled else f"; {SIGNALS[store]}"),
                )
        finally:
            if flush is not None:
                flush.close()
        name, bound, op, unit = targets[0]
        note = "quick: too few trials to judge" if plan.quick else ""
        if flush is not None:
            on, off = (percentile(flush.timings[m], 0.5) for m in ("on", "off"))
            report.row(
                SECTION,
                PG_FLUSH,
                rate=(on - off) * 1e6,
                unit="µs",
                p50_us=on * 1e6,
                p99_us=percentile(flush.timings["on"], 0.99) * 1e6,
                note=f"1-row UPDATE: p50 {on * 1e6:.0f} µs synchronous vs {off * 1e6:.0f} µs asynchronous"
                f" commit, {len(flush.timings['on'])} each, between the woken trials"
                + (
                    ""
                    if flush.seen is None
                    else f"; the server meanwhile, every session: {flush.seen[0]:.0f} commits/s,"
                    f" {flush.seen[1]:.0f} WAL flushes/s"
                ),
            )
            woken = p50s[rows[0]]
            note = (note + "; " if note else "") + (
                f"of which the disk's commit flush p50 {flush.flush() * 1000:.2f} ms:"
                f" handover minus flush {(woken - flush.flush()) * 1000:.2f} ms"
                + ("" if flush.seen is None else f"; server {flush.seen[1]:.0f} WAL flushes/s")
            )
        report.target(name, p50s[rows[0]] * 1000, bound, op=op, unit=unit, note=note)


if __name__ == "__main__":
    main()
