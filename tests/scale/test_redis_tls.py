"""The Redis store over TLS on a private Redis Cluster (``rediss+cluster://``) and through a
private Sentinel (``rediss+sentinel://``), every server taking TLS only.

The cluster's nodes talk TLS to each other too (``tls-cluster``), the sentinel to the
primary (``tls-replication``), with one self-signed certificate (``openssl``). On each, a
waiter is woken by a release through its own TLS subscription, and the lock contract runs
once more (acquire, release, refresh, the heartbeat, expiry, fences, processes).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_exclusive import LeaseState, LockService
from tests.conftest import Store
from tests.contract.test_waiting import assert_woken_handovers
from tests.scale._servers import (
    binary,
    cluster_ports,
    free_port,
    processes,
    redis_tls_args,
    self_signed,
    start,
    start_cluster_node,
    unavailable,
    wait_for,
)
from tests.scale.conftest import contract_store, contract_tests
from tests.scale.test_redis_sentinel import _start_sentinel


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private three-primary Redis Cluster taking TLS only; the ``rediss+cluster://`` URL a
    user would write for it, trusting its certificate."""
    folder = tmp_path_factory.mktemp("cluster-tls")
    cert, key = self_signed(folder)
    ports = cluster_ports(3)
    with processes() as started:
        nodes = [start_cluster_node(started, folder, port, 5000, tls=(cert, key)) for port in ports]
        addresses = [f"127.0.0.1:{port}" for port in ports]
        create = [binary("redis-cli"), "--tls", "--cacert", str(cert), "--cluster", "create", *addresses]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        created = subprocess.run(create, capture_output=True, timeout=60, check=False)
        if created.returncode != 0:
            unavailable(f"redis-cli --cluster create over TLS failed: {created.stdout[-500:]!r}")
        ok = lambda: all(n.cluster("INFO")["cluster_state"] == "ok" for n in nodes)  # noqa: E731
        wait_for(ok, "cluster state ok", started[0])
        for node in nodes:
            node.close()
        yield f"rediss+cluster://{addresses[0]},{addresses[1]}?ssl_ca_certs={cert}"


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private primary and a sentinel naming it ``mymaster``, both taking TLS only; the
    ``rediss+sentinel://`` URL a user would write, trusting their certificate."""
    folder: Path = tmp_path_factory.mktemp("sentinel-tls")
    cert, key = self_signed(folder)
    port = free_port()
    with processes() as started:
        args = [binary("redis-server"), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += [*redis_tls_args(cert, key), "--tls-port", str(port), "--dir", str(folder)]
        proc = start(started, args, folder / "primary.log")
        primary = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=5)
        wait_for(primary.ping, "private TLS primary", proc)
        primary.close()
        sentinel = _start_sentinel(started, folder, port, tls=(cert, key))
        yield f"rediss+sentinel://127.0.0.1:{sentinel}/mymaster/0?ssl_ca_certs={cert}"


@pytest.fixture(params=["cluster", "sentinel"])
def tls_url(request: pytest.FixtureRequest) -> str:
    """Each TLS store's URL in turn."""
    url: str = request.getfixturevalue(f"tls_{request.param}")
    return url


def test_the_tls_url_serves_locks(tls_url: str) -> None:
    """The URL's store locks and releases: there is no plain port to fall back to."""
    service = LockService(tls_url)
    try:
        with service.lock("plain-refused") as lease:
            assert lease.state is LeaseState.HELD
    finally:
        service.close(release=True)


def test_a_waiter_is_woken_by_the_release_over_tls(tls_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``lock(wait=10)`` blocked on a held key is woken by its holder's release, five
    times (:func:`assert_woken_handovers`: polling slowed to 60 s): the release's message, read on the
    waiter's own TLS subscription."""
    assert_woken_handovers(tls_url, monkeypatch)


@pytest.fixture
def store(tls_url: str) -> Iterator[Store]:
    """The TLS cluster, then the TLS sentinel's primary, as the contract suite's one store."""
    yield from contract_store("redis-tls", tls_url)


# The lock contract over TLS, its heartbeat tests among them (the outage test needs an
# unreachable server, not these; the guard test a SQL store).
globals().update(contract_tests())
