"""Issue #16: what a µs of client CPU costs in cycle time, and what a short spin before
blocking buys (a probe, not part of ``python -m benchmarks``).

Against a *private* redis-server (a temp dir, a free port; the shared one is never touched)
this runs, interleaved round by round, the C Redis floor (``c/redis_floor.c``) with
``think`` µs busy-waited before each of its two commands and ``spin`` µs of non-blocking
polling before each blocking ``recv``; the Python floor (hand-written RESP) and
``LockService.lock() + release()`` with and without the same spin (a scratch patch of this
process's wire, not the library's code); each with the client and the server on the same
vCPU, on different vCPUs, or where the scheduler puts them. Per cycle: wall time, the
client's and the server's CPU (``/proc/<pid>/schedstat``), the client's voluntary context
switches, and the idle entries of all vCPUs (``cpuidle/state*/usage``).

    python -m benchmarks.wakeup [--rounds 5] [--cycles 2000] [--only c|py|svc]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import floors
from benchmarks.harness import Cleanup
from celery_exclusive.providers import _redis_wire

CPUS = sorted(os.sched_getaffinity(0))


def load() -> str:
    return Path("/proc/loadavg").read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, int]]:
    """A redis-server of our own (no persistence) on a free port: (url, pid)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found")
    tmp = tempfile.mkdtemp(prefix="cewakeup-")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def cpu_ns(pid: int, tid: int | None = None) -> int:
    """CPU time of a process's main thread (or of ``tid``) so far."""
    path = f"/proc/{pid}/task/{tid or pid}/schedstat"
    return int(Path(path).read_text().split()[0])


def wait_ns(*pids: int) -> int:
    """Time the main threads of ``pids`` spent runnable, waiting for a vCPU, so far."""
    return sum(int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) for pid in pids)


