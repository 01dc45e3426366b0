"""The Redis store on a private three-primary Redis Cluster (``redis+cluster://``).

Every script touches one key or keys of one hash slot, so acquire, release and peek are
single-slot; refresh and scan group keys by slot (pipelined per node). The shared
contract suite is run once more against the cluster at the end of this module, and so
are the semaphore contract tests (``limit=N``: slot 1 is the key, slots 2..N ``{key}#i``
share one hash slot) and the waiting / lock_many ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
import redis
from redis.cluster import RedisCluster

from celery_exclusive import LockedError, LockService, ReleaseOutcome
from celery_exclusive.errors import BackendError
from celery_exclusive.providers._redis_scripts import fence_key
from celery_exclusive.providers.base import Grant, Held, RefreshRequest
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.semaphore import slot_key, slot_keys, slot_of
from celery_exclusive.testing.contract import wait_until
from celery_exclusive.waiting import POLL_MAX
from tests.conftest import Store
from tests.contract import test_waiting as _waiting

# The semaphore contract on the cluster (its script runs per attempt are counted below).
from tests.contract.test_semaphore import (  # noqa: F401
    test_a_bad_key_is_refused_for_a_semaphore_too,
    test_a_dead_holders_slot_is_reclaimed_after_its_ttl_and_not_before,
    test_a_failure_that_is_not_the_stores_propagates_and_frees_the_slot,
    test_a_lost_reply_is_retried_with_the_same_token_and_keeps_one_slot,
    test_a_waiter_on_a_full_semaphore_gets_the_slot_a_holder_releases,
    test_each_slot_has_its_own_fence,
    test_limit_one_is_the_single_lock,
    test_locks_list_each_slot,
    test_locks_with_a_filter_include_the_higher_slots,
    test_lowering_the_limit_keeps_higher_slots_until_released,
    test_n_holders_are_granted_and_the_next_is_refused,
    test_one_call_where_the_store_offers_it,
    test_release_frees_exactly_one_slot,
    test_semaphore_oracle_never_more_than_limit_holders,
    test_sigkilled_holders_slots_free_after_the_ttl_only,
)

# Waiting and several keys on the cluster (tests/contract/test_waiting.py): the woken
# handover (p50 within 50 ms, as on every store that signals releases), waits that end at
# their timeout or after a SIGKILLed holder's ttl, lock_many over keys in different hash
# slots (on different primaries: separate leases in canonical order, rolled back on a
# refusal or a failure), 8 processes on random key sets (no deadlock, no overlap: the
# cross-slot canonical order is the cluster's own), a releaser giving way to the waiters
# its signal reached, and not taking the next turn from a longer waiter after it
# (GIVE_WAY_DEFER: the key's shard sends a release to its newest subscriber first). The 8
# processes on one key (nobody starved) only with CE_LONG=1 (below).
from tests.contract.test_waiting import (  # noqa: F401
    test_a_releaser_gives_way_to_a_waiter,
    test_a_releaser_nobody_waits_for_does_not_give_way,
    test_a_releaser_that_gave_way_does_not_take_the_next_turn_from_a_longer_waiter,
    test_a_semaphore_waiter_is_woken_by_the_release_of_any_slot,
    test_a_waiter_acquires_soon_after_the_release,
    test_a_waiter_on_a_sigkilled_holders_key_acquires_after_the_ttl,
    test_bad_arguments_with_wait_are_refused_before_the_store_is_touched,
    test_lock_many_is_all_or_none,
    test_lock_many_rolls_back_when_a_later_key_fails,
    test_lock_many_waits_without_holding_anything,
    test_overlapping_random_key_sets_never_deadlock_or_overlap,
    test_wait_ends_at_its_timeout_and_answers_as_without_wait,
)
from tests.scale._servers import cluster_ports, processes, start_cluster_node, wait_for
from tests.scale.conftest import contract_store, contract_tests


@pytest.mark.skipif(os.environ.get("CE_LONG") != "1", reason="8 processes on one key: CE_LONG=1 only here")
def test_no_waiting_process_is_starved(store: Store) -> None:
    """tests/contract/test_waiting.py's, on the cluster (~4 s): a single key lives in one
    slot, on one primary, where the waiting code is the standalone server's (run there in
    the default mode); the cluster's own path, keys across slots, stays in the default mode
    (test_overlapping_random_key_sets_never_deadlock_or_overlap)."""
    _waiting.test_no_waiting_process_is_starved(store)


@pytest.fixture
def provider(redis_cluster: str) -> Iterator[RedisLockProvider]:
    """A provider on the private cluster, closed afterwards."""
    p = RedisLockProvider(redis_cluster)
    yield p
    p.close()


def script_runs(cluster: RedisCluster) -> int:
    """Scripts run so far (EVAL, and EVALSHA but for failed ones such as NOSCRIPT), summed
    over the primaries: a node's first call of a script costs a NOSCRIPT and an EVAL."""
    stats = cluster.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    return sum(
        node.get(name, {}).get("calls", 0) - node.get(name, {}).get("failed_calls", 0)
        for node in stats.values()
        for name in ("cmdstat_evalsha", "cmdstat_eval")
    )


