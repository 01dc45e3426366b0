"""Per-call deadlines on the private Redis Cluster: a call with ``timeout=`` ends on the
socket at its deadline with a BackendError when the key's node is silent (SIGSTOP: its
TCP connections stay open and nothing answers), however long the client's own socket
timeout (10 s by default; 30 s here, so the old behaviour could not pass by accident).

Each call freezes the node for about 1 s only: under the fixture's cluster node timeout
(5 s), so the other nodes never mark it failed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from redis.cluster import RedisCluster

from celery_exclusive import LockService
from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import Grant, RefreshRequest
from celery_exclusive.providers.redis import RedisLockProvider
from tests.conftest import TIME_SLACK
from tests.scale._servers import assert_child_forked_mid_connect_connects_itself, frozen


@pytest.fixture
def provider(redis_cluster: str) -> Iterator[RedisLockProvider]:
    """A provider on the private cluster whose client's socket timeout is 30 s."""
    p = RedisLockProvider(redis_cluster + "?socket_timeout=30")
    yield p
    p.close()


def _node_pid(cluster: RedisCluster, key: str) -> int:
    node = cluster.get_node_from_key(key)
    one = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
    try:
        return int(cast(dict[str, Any], one.info("server"))["process_id"])
    finally:
        one.close()


def test_every_call_ends_at_its_deadline_on_a_silent_node(provider: RedisLockProvider) -> None:
    """acquire, refresh, peek and release with ``timeout=1`` on a key whose node is frozen:
    each a BackendError within 1 s plus slack; thawed, the next calls work."""
    key = f"clusterdl-{uuid.uuid4().hex[:10]}"
    other = f"clusterdl-{uuid.uuid4().hex[:10]}"
    cluster = cast(RedisCluster, provider._client)
    elsewhere = _key_not_on(cluster, cluster.get_node_from_key(key).name)
    for k in (key, elsewhere):
        assert isinstance(provider.acquire(k, "tok", 30.0, 60.0, "{}"), Grant)
    both = [RefreshRequest(key, "tok", 30.0), RefreshRequest(elsewhere, "tok", 30.0)]
    pid = _node_pid(cluster, other)
    calls: dict[str, Callable[[], object]] = {
        "acquire": lambda: provider.acquire(other, "tok", 30.0, 60.0, "{}", timeout=1.0),
        "refresh": lambda: provider.refresh([RefreshRequest(key, "tok", 30.0)], timeout=1.0),
        "refresh on two nodes": lambda: provider.refresh(both, timeout=1.0),
        "peek": lambda: provider.peek(key, timeout=1.0),
        "scan": lambda: provider.scan("clusterdl-", timeout=1.0),
        "release": lambda: provider.release(key, "tok", timeout=1.0),
    }
    key_pid = _node_pid(cluster, key)
    bound = 1.0 + 0.5 * TIME_SLACK
    try:
        for name, call in calls.items():
            with frozen(pid if name == "acquire" else key_pid, at_most=bound + 0.5):
                started = time.monotonic()
                with pytest.raises(BackendError):
                    call()
                elapsed = time.monotonic() - started
            print(f"{name}: BackendError after {elapsed:.3f} s")
            assert 0.9 <= elapsed <= bound, (name, elapsed)
        # Thawed: the abandoned connections are gone and the next calls work (the frozen
        # node may still have run what it had read: the release, say).
        provider.peek(key, timeout=1.0)
        assert isinstance(provider.acquire(key, "tok", 30.0, 60.0, "{}", timeout=1.0), Grant)
        assert provider.refresh(both, timeout=1.0) == [pytest.approx(30.0, abs=0.5)] * 2
    finally:
        for k in (key, other, elsewhere):
            provider.release(k, "tok")


def test_a_cold_client_on_a_silent_cluster_ends_each_call_at_its_deadline(redis_cluster: str) -> None:
    """A new service's first calls on a cluster whose every node is frozen: each lock()
    a BackendError within call_timeout plus slack, the second too (its client still being
    built); thawed, the service works. Building the client (the slot map) used to take the
    client's socket timeout, 30 s here, and every later call queued behind the heartbeat's
    retried releases of the failed acquires, each building in turn (minutes)."""
    pids = _primary_pids(redis_cluster)
    service = LockService(redis_cluster + "?socket_timeout=30", call_timeout=1.0, prefix="cold-cluster:")
    bound = 1.0 + 0.5 * TIME_SLACK
    try:
        with frozen(*pids, at_most=2 * bound + 0.5):
            for attempt in (1, 2):
                started = time.monotonic()
                with pytest.raises(BackendError):
                    service.try_lock(f"cold-{attempt}")
                elapsed = time.monotonic() - started
                assert elapsed <= bound, (attempt, elapsed)
        deadline = time.monotonic() + 15
        while True:
            try:
                lease = service.lock("cold-after")
                break
            except BackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert lease.release().value == "released"
    finally:
        service.close()


def test_a_child_forked_during_a_cold_build_builds_its_own_client(redis_cluster: str) -> None:
    """A child forked while its parent's cluster client is being built (every node frozen)
    builds its own once the nodes are thawed: its lock() succeeds. The parent's build
    thread is not in the child: waiting for it failed every call there."""
    pids = _primary_pids(redis_cluster)
    service = LockService(redis_cluster + "?socket_timeout=30", call_timeout=1.0, prefix="fork-cluster:")
    try:
        assert_child_forked_mid_connect_connects_itself(service, pids, at_most=4.0)
    finally:
        service.close()


