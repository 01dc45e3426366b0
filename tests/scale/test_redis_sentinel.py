"""The Redis store through Sentinel (``redis+sentinel://``): a private primary and sentinel.

Only discovery and normal operation are tested here; what a failover does to leases
(async replication can lose them) is tested in tests/faults/test_failover.py and
documented in docs/scaling.md.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_exclusive import BackendError, LockService
from celery_exclusive.providers.base import Grant, RefreshRequest
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.testing.contract import wait_until
from tests.scale._servers import binary, free_port, processes, start, wait_for


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """A private primary and one sentinel monitoring it as ``mymaster``: (primary, sentinel) ports."""
    server = binary("redis-server")
    folder: Path = tmp_path_factory.mktemp("sentinel")
    primary_port = free_port()
    sentinel_port = free_port()
    while sentinel_port == primary_port:
        sentinel_port = free_port()
    config = folder / "sentinel.conf"  # sentinel rewrites it: must be writable
    config.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor mymaster 127.0.0.1 {primary_port} 1\n"
        "sentinel down-after-milliseconds mymaster 60000\n"
    )
    with processes() as started:
        args = [
            server,
            "--port",
            str(primary_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        proc = start(started, [*args, "--dir", str(folder)], folder / "primary.log")
        primary = redis.Redis(port=primary_port, socket_timeout=5)
        wait_for(primary.ping, "private primary", proc)
        primary.close()
        proc = start(started, [server, str(config), "--sentinel"], folder / "sentinel.log")
        watcher = redis.Redis(port=sentinel_port, socket_timeout=5)
        found = [b"127.0.0.1", str(primary_port).encode()]
        wait_for(
            lambda: watcher.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster") == found,
            "private sentinel",
            proc,
        )
        watcher.close()
        yield primary_port, sentinel_port


def test_core_operations_through_sentinel(sentinel: tuple[int, int]) -> None:
    """Through the sentinel: acquire, contend, refresh, peek, scan and release reach the primary."""
    primary_port, sentinel_port = sentinel
    prefix = f"s{uuid.uuid4().hex[:8]}:"
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0"
    service, rival = LockService(url, prefix=prefix), LockService(url, prefix=prefix)
    direct = redis.Redis(port=primary_port)
    try:
        first = service.lock("job", holder={"task_name": "demo"})
        assert rival.try_lock("job") is None
        assert direct.hget(prefix + "job", "token").decode() == first.token
        leases = [service.lock(f"many:{i}", ttl=5.0) for i in range(50)]
        answers = service.provider.refresh(
            [RefreshRequest(lease.store_key, lease.token, 30.0) for lease in leases]
        )
        assert all(a is not None and 29.0 < a <= 30.0 for a in answers)
        info = rival.peek("job")
        assert info is not None
        assert info.holder["task_name"] == "demo"
        assert len(rival.locks()) == 51
        first.release()
        second = rival.lock("job")
        assert second.fence > first.fence
        second.release()
        for lease in leases:
            lease.release()
        assert rival.locks() == []
    finally:
        service.close()
        rival.close()
        direct.close()


def test_database_number_and_diagnose(sentinel: tuple[int, int]) -> None:
    """The URL's database number is used on the primary, and diagnose() finds a primary."""
    primary_port, sentinel_port = sentinel
    provider = RedisLockProvider(f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/3?socket_timeout=3")
    direct = redis.Redis(port=primary_port, db=3)
    key = f"db3:{uuid.uuid4().hex[:8]}"
    try:
        assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
        assert direct.hget(key, "token") == b"tok"
        assert provider.release(key, "tok") is True
        checks = {d.check: d.status for d in provider.diagnose()}
        assert checks["server"] == "ok"
        assert "replica" not in checks  # a primary without replicas
    finally:
        direct.delete(key)
        direct.close()
        provider.close()


def test_an_unknown_service_is_a_backend_error(sentinel: tuple[int, int]) -> None:
    """A service name the sentinel does not monitor is an outage (BackendError), not contention."""
    _, sentinel_port = sentinel
    provider = RedisLockProvider(f"redis+sentinel://:s3cret@127.0.0.1:{sentinel_port}/nosuch")
    try:
        with pytest.raises(BackendError, match="nosuch") as raised:
            provider.acquire("k", "tok", 10.0, 60.0, "{}")
        assert "s3cret" not in str(raised.value)
    finally:
        provider.close()


def test_waiters_are_woken_on_the_primary_the_sentinel_names(sentinel: tuple[int, int]) -> None:
    """Through the sentinel, the subscriber connection is on the primary and a release
    wakes the waiter (p50 of 10 handovers within 50 ms); an unknown service cannot be
    subscribed to (a BackendError, so the waiter would poll and its attempt fail)."""
    primary_port, sentinel_port = sentinel
    prefix = f"w{uuid.uuid4().hex[:8]}:"
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0"
    holder, waiter = LockService(url, prefix=prefix), LockService(url, prefix=prefix)
    direct = redis.Redis(port=primary_port)
    latencies: list[float] = []
    try:
        for _ in range(10):
            lease = holder.lock("job", ttl=30)
            acquired: list[float] = []
            thread = threading.Thread(target=_wait_and_release, args=(waiter, acquired))
            thread.start()
            assert wait_until(
                lambda: direct.execute_command("PUBSUB", "SHARDNUMSUB", prefix + "job")[1] == 1, 5.0
            )
            released = time.monotonic()
            lease.release()
            thread.join(15)
            latencies.append(acquired[0] - released)
        assert statistics.median(latencies) <= 0.05, latencies
    finally:
        holder.close()
        waiter.close()
        direct.close()
    provider = RedisLockProvider(f"redis+sentinel://127.0.0.1:{sentinel_port}/nosuch")
    try:
        with pytest.raises(BackendError, match="nosuch"):
            provider.subscribe("k")
    finally:
        provider.close()


def _wait_and_release(service: LockService, acquired: list[float]) -> None:
    lease = service.lock("job", ttl=30, wait=10)
    acquired.append(time.monotonic())
    lease.release()