def test_core_operations_across_every_node(provider: RedisLockProvider) -> None:
    """Acquire, contend, refresh, peek, scan and release 600 keys spread over all three primaries."""
    prefix = f"c{uuid.uuid4().hex[:8]}:"
    keys = [f"{prefix}{i}" for i in range(600)]
    cluster = provider._client
    owners = {cluster.nodes_manager.get_node_from_slot(cluster.keyslot(k)).name for k in keys}
    assert len(owners) == 3
    grants = [provider.acquire(k, "tok", 30.0, 600.0, '{"pid":1}') for k in keys]
    assert all(isinstance(g, Grant) for g in grants)
    held = provider.acquire(keys[0], "other", 30.0, 600.0, "{}")
    assert isinstance(held, Held)
    assert held.holder is not None
    assert held.holder.holder == {"pid": 1}
    for key in keys[::7]:
        assert provider.release(key, "tok") is True
    requests = [RefreshRequest(k, "tok" if i % 11 else "wrong", 120.0) for i, k in enumerate(keys)]
    answers = provider.refresh(requests)
    for i, answer in enumerate(answers):
        if i % 7 == 0 or i % 11 == 0:
            assert answer is None, i
        else:
            assert answer is not None
            assert 119.0 < answer <= 120.0, i
    info = provider.peek(keys[1])
    assert info is not None
    assert info.expires_in > 100.0
    live = sorted(k for i, k in enumerate(keys) if i % 7)
    assert [i.key for i in provider.scan(prefix)] == live
    assert cluster.exists(keys[0]) == 0  # released: deleted, its fence kept by its slot's key
    for key in live:
        assert provider.release(key, "tok") is True
    assert provider.scan(prefix) == []


def test_refresh_sends_one_script_call_per_slot(provider: RedisLockProvider) -> None:
    """A refresh of keys in N slots costs N script calls; hash-tagged keys cost one."""
    cluster = provider._client
    prefix = f"s{uuid.uuid4().hex[:8]}:"
    spread = [f"{prefix}{i}" for i in range(50)]
    tagged = [f"{{{prefix}job}}:{i}" for i in range(1500)]  # one slot, two chunks of 1000
    for key in spread + tagged:
        assert isinstance(provider.acquire(key, "tok", 30.0, 60.0, "{}"), Grant)
    slots = {cluster.keyslot(k) for k in spread}
    before = script_runs(cluster)
    assert all(a is not None for a in provider.refresh([RefreshRequest(k, "tok", 30.0) for k in spread]))
    assert script_runs(cluster) - before == len(slots)
    before = script_runs(cluster)
    assert all(a is not None for a in provider.refresh([RefreshRequest(k, "tok", 30.0) for k in tagged]))
    assert script_runs(cluster) - before == 2
    assert len(provider.scan(prefix)) == len(spread)  # the tagged keys start with "{"
    assert len(provider.scan("{" + prefix)) == len(tagged)
    for key in spread + tagged:
        provider.release(key, "tok")


def test_fences_increase_per_key_on_every_node(provider: RedisLockProvider) -> None:
    """Each key's fences strictly increase over release and takeover, whichever node holds it."""
    keys = [f"f{uuid.uuid4().hex[:8]}:{i}" for i in range(30)]
    last = dict.fromkeys(keys, 0)
    for round_ in range(3):
        for key in keys:
            grant = provider.acquire(key, f"t{round_}", 30.0, 60.0, "{}")
            assert isinstance(grant, Grant)
            assert grant.fence > last[key]
            last[key] = grant.fence
            assert provider.release(key, f"t{round_}") is True
            assert provider._client.exists(key) == 0


def test_each_slot_keeps_its_high_water_fence_in_that_slot(provider: RedisLockProvider) -> None:
    """A grant sets its slot's own high-water key (on the node owning the slot) to the fence;
    once the hash is gone, that key alone makes the next fence higher, even ahead of the clock
    (as after a clock step back: the stored high-water mark then exceeds TIME)."""
    cluster = provider._client
    keys = [f"h{uuid.uuid4().hex[:8]}:{i}" for i in range(40)]
    for key in keys:
        slot = cluster.keyslot(key)
        fences = fence_key(slot)
        assert cluster.keyslot(fences) == slot
        grant = provider.acquire(key, "tok", 30.0, 60.0, "{}")
        assert isinstance(grant, Grant)
        assert int(cluster.get(fences)) >= grant.fence
        assert provider.release(key, "tok") is True
        ahead = int(cluster.get(fences)) + 86_400 * 10**6  # a day ahead of the server's clock
        cluster.set(fences, str(ahead))
        again = provider.acquire(key, "tok", 30.0, 60.0, "{}")
        assert isinstance(again, Grant)
        assert again.fence == ahead + 1
        assert provider.release(key, "tok") is True
    owners = {cluster.nodes_manager.get_node_from_slot(cluster.keyslot(k)).name for k in keys}
    assert len(owners) == 3


def test_a_given_cluster_client_is_used_and_left_open(redis_cluster: str) -> None:
    """A RedisCluster client passed in is used (refresh grouped by slot) and not closed."""
    first = urlsplit(redis_cluster.replace("redis+cluster://", "redis://").split(",")[0])
    client = RedisCluster(host=first.hostname, port=first.port, decode_responses=True)
    provider = RedisLockProvider(client=client)
    assert "cluster" in repr(provider)
    prefix = f"g{uuid.uuid4().hex[:8]}:"
    keys = [f"{prefix}{i}" for i in range(40)]
    for key in keys:
        assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
    assert all(a is not None for a in provider.refresh([RefreshRequest(k, "tok", 20.0) for k in keys]))
    assert sorted(i.key for i in provider.scan(prefix)) == sorted(keys)
    provider.close()
    assert client.hget(keys[0], "token") == "tok"
    for key in keys:
        client.delete(key)
    client.close()


