"""A worker fleet on one PostgreSQL through PgBouncer (transaction pooling): what the server sees.

``python -m benchmarks.fleet [--processes 64] [--seconds 30] [--pool 20] [--leases 4] [--rate 2]``
starts a private PostgreSQL (``max_connections=100``, ``fsync`` on) and a private PgBouncer in
transaction mode with ``default_pool_size=--pool`` in front of it, both on free loopback ports
in temporary directories, then forks ``--processes`` worker processes. Each builds one
``LockService`` on the PgBouncer URL (``ce_pgbouncer=true``), holds ``--leases`` leases for the
whole run, kept alive by its heartbeat (ttl ``--ttl``, a refresh every ``--refresh`` seconds),
and meanwhile runs ``--rate`` ``lock()`` + ``release()`` cycles per second on keys of its own
(paced, jittered, no catch-up bursts). A thread of this process samples the server's
``pg_stat_activity`` (client backends, and those running a statement) every 20 ms and
PgBouncer's ``SHOW POOLS`` every 100 ms over a direct connection of its own (not counted).

Reported: the server connections (max over the run, from before the workers connect until
they have closed), PgBouncer's client connections and waiting clients, ``lock()`` latency
p50/p99, heartbeat refresh-call latency p50/p99 (``lock_refreshed``'s ``duration``: one
statement refreshing every due lease of the process), store errors, and leases lost (the
``lock_lost`` signals plus held leases found not held at the end; the target is 0).
Everything started is stopped and removed at the end. :func:`measure` is the measurement on
any PgBouncer and server; ``tests/scale/test_fleet.py`` runs it short.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import percentile

#: Seconds the workers get to connect and take their held leases before the window opens.
SETUP_TIMEOUT = 120.0


@dataclass
class Fleet:
    """What one run measured (latencies in seconds)."""

    processes: int
    seconds: float
    pool_size: int
    max_connections: int
    server_max: int = 0  # client backends on the server, max over the run
    server_busy_mean: float = 0.0  # of those, running a statement (mean over the window's samples)
    server_busy_max: int = 0  # the same, max over the window
    clients_max: int = 0  # client connections PgBouncer held, max over the run
    waiting_max: int = 0  # clients PgBouncer had queued for a server connection, max over the run
    waiting_window_max: int = 0  # the same, max over the window
    reported: int = 0  # worker processes that reported back
    cycles: int = 0
    acquire: list[float] = field(default_factory=list)
    release: list[float] = field(default_factory=list)
    refresh: list[float] = field(default_factory=list)
    held: int = 0  # leases held for the whole run, over all processes
    lost: int = 0
    lost_in_setup: int = 0  # of those, before the window opened (while the fleet connected)
    setup: list[float] = field(default_factory=list)  # per process: taking its held leases
    refresh_failed: int = 0
    errors: list[str] = field(default_factory=list)
    window: float = 0.0  # seconds the cycling actually ran

    def lines(self) -> list[str]:
        """The result, one finding a line."""

        def ms(values: list[float], q: float) -> str:
            return f"{percentile(values, q) * 1e3:.2f} ms"

        rate = self.cycles / self.window if self.window else 0.0
        return [
            f"{self.processes} processes ({self.reported} reported), {self.held} leases held by heartbeats, "
            f"{self.cycles:,} lock()+release() cycles in {self.window:.1f} s ({rate:,.0f}/s), "
            f"{len(self.refresh):,} refresh calls",
            f"server connections: max {self.server_max} (pool {self.pool_size}, max_connections "
            f"{self.max_connections}); running a statement while cycling: mean {self.server_busy_mean:.2f}, "
            f"max {self.server_busy_max}",
            f"PgBouncer clients: max {self.clients_max}; waiting for a server connection: max "
            f"{self.waiting_max} (while cycling: {self.waiting_window_max})",
            f"lock(): p50 {ms(self.acquire, 0.5)}, p99 {ms(self.acquire, 0.99)}; release(): p50 "
            f"{ms(self.release, 0.5)}, p99 {ms(self.release, 0.99)}",
            f"refresh call: p50 {ms(self.refresh, 0.5)}, p99 {ms(self.refresh, 0.99)}; "
            f"failed refreshes {self.refresh_failed}",
            f"taking the held leases at start-up (first use): p50 {ms(self.setup, 0.5)}, "
            f"max {ms(self.setup, 1.0)}",
            f"leases lost: {self.lost} ({self.lost_in_setup} while the fleet connected); "
            f"store errors: {len(self.errors)}" + (f" (first: {self.errors[0]})" if self.errors else ""),
        ]


@dataclass(frozen=True)
class Shape:
    """What each worker process does: ``leases`` held throughout with ``ttl`` and
    ``refresh``, ``rate`` lock()+release() cycles per second for ``seconds``."""

    leases: int
    rate: float
    ttl: float
    refresh: float
    seconds: float


def _worker(index: int, url: str, shape: Shape, channels: tuple[Any, Any, Any]) -> None:
    """One worker process: see the module docstring. ``channels``: the events ``setup`` (may
    connect) and ``go`` (may cycle), and the queue ``out`` its findings (a dict) go on."""
    setup, go, out = channels
    leases, rate, seconds = shape.leases, shape.rate, shape.seconds
    from celery_exclusive import BackendError, LockService, signals

    found: dict[str, Any] = {"acquire": [], "release": [], "refresh": [], "lost": 0, "failed": 0}
    found.update(errors=[], cycles=0, held=0, window=0.0, setup=0.0, lost_in_setup=0)

    def refreshed(sender: object = None, duration: float = 0.0, **_: Any) -> None:
        found["refresh"].append(duration)

    def lost(sender: object = None, **_: Any) -> None:
        found["lost"] += 1

    def failed(sender: object = None, **_: Any) -> None:
        found["failed"] += 1

    signals.lock_refreshed.connect(refreshed, weak=False)
    signals.lock_lost.connect(lost, weak=False)
    signals.refresh_failed.connect(failed, weak=False)
    setup.wait()
    service = LockService(url, prefix=f"fleet{index}:", ttl=shape.ttl, refresh_interval=shape.refresh)
    try:
        start = time.perf_counter()
        held = [service.lock(f"held{n}") for n in range(leases)]
        found["setup"] = time.perf_counter() - start
        out.put(("ready", index))
        go.wait()
        found["lost_in_setup"] = found["lost"]
        began = time.monotonic()
        end, period, n = began + seconds, 1.0 / rate, 0
        due = began + random.uniform(0, period)
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if due > now:
                time.sleep(min(due - now, end - now))
                continue
            due = max(due + period * random.uniform(0.5, 1.5), now)
            try:
                start = time.perf_counter()
                lease = service.lock(f"job{n % 16}")
                taken = time.perf_counter()
                service.release(lease)
                found["acquire"].append(taken - start)
                found["release"].append(time.perf_counter() - taken)
                found["cycles"] += 1
            except BackendError as exc:
                found["errors"].append(str(exc)[:300])
            n += 1
        found["window"] = time.monotonic() - began
        found["held"] = sum(lease.held for lease in held)
        found["lost"] = max(found["lost"], leases - found["held"])
        for lease in held:
            service.release(lease)
    except BackendError as exc:
        found["errors"].append(f"setup: {str(exc)[:300]}")
        out.put(("ready", index))
    finally:
        service.close()
        out.put(("done", found))


class _Sampler(threading.Thread):
    """Samples the server's client backends and PgBouncer's pools until :meth:`stop`."""

    def __init__(self, server_dsn: str, admin_dsn: str | None) -> None:
        super().__init__(name="fleet-sampler", daemon=True)
        import psycopg

        self._server = psycopg.connect(server_dsn, autocommit=True)
        self._admin = psycopg.connect(admin_dsn, autocommit=True) if admin_dsn else None
        row = self._server.execute("SHOW max_connections").fetchone()
        self.max_connections = int(row[0]) if row else 0
        self.server: list[int] = []
        self.window: list[int] = []  # busy counts sampled while the window was open
        self.window_waiting: list[int] = []
        self.in_window = False
        self.clients: list[int] = []
        self.waiting: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        step = 0
        while not self._halt.wait(0.02):
            row = self._server.execute(
                "SELECT count(*), count(*) FILTER (WHERE state = 'active') FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchone()
            if row:
                self.server.append(int(row[0]))
                if self.in_window:
                    self.window.append(int(row[1]))
            step += 1
            if self._admin is not None and step % 5 == 0:
                clients, waiting = self._pools()
                self.clients.append(clients)
                self.waiting.append(waiting)
                if self.in_window:
                    self.window_waiting.append(waiting)

    def _pools(self) -> tuple[int, int]:
        """Client connections and waiting clients over PgBouncer's pools (``SHOW POOLS``, which
        the admin console answers only in the simple query protocol)."""
        assert self._admin is not None
        result = self._admin.pgconn.exec_(b"SHOW POOLS")
        names = [result.fname(c).decode() for c in range(result.nfields)]
        active, waiting = names.index("cl_active"), names.index("cl_waiting")
        total = waiting_total = 0
        for r in range(result.ntuples):
            if result.get_value(r, names.index("database")) == b"pgbouncer":
                continue
            total += int(result.get_value(r, active) or 0) + int(result.get_value(r, waiting) or 0)
            waiting_total += int(result.get_value(r, waiting) or 0)
        return total, waiting_total

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self._server.close()
        if self._admin is not None:
            self._admin.close()


def measure(
    url: str,
    server_dsn: str,
    *,
    admin_dsn: str | None = None,
    pool_size: int,
    processes: int = 64,
    seconds: float = 30.0,
    leases: int = 4,
    rate: float = 2.0,
    ttl: float = 3.0,
    refresh: float = 1.0,
    create_table: bool = False,
) -> Fleet:
    """Run the fleet on the store ``url`` (through PgBouncer), sampling the server at
    ``server_dsn`` (libpq, direct) and PgBouncer's admin console at ``admin_dsn``.

    The schema is created first, by this process; the workers' URL says
    ``ce_create_table=false`` unless ``create_table`` (then each worker's first use checks
    the schema in a transaction under an advisory lock: one at a time across the fleet)."""
    from celery_exclusive import LockService

    first = LockService(url, prefix="fleet-deploy:")  # the schema exists before the fleet starts
    first.release(first.lock("created"))
    first.close()
    if not create_table:
        url += "&ce_create_table=false"
    context = multiprocessing.get_context("fork")
    setup, go = context.Event(), context.Event()
    out = context.Queue()
    children = [
        context.Process(
            target=_worker,
            args=(i, url, Shape(leases, rate, ttl, refresh, seconds), (setup, go, out)),
            name=f"fleet-{i}",
            daemon=True,
        )
        for i in range(processes)
    ]
    for child in children:
        child.start()
    sampler = _Sampler(server_dsn, admin_dsn)  # after forking: no thread is forked
    sampler.start()
    result = Fleet(processes, seconds, pool_size, sampler.max_connections)
    found: list[dict[str, Any]] = []
    try:
        setup.set()
        ready, deadline = 0, time.monotonic() + SETUP_TIMEOUT
        while ready + len(found) < processes:  # a worker that failed reports "done" only
            kind, value = out.get(timeout=max(deadline - time.monotonic(), 0.1))
            if kind == "ready":
                ready += 1
            else:
                found.append(value)
        sampler.in_window = True
        go.set()
        deadline = time.monotonic() + seconds + SETUP_TIMEOUT
        while len(found) < processes:
            kind, value = out.get(timeout=max(deadline - time.monotonic(), 0.1))
            if kind == "done":
                found.append(value)
        sampler.in_window = False
    finally:
        go.set()
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(5)
        time.sleep(0.1)  # a last sample after every worker closed
        sampler.stop()
    result.reported = len(found)
    for each in found:
        result.acquire += each["acquire"]
        result.release += each["release"]
        result.refresh += each["refresh"]
        result.errors += each["errors"]
        result.cycles += each["cycles"]
        result.held += each["held"]
        result.lost += each["lost"]
        result.lost_in_setup += each["lost_in_setup"]
        result.setup.append(each["setup"])
        result.refresh_failed += each["failed"]
    result.window = max((each["window"] for each in found), default=0.0)
    result.server_max = max(sampler.server, default=0)
    result.server_busy_max = max(sampler.window, default=0)
    result.server_busy_mean = sum(sampler.window) / len(sampler.window) if sampler.window else 0.0
    result.clients_max = max(sampler.clients, default=0)
    result.waiting_max = max(sampler.waiting, default=0)
    result.waiting_window_max = max(sampler.window_waiting, default=0)
    return result


@contextlib.contextmanager
def private_servers(pool_size: int, max_connections: int = 100) -> Iterator[tuple[str, str, str]]:
    """A private PostgreSQL and a PgBouncer (transaction mode) in front of it, stopped and
    removed on exit; yields ``(store URL through PgBouncer, server DSN, admin DSN)``.

    Uses the test suite's private-server helpers (``tests/faults/servers.py``,
    ``tests/scale/_servers.py``): run from the repository's root.
    """
    from tests.faults.servers import PrivatePostgres, ServerUnavailable, postgres_bindir
    from tests.scale._servers import processes, start_pgbouncer

    bindir = postgres_bindir()
    if bindir is None:
        raise ServerUnavailable("no PostgreSQL server binaries (initdb, pg_ctl, postgres)")
    # fsync on: acquires and refreshes commit durably, as on a real server.
    settings = {"max_connections": str(max_connections), "fsync": "on", "shared_buffers": "64MB"}
    server = PrivatePostgres(bindir, settings).start()
    folder = Path(tempfile.mkdtemp(prefix="ce-fleet-pgbouncer-"))
    try:
        conninfo = f"host=127.0.0.1 port={server.port} dbname=postgres user=postgres"
        with processes() as started:
            port = start_pgbouncer(
                started, folder, {"fleet": conninfo}, pool_size=pool_size, max_client_conn=2000
            )
            yield (
                f"postgresql+psycopg://postgres@127.0.0.1:{port}/fleet?ce_pgbouncer=true&ce_table=ce_fleet",
                conninfo,
                f"host=127.0.0.1 port={port} dbname=pgbouncer user=postgres",
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--pool", type=int, default=20, help="PgBouncer default_pool_size")
    parser.add_argument("--leases", type=int, default=4, help="leases each process holds throughout")
    parser.add_argument("--rate", type=float, default=2.0, help="lock()+release() cycles/s per process")
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--refresh", type=float, default=1.0)
    parser.add_argument(
        "--create-table", action="store_true", help="workers check the schema on first use (the default URL)"
    )
    args = parser.parse_args()
    print(f"load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with private_servers(args.pool) as (url, server_dsn, admin_dsn):
        fleet = measure(
            url,
            server_dsn,
            admin_dsn=admin_dsn,
            pool_size=args.pool,
            processes=args.processes,
            seconds=args.seconds,
            leases=args.leases,
            rate=args.rate,
            ttl=args.ttl,
            refresh=args.refresh,
            create_table=args.create_table,
        )
    print(f"workers' URL {'without' if args.create_table else 'with'} ce_create_table=false")
    print("\n".join(fleet.lines()))
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
