"""Private servers and a controllable loopback TCP proxy for the fault-injection suite.

Every server here is this suite's own: a PostgreSQL cluster made by ``initdb`` in a fresh
temporary directory (trust auth, ``fsync=off``) and a Redis without persistence, each on a
free loopback port, so that restarting, terminating or flushing them never touches the
machine's shared servers. :class:`TcpProxy` sits between a lock service and a server and
can stall, resume or cut the traffic. Callers stop everything they start (the fixtures in
``conftest.py`` do it in teardown); an ``atexit`` hook is the last resort.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Everything started here and not yet stopped, stopped at interpreter exit at the latest.
_RUNNING: set[PrivatePostgres | PrivateRedis | PrivateSentinel | TcpProxy] = set()


class ServerUnavailable(RuntimeError):
    """A private server could not be started (binary missing, or it failed to come up)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def postgres_bindir() -> Path | None:
    """The directory holding PostgreSQL's server binaries, or None if none is installed.

    ``CE_TEST_PG_BIN`` decides if set; else the newest ``/usr/lib/postgresql/*/bin``, else
    the directory of ``pg_ctl`` on PATH.
    """
    explicit = os.environ.get("CE_TEST_PG_BIN")
    if explicit:
        chosen = Path(explicit)
        return chosen if all((chosen / t).is_file() for t in ("initdb", "pg_ctl", "postgres")) else None
    candidates: list[Path] = []
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates += versions
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).parent)
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return candidate
    return None