def test_no_nodes_wire_keeps_a_connection_after_close(redis_cluster: str) -> None:
    """Calls after close() (a provider used without a service) still answer, and no node's
    fast-path wire keeps their connections: neither one made before close() nor one made
    after it (a node first reached then; such a wire was never closed)."""
    provider = RedisLockProvider(redis_cluster)
    prefix = f"w{uuid.uuid4().hex[:8]}:"
    try:
        assert provider.peek(f"{prefix}first", timeout=5) is None
        provider.close()
        for i in range(30):  # keys on every primary
            assert provider.peek(f"{prefix}{i}", timeout=5) is None
        wires = provider._server._node_wires
        assert len(wires) == 3
        kept = {name: len(wire.kept) for name, wire in wires.items()}
        assert sum(kept.values()) == 0, f"connections kept after close(): {kept}"
    finally:
        provider.close()


def test_diagnose_checks_every_primary(provider: RedisLockProvider, redis_cluster: str) -> None:
    """diagnose() reports the cluster and each primary; a plain URL at a cluster node fails.
    With ``timeout=`` (each primary asked on its Wire) the same findings."""
    found = provider.diagnose()
    within = provider.diagnose(timeout=10)
    assert [(d.check, d.status) for d in within] == [(d.check, d.status) for d in found]
    checks = {d.check for d in found}
    assert {"cluster", "server", "clock", "scripts"} <= checks
    assert [d.status for d in found if d.check == "cluster"] == ["ok"]
    assert len([d for d in found if d.check == "server" and d.status == "ok"]) == 3
    assert len([d for d in found if d.check == "persistence"]) == 3  # appendonly no on each
    host = redis_cluster.split("//", 1)[1].split(",", maxsplit=1)[0]
    plain = RedisLockProvider(f"redis://{host}/0")
    try:
        statuses = {d.check: d.status for d in plain.diagnose()}
        assert statuses["cluster"] == "fail"
        assert {d.check: d.status for d in plain.diagnose(timeout=10)} == statuses
    finally:
        plain.close()


def test_lock_service_on_the_cluster(redis_cluster: str) -> None:
    """LockService on a redis+cluster:// URL excludes, heartbeats and lists leases across nodes."""
    prefix = f"l{uuid.uuid4().hex[:8]}:"
    service, rival = LockService(redis_cluster, prefix=prefix), LockService(redis_cluster, prefix=prefix)
    try:
        leases = [service.lock(f"job:{i}", ttl=1.0) for i in range(30)]
        assert rival.try_lock("job:0") is None
        assert sorted(info.key for info in rival.locks()) == sorted(f"job:{i}" for i in range(30))
        service.heartbeat.beat()  # one batched, slot-grouped refresh
        for lease in leases:
            lease.check()
            lease.release()
        assert rival.locks() == []
    finally:
        service.close()
        rival.close()


def test_a_cluster_urls_connection_options_reach_every_node(redis_cluster: str) -> None:
    """The connection options a cluster URL may carry (checked before the client is built:
    tests/test_bad_input.py) are used on every primary: each one knows the client by the
    URL's ``client_name``."""
    name = f"ce-url-{uuid.uuid4().hex[:8]}"
    options = "socket_timeout=4&socket_connect_timeout=2&socket_keepalive=true&max_connections=50"
    service = LockService(f"{redis_cluster}/0?client_name={name}&{options}", prefix=f"o{name}:")
    seen = RedisCluster.from_url(redis_cluster.replace("redis+cluster://", "redis://").split(",")[0])
    primaries = _primaries(seen)
    try:
        leases = [service.lock(f"job:{i}", ttl=30) for i in range(30)]  # keys on every primary
        for node, client in primaries.items():
            names = [c["name"] for c in client.client_list()]
            assert name in names, (node, names)
        for lease in leases:
            assert lease.release() is ReleaseOutcome.RELEASED
    finally:
        service.close()
        for client in primaries.values():
            client.close()
        seen.close()


def _primaries(cluster: RedisCluster) -> dict[str, redis.Redis]:
    """A plain client per primary, by node name (``host:port``)."""
    return {
        node.name: redis.Redis(host=node.host, port=node.port, socket_timeout=5)
        for node in cluster.get_primaries()
    }


