"""Private servers for the scale tests: free loopback ports, temp dirs, stopped on teardown.

Nothing here touches the shared servers the rest of the suite uses, except that the
PgBouncer fixture forwards to the shared PostgreSQL (read from ``CE_TEST_POSTGRES_URL``).
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from celery_exclusive import BackendError, LockService
from tests.conftest import IN_CI


@contextmanager
def frozen(*pids: int, at_most: float) -> Iterator[None]:
    """Servers ``pids`` stopped (SIGSTOP) for the block, and never longer than ``at_most`` s
    (a timer thaws them: a call that does not time out then completes, and no cluster or
    sentinel fails a server over)."""
    thaw = [threading.Timer(at_most, os.kill, (pid, signal.SIGCONT)) for pid in pids]
    try:
        for pid, timer in zip(pids, thaw, strict=True):
            os.kill(pid, signal.SIGSTOP)
            timer.start()
        yield
    finally:
        for pid, timer in zip(pids, thaw, strict=True):
            timer.cancel()
            os.kill(pid, signal.SIGCONT)


def assert_child_forked_mid_connect_connects_itself(
    service: LockService, pids: Sequence[int], at_most: float
) -> None:
    """With ``pids`` frozen, ``service``'s first lock() fails at its deadline while its
    connect (a cluster's slot map, a sentinel's lookup) still waits in a thread of its own;
    a child forked then, once the servers thaw, must connect by itself and lock: the
    parent's thread is not in the child, and waiting for it would fail every call there."""
    go_r, go_w = os.pipe()
    try:
        with frozen(*pids, at_most=at_most):
            with pytest.raises(BackendError):
                service.lock("parent")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
                child = os.fork()
            if child == 0:
                code = 1
                try:
                    os.read(go_r, 1)
                    service.lock("child").release()
                    code = 0
                finally:
                    os._exit(code)
        os.write(go_w, b"1")  # thawed
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(go_r)
        os.close(go_w)


def unavailable(reason: str) -> None:
    """Skip the test locally, fail it under CI=true."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def binary(name: str, *candidates: str) -> str:
    """The path of an executable (on PATH or at one of ``candidates``), or skip/fail."""
    found = shutil.which(name) or next((c for c in candidates if os.access(c, os.X_OK)), None)
    if found is None:
        unavailable(f"{name} is not installed (needed by this test)")
        raise AssertionError  # unreachable: unavailable() skips or fails
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on (and its Redis Cluster bus port, +10000, if asked)."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        if _bindable(port) and (not with_bus or _bindable(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def wait_for(
    check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], timeout: float = 15.0
) -> None:
    """Poll ``check()`` until true; skip/fail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: S110 - not up yet
            pass
        if proc.poll() is not None:
            unavailable(f"{what} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            unavailable(f"{what} did not become ready within {timeout:g} s")
        time.sleep(0.05)


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to start processes into; every one is terminated (then killed) on exit."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
        for proc in started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def start(
    started: list[subprocess.Popen[bytes]], args: Sequence[str], log: Path, **kwargs: object
) -> subprocess.Popen[bytes]:
    """Start ``args`` with output to ``log``, remembered in ``started`` for teardown."""
    with log.open("ab") as out:
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, **kwargs)  # type: ignore[call-overload]
    started.append(proc)
    return proc


def cluster_ports(count: int) -> list[int]:
    """``count`` free ports for Redis Cluster nodes, none clashing with another's bus port."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(with_bus=True)
        if not {port, port + 10000} & {p for q in ports for p in (q, q + 10000)}:
            ports.append(port)
    return ports


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by ``openssl`` in ``folder``
    (skip, or fail under CI=true, without it): (certificate, key)."""
    openssl = binary("openssl")
    cert, key = folder / "cert.pem", folder / "key.pem"
    made = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
    made += ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(made, check=True, capture_output=True, timeout=60)
    return cert, key


def redis_tls_args(cert: Path, key: Path) -> list[str]:
    """redis-server arguments for TLS only (no plain port; clients are not asked for a
    certificate) with ``cert``, its own CA, for its replication and cluster links too."""
    args = ["--port", "0", "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    args += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--tls-replication", "yes"]
    return args


def start_cluster_node(
    started: list[subprocess.Popen[bytes]],
    folder: Path,
    port: int,
    node_timeout_ms: int,
    tls: tuple[Path, Path] | None = None,
) -> redis.Redis:
    """Start an empty cluster-enabled Redis (no persistence) on ``port``; a client of it.
    ``tls``: (certificate, key) to take TLS only, on ``port`` and the cluster bus."""
    node = folder / str(port)
    node.mkdir()
    args = [binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
    if tls is not None:
        args += [*redis_tls_args(*tls), "--tls-port", str(port), "--tls-cluster", "yes"]
    args += [
        "--cluster-config-file",
        str(node / "nodes.conf"),
        "--cluster-node-timeout",
        str(node_timeout_ms),
    ]
    args += ["--save", "", "--appendonly", "no", "--dir", str(node)]
    proc = start(started, args, node / "redis.log")
    secure: dict[str, Any] = {} if tls is None else {"ssl": True, "ssl_ca_certs": str(tls[0])}
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, decode_responses=True, **secure)
    wait_for(client.ping, f"cluster node on port {port}", proc)
    return client


def run_as_postgres() -> dict[str, Any]:
    """Popen arguments that drop root (PgBouncer refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        unavailable("running as root and there is no 'postgres' user to run pgbouncer as")
    return {"user": "postgres", "group": "postgres"}


def start_pgbouncer(
    started: list[subprocess.Popen[bytes]],
    folder: Path,
    databases: dict[str, str],
    *,
    pool_size: int,
    user: str = "postgres",
    max_client_conn: int = 500,
) -> int:
    """Start a PgBouncer in transaction pooling mode from ``folder`` on a free port; its port
    once it accepts connections.

    ``databases`` maps each alias to the libpq conninfo of its server (one pool of
    ``pool_size`` server connections per alias). ``user`` may connect without a password
    and also to the ``pgbouncer`` admin database (``SHOW POOLS``). ``folder`` must be
    readable by the ``postgres`` user when this process is root (PgBouncer then runs as it).
    """
    exe = binary("pgbouncer", "/usr/sbin/pgbouncer")
    drop = run_as_postgres()
    port = free_port()
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    aliases = "".join(f"{alias} = {conninfo}\n" for alias, conninfo in databases.items())
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
{aliases}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "userlist.txt"}
admin_users = {user}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = {max_client_conn}
server_reset_query =
pidfile = {folder / "pgbouncer.pid"}
logfile = {folder / "pgbouncer.log"}
"""
    )
    if drop:
        for item in (folder, *folder.iterdir()):
            shutil.chown(item, "postgres", "postgres")
    proc = start(started, [exe, str(folder / "pgbouncer.ini")], folder / "stdout.log", **drop)
    first = next(iter(databases))

    def accepts() -> bool:
        psycopg.connect(f"host=127.0.0.1 port={port} dbname={first} user={user}", connect_timeout=2).close()
        return True

    wait_for(accepts, f"pgbouncer on port {port}", proc)
    return port