def _primary_pids(url: str) -> list[int]:
    """The process ids of the cluster's primaries (one key on each asks its node)."""
    seeing = RedisLockProvider(url)
    try:
        cluster = cast(RedisCluster, seeing._client)
        return [_node_pid(cluster, key) for key in _one_key_per_node(cluster)]
    finally:
        seeing.close()


def _one_key_per_node(cluster: RedisCluster) -> list[str]:
    """A key on each primary of ``cluster``."""
    found: dict[str, str] = {}
    for i in range(10_000):
        key = f"node-{i}"
        found.setdefault(cluster.get_node_from_key(key).name, key)
        if len(found) == len(cluster.get_primaries()):
            return list(found.values())
    raise AssertionError("no key found for some primary")


def _key_not_on(cluster: RedisCluster, node: str) -> str:
    while True:
        key = f"clusterdl-{uuid.uuid4().hex[:10]}"
        if cluster.get_node_from_key(key).name != node:
            return key


def test_a_moved_slot_is_followed_by_calls_with_a_deadline(provider: RedisLockProvider) -> None:
    """Two empty slots handed to another primary after the provider read the slot map: a
    call with ``timeout=`` sent to the old owner is answered MOVED (nothing ran there), the
    map is read again and the call made on the new owner: an acquire is granted there, a
    refresh pipelined over two nodes answers both keys."""
    cluster = cast(RedisCluster, provider._client)
    held = f"clusterdl-{uuid.uuid4().hex[:10]}"
    assert isinstance(provider.acquire(held, "tok", 30.0, 60.0, "{}", timeout=1.0), Grant)
    owner = cluster.get_node_from_key(held).name
    fresh, absent = _empty_slot_key(cluster, owner), _empty_slot_key(cluster, owner)
    try:
        _hand_slot(cluster, absent, owner)
        both = [RefreshRequest(held, "tok", 30.0), RefreshRequest(absent, "tok", 30.0)]
        assert provider.refresh(both, timeout=1.0) == [pytest.approx(30.0, abs=0.5), None]
        assert cluster.get_node_from_key(absent).name == owner  # the map was read again
        source = cluster.get_node_from_key(fresh).name
        _hand_slot(cluster, fresh, owner)
        assert isinstance(provider.acquire(fresh, "tok", 30.0, 60.0, "{}", timeout=1.0), Grant)
        assert cluster.get_node_from_key(fresh).name == owner != source
    finally:
        for key in (held, fresh):
            provider.release(key, "tok", timeout=1.0)


def _empty_slot_key(cluster: RedisCluster, not_on: str) -> str:
    """A fresh key of a slot holding no keys, owned by a primary other than ``not_on``."""
    while True:
        key = _key_not_on(cluster, not_on)
        node = cluster.get_node_from_key(key)
        if node.redis_connection.execute_command("CLUSTER", "COUNTKEYSINSLOT", cluster.keyslot(key)) == 0:
            return key


def _hand_slot(cluster: RedisCluster, key: str, to: str) -> None:
    """``key``'s (empty) slot handed to primary ``to`` (host:port), the provider's map left stale."""
    slot = cluster.keyslot(key)
    source = cluster.get_node_from_key(key).redis_connection
    target = cluster.get_node(node_name=to).redis_connection
    target_id = target.execute_command("CLUSTER", "MYID")
    for node in (target, source):
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def test_a_slot_being_migrated_is_followed_by_asking_within_the_deadline(
    provider: RedisLockProvider,
) -> None:
    """A slot MIGRATING from its owner to another primary, its keys already moved there (as
    a resharding moves them): the owner answers ASK and the call goes to the migration's
    target after ``ASKING``, on the provider's own connection. While the target is silent
    the call raises by its deadline (before, the cluster client followed the ASK with its
    own 30 s socket timeout); while it answers, a lease moved there is refreshed and
    released on it."""
    cluster = cast(RedisCluster, provider._client)
    target = cluster.get_primaries()[0]
    key = _empty_slot_key(cluster, target.name)
    held = f"{{{key}}}-held"  # the same slot, by its hash tag
    slot = cluster.keyslot(key)
    assert cluster.keyslot(held) == slot
    assert isinstance(provider.acquire(held, "tok", 30.0, 60.0, "{}", timeout=1.0), Grant)
    source = cluster.get_node_from_key(key).redis_connection
    importing = target.redis_connection
    source_id, target_id = (n.execute_command("CLUSTER", "MYID") for n in (source, importing))
    importing.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    bound = 1.0 + 0.5 * TIME_SLACK
    try:
        moving = source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        assert len(moving) == 2  # the lease and the slot's fence high-water
        source.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *moving)
        pid = int(cast(dict[str, Any], importing.info("server"))["process_id"])
        with frozen(pid, at_most=bound + 0.5):
            started = time.monotonic()
            with pytest.raises(BackendError):
                provider.refresh([RefreshRequest(held, "tok", 30.0)], timeout=1.0)
            elapsed = time.monotonic() - started
        assert 0.9 <= elapsed <= bound, elapsed
        assert provider.refresh([RefreshRequest(held, "tok", 30.0)], timeout=1.0) == [
            pytest.approx(30.0, abs=0.5)
        ]
        assert provider.release(held, "tok", timeout=1.0)
    finally:
        for node in (importing, source):  # the migration finished: the target owns the slot
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        provider.release(held, "tok", timeout=1.0)