def test_a_held_lease_survives_resharding(provider: RedisLockProvider) -> None:
    """Moving a held key's slot to another primary (MIGRATING/IMPORTING, MIGRATE, SETSLOT
    NODE) keeps the lease: during the move scripts follow ASK, after it MOVED; token, fence
    and TTL travel with the hash, a rival stays out, and the next fence is higher."""
    cluster = provider._client
    key = f"{{m{uuid.uuid4().hex[:8]}}}:moving"
    other = f"o{uuid.uuid4().hex[:8]}:still"
    slot = cluster.keyslot(key)
    grant = provider.acquire(key, "tok", 30.0, 600.0, "{}")
    assert isinstance(grant, Grant)
    assert isinstance(provider.acquire(other, "tok", 30.0, 600.0, "{}"), Grant)
    source = cluster.nodes_manager.get_node_from_slot(slot)
    nodes = _primaries(cluster)
    target_name = next(name for name in nodes if name != source.name)
    ids = {name: client.cluster("MYID") for name, client in nodes.items()}
    ids = {name: (i.decode() if isinstance(i, bytes) else i) for name, i in ids.items()}
    src, dst = nodes[source.name], nodes[target_name]
    moved = False
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.name])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target_name])
        host, port = target_name.rsplit(":", 1)
        src.execute_command("MIGRATE", host, int(port), "", 0, 5000, "KEYS", key)
        asking = dst.pipeline(transaction=False)
        asking.execute_command("ASKING")
        asking.exists(key)
        assert asking.execute()[1] == 1  # the hash is on the target; the source now says ASK
        # The slot's fence key has not moved yet: a script on both keys is refused (TRYAGAIN,
        # which redis-py retries for a while) until it has, an outage, never a wrong grant.
        with pytest.raises(BackendError):
            provider.acquire(key, "rival", 30.0, 600.0, "{}")
        src.execute_command("MIGRATE", host, int(port), "", 0, 5000, "KEYS", fence_key(slot))
        # Mid-move: the source answers ASK for the key, which now lives on the target.
        assert provider.refresh([RefreshRequest(key, "tok", 40.0)]) == [pytest.approx(40.0, abs=1.0)]
        assert isinstance(provider.acquire(key, "rival", 30.0, 600.0, "{}"), Held)
        for client in nodes.values():
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target_name])
        moved = True
        # After it: MOVED, and the client learns the new owner; a pipelined refresh across
        # two slots (two nodes) works too.
        answers = provider.refresh([RefreshRequest(key, "tok", 50.0), RefreshRequest(other, "tok", 50.0)])
        assert answers == [pytest.approx(50.0, abs=1.0), pytest.approx(50.0, abs=1.0)]
        info = provider.peek(key)
        assert info is not None
        assert (info.token, info.fence) == ("tok", grant.fence)
        assert cluster.nodes_manager.get_node_from_slot(slot).name == target_name
        assert 40_000 < dst.pttl(key) <= 50_000  # the TTL moved with the hash (the last refresh)
        assert isinstance(provider.acquire(key, "rival", 30.0, 600.0, "{}"), Held)
        assert provider.release(key, "tok") is True
        again = provider.acquire(key, "next", 30.0, 600.0, "{}")
        assert isinstance(again, Grant)
        assert again.fence > grant.fence
        assert provider.release(key, "next") is True
        assert provider.release(other, "tok") is True
    finally:
        if not moved:  # leave the shared test cluster without a half-done move
            for client in (src, dst):
                client.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        for client in nodes.values():
            client.close()


@contextlib.contextmanager
def cluster_with_replicas(
    folder: Path, primaries: int
) -> Iterator[tuple[str, list[redis.Redis], list[redis.Redis]]]:
    """A private cluster of ``primaries`` primaries (the slots split evenly), each with one
    replica: its URL, the primaries and their replicas (replica i of primary i)."""
    ports = cluster_ports(2 * primaries)
    with processes() as started:
        clients = [start_cluster_node(started, folder, port, 3000) for port in ports]
        heads, tails = clients[:primaries], clients[primaries:]
        try:
            step = 16384 // primaries
            for n, head in enumerate(heads):
                last = 16383 if n == primaries - 1 else (n + 1) * step - 1
                head.execute_command("CLUSTER", "ADDSLOTSRANGE", n * step, last)
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0])
            ids = [head.execute_command("CLUSTER", "MYID") for head in heads]
            for tail in tails:
                wait_for(
                    lambda tail=tail: all(i in tail.execute_command("CLUSTER", "NODES") for i in ids),
                    "the meet",
                    started[0],
                )
            for head_id, tail in zip(ids, tails, strict=True):
                tail.execute_command("CLUSTER", "REPLICATE", head_id)
            for tail in tails:
                wait_for(
                    lambda tail=tail: tail.info("replication").get("master_link_status") == "up",
                    "replication",
                    started[0],
                )
            wait_for(
                lambda: all(c.cluster("INFO")["cluster_state"] == "ok" for c in clients),
                "cluster state ok",
                started[0],
            )
            yield f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", heads, tails
        finally:
            for client in clients:
                client.close()


@pytest.fixture
def primary_and_replica(tmp_path: Path) -> Iterator[tuple[str, redis.Redis, redis.Redis]]:
    """A private one-primary cluster (all slots) with one replica; its URL and both nodes."""
    with cluster_with_replicas(tmp_path, 1) as (url, (primary,), (replica,)):
        yield url, primary, replica


def test_a_held_lease_survives_a_manual_failover(
    primary_and_replica: tuple[str, redis.Redis, redis.Redis],
) -> None:
    """CLUSTER FAILOVER (the replica takes over once it has caught up, as in maintenance)
    keeps a held lease: the client follows MOVED to the new primary; token, fence and the
    exclusion hold, and the next fence is higher."""
    url, primary, replica = primary_and_replica
    provider = RedisLockProvider(url)
    try:
        key = f"fo{uuid.uuid4().hex[:8]}"
        grant = provider.acquire(key, "tok", 30.0, 600.0, "{}")
        assert isinstance(grant, Grant)
        assert primary.execute_command("WAIT", 1, 5000) == 1  # the replica has the lease
        replica.execute_command("CLUSTER", "FAILOVER")

        def swapped() -> bool:
            return replica.info("replication")["role"] == "master" and (
                primary.info("replication")["role"] == "slave"
            )

        deadline = time.monotonic() + 20
        while not swapped():
            assert time.monotonic() < deadline, "the manual failover did not complete"
            time.sleep(0.05)
        answers = provider.refresh([RefreshRequest(key, "tok", 40.0)])
        assert answers == [pytest.approx(40.0, abs=1.0)]
        info = provider.peek(key)
        assert info is not None
        assert (info.token, info.fence) == ("tok", grant.fence)
        assert isinstance(provider.acquire(key, "rival", 30.0, 600.0, "{}"), Held)
        assert provider.release(key, "tok") is True
        again = provider.acquire(key, "next", 30.0, 600.0, "{}")
        assert isinstance(again, Grant)
        assert again.fence > grant.fence
    finally:
        provider.close()