class PrivatePostgres:
    """A throwaway PostgreSQL cluster on a free loopback port.

    Runs as the ``postgres`` OS user when this process is root (the server refuses root).
    ``restart()`` and ``admin()`` act on this cluster only.
    """

    def __init__(self, bindir: Path, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        self.port = 0
        #: postgresql.conf lines on top of this suite's defaults (values quoted as SQL needs).
        self.settings = dict(settings or {})
        self.root = Path(tempfile.mkdtemp(prefix="ce-faults-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.root, ignore_errors=True)
                raise ServerUnavailable("running as root and there is no 'postgres' OS user") from None
            self._user = entry.pw_name
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def __repr__(self) -> str:
        return f"<PrivatePostgres 127.0.0.1:{self.port} {self.data}>"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the cluster's ``postgres`` database, straight to the server."""
        return self.url_for(self.port)

    @staticmethod
    def url_for(port: int, application_name: str = "celery-exclusive-faults") -> str:
        """SQLAlchemy URL of a cluster (or a proxy in front of one) on ``port``."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres?application_name={application_name}"

    def _run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args),
            cwd=self.root,  # the postgres user must be able to read its working directory
            user=self._user,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), *args, timeout=timeout)

    def start(self) -> PrivatePostgres:
        """initdb, then start on a free port; ServerUnavailable if it cannot."""
        made = self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        )
        if made.returncode != 0:
            self.stop()
            raise ServerUnavailable(f"initdb failed: {made.stderr.strip()[-500:]}")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.root}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "60",
            "shared_buffers": "16MB",
            "log_min_messages": "warning",
            **self.settings,
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        return self._launch()

    def _launch(self, auto_conf: str = "", port: int | None = None) -> PrivatePostgres:
        """Start the cluster in ``self.data`` on ``port`` or a free one (``auto_conf``: more
        postgresql.auto.conf lines)."""
        _RUNNING.add(self)
        for _ in range(1 if port else 5):  # a port picked free may be taken before the server binds it
            self.port = port or free_port()
            self._set_port(auto_conf)
            started = self._ctl("start", "-w", "-t", "60", "-l", str(self.log))
            if started.returncode == 0:
                return self
        tail = self.log.read_text(errors="replace")[-800:] if self.log.exists() else started.stderr
        self.stop()
        raise ServerUnavailable(f"PostgreSQL did not start: {tail.strip()}")

    def _set_port(self, auto_conf: str = "") -> None:
        self._write(self.data / "postgresql.auto.conf", f"port = {self.port}\n{auto_conf}")

    def _write(self, path: Path, text: str) -> None:
        path.write_text(text)
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def standby(self, name: str, port: int | None = None, via: int | None = None) -> PrivatePostgres:
        """A streaming-replication standby of this (running) cluster, started, as ``name``.

        Made by ``pg_basebackup``; its ``primary_conninfo`` carries ``application_name=name``,
        the name this cluster's ``synchronous_standby_names`` must list for it to be
        synchronous. The standby itself requires no synchronous standby once promoted.
        ``port``: the port to listen on (a dead server's, say) instead of a free one; ``via``:
        the port it streams from (a :class:`TcpProxy` in front of this cluster) if not this
        cluster's own.
        """
        if not (self.bindir / "pg_basebackup").is_file():
            raise ServerUnavailable(f"no pg_basebackup in {self.bindir}")
        standby = PrivatePostgres(self.bindir)
        copied = standby._run(
            str(self.bindir / "pg_basebackup"),
            "-D",
            str(standby.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "--no-sync",
            "-c",
            "fast",
        )
        if copied.returncode != 0:
            standby.stop()
            raise ServerUnavailable(f"pg_basebackup failed: {copied.stderr.strip()[-500:]}")
        with (standby.data / "postgresql.conf").open("a") as conf:
            conf.write(f"unix_socket_directories = '{standby.root}'\nsynchronous_standby_names = ''\n")
            # A standby whose stream broke waits this long before it looks for WAL again, and
            # does not notice a promote request meanwhile (5 s by default: a 5 s failover).
            conf.write("wal_retrieve_retry_interval = '100ms'\n")
        standby._write(standby.data / "standby.signal", "")
        conninfo = f"host=127.0.0.1 port={via or self.port} user=postgres application_name={name}"
        return standby._launch(f"primary_conninfo = '{conninfo}'\n", port)

    def promote(self) -> float:
        """``pg_ctl promote`` a standby and wait until it accepts writes; seconds it took."""
        began = time.monotonic()
        done = self._ctl("promote", "-w", "-t", "60")
        if done.returncode != 0:
            raise ServerUnavailable(f"pg_ctl promote failed: {done.stderr.strip()[-500:]}")
        return time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it started (a crash: nothing is flushed)."""
        pid = self._postmaster_pid()
        if pid is None:
            return
        children = _children(pid)
        for each in (pid, *children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGKILL)
        for each in (pid, *children):
            _wait_gone(each)
        with contextlib.suppress(FileNotFoundError):  # its pid may be reused: never signal it again
            (self.data / "postmaster.pid").unlink()

    def restart(self, mode: str = "fast") -> float:
        """``pg_ctl restart -m mode`` (waits until it accepts connections); seconds it took."""
        began = time.monotonic()
        done = self._ctl("restart", "-m", mode, "-w", "-t", "60", "-l", str(self.log))
        if done.returncode != 0:
            raise ServerUnavailable(f"pg_ctl restart failed: {done.stderr.strip()[-500:]}")
        return time.monotonic() - began

    def admin(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        """Run one statement on a fresh superuser connection; its rows (empty if none)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            cursor = conn.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []

    def terminate(self, application_name: str) -> int:
        """``pg_terminate_backend`` every session of ``application_name``; how many there were."""
        rows = self.admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        )
        return len(rows)

    def _postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        return None

    def stop(self) -> None:
        """Stop the server (immediate mode) and delete its directory; safe to call twice."""
        if self.data.exists():
            stopped = self._ctl("stop", "-m", "immediate", "-w", "-t", "30")
            pid = self._postmaster_pid()
            if stopped.returncode != 0 and pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                for _ in range(100):
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)
        _RUNNING.discard(self)


def _came_up(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Wait until ``ready()`` is true (True), or ``proc`` exits or ``timeout`` passes (False).

    ``ready`` may raise while the server is still starting; that counts as not ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(Exception):
            if ready():
                return True
        time.sleep(0.02)
    return False


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s direct children (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # the field after the parenthesised command name is the state, then the ppid
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Wait until ``pid`` has exited (a zombie counts as gone: its sockets are closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)


class PrivateRedis:
    """A throwaway redis-server (no RDB, no AOF) on a free loopback port, as a child process."""

    def __init__(self, binary: str, extra: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.port = 0
        #: More redis-server options (``("--replicaof", "127.0.0.1", "7000")``, say).
        self.extra = extra
        self.root = Path(tempfile.mkdtemp(prefix="ce-faults-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<PrivateRedis 127.0.0.1:{self.port}>"

    @property
    def url(self) -> str:
        """URL of this server, straight (not through a proxy)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self) -> bool:
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
                "--logfile",
                str(self.root / "server.log"),
                "--protected-mode",
                "no",
                *self.extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if _came_up(self._proc, self.ping):
            return True
        self._kill()  # or only forget it, if it already exited
        return False

    def start(self) -> PrivateRedis:
        """Start on a free port; ServerUnavailable if it does not answer PING."""
        _RUNNING.add(self)
        for _ in range(5):
            self.port = free_port()
            if self._spawn():
                return self
        self.stop()
        raise ServerUnavailable(f"redis-server did not start on 127.0.0.1 (log in {self.root})")

    def ping(self) -> bool:
        """True if the server answers PING."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def restart(self) -> tuple[float, float]:
        """Stop (SIGTERM: no save, there is no persistence) and start again on the same port.

        Returns (when it was down, when it answered again) on this process's monotonic clock.
        """
        self._kill(signal.SIGTERM)
        down = time.monotonic()
        if not self._spawn():
            raise ServerUnavailable(f"redis-server did not come back on port {self.port}")
        return down, time.monotonic()

    def command(self, *args: str) -> object:
        """Send one command on a fresh connection; its reply."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash); ``stop()`` still cleans up."""
        self._kill()

    def _kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def stop(self) -> None:
        """Stop the server and delete its directory; safe to call twice."""
        self._kill()
        shutil.rmtree(self.root, ignore_errors=True)
        _RUNNING.discard(self)


class PrivateSentinel:
    """A throwaway ``redis-server --sentinel`` monitoring one primary as ``service``.

    Quorum 1 (it is the only sentinel), so it fails over alone once the primary has not
    answered for ``down_after_ms``.
    """

    def __init__(
        self, binary: str, primary_port: int, service: str = "mymaster", down_after_ms: int = 500
    ) -> None:
        self.binary = binary
        self.service = service
        self.primary_port = primary_port
        self.down_after_ms = down_after_ms
        self.port = 0
        self.root = Path(tempfile.mkdtemp(prefix="ce-faults-sentinel-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<PrivateSentinel 127.0.0.1:{self.port} {self.service}>"

    @property
    def url(self) -> str:
        """The lock store URL of the primary this sentinel names."""
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"

    def start(self) -> PrivateSentinel:
        """Start on a free port; ServerUnavailable unless it names the primary within 15 s."""
        _RUNNING.add(self)
        for _ in range(5):
            self.port = free_port()
            config = self.root / "sentinel.conf"  # the sentinel rewrites it: it must be writable
            config.write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.root}\nprotected-mode no\n"
                f"logfile {self.root / 'sentinel.log'}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 1\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} 5000\n"
            )
            self._proc = subprocess.Popen(
                [self.binary, str(config), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if _came_up(self._proc, lambda: self.primary() == self.primary_port):
                return self
            self._kill()
        self.stop()
        raise ServerUnavailable(f"redis sentinel did not start (log in {self.root})")

    def command(self, *args: str) -> Any:
        """Send one command to the sentinel on a fresh connection; its reply."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, decode_responses=True)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def primary(self) -> int | None:
        """The port of the primary the sentinel names to clients now (as redis-py asks: by
        ``SENTINEL MASTER``), or None while it is down or a failover is still switching."""
        reply = self.command("SENTINEL", "MASTER", self.service)
        fields = dict(zip(reply[::2], reply[1::2], strict=False)) if isinstance(reply, list) else reply
        return int(fields["port"]) if fields.get("flags") == "master" else None

    def replicas(self) -> list[int]:
        """Ports of the replicas the sentinel knows of that it does not consider down."""
        found = []
        for row in self.command("SENTINEL", "REPLICAS", self.service):
            fields = dict(zip(row[::2], row[1::2], strict=False)) if isinstance(row, list) else row
            flags = str(fields.get("flags", ""))
            if "s_down" not in flags and "disconnected" not in flags:
                found.append(int(fields["port"]))
        return found

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        """Stop the sentinel and delete its directory; safe to call twice."""
        self._kill()
        shutil.rmtree(self.root, ignore_errors=True)
        _RUNNING.discard(self)


class TcpProxy:
    """A loopback TCP relay to ``upstream`` that a test can stall, resume and cut.

    ``stall()`` stops relaying in both directions: bytes already sent wait in the kernel's
    buffers (the peers' TCP sees nothing wrong, exactly like a silent network) and new
    connections are accepted but get no answer. ``resume()`` lets everything through again,
    in order. ``cut()`` resets every open connection (RST to both sides); new ones work.
    One selector thread does all the relaying.
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._flowing = True
        self._closing = False
        self._requests: list[tuple[str, threading.Event]] = []
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far
        self._thread = threading.Thread(target=self._loop, name="ce-fault-proxy", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<TcpProxy 127.0.0.1:{self.port} -> {self.upstream[0]}:{self.upstream[1]}>"

    def _ask(self, what: str) -> None:
        done = threading.Event()
        with self._lock:
            self._requests.append((what, done))
        self._wake_w.send(b"x")
        if not done.wait(10):
            raise RuntimeError(f"proxy did not {what} within 10 s")

    def stall(self) -> None:
        """Stop relaying (both directions, every connection, new ones too) until resume()."""
        self._ask("stall")

    def resume(self) -> None:
        """Relay again; what was held back is delivered in order."""
        self._ask("resume")

    def cut(self) -> int:
        """Reset every open connection; returns how many there were."""
        before = len(self._peers) // 2
        self._ask("cut")
        return before

    def close(self) -> None:
        """Stop the relay thread and close every socket; safe to call twice."""
        if not self._thread.is_alive():
            _RUNNING.discard(self)
            return
        self._ask("close")
        self._thread.join(10)
        _RUNNING.discard(self)

    # -- the relay thread -----------------------------------------------------------

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closing:
                for key, _ in selector.select(timeout=0.5):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._handle_requests(selector)
                    elif sock is self._listener:
                        self._accept(selector)
                    elif self._flowing and sock in self._peers:
                        self._relay(selector, sock)  # type: ignore[arg-type]
        finally:
            for sock in list(self._peers):
                self._drop(selector, sock, reset=True)
            selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _handle_requests(self, selector: selectors.BaseSelector) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        with self._lock:
            requests, self._requests = self._requests, []
        for what, done in requests:
            if what == "stall":
                self._flowing = False
                for sock in self._peers:
                    selector.unregister(sock)
            elif what == "resume":
                if not self._flowing:
                    self._flowing = True
                    for sock in self._peers:
                        selector.register(sock, selectors.EVENT_READ)
            elif what == "cut":
                for sock in list(self._peers):
                    self._drop(selector, sock, reset=True)
            elif what == "close":
                self._closing = True
            done.set()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            self._reset(client)
            return
        self.connections += 1
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(5)  # sendall to a peer that stopped reading must not wedge the relay
        self._peers[client], self._peers[upstream] = upstream, client
        if self._flowing:
            selector.register(client, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)

    def _relay(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            self._drop(selector, sock, reset=True)
            return
        self._drop(selector, sock, reset=False)  # orderly EOF: close both sides

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    def _drop(self, selector: selectors.BaseSelector, sock: socket.socket, *, reset: bool) -> None:
        peer = self._peers.pop(sock, None)
        for each in (sock, peer):
            if each is None:
                continue
            self._peers.pop(each, None)
            if self._flowing:
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(each)
            if reset:
                self._reset(each)
            else:
                each.close()


def stop_everything() -> None:
    """Stop every server and proxy still running (the atexit safety net)."""
    for thing in list(_RUNNING):
        with contextlib.suppress(Exception):
            thing.close() if isinstance(thing, TcpProxy) else thing.stop()


atexit.register(stop_everything)
