"""The physical floors of lock + release: C programs, and the least Python can do (a
hand-written RESP client; the PostgreSQL statements through ``psycopg.pq``).

The C sources live in ``benchmarks/c/``; each run compiles them with ``cc`` into a
temporary directory (removed at the end), so nothing built is ever committed. Without a
compiler (or, for the PostgreSQL floor, without libpq's headers: Debian's ``libpq-dev``)
their rows say n/a and why.

Each floor sends what the package sends, read from the package at run time: the Redis
floor replays the two commands a ``LockService.lock() + release()`` was just seen to send
(captured once, with the key and token made placeholders), the PostgreSQL floor prepares
the provider's own acquire and release statements. A floor program stays running for the
whole comparison; each batch is one line on its stdin, and it answers with the batch's
time and every cycle's, measured with ``CLOCK_MONOTONIC`` inside the program.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.harness import Batch, Cleanup

SOURCES = Path(__file__).resolve().parent / "c"

_built: dict[str, Path | str] = {}
_build_dir: list[Path] = []


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build(name: str, cleanup: Cleanup) -> Path | str:
    """The path of floor program ``name`` (``redis_floor``, ``pg_floor``), or why it is n/a."""
    if name in _built:
        return _built[name]
    cc = _compiler()
    if cc is None:
        _built[name] = "no C compiler (cc) on this machine"
        return _built[name]
    if not _build_dir:
        _build_dir.append(Path(tempfile.mkdtemp(prefix="cebench-floors-")))
        cleanup.add("floor programs", _remove_builds)
    flags: list[str] = []
    if name == "pg_floor":
        include = _libpq_include()
        if include is None:
            _built[name] = "libpq headers missing (Debian: apt-get install libpq-dev)"
            return _built[name]
        flags = [f"-I{include}", "-lpq"]
    target = _build_dir[0] / name
    command = [cc, "-O2", "-o", str(target), str(SOURCES / f"{name}.c"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        _built[name] = f"cc failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    else:
        _built[name] = target
    return _built[name]


def _remove_builds() -> None:
    """Delete the compiled programs (and forget them: a later run builds again)."""
    for directory in _build_dir:
        shutil.rmtree(directory, ignore_errors=True)
    _build_dir.clear()
    _built.clear()


def _libpq_include() -> str | None:
    candidates = []
    if shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            candidates.append(
                subprocess.run(
                    ["pg_config", "--includedir"], capture_output=True, text=True, timeout=10, check=False
                ).stdout.strip()
            )
    candidates.append("/usr/include/postgresql")
    return next((c for c in candidates if c and Path(c, "libpq-fe.h").is_file()), None)


class FloorProgram:
    """A running floor program: :meth:`batch` runs N cycles in it and returns their times."""

    def __init__(self, argv: Sequence[str], what: str) -> None:
        self.what = what
        self.popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def batch(self, n: int, think_ns: int = 0, spin_ns: int = 0) -> tuple[int, list[int]]:
        """Run ``n`` cycles (``think_ns``: busy-waiting that long before each statement or
        command; ``spin_ns``: each reply wait polls that long before blocking, the Redis floor
        only); (elapsed ns of the batch, each cycle's ns)."""
        request = f"{n} {think_ns} {spin_ns}" if spin_ns > 0 else f"{n} {think_ns}" if think_ns else str(n)
        elapsed, *cycles = map(int, self.ask(request).split())
        return elapsed, cycles

    def ask(self, request: str) -> str:
        """Send one request line; the program's one-line answer."""
        assert self.popen.stdin is not None
        assert self.popen.stdout is not None
        try:
            self.popen.stdin.write(f"{request}\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.popen.stdout.readline()
        if not line:
            self.popen.wait(10)
            err = self.popen.stderr.read() if self.popen.stderr else ""
            raise RuntimeError(f"{self.what} exited {self.popen.returncode}: {err.strip()}")
        return line

    def as_approach(self) -> Batch:
        """This program as an approach of :func:`benchmarks.harness.interleave`."""
        return Batch(self.batch)

    def close(self) -> None:
        """End the program (EOF on its stdin), killing it if it does not exit at once."""
        with contextlib.suppress(OSError):
            if self.popen.stdin:
                self.popen.stdin.close()
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream:
                stream.close()


# -- Redis -----------------------------------------------------------------------------------


def _unpacked(data: bytes) -> tuple[bytes, ...]:
    """The arguments of one command packed as RESP (an array of bulk strings)."""
    end = data.index(b"\r\n")
    count, at, args = int(data[1:end]), end + 2, []
    for _ in range(count):
        end = data.index(b"\r\n", at)
        start = end + 2
        args.append(data[start : start + int(data[at + 1 : end])])
        at = start + len(args[-1]) + 2
    return tuple(args)


def capture_redis_commands(service: Any) -> tuple[list[str], list[str]] | str:
    """The two commands ``service.lock(k).release()`` sends, as words with ``{key}`` and
    ``{token}`` placeholders; or why they could not be seen (the provider changed shape)."""
    provider = service.provider
    # A provider that built its client sends through its fast path's wire (which takes the
    # per-call timeout); a client passed in is driven through _execute.
    # On the wire every command goes through send_many (send() is one command of it).
    wire = getattr(provider, "_wire", None)
    owner, name = (wire, "send_many") if wire is not None else (provider, "_execute")
    original = getattr(owner, name, None)
    if original is None:
        return "the Redis provider has no _execute to observe its commands"
    service.lock("floor-probe-warm").release()  # the scripts are loaded: no NOSCRIPT retry below
    seen: list[tuple[Any, ...]] = []

    def record(*command: Any, **options: Any) -> Any:
        if owner is wire:  # send_many(commands, timeout): command tuples, or one packed
            commands = command[0]
            if isinstance(commands, bytes):
                seen.append(_unpacked(commands))
            else:
                seen.extend(commands)
        else:
            seen.append(command)
        return original(*command, **options)

    setattr(owner, name, record)
    try:
        lease = service.lock("floor-probe")
        lease.release()
    finally:
        if owner is wire:
            delattr(owner, name)  # back to the class's method, as it was
        else:
            setattr(owner, name, original)
    if len(seen) != 2:
        return f"lock() + release() sent {len(seen)} commands through {name}, not 2"

    def words(command: tuple[Any, ...]) -> list[str]:
        out = []
        for arg in command:
            text = arg.decode() if isinstance(arg, bytes) else str(arg)
            out.append("{key}" if text == lease.store_key else "{token}" if text == lease.token else text)
        return out

    acquire, release = words(seen[0]), words(seen[1])
    if "{key}" not in acquire or "{token}" not in acquire or "{token}" not in release:
        return "the captured commands do not carry the lease's key and token"
    return acquire, release


def token_prefix() -> str:
    """The package's token shape up to its wall-time part: ``host:pid:``."""
    return f"{socket.gethostname()}:{os.getpid()}:"


def redis_floor(path: Path, url: str, key_prefix: str, commands: tuple[list[str], list[str]]) -> FloorProgram:
    """Start the C Redis floor on ``url`` (host, port, DB number) for keys ``key_prefix<i>``."""
    parts = urlsplit(url)
    db = (parts.path or "/0").lstrip("/") or "0"
    argv = [
        str(path),
        parts.hostname or "127.0.0.1",
        str(parts.port or 6379),
        db,
        key_prefix,
        token_prefix(),
        *commands[0],
        "--",
        *commands[1],
    ]
    return FloorProgram(argv, "redis_floor")


class RespClient:
    """A minimal Redis client: hand-written RESP over one blocking socket (the Python floor).

    Blocking, its 10 s timeouts the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO``), as the C floor
    and the package's own connections: a socket with a Python timeout would ``poll()`` before
    every send and receive, two system calls a round trip the least Python can do need not pay.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", 10, 0))
        self.file = self.sock.makefile("rb")
        db = (parts.path or "/0").lstrip("/") or "0"
        self.call(b"SELECT", db.encode())

    def call(self, *args: bytes) -> Any:
        """Send one command, return its reply (an error reply raises RuntimeError)."""
        self.sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args))
        return self._read()

    def _read(self) -> Any:
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self.file.read(size + 2)[:-2]
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self._read() for _ in range(count)]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RuntimeError(rest.decode(errors="replace"))
        raise RuntimeError(f"unexpected reply {line[:40]!r}")

    def close(self) -> None:
        """Close the socket."""
        self.file.close()
        self.sock.close()


def python_floor(client: RespClient, keys: Sequence[str], commands: tuple[list[str], list[str]]) -> Any:
    """An op (for ``interleave``) sending the captured two commands with ``client``."""
    prefix = token_prefix()
    acquire = [w.encode() for w in commands[0]]
    release = [w.encode() for w in commands[1]]
    key_at = [commands[0].index("{key}"), commands[0].index("{token}")]
    rel_at = [commands[1].index(w) if w in commands[1] else -1 for w in ("{key}", "{token}")]
    encoded = [k.encode() for k in keys]
    n = len(keys)
    serial = itertools.count(1)

    def op(i: int) -> None:
        key = encoded[i % n]
        # The package's token shape; its 64 bits as the C floor makes them (no getrandom()).
        bits = (0x9E3779B97F4A7C15 * next(serial)) & 0xFFFFFFFFFFFFFFFF
        token = f"{prefix}{int(time.time() * 1000)}:{bits:016x}".encode()
        acquire[key_at[0]], acquire[key_at[1]] = key, token
        reply = client.call(*acquire)
        if (reply[0] if isinstance(reply, list) else reply) != 1:
            raise RuntimeError("python floor: key unexpectedly held")
        if rel_at[0] >= 0:
            release[rel_at[0]] = key
        release[rel_at[1]] = token
        client.call(*release)

    return op


# -- PostgreSQL ------------------------------------------------------------------------------


def pg_floor(
    path: Path,
    dsn: str,
    *,
    key_prefix: str,
    ttl: float,
    life: float,
    holder: str,
    acquire: tuple[bytes, Sequence[str]],
    release: tuple[bytes, Sequence[str]],
) -> FloorProgram:
    """Start the C libpq floor: ``acquire``/``release`` are ($n-numbered SQL, parameter names)."""
    argv = [
        str(path),
        dsn,
        key_prefix,
        token_prefix(),
        repr(float(ttl)),
        repr(float(life)),
        holder,
        acquire[0].decode(),
        ",".join(acquire[1]),
        release[0].decode(),
        ",".join(release[1]),
    ]
    return FloorProgram(argv, "pg_floor")


class PgPythonFloor:
    """The least Python can do for the package's two PostgreSQL statements (the Python floor,
    as :func:`python_floor` is for Redis): one ``psycopg.pq`` connection, both statements
    prepared, each sent with ``PQsendQueryPrepared`` and its reply awaited by ``poll`` on the
    socket in Python (as the package must, so that signal handlers run and deadlines hold;
    ``PQexecPrepared`` would block inside libpq), parameters made as bytes in place. No
    token from ``secrets``, no holder made per call, no result converted: what is left is
    the driver's binding and the interpreter."""

    def __init__(
        self,
        dsn: str,
        *,
        key_prefix: str,
        ttl: float,
        life: float,
        holder: str,
        acquire: tuple[bytes, Sequence[str]],
        release: tuple[bytes, Sequence[str]],
    ) -> None:
        import select

        from psycopg import pq

        self.conn = pq.PGconn.connect(dsn.encode())
        if self.conn.status != pq.ConnStatus.OK:
            raise RuntimeError(f"python floor: {self.conn.get_error_message()}")
        for name, (sql, _) in ((b"a", acquire), (b"r", release)):
            result = self.conn.prepare(name, sql)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise RuntimeError(f"python floor: {result.get_error_message()}")
        self._poll = select.poll()
        self._poll.register(self.conn.socket, select.POLLIN)
        self._fixed = {
            "ttl": repr(float(ttl)).encode(),
            "life": repr(float(life)).encode(),
            "holder": holder.encode(),
        }
        self._acquire = acquire[1]
        # The release notifies a channel when it frees the lease: the key serves (as the C floor's).
        self._release = tuple("key" if p == "channel" else p for p in release[1])
        self._keys = [f"{key_prefix}{i}".encode() for i in range(256)]
        self._prefix = token_prefix()
        self._serial = itertools.count(1)

    def _run(self, name: bytes, params: list[bytes | None]) -> Any:
        conn = self.conn
        conn.send_query_prepared(name, params)
        while True:
            conn.consume_input()
            if not conn.is_busy():
                break
            self._poll.poll()
        result = conn.get_result()
        while conn.get_result() is not None:
            pass
        return result

    def op(self, i: int) -> None:
        """One acquire + release of key ``i`` (mod 256), for ``interleave``."""
        key = self._keys[i % 256]
        bits = (0x9E3779B97F4A7C15 * next(self._serial)) & 0xFFFFFFFFFFFFFFFF
        token = f"{self._prefix}{int(time.time() * 1000)}:{bits:016x}".encode()
        values = {**self._fixed, "key": key, "token": token}
        granted = self._run(b"a", [values.get(p) for p in self._acquire])
        if granted.ntuples != 1 or granted.get_value(0, 0) in (None, b"f", b"0"):
            raise RuntimeError("python floor: key unexpectedly held")
        self._run(b"r", [values.get(p) for p in self._release])

    def close(self) -> None:
        """Close the connection."""
        self.conn.finish()


#: The clause by which the package's release commits without waiting for its WAL flush.
ASYNC_CLAUSE = " AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"


def durable(sql: bytes) -> bytes | None:
    """``sql`` without the asynchronous-commit clause (None if it has none)."""
    clause = ASYNC_CLAUSE.encode()
    return sql.replace(clause, b"") if clause in sql else None


# -- the scheduler ---------------------------------------------------------------------------


def sched(pid: int) -> tuple[int, int, int] | None:
    """``(ns on a CPU, ns runnable but waiting for one, voluntary context switches)`` of
    process ``pid``, every thread summed (Linux's ``/proc/<pid>/task/*/schedstat`` and
    ``status``); None where /proc does not say (another OS, a process gone or not ours to read)."""
    cpu = waited = sleeps = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        base = f"/proc/{pid}/task/{task}"
        try:
            with open(f"{base}/schedstat") as f:
                on_cpu, runnable, _ = map(int, f.read().split())
            with open(f"{base}/status") as f:
                status = f.read()
        except (OSError, ValueError):
            continue  # a thread that just ended
        cpu += on_cpu
        waited += runnable
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                sleeps += int(line.split()[1])
    return cpu, waited, sleeps


def is_postgres(pid: int) -> bool:
    """Whether ``pid`` is a PostgreSQL server process on this machine (its command name)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() in ("postgres", "postmaster")
    except OSError:
        return False


# -- the disk --------------------------------------------------------------------------------


def fdatasync_latency(seconds: float, directory: str | None = None) -> list[int]:
    """Nanoseconds of each ``write(8 KiB) + fdatasync`` over ``seconds`` in a temp file."""
    block = b"\0" * 8192
    with tempfile.NamedTemporaryFile(dir=directory, prefix="cebench-fsync-") as f:
        fd = f.fileno()
        os.write(fd, block * 16)
        os.fsync(fd)
        out: list[int] = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end or len(out) < 5:
            t0 = time.perf_counter_ns()
            os.pwrite(fd, block, (i % 16) * 8192)
            os.fdatasync(fd)
            out.append(time.perf_counter_ns() - t0)
            i += 1
        return out