@pytest.fixture
def store(redis_cluster: str) -> Iterator[Store]:
    """The private cluster as the contract suite's one store."""
    yield from contract_store("redis-cluster", redis_cluster)


# The shared contract suite, collected here once more against the store above. The outage
# and guard tests are left out (this store declares neither capability).
globals().update(contract_tests())


def test_a_release_wakes_its_waiters_on_every_primary(provider: RedisLockProvider) -> None:
    """release.lua's SPUBLISH on the key (the script's own slot) reaches a subscriber on the
    key's shard: keys on each of the three primaries, one subscriber connection per primary."""
    prefix = f"w{uuid.uuid4().hex[:8]}:"
    cluster = provider._client
    by_node: dict[str, str] = {}
    for i in range(200):
        key = f"{prefix}{i}"
        by_node.setdefault(cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key)).name, key)
    assert len(by_node) == 3
    subscriptions = {key: provider.subscribe(key) for key in by_node.values()}
    signals = provider._signals
    assert signals is not None
    assert sorted(signals._links) == sorted(by_node)
    for key, subscription in subscriptions.items():
        assert isinstance(provider.acquire(key, "tok", 30.0, 600.0, "{}"), Grant)
        assert subscription.wait(0.1) is False
        assert provider.release(key, "tok") is True
        assert subscription.wait(5.0) is True
        assert all(s.wait(0) is False for k, s in subscriptions.items() if k != key)
    for subscription in subscriptions.values():
        subscription.close()


def test_lock_many_over_keys_on_every_primary_is_all_or_none(redis_cluster: str) -> None:
    """lock_many of three keys on three primaries (three hash slots: no script could take
    them at once): with the last key in canonical order held elsewhere, the call takes the
    first two, is refused on the third and releases the two; once it is free the set is
    taken whole, each key a lease on its own primary with that slot's fence."""
    prefix = f"m{uuid.uuid4().hex[:8]}:"
    first, second = LockService(redis_cluster, prefix=prefix), LockService(redis_cluster, prefix=prefix)
    try:
        provider = first.provider
        assert isinstance(provider, RedisLockProvider)
        cluster = provider._client
        by_node: dict[str, str] = {}
        for i in range(200):
            by_node.setdefault(cluster.get_node_from_key(f"{prefix}k{i}").name, f"k{i}")
        assert len(by_node) == 3
        keys = sorted(by_node.values(), key=lambda key: prefix + key)  # the canonical order
        blocker = first.lock(keys[2], ttl=30)
        with pytest.raises(LockedError) as refused:
            second.lock_many(keys[::-1], ttl=30)
        assert refused.value.key == keys[2]
        assert second.held() == []
        assert [first.peek(key) for key in keys[:2]] == [None, None]
        blocker.release()
        taken = second.lock_many(keys[::-1], ttl=30)
        assert taken.keys == keys
        for lease in taken:
            assert cluster.hget(prefix + lease.key, "token") == lease.token.encode()
            assert int(cluster.get(fence_key(cluster.keyslot(prefix + lease.key)))) >= lease.fence
        assert taken.release() == dict.fromkeys(keys, ReleaseOutcome.RELEASED)
        assert first.locks() == []
    finally:
        first.close()
        second.close()


def test_a_semaphore_takes_slots_with_their_slots_fence_and_wakes_on_any(provider: RedisLockProvider) -> None:
    """limit=3 on a cluster under a service prefix: slot 1 (``prefix + key``) and slots 2..3
    (``prefix + {key}#i``, hashed on ``key``) sit in different hash slots (on different
    primaries here); acquire_any draws each group's fence from that hash slot's high-water
    key, and one subscribe_any over the three keys is woken by the release of any of them."""
    cluster = provider._client
    for i in range(200):
        prefix, key = f"p{uuid.uuid4().hex[:8]}:", f"sem{i}"
        keys = [prefix + key, prefix + "{" + key + "}#2", prefix + "{" + key + "}#3"]
        nodes = {cluster.nodes_manager.get_node_from_slot(cluster.keyslot(k)).name for k in keys}
        if len(nodes) == 2:
            break
    else:  # pragma: no cover - 3 primaries: a random prefix lands apart from the tag 2/3 of the time
        pytest.fail("no key found whose slots are on two primaries")
    subscription = provider.subscribe_any(keys)
    try:
        for i, key in enumerate(keys):
            answer = provider.acquire_any(keys, f"t{i}", 30.0, 600.0, "{}")
            assert isinstance(answer, tuple)
            assert answer[0] == i
            assert int(cluster.get(fence_key(cluster.keyslot(key)))) >= answer[1].fence
            assert 29_000 < cluster.pttl(key) <= 30_000
        assert not isinstance(provider.acquire_any(keys, "late", 30.0, 600.0, "{}"), tuple)
        assert subscription.wait(0.1) is False
        for i in (2, 0):
            assert provider.release(keys[i], f"t{i}") is True
            assert subscription.wait(5.0) is True
        assert provider.release(keys[1], "t1") is True
    finally:
        subscription.close()


