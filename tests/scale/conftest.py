"""Fixtures for the scale tests: a private Redis Cluster and a private PgBouncer.

Each runs on free loopback ports from a temp dir for the whole session and is stopped
afterwards; a missing binary skips locally and fails under ``CI=true``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import redis

from celery_exclusive import LockService
from tests.conftest import POSTGRES_URL, Store, drop_lock_table, require_server
from tests.scale._servers import (
    binary,
    cluster_ports,
    free_port,
    processes,
    start,
    start_cluster_node,
    unavailable,
    wait_for,
)


def contract_store(name: str, url: str) -> Iterator[Store]:
    """A contract-suite ``Store`` on ``url`` with a unique prefix; its services are closed after."""
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    services: list[LockService] = []

    def make(**kwargs: Any) -> LockService:
        kwargs.setdefault("prefix", prefix)
        service = LockService(url, **kwargs)
        services.append(service)
        return service

    yield Store(name=name, url=url, cross_process=True, make=make)
    for service in services:
        service.close(release=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Redis Cluster of three primaries on loopback; its ``redis+cluster://`` URL."""
    cli = binary("redis-cli")
    folder = tmp_path_factory.mktemp("cluster")
    ports = cluster_ports(3)
    with processes() as started:
        for port in ports:
            start_cluster_node(started, folder, port, 5000).close()
        addresses = [f"127.0.0.1:{port}" for port in ports]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            unavailable(
                f"redis-cli --cluster create failed: {created.stdout[-500:]!r} {created.stderr[-500:]!r}"
            )
        nodes = [redis.Redis(port=port, socket_timeout=5) for port in ports]
        wait_for(
            lambda: all(n.cluster("INFO")["cluster_state"] == "ok" for n in nodes),
            "cluster state ok",
            started[0],
        )
        for n in nodes:
            n.close()
        yield f"redis+cluster://{addresses[0]},{addresses[1]}"


def _run_as_postgres() -> dict[str, Any]:
    """Popen arguments that drop root (PgBouncer refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        unavailable("running as root and there is no 'postgres' user to run pgbouncer as")
    return {"user": "postgres", "group": "postgres"}


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[Callable[..., str]]:
    """A private PgBouncer in transaction pooling mode in front of the shared PostgreSQL.

    Yields ``url(table, own_pool=False)``: a ``postgresql+psycopg://`` URL through PgBouncer
    (``own_pool`` picks a second alias of the same database with separate server connections).
    """
    require_server(POSTGRES_URL)
    exe = binary("pgbouncer", "/usr/sbin/pgbouncer")
    drop = _run_as_postgres()
    # Not under pytest's root-only temp dir: PgBouncer may run as postgres and must reach it.
    folder = Path(tempfile.mkdtemp(prefix="ce-pgbouncer-"))
    try:
        yield from _pgbouncer(exe, folder, drop)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pgbouncer(exe: str, folder: Path, drop: dict[str, Any]) -> Iterator[Callable[..., str]]:
    target = urlsplit(POSTGRES_URL)
    database = target.path.lstrip("/") or "test"
    user = target.username or "postgres"
    port = free_port()
    server = f"host={target.hostname or '127.0.0.1'} port={target.port or 5432} dbname={database} user={user}"
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    # default_pool_size 3 is far fewer server connections than the tests' clients, so
    # consecutive statements of one client land on different server sessions. The second
    # alias is the same database with a pool of its own, for the test that leaves prepared
    # statements behind on its server connections.
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
{database} = {server}
{database}_prepared = {server}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "userlist.txt"}
pool_mode = transaction
default_pool_size = 3
max_client_conn = 500
server_reset_query =
pidfile = {folder / "pgbouncer.pid"}
logfile = {folder / "pgbouncer.log"}
"""
    )
    if drop:
        for item in (folder, *folder.iterdir()):
            shutil.chown(item, "postgres", "postgres")
    with processes() as started:
        proc = start(started, [exe, str(folder / "pgbouncer.ini")], folder / "stdout.log", **drop)

        def accepts() -> bool:
            dsn = f"host=127.0.0.1 port={port} dbname={database} user={user}"
            psycopg.connect(dsn, connect_timeout=2).close()
            return True

        wait_for(accepts, f"pgbouncer on port {port}", proc)

        def url(table: str, *, own_pool: bool = False) -> str:
            alias = f"{database}_prepared" if own_pool else database
            return f"postgresql+psycopg://{user}@127.0.0.1:{port}/{alias}?ce_table={table}"

        yield url


def drop_table(table: str) -> None:
    """Drop a lock table and its fence sequence on the shared PostgreSQL, directly."""
    drop_lock_table(POSTGRES_URL, table)
