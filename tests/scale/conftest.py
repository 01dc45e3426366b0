"""Fixtures for the scale tests: a private Redis Cluster and a private PgBouncer.

Each runs on free loopback ports from a temp dir for the whole session and is stopped
afterwards; a missing binary skips locally and fails under ``CI=true``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from celery_exclusive import LockService
from celery_exclusive.testing import contract as _contract
from tests.conftest import CONTRACT_CYCLES, POSTGRES_URL, Store, drop_lock_table, require_server
from tests.contract._processes import process_context
from tests.scale._servers import (
    binary,
    cluster_ports,
    processes,
    start_cluster_node,
    start_pgbouncer,
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

    yield Store(
        name=name,
        url=url,
        cross_process=True,
        make=make,
        mp_context=process_context(),
        cycles=CONTRACT_CYCLES,
    )
    for service in services:
        service.close(release=True)


def contract_tests(leave_out: tuple[str, ...] = ("test_outage", "test_guard")) -> dict[str, Any]:
    """The lock contract suite's tests, for a module to collect once more against its own
    ``store`` fixture: ``globals().update(contract_tests())``. ``leave_out``: name prefixes
    of the tests its store cannot serve (by default the outage tests, which need an
    unreachable server, and the guard tests, which need a SQL store)."""
    return {
        name: getattr(_contract, name)
        for name in dir(_contract)
        if name.startswith("test_") and not name.startswith(leave_out)
    }


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


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[Callable[..., str]]:
    """A private PgBouncer in transaction pooling mode in front of the shared PostgreSQL.

    Yields ``url(table, own_pool=False)``: a ``postgresql+psycopg://`` URL through PgBouncer
    (``own_pool`` picks a second alias of the same database with separate server connections).
    """
    require_server(POSTGRES_URL)
    target = urlsplit(POSTGRES_URL)
    database = target.path.lstrip("/") or "test"
    user = target.username or "postgres"
    server = f"host={target.hostname or '127.0.0.1'} port={target.port or 5432} dbname={database} user={user}"
    # Not under pytest's root-only temp dir: PgBouncer may run as postgres and must reach it.
    folder = Path(tempfile.mkdtemp(prefix="ce-pgbouncer-"))
    try:
        with processes() as started:
            # A pool of 3 is far fewer server connections than the tests' clients, so
            # consecutive statements of one client land on different server sessions. The
            # second alias is the same database with a pool of its own, for the test that
            # leaves prepared statements behind on its server connections.
            port = start_pgbouncer(
                started, folder, {database: server, f"{database}_prepared": server}, pool_size=3, user=user
            )

            def url(table: str, *, own_pool: bool = False) -> str:
                alias = f"{database}_prepared" if own_pool else database
                return f"postgresql+psycopg://{user}@127.0.0.1:{port}/{alias}?ce_table={table}"

            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def drop_table(table: str) -> None:
    """Drop a lock table and its fence sequence on the shared PostgreSQL, directly."""
    drop_lock_table(POSTGRES_URL, table)