def test_semaphore_slots_live_in_at_most_two_hash_slots(redis_cluster: str) -> None:
    """limit=3 on the cluster: three holders, each its own slot key, token and fence; slots
    2..3 share one hash slot (slot 1, the key itself, has its own); an attempt costs one
    script call while slot 1 is free and two once it is held, granted or refused; peek and
    locks() show each slot's holder; a released slot is reclaimed with a greater fence."""
    prefix = f"sem{uuid.uuid4().hex[:8]}:"
    services = [LockService(redis_cluster, prefix=prefix) for _ in range(4)]
    provider = services[0].provider
    assert isinstance(provider, RedisLockProvider)
    cluster = provider._client
    try:
        keys = [prefix + k for k in slot_keys("tenant", 3)]
        assert cluster.keyslot(keys[1]) == cluster.keyslot(keys[2])
        calls = []
        leases = []
        for service in services[:3]:
            before = script_runs(cluster)
            leases.append(service.lock("tenant", limit=3, ttl=30, holder={"n": len(leases)}))
            calls.append(script_runs(cluster) - before)
        assert calls == [1, 2, 2], calls
        assert [lease.store_key for lease in leases] == keys
        assert len({lease.token for lease in leases}) == 3
        before = script_runs(cluster)
        assert services[3].try_lock("tenant", limit=3) is None
        assert script_runs(cluster) - before == 2
        for slot, lease in enumerate(leases, start=1):
            info = services[3].peek(slot_key("tenant", slot))
            assert info is not None
            assert (info.token, info.fence, info.holder["n"]) == (lease.token, lease.fence, slot - 1)
        listed = services[3].locks("tenant")
        assert [slot_of(info.key) for info in listed] == [("tenant", 1), ("tenant", 2), ("tenant", 3)]
        assert [info.token for info in listed] == [lease.token for lease in leases]
        assert leases[1].release() is ReleaseOutcome.RELEASED
        again = services[3].lock("tenant", limit=3, ttl=30)
        assert again.store_key == keys[1]
        assert again.fence > leases[1].fence
        for lease in (leases[0], leases[2], again):
            assert lease.release() is ReleaseOutcome.RELEASED
        assert services[3].locks("tenant") == []
    finally:
        for service in services:
            service.close(release=True)


@pytest.mark.parametrize("tagged_prefix", [False, True], ids=["prefix", "hash-tagged-prefix"])
def test_keys_with_braces_lock_refresh_and_fill_a_semaphore_on_the_cluster(
    redis_cluster: str, tagged_prefix: bool
) -> None:
    """Keys whose braces make odd hash tags (two tags, an empty one first, nested, unclosed,
    a lone closing brace), under a plain prefix and one that tags every key into one slot:
    each locks, refuses a rival, survives a slot-grouped refresh and is released, and as a
    semaphore (limit=3: its slot keys ``{key}#i`` hash on another tag than the key's own)
    takes three holders with their own fences, refuses a fourth and is reclaimed with a
    greater fence: every script finds its keys, and its slot's fence key, in one slot."""
    run = uuid.uuid4().hex[:8]
    prefix = f"{{br{run}}}:" if tagged_prefix else f"br{run}:"
    keys = ["a{x}b{y}", "{}{z}", "{{n}}", "{open", "close}", "}{t}", "{x}#2y"]
    services = [LockService(redis_cluster, prefix=prefix) for _ in range(4)]
    provider = services[0].provider
    assert isinstance(provider, RedisLockProvider)
    cluster = provider._client
    try:
        slots = {cluster.keyslot(prefix + k) for k in keys}
        assert len(slots) == 1 if tagged_prefix else len(slots) > 1  # one slot, or spread
        leases = [services[0].lock(key, ttl=30) for key in keys]
        for key in keys:
            assert services[1].try_lock(key) is None
        services[0].heartbeat.beat()  # the refresh groups these keys by hash slot
        for lease in leases:
            lease.check()
            assert lease.release() is ReleaseOutcome.RELEASED
        for key in keys:
            held = [service.lock(key, limit=3, ttl=30) for service in services[:3]]
            assert [lease.store_key for lease in held] == [prefix + k for k in slot_keys(key, 3)]
            assert services[3].try_lock(key, limit=3) is None
            assert held[2].release() is ReleaseOutcome.RELEASED
            again = services[3].lock(key, limit=3, ttl=30)
            assert again.store_key == held[2].store_key
            assert again.fence > held[2].fence
            for lease in (*held[:2], again):
                assert lease.release() is ReleaseOutcome.RELEASED
        assert services[3].locks() == []
    finally:
        for service in services:
            service.close(release=True)