def vcsw(pid: int, tid: int | None = None) -> int:
    for line in Path(f"/proc/{pid}/task/{tid or pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def private_postgres(fsync: str) -> Iterator[str]:
    """A PostgreSQL server of our own (initdb in a temp dir, a free port): its URL."""
    tmp = tempfile.mkdtemp(prefix="cewakeup-pg-")
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
    data, port = f"{tmp}/data", free_port()
    as_pg = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def run(*cmd: str) -> None:
        subprocess.run([*as_pg, *cmd], check=True, capture_output=True)

    run("initdb", "-D", data, "-U", "postgres", "--auth=trust")
    opts = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c shared_buffers=32MB -c fsync={fsync}"
    run("pg_ctl", "-D", data, "-o", opts, "-l", f"{tmp}/log", "-w", "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        run("pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
        shutil.rmtree(tmp, ignore_errors=True)


def pg_probe(args: argparse.Namespace) -> dict[tuple[str, str, int, int], list[tuple[float, ...]]]:
    """The C libpq floor (think 0 and each ``--think``) and LockService, by placement."""
    from benchmarks.harness import psycopg_dsn
    from celery_exclusive import LockService
    from celery_exclusive.providers.base import encode_holder

    results: dict[tuple[str, str, int, int], list[tuple[float, ...]]] = {}
    cleanup = Cleanup()
    me = os.getpid()
    with private_postgres(args.fsync) as url:
        service = LockService(f"{url}?ce_table=wakeup_locks", prefix="svc:", ttl=30.0)
        service.lock("warm").release()
        provider: Any = service.provider
        statements = provider._executor.statements
        acquire, release = statements["acquire"], statements["release"]
        program = floors.build("pg_floor", cleanup)
        if isinstance(program, str):
            raise SystemExit(program)
        floor = floors.pg_floor(
            program,
            psycopg_dsn(url),
            key_prefix="cfloor:",
            ttl=30.0,
            life=30.0,
            holder=encode_holder({"host": "wakeup", "pid": me}),
            acquire=(acquire.sql, acquire.params),
            release=(release.sql, tuple("key" if p == "channel" else p for p in release.params)),
        )
        floor_backend = int(floor.ask("backend"))
        import psycopg  # the service's backend: its kept connection's

        service_backend = None
        with psycopg.connect(psycopg_dsn(url), autocommit=True) as probe:
            rows = probe.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND pid <> pg_backend_pid() AND pid <> %s",
                (floor_backend,),
            ).fetchall()
            service_backend = rows[0][0] if len(rows) == 1 else None
        if service_backend is None:
            raise SystemExit("cannot tell the service's backend")
        thinks = [int(x) for x in args.think.split(",")]
        keys = [f"k{i}" for i in range(256)]
        cases = [("C floor", t) for t in thinks] + [("LockService", 0)]
        for what, think in cases:
            if what == "C floor":
                floor.batch(200, think * 1000)
            else:
                for i in range(200):
                    service.lock(keys[i % 256]).release()
        for _ in range(args.rounds):
            for place in args.placements.split(","):
                client_cpus, server_cpus = PLACEMENTS[place]
                pin(floor.popen.pid, client_cpus)
                os.sched_setaffinity(0, client_cpus)
                for backend in (floor_backend, service_backend):
                    pin(backend, server_cpus)
                for what, think in cases:
                    n = args.cycles
                    server = floor_backend if what == "C floor" else service_backend
                    pid = floor.popen.pid if what == "C floor" else me
                    s0, i0, c0, v0 = cpu_ns(server), idle_entries(), cpu_ns(pid), vcsw(pid)
                    m0 = migrations(server) + migrations(pid)
                    w0 = wait_ns(server, pid)
                    t0 = time.perf_counter_ns()
                    if what == "C floor":
                        floor.batch(n, think * 1000)
                    else:
                        for i in range(n):
                            service.lock(keys[i % 256]).release()
                    wall = time.perf_counter_ns() - t0
                    results.setdefault((place, what, think, 0), []).append(
                        (
                            wall / n / 1000,
                            (cpu_ns(pid) - c0) / n / 1000,
                            (cpu_ns(server) - s0) / n / 1000,
                            (vcsw(pid) - v0) / n,
                            (idle_entries() - i0) / n,
                            (migrations(server) + migrations(pid) - m0) / n,
                            float(last_cpu(server) == last_cpu(pid)),
                            (wait_ns(server, pid) - w0) / n / 1000,
                        )
                    )
        os.sched_setaffinity(0, set(CPUS))
        floor.close()
        service.provider.close() if hasattr(service.provider, "close") else None
        cleanup.run()
    return results


def last_cpu(pid: int) -> int:
    """The vCPU process ``pid``'s main thread last ran on."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[36])


def migrations(pid: int) -> int:
    for line in Path(f"/proc/{pid}/task/{pid}/sched").read_text().splitlines():
        if line.startswith("se.nr_migrations"):
            return int(line.split(":")[1])
    return 0


def idle_entries() -> int:
    total = 0
    for usage in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpuidle/state*/usage"):
        total += int(usage.read_text())
    return total


def pin(pid: int, cpus: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


PLACEMENTS: dict[str, tuple[set[int], set[int]]] = {
    "free": (set(CPUS), set(CPUS)),
    "same": ({CPUS[0]}, {CPUS[0]}),
    "apart": ({CPUS[0]}, {CPUS[-1]}),
}


def spin_recv_into(sock: socket.socket, spin_ns: int) -> Callable[..., int]:
    """``sock.recv_into`` that polls (MSG_DONTWAIT) up to ``spin_ns`` before it blocks."""
    blocking = sock.recv_into
    dontwait = socket.MSG_DONTWAIT
    clock = time.monotonic_ns

    def recv_into(buf: Any, nbytes: int = 0, flags: int = 0) -> int:
        end = clock() + spin_ns
        while True:
            try:
                return sock.recv_into(buf, nbytes, dontwait)
            except BlockingIOError:
                if clock() >= end:
                    return blocking(buf, nbytes, flags)

    return recv_into


class SpinningSocket:
    """A socket proxy whose ``recv_into`` spins first (the wire keeps ``sock`` as attribute)."""

    def __init__(self, sock: socket.socket, spin_ns: int) -> None:
        self._sock = sock
        self.recv_into = spin_recv_into(sock, spin_ns)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def spinning_received(spin_ns: int) -> Callable[..., Any]:
    """A scratch copy of ``_Line._received`` whose ``recv_into`` spins ``spin_ns`` first."""
    monotonic = _redis_wire._monotonic
    tolerance = _redis_wire.TOLERANCE

    def _received(self: Any, deadline: float | None) -> Any:
        reader, buf, missing = self.reader, self.buf, self.lib.not_enough_data
        recv_into = spin_recv_into(self.sock, spin_ns)
        end = deadline if deadline is not None else self._end(None)
        reply = missing
        try:
            while reply is missing:
                if end is not None and end - monotonic() + tolerance < self.rcv:
                    self.rcv = self._arm(socket.SO_RCVTIMEO, end - monotonic())
                try:
                    count = recv_into(buf)
                except BlockingIOError:
                    self._expired(socket.SO_RCVTIMEO, end)
                    continue
                if not count:
                    raise self.lib.connection_error(self.lib.closed_message)
                reader.feed(buf, 0, count)
                reply = reader.gets()
                if deadline is None:
                    end = self._end(None)
        except OSError as exc:
            raise self.lib.connection_error(f"Error while reading: {exc.args}") from exc
        return reply

    return _received


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument(
        "--think", default="0,5,10,20,50,100", help="µs busy-waited before each command (C floor)"
    )
    ap.add_argument("--spin", default="0,20,50", help="µs of polling before blocking")
    ap.add_argument("--placements", default="free,same,apart")
    ap.add_argument("--only", default="c,py,svc")
    ap.add_argument("--fsync", default="off", choices=("on", "off"), help="the private PostgreSQL's fsync")
    ap.add_argument("--store", default="redis", choices=("redis", "postgres"))
    args = ap.parse_args(argv)
    thinks = [int(x) for x in args.think.split(",")]
    spins = [int(x) for x in args.spin.split(",")]
    places = args.placements.split(",")
    only = set(args.only.split(","))
    cleanup = Cleanup()
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC load {load()}")
    try:
        if args.store == "postgres":
            results = pg_probe(args)
        else:
            results = redis_probe(args, thinks, spins, places, only, cleanup)
    finally:
        cleanup.run()
    print(f"# end {time.strftime('%H:%M:%S', time.gmtime())} UTC load {load()}")
    return report(results)


def redis_probe(  # noqa: PLR0917
    args: argparse.Namespace,
    thinks: list[int],
    spins: list[int],
    places: list[str],
    only: set[str],
    cleanup: Cleanup,
) -> dict[tuple[str, str, int, int], list[tuple[float, ...]]]:
    me = os.getpid()
    results: dict[tuple[str, str, int, int], list[tuple[float, ...]]] = {}
    if True:
        with private_redis() as (url, server):
            from celery_exclusive import LockService

            service = LockService(url, prefix="wakeup:svc:", ttl=30.0)
            commands = floors.capture_redis_commands(service)
            if isinstance(commands, str):
                raise SystemExit(commands)
            program = floors.build("redis_floor", cleanup)
            if isinstance(program, str):
                raise SystemExit(program)
            c_floor = floors.redis_floor(program, url, "wakeup:c:", commands)
            resp = floors.RespClient(url)
            py_op = floors.python_floor(resp, [f"wakeup:py:{i}" for i in range(256)], commands)
            resp_sock = resp.sock
            svc_keys = [f"k{i}" for i in range(256)]

            def run_c(n: int, think: int, spin: int) -> tuple[int, int, int]:
                pid = c_floor.popen.pid
                c0, v0 = cpu_ns(pid), vcsw(pid)
                c_floor.batch(n, think * 1000, spin * 1000)
                return c0, v0, pid

            def py_batch(op: Callable[[int], None], n: int) -> None:
                for i in range(n):
                    op(i)

            def with_spin(spin: int, body: Callable[[], None]) -> None:
                if spin <= 0:
                    body()
                    return
                # Python floor: readline() reads through makefile's raw socket reader.
                raw = socket.SocketIO(SpinningSocket(resp_sock, spin * 1000), "rb")  # type: ignore[arg-type]
                resp.file = io.BufferedReader(raw)
                plain = _redis_wire._Line._received
                _redis_wire._Line._received = spinning_received(spin * 1000)  # type: ignore[method-assign]
                try:
                    body()
                finally:
                    _redis_wire._Line._received = plain  # type: ignore[method-assign]
                    resp.file = resp_sock.makefile("rb")

            cases: list[tuple[str, int, int]] = []
            if "c" in only:
                cases += [("C floor", t, s) for t in thinks for s in spins]
            if "py" in only:
                cases += [("Python floor", 0, s) for s in spins]
            if "svc" in only:
                cases += [("LockService", 0, s) for s in spins]
            for what, think, spin in cases:  # warm-up
                if what == "C floor":
                    c_floor.batch(200, think * 1000, spin * 1000)
                else:
                    op = (
                        py_op
                        if what == "Python floor"
                        else (lambda i: service.lock(svc_keys[i % 256]).release())
                    )
                    with_spin(spin, lambda op=op: py_batch(op, 200))  # type: ignore[misc]
            for _ in range(args.rounds):
                for place in places:
                    client_cpus, server_cpus = PLACEMENTS[place]
                    pin(server, server_cpus)
                    pin(c_floor.popen.pid, client_cpus)
                    os.sched_setaffinity(0, client_cpus)
                    for what, think, spin in cases:
                        n = args.cycles
                        s0, i0 = cpu_ns(server), idle_entries()
                        m0 = migrations(server) + migrations(c_floor.popen.pid if what == "C floor" else me)
                        w0 = wait_ns(server, c_floor.popen.pid if what == "C floor" else me)
                        t0 = time.perf_counter_ns()
                        if what == "C floor":
                            c0, v0, pid = run_c(n, think, spin)
                            tid = None
                        else:
                            pid, tid = me, None
                            c0, v0 = cpu_ns(me), vcsw(me)
                            op = (
                                py_op
                                if what == "Python floor"
                                else (lambda i: service.lock(svc_keys[i % 256]).release())
                            )
                            with_spin(spin, lambda op=op, n=n: py_batch(op, n))  # type: ignore[misc]
                        wall = time.perf_counter_ns() - t0
                        row = (
                            wall / n / 1000,
                            (cpu_ns(pid, tid) - c0) / n / 1000,
                            (cpu_ns(server) - s0) / n / 1000,
                            (vcsw(pid, tid) - v0) / n,
                            (idle_entries() - i0) / n,
                            (migrations(server) + migrations(pid) - m0) / n,
                            float(last_cpu(server) == last_cpu(pid)),
                            (wait_ns(server, pid) - w0) / n / 1000,
                        )
                        results.setdefault((place, what, think, spin), []).append(row)
            os.sched_setaffinity(0, set(CPUS))
            c_floor.close()
            resp.close()
    return results


def report(results: dict[tuple[str, str, int, int], list[tuple[float, ...]]]) -> int:
    print(
        "| placement | client | think µs/cmd | spin µs | cycle µs (median of rounds) | cycles/s "
        "| client CPU µs | server CPU µs | client sleeps | idle entries (all vCPUs) "
        "| migrations (both) | rounds ending on one vCPU | both waiting for a vCPU µs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (place, what, think, spin), rows in results.items():
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        lo, hi = min(r[0] for r in rows), max(r[0] for r in rows)
        print(
            f"| {place} | {what} | {think} | {spin} | {med[0]:.1f} ({lo:.0f}-{hi:.0f}) | {1e6 / med[0]:,.0f} "
            f"| {med[1]:.1f} | {med[2]:.1f} | {med[3]:.2f} | {med[4]:.2f} | {med[5]:.3f} "
            f"| {sum(r[6] for r in rows):.0f}/{len(rows)} | {med[7]:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