def test_any_slots_release_wakes_a_semaphore_waiter_on_the_cluster(redis_cluster: str) -> None:
    """A waiter on a full limit=3 semaphore subscribes to its slot keys (slot 1's on that
    key's shard); the release of slot 1, or of slot 3 (another hash slot), hands over within
    50 ms (p50 of each, woken by SPUBLISH), and every handover within the poll bound."""
    prefix = f"semw{uuid.uuid4().hex[:8]}:"
    holder, waiter = LockService(redis_cluster, prefix=prefix), LockService(redis_cluster, prefix=prefix)
    provider = holder.provider
    assert isinstance(provider, RedisLockProvider)
    node = provider._client.get_node_from_key(prefix + "full")
    shard = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
    latencies: dict[int, list[float]] = {1: [], 3: []}
    try:
        leases = [holder.lock("full", limit=3, ttl=30) for _ in range(3)]
        for slot in (1, 3, 1, 3, 1, 3, 1, 3, 1, 3):
            acquired: list[tuple[float, str]] = []

            def wait_for_a_slot(acquired: list[tuple[float, str]] = acquired) -> None:
                got = waiter.lock("full", limit=3, ttl=30, wait=10)
                acquired.append((time.monotonic(), got.store_key))
                leases.append(got)

            thread = threading.Thread(target=wait_for_a_slot)
            thread.start()
            assert wait_until(
                lambda: shard.execute_command("PUBSUB", "SHARDNUMSUB", prefix + "full")[1] == 1, 5.0
            )
            time.sleep(0.3)  # the waiter is in its longest pauses by now
            freed = next(lease for lease in leases if lease.store_key == prefix + slot_key("full", slot))
            released = time.monotonic()
            assert freed.release() is ReleaseOutcome.RELEASED
            leases.remove(freed)
            thread.join(15)
            assert acquired
            assert acquired[0][1] == freed.store_key
            latencies[slot].append(acquired[0][0] - released)
        print(f"handover after slot 1's release {latencies[1]}, after slot 3's {latencies[3]}")
        assert statistics.median(latencies[1]) <= 0.05, latencies
        assert statistics.median(latencies[3]) <= 0.05, latencies
        assert max(latencies[1] + latencies[3]) <= POLL_MAX + 0.3, latencies
        for lease in leases:
            lease.release()
    finally:
        shard.close()
        holder.close(release=True)
        waiter.close(release=True)


class LosesFirstSemaphoreReply:
    """The cluster provider, except that its first ``acquire_any`` takes a slot, then lets
    ``meanwhile()`` run and raises as a lost reply would."""

    def __init__(self, provider: RedisLockProvider, meanwhile: Callable[[], object]) -> None:
        self._provider, self._meanwhile, self.calls = provider, meanwhile, 0
        self.max_key_length = provider.max_key_length

    def acquire_any(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        answer = self._provider.acquire_any(*args, **kwargs)
        if self.calls == 1:
            self._meanwhile()
            raise BackendError("injected: the reply was lost")
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)


def test_a_semaphore_retry_after_a_lost_reply_holds_one_slot(redis_cluster: str) -> None:
    """The first attempt takes slot 2 (slot 1 held; on a cluster, another hash slot's script
    call) and its reply is lost; slot 1 is released before the same-token retry, which takes
    it: the token's slot 2 is released too, not left holding a second slot for its ttl."""
    prefix = f"semr{uuid.uuid4().hex[:8]}:"
    other = LockService(redis_cluster, prefix=prefix)
    first = other.lock("retried", limit=3, ttl=30)
    assert first.store_key == prefix + "retried"
    lossy = LosesFirstSemaphoreReply(RedisLockProvider(redis_cluster), first.release)
    service = LockService(lossy, prefix=prefix)
    try:
        lease = service.lock("retried", limit=3, ttl=30)
        assert lossy.calls == 2
        assert lease.store_key == prefix + "retried"  # the retry found slot 1 free
        assert wait_until(lambda: other.peek(slot_key("retried", 2)) is None, 5.0), other.peek(
            slot_key("retried", 2)
        )
        holders = [other.peek(key) for key in slot_keys("retried", 3)]
        assert [info.token for info in holders if info is not None] == [lease.token]
        lease.release()
    finally:
        service.close(release=True)
        other.close(release=True)


@pytest.mark.parametrize("tagged", [True, False], ids=["one-slot", "two-slots"])
def test_try_mark_unless_on_the_cluster(
    redis_cluster: str, tagged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dedupe marker unless its execution key is held, on the cluster: one script when the
    two keys share a slot (a hash tag in the key, as docs/celery.md advises: ``zip:{7}``), else
    in steps (the provider's own acquire and peek); both refuse while the key is held and
    name who holds it."""
    prefix = f"u{uuid.uuid4().hex[:8]}:"
    service, rival = LockService(redis_cluster, prefix=prefix), LockService(redis_cluster, prefix=prefix)
    try:
        provider = cast("RedisLockProvider", service.provider)
        cluster = provider._client
        for i in range(100):  # a key whose marker hashes elsewhere (or, tagged, not)
            key = f"zip:{{{i}}}" if tagged else f"job{i}"
            same = cluster.keyslot(prefix + key) == cluster.keyslot(prefix + key + "#queued")
            if same == tagged:
                break
        steps: list[str] = []
        for name in ("acquire", "peek"):
            method = getattr(provider, name)

            def counted(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
                if _name == "acquire" or args[0] == prefix + key:  # not the test's own peeks
                    steps.append(_name)
                return _method(*args, **kwargs)

            monkeypatch.setattr(provider, name, counted)
        run = rival.lock(key)
        refused = service.try_mark(key + "#queued", ttl=60, holder={"task_id": "b"}, unless=key)
        assert isinstance(refused, Held)
        assert refused.holder is not None
        assert (refused.holder.key, refused.holder.token) == (key, run.token)
        assert service.peek(key + "#queued") is None
        run.release()
        token = service.try_mark(key + "#queued", ttl=60, holder={"task_id": "a"}, unless=key)
        assert isinstance(token, str)
        queued = rival.try_mark(key + "#queued", ttl=60, unless=key)
        assert isinstance(queued, Held)
        assert queued.holder is not None
        assert queued.holder.holder["task_id"] == "a"
        assert service.force_release(key + "#queued", token)
        assert (steps == []) == tagged, steps  # tagged: the one script, never a step
    finally:
        service.close()
        rival.close()


def test_wait_replicas_on_a_cluster_without_replicas_refuses_every_grant(redis_cluster: str) -> None:
    """ce_wait_replicas=1 on primaries that have no replica: each grant and refresh, on every
    node, waits out ce_wait_timeout and raises BackendError; it is never a lease. A contended
    acquire and a release are answered as usual."""
    provider = RedisLockProvider(redis_cluster + "?ce_wait_replicas=1&ce_wait_timeout=0.1")
    plain = RedisLockProvider(redis_cluster)
    cluster = cast(RedisCluster, plain._client)
    keys = _keys_on_every_primary(cluster)
    try:
        for key in keys:
            began = time.monotonic()
            with pytest.raises(BackendError, match=r"grant reached 0 of 1 replica\(s\) within 100 ms"):
                provider.acquire(key, "tok", 10.0, 60.0, "{}")
            assert time.monotonic() - began >= 0.1  # WAIT waited on the node, not answered at once
            assert isinstance(provider.acquire(key, "rival", 10.0, 60.0, "{}"), Held)  # the write is there
        with pytest.raises(BackendError, match=r"refresh reached 0 of 1 replica\(s\)"):
            provider.refresh([RefreshRequest(key, "tok", 10.0) for key in keys])
        assert all(provider.release(key, "tok") for key in keys)
    finally:
        provider.close()
        plain.close()


def _keys_on_every_primary(cluster: RedisCluster) -> list[str]:
    """One fresh key owned by each primary of ``cluster``."""
    found: dict[str, str] = {}
    while len(found) < len(cluster.get_primaries()):
        key = f"w{uuid.uuid4().hex[:10]}"
        found.setdefault(cluster.get_node_from_key(key).name, key)
    return list(found.values())


def test_wait_replicas_on_a_cluster_counts_each_node_written(tmp_path: Path) -> None:
    """Two primaries, one replica each; one replica frozen (SIGSTOP: still connected,
    acknowledging nothing). Grants on the other primary are acknowledged; grants on the
    frozen one's primary fail; a refresh spanning both primaries fails (the fewest
    acknowledgements count), one of the healthy primary's keys alone is confirmed. Thawed,
    everything works again. Then a slot moves (MOVED, see :func:`_moved_slot`)."""
    with cluster_with_replicas(tmp_path, 2) as (url, primaries, replicas):
        provider = RedisLockProvider(url + "?ce_wait_replicas=1&ce_wait_timeout=0.2")
        cluster = cast(RedisCluster, provider._client)
        stuck = f"127.0.0.1:{replicas[1].info('replication')['master_port']}"  # frozen replica's primary
        pid = int(replicas[1].info("server")["process_id"])
        try:
            ok1, ok2 = _key_on(cluster, stuck, want=False), _key_on(cluster, stuck, want=False)
            frozen, frozen2 = _key_on(cluster, stuck), _key_on(cluster, stuck)
            for key in (ok1, frozen):
                assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
            both = [RefreshRequest(ok1, "tok", 10.0), RefreshRequest(frozen, "tok", 10.0)]
            os.kill(pid, signal.SIGSTOP)
            try:
                assert isinstance(provider.acquire(ok2, "tok", 10.0, 60.0, "{}"), Grant)
                with pytest.raises(BackendError, match=r"grant reached 0 of 1 replica\(s\)"):
                    provider.acquire(frozen2, "tok", 10.0, 60.0, "{}")
                with pytest.raises(BackendError, match=r"refresh reached 0 of 1 replica\(s\)"):
                    provider.refresh(both)
                assert provider.refresh(both[:1]) == [pytest.approx(10.0, abs=0.1)]
            finally:
                os.kill(pid, signal.SIGCONT)
            assert provider.refresh(both) == [pytest.approx(10.0, abs=0.1)] * 2
            _moved_slot(provider, cluster, primaries)
        finally:
            provider.close()


def _moved_slot(provider: RedisLockProvider, cluster: RedisCluster, primaries: list[redis.Redis]) -> None:
    """A slot handed to the other primary after the client read the slot map: the grant
    sent to the old owner is answered MOVED (nothing ran there), a BackendError, and the
    slot map is read again, so the next attempt goes to the new owner and is granted."""
    first = f"127.0.0.1:{primaries[0].connection_pool.connection_kwargs['port']}"
    while True:  # a slot that holds no key (the test's earlier leases and their fences)
        key = _key_on(cluster, first)
        slot = cluster.keyslot(key)
        if primaries[0].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0:
            break
    target = primaries[1].execute_command("CLUSTER", "MYID")
    for node in (primaries[1], primaries[0]):  # an empty slot: no keys to migrate
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)
    with pytest.raises(BackendError, match=r"MOVED \d+ 127.0.0.1:\d+: the slot is served elsewhere"):
        provider.acquire(key, "tok", 10.0, 60.0, "{}")
    assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
    assert primaries[1].hget(key, "token") == "tok"
    assert provider.release(key, "tok") is True


def _key_on(cluster: RedisCluster, node: str, *, want: bool = True) -> str:
    """A fresh key owned by the primary ``node`` (host:port), or by another if not ``want``."""
    while True:
        key = f"w{uuid.uuid4().hex[:10]}"
        if (cluster.get_node_from_key(key).name == node) is want:
            return key
