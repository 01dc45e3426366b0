"""Redis-specific behaviour of RedisLockProvider, against real servers only.

The shared server (``CE_TEST_REDIS_URL``) is used under a unique key prefix per test, and
only that prefix is deleted afterwards. Tests that must flush scripts or use a unix socket
start their own ``redis-server``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import socket
import struct
import subprocess
import time
import uuid
import warnings
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_exclusive.errors import BackendError, ConfigurationError, InvalidArgumentError
from celery_exclusive.providers._redis_scripts import SLOTS, fence_key
from celery_exclusive.providers._redis_urls import _cluster_factory
from celery_exclusive.providers._redis_wire import POLL_AFTER, SLICE, TOLERANCE
from celery_exclusive.providers.base import Completion, Grant, Held, LockProvider, RefreshRequest
from celery_exclusive.providers.redis import FENCES, RedisLockProvider
from celery_exclusive.urls import scheme_family
from tests.conftest import IN_CI, REDIS_URL, TIME_SLACK, require_server
from tests.faults.servers import free_port
from tests.scale._servers import redis_tls_args, self_signed


def unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
    keys = list(client.scan_iter(match=pattern, count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A unique key prefix; every key under it is deleted afterwards."""
    require_server(REDIS_URL)
    value = f"ce-test-{uuid.uuid4().hex[:12]}:"
    yield value
    client = redis.Redis.from_url(REDIS_URL)
    try:
        delete_prefix(client, value)
    finally:
        client.close()


@pytest.fixture
def provider(prefix: str) -> Iterator[RedisLockProvider]:
    p = RedisLockProvider(REDIS_URL)
    try:
        p.peek(prefix + "ping")
    except BackendError as exc:
        unavailable(f"redis at {REDIS_URL} is unusable: {exc}")
    yield p
    p.close()


@contextlib.contextmanager
def _own_redis_server(args: list[str], client: redis.Redis) -> Iterator[None]:
    """redis-server run with ``args`` (no persistence) from when ``client`` gets an answer
    until the block ends; the client is closed."""
    exe = shutil.which("redis-server")
    if exe is None:
        unavailable("redis-server is not on PATH")
        raise AssertionError  # unreachable: unavailable() skips or fails
    args = [exe, *args, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    unavailable("private redis-server did not start")
                time.sleep(0.05)
        client.close()
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of our own on a unix socket (no TCP port); its URL."""
    folder = tmp_path_factory.mktemp("redis")
    sock = folder / "r.sock"
    args = ["--port", "0", "--unixsocket", str(sock), "--dir", str(folder)]
    with _own_redis_server(args, redis.Redis(unix_socket_path=str(sock))):
        yield f"unix://{sock}?db=0"


@pytest.fixture(scope="module")
def private_tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of our own taking TLS only, with a self-signed certificate for
    127.0.0.1 (made by ``openssl``); its ``rediss://`` URL, trusting that certificate."""
    folder = tmp_path_factory.mktemp("redis-tls")
    cert, key = self_signed(folder)
    port = free_port()
    args = [*redis_tls_args(cert, key), "--tls-port", str(port), "--dir", str(folder)]
    client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=5)
    with _own_redis_server(args, client):
        yield f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"


def test_is_a_lock_provider() -> None:
    """RedisLockProvider satisfies the LockProvider protocol."""
    assert isinstance(RedisLockProvider("redis://127.0.0.1:6379/0"), LockProvider)


def test_a_grant_is_the_grant_its_constructor_makes(provider: RedisLockProvider, prefix: str) -> None:
    """The acquire's Grant (made without ``Grant.__init__``) is the frozen dataclass: equal to
    ``Grant(fence, ttl)``, hashed and shown alike, its fields read-only."""
    grant = provider.acquire(prefix + "grant", "t", 30.0, 60.0, "{}")
    assert type(grant) is Grant
    made = Grant(grant.fence, grant.ttl)
    assert grant == made
    assert hash(grant) == hash(made)
    assert repr(grant) == repr(made)
    assert type(grant.fence) is int
    assert type(grant.ttl) is float
    assert 29.0 < grant.ttl <= 30.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        grant.fence = 1  # type: ignore[misc]
    assert provider.release(prefix + "grant", "t") is True


def server_micros(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def test_fence_increases_across_release_and_expiry(provider: RedisLockProvider, prefix: str) -> None:
    """Fences strictly increase across release and expiry; a released key leaves nothing, its
    last fence is kept by the server's high-water key."""
    key = prefix + "fence"
    before = server_micros(provider._client)
    first = provider.acquire(key, "a", 30.0, 60.0, "{}")
    assert isinstance(first, Grant)
    assert first.fence >= before  # taken from the server's microsecond clock
    assert provider.release(key, "a") is True
    second = provider.acquire(key, "b", 0.2, 60.0, "{}")
    assert isinstance(second, Grant)
    assert second.fence > first.fence
    time.sleep(0.3)
    third = provider.acquire(key, "c", 30.0, 60.0, "{}")
    assert isinstance(third, Grant)
    assert third.fence > second.fence
    assert provider.release(key, "c") is True
    assert provider._client.exists(key) == 0
    assert provider._client.memory_usage(key) is None
    assert int(provider._client.get(FENCES)) >= third.fence  # shared: other keys raise it too


def test_hash_ttl_follows_the_lease_and_release_deletes_it(provider: RedisLockProvider, prefix: str) -> None:
    """A held hash expires with its lease (a refresh moves that, never past the hard deadline);
    a release deletes it; a dead lease's hash is gone once its lease expired."""
    key = prefix + "retain"
    client = provider._client

    def dies_with_the_lease() -> bool:
        """The hash expires exactly at the lease's ``expires`` (ms), never before it."""
        try:
            at = client.execute_command("PEXPIRETIME", key)
        except redis.ResponseError:  # Redis < 7 has no PEXPIRETIME: the pttl checks remain
            return True
        return bool(at == int(client.hget(key, "expires")))

    assert isinstance(provider.acquire(key, "tok", 30.0, 600.0, "{}"), Grant)
    assert 29_000 < client.pttl(key) <= 30_000
    assert dies_with_the_lease()
    assert provider.refresh([RefreshRequest(key, "tok", 120.0)])[0] is not None
    assert 119_000 < client.pttl(key) <= 120_000
    assert dies_with_the_lease()
    assert provider.refresh([RefreshRequest(key, "tok", 900.0)])[0] is not None
    assert 590_000 < provider._client.pttl(key) <= 600_000  # the hard deadline caps it
    assert provider.release(key, "tok") is True
    assert provider._client.exists(key) == 0
    assert provider.peek(key) is None
    assert provider.scan(prefix) == []
    dead = prefix + "dead"
    assert isinstance(provider.acquire(dead, "crashed", 0.2, 600.0, "{}"), Grant)
    time.sleep(0.35)  # its holder never refreshes or releases
    assert provider._client.exists(dead) == 0


def test_fence_after_the_hash_was_deleted_exceeds_every_earlier_one(
    provider: RedisLockProvider, prefix: str
) -> None:
    """The released hash is deleted (and here also any that expired, or was evicted, is deleted
    by hand): the next fence still exceeds every earlier one of that key."""
    key = prefix + "gone"
    fences = []
    for token in ("a", "b", "c", "d"):
        grant = provider.acquire(key, token, 30.0, 60.0, "{}")
        assert isinstance(grant, Grant)
        fences.append(grant.fence)
        if token in ("b", "d"):
            provider._client.delete(key)  # expiry or eviction of a held key's hash
        else:
            assert provider.release(key, token) is True
        assert provider._client.exists(key) == 0
    assert fences == sorted(set(fences))


def test_a_completion_record_keeps_the_hash_for_its_retention(
    provider: RedisLockProvider, prefix: str
) -> None:
    """Completion records survive release for their retention (the hash stays that long, then
    goes); the key's next fence is still higher."""
    key = prefix + "done"
    grant = provider.acquire(key, "tok", 30.0, 60.0, "{}")
    assert isinstance(grant, Grant)
    assert provider.release(key, "tok", Completion("task-1", "success", 1, 300.0)) is True
    assert 299_000 < provider._client.pttl(key) <= 300_000
    record = provider.completion(key, "task-1")
    assert record is not None
    assert record.outcome == "success"
    again = provider.acquire(key, "tok2", 30.0, 60.0, "{}")
    assert isinstance(again, Grant)
    assert again.fence > grant.fence
    assert provider._client.pttl(key) > 299_000  # the record's retention, not the lease's ttl
    assert provider.refresh([RefreshRequest(key, "tok2", 10.0)])[0] is not None
    assert provider._client.pttl(key) > 299_000
    assert provider.release(key, "tok2") is True
    assert provider.completion(key, "task-1") is not None
    assert provider._client.pttl(key) > 299_000


def test_the_hash_ends_with_its_longest_kept_record(provider: RedisLockProvider, prefix: str) -> None:
    """A record is stored as ``expires|recorded|attempt|outcome``, ``expires`` exactly its
    retention after ``recorded``; the hash ends exactly when its longest-kept record does
    (``done_max``), whatever shorter record or plain release comes later."""
    key = prefix + "longest"
    client = provider._client

    def ends_at() -> int:
        try:
            return int(client.execute_command("PEXPIRETIME", key))
        except redis.ResponseError:  # Redis < 7: within the ms the pttl tells
            return int(client.hget(key, "done_max")) if client.pttl(key) > 0 else -1

    assert isinstance(provider.acquire(key, "tok", 30.0, 60.0, "{}", task_id="long"), Grant)
    assert provider.release(key, "tok", Completion("long", "success", 0, 300.0)) is True
    expires, recorded, attempt, outcome = client.hget(key, "done:long").decode().split("|")
    assert (int(expires) - int(recorded), attempt, outcome) == (300_000, "0", "success")
    assert ends_at() == int(client.hget(key, "done_max")) == int(expires)
    assert isinstance(provider.acquire(key, "tok2", 30.0, 60.0, "{}", task_id="short"), Grant)
    assert provider.release(key, "tok2", Completion("short", "retried", 3, 10.0)) is True
    expires2, recorded2, attempt2, outcome2 = client.hget(key, "done:short").decode().split("|")
    assert (int(expires2) - int(recorded2), attempt2, outcome2) == (10_000, "3", "retried")
    assert ends_at() == int(client.hget(key, "done_max")) == int(expires)  # the longer one's
    assert provider.release(key, "nobody", Completion("other", "failure", 1, 5.0)) is False
    assert ends_at() == int(expires)
    assert isinstance(provider.acquire(key, "tok3", 30.0, 60.0, "{}"), Grant)
    assert provider.release(key, "tok3") is True
    assert ends_at() == int(expires)
    assert {r.task_id for r in provider.completions(prefix)} == {"long", "short", "other"}


def test_expired_records_are_pruned_as_the_hash_grows(provider: RedisLockProvider, prefix: str) -> None:
    """Records expire by the server's clock and are pruned by later releases once the hash
    has more than 16 fields (then twice as many as after the last pruning): a key that gets
    a record per run does not keep every expired one for as long as a live one keeps it."""
    key = prefix + "pruned"
    client = provider._client
    assert provider.release(key, "nobody", Completion("keeper", "success", 0, 300.0)) is False
    for i in range(10):
        assert isinstance(provider.acquire(key, f"tok-{i}", 30.0, 60.0, "{}", task_id=f"old-{i}"), Grant)
        assert provider.release(key, f"tok-{i}", Completion(f"old-{i}", "success", 0, 0.05)) is True
    time.sleep(0.1 * TIME_SLACK)  # every old-* record has expired; the keeper keeps the hash
    assert [r.task_id for r in provider.completions(prefix)] == ["keeper"]
    for i in range(10):
        assert isinstance(provider.acquire(key, f"new-tok-{i}", 30.0, 60.0, "{}", task_id=f"new-{i}"), Grant)
        assert provider.release(key, f"new-tok-{i}", Completion(f"new-{i}", "success", 0, 300.0)) is True
    fields = {f.decode() for f in client.hkeys(key)}
    assert {f for f in fields if f.startswith("done:")} == {
        "done:keeper",
        *(f"done:new-{i}" for i in range(10)),
    }
    assert len(provider.completions(prefix)) == 11


def test_acquire_any_grants_like_acquire(provider: RedisLockProvider, prefix: str) -> None:
    """A semaphore slot taken by acquire_any.lua expires with its lease (PEXPIRETIME equals
    its ``expires``) and draws its fence from the high-water key like acquire.lua (above the
    fence acquire granted just before, and the key raised to it), in one call: no failed
    first attempt retried."""
    client = provider._client
    keys = [prefix + "any", "{" + prefix + "any}#2"]
    single = provider.acquire(prefix + "other", "x", 30.0, 60.0, "{}")
    assert isinstance(single, Grant)
    calls = []
    run = provider._scripts.run
    provider._scripts.run = lambda *a, **k: calls.append(a[0]) or run(*a, **k)  # type: ignore[method-assign]
    answer = provider.acquire_any(keys, "a", 30.0, 600.0, "{}")
    assert isinstance(answer, tuple)
    assert len(calls) == 1
    index, grant = answer
    assert index == 0
    assert grant.fence > single.fence
    assert int(client.get(FENCES)) >= grant.fence  # other tests' grants may raise it further
    assert 29_000 < client.pttl(keys[0]) <= 30_000
    with contextlib.suppress(redis.ResponseError):  # Redis < 7 has no PEXPIRETIME
        assert client.execute_command("PEXPIRETIME", keys[0]) == int(client.hget(keys[0], "expires"))
    again = provider.acquire_any(keys, "a", 30.0, 600.0, "{}")
    assert isinstance(again, tuple)
    assert again[0] == 0
    assert again[1].fence == grant.fence  # a retried call gets its own slot back
    for key, token in ((keys[0], "a"), (prefix + "other", "x")):
        assert provider.release(key, token) is True
    with pytest.raises(InvalidArgumentError, match="fences"):
        provider.acquire_any([FENCES, "{" + FENCES + "}#2"], "tok", 30.0, 60.0, "{}")


def test_the_fence_keys_are_refused_as_lock_keys(provider: RedisLockProvider) -> None:
    """A lock key naming the store's own high-water keys is bad input, refused before Redis
    (a release or forget of one, as ``force_release`` and ``forget`` send, used to reach it:
    a BackendError, WRONGTYPE)."""
    for key in (FENCES, fence_key(0), FENCES + "x"):
        with pytest.raises(InvalidArgumentError, match="fences"):
            provider.acquire(key, "tok", 30.0, 60.0, "{}")
        with pytest.raises(InvalidArgumentError, match="fences"):
            provider.release(key, "tok")
        with pytest.raises(InvalidArgumentError, match="fences"):
            provider.forget(key, "task-id")


def test_every_cluster_slot_has_its_own_pinned_fence_key() -> None:
    """``fence_key(slot)`` lands in ``slot`` for all 16,384 slots, each a distinct short key;
    the names are part of the stored format (a change would split a slot's high-water mark
    between versions), so a few are pinned here."""
    from redis.crc import key_slot

    names = [fence_key(slot) for slot in range(SLOTS)]
    assert [key_slot(name.encode()) for name in names] == list(range(SLOTS))
    assert len(set(names)) == SLOTS
    assert max(len(name) for name in names) == len(FENCES) + 5
    assert (names[0], names[1], names[16383]) == (
        "celery-exclusive:fences{la2}",
        "celery-exclusive:fences{oD0}",
        "celery-exclusive:fences{hia}",
    )


def test_a_burst_of_acquisitions_stays_strictly_increasing(provider: RedisLockProvider, prefix: str) -> None:
    """Acquire/release cycles faster than the microsecond clock still get distinct rising fences."""
    key = prefix + "burst"
    fences = []
    for i in range(300):
        grant = provider.acquire(key, f"t{i}", 30.0, 60.0, "{}")
        assert isinstance(grant, Grant)
        fences.append(grant.fence)
        assert provider.release(key, f"t{i}") is True
    assert fences == sorted(set(fences))
    assert fences[-1] < 2**53  # exact in Lua's doubles


def test_a_legacy_hash_without_ttl_is_adopted(provider: RedisLockProvider, prefix: str) -> None:
    """A hash an earlier version left (small fence, no TTL) gets a larger fence and a TTL."""
    key = prefix + "legacy"
    provider._client.hset(key, "fence", "7")
    assert provider._client.pttl(key) == -1
    grant = provider.acquire(key, "tok", 30.0, 60.0, "{}")
    assert isinstance(grant, Grant)
    assert grant.fence > 7
    assert 0 < provider._client.pttl(key) <= 30_000
    assert provider.release(key, "tok") is True


def test_retry_is_idempotent_and_held_reports_holder(provider: RedisLockProvider, prefix: str) -> None:
    """A same-token retry gets the same lease; another token learns the holder."""
    key = prefix + "idem"
    grant = provider.acquire(key, "tok", 10.0, 60.0, '{"host":"h1","pid":7}')
    again = provider.acquire(key, "tok", 10.0, 60.0, "{}")
    assert isinstance(grant, Grant)
    assert isinstance(again, Grant)
    assert again.fence == grant.fence
    assert 9.0 < again.ttl <= 10.0
    held = provider.acquire(key, "other", 10.0, 60.0, "{}")
    assert isinstance(held, Held)
    assert held.holder is not None
    assert (held.holder.token, held.holder.fence, held.holder.holder) == (
        "tok",
        grant.fence,
        {"host": "h1", "pid": 7},
    )
    assert 59.0 < held.holder.hard_expires_in <= 60.0
    assert 0.0 <= held.holder.age < 1.0


def test_refresh_after_expiry_returns_none_and_does_not_revive(
    provider: RedisLockProvider, prefix: str
) -> None:
    """Refreshing an expired lease answers None and leaves the key free."""
    key = prefix + "late"
    assert isinstance(provider.acquire(key, "tok", 0.2, 60.0, "{}"), Grant)
    time.sleep(0.3)
    assert provider.refresh([RefreshRequest(key, "tok", 30.0)]) == [None]
    assert provider.peek(key) is None
    assert provider.release(key, "tok") is False
    assert isinstance(provider.acquire(key, "next", 30.0, 60.0, "{}"), Grant)


def test_refresh_is_clamped_at_the_hard_deadline(provider: RedisLockProvider, prefix: str) -> None:
    """Refreshes never extend a lease past its hard deadline."""
    key = prefix + "clamp"
    grant = provider.acquire(key, "tok", 5.0, 1.0, "{}")
    assert isinstance(grant, Grant)
    assert grant.ttl <= 1.0
    started = time.monotonic()
    previous = grant.ttl
    while time.monotonic() - started < 0.8:
        (left,) = provider.refresh([RefreshRequest(key, "tok", 5.0)])
        assert left is not None
        assert left <= previous
        previous = left
        time.sleep(0.1)
    time.sleep(max(0.0, 1.1 - (time.monotonic() - started)))
    assert provider.refresh([RefreshRequest(key, "tok", 5.0)]) == [None]
    assert provider.peek(key) is None
    taken = provider.acquire(key, "next", 5.0, 60.0, "{}")
    assert isinstance(taken, Grant)
    assert taken.fence > grant.fence


def test_refresh_ten_thousand_leases_in_order(provider: RedisLockProvider, prefix: str) -> None:
    """One refresh call of 10,000 leases answers each request in order.

    The 10,000 acquires run one by one: each lease outlives the whole loop (300 s x
    TIME_SLACK, where a 30 s ttl let the first keys expire before the refresh on a loaded
    machine), and the refresh asks for twice that, so every answer and the peek after it
    show a lease the refresh extended, not one the acquire left."""
    hold = 300.0 * TIME_SLACK
    extended = 2 * hold
    keys = [f"{prefix}bulk:{i}" for i in range(10_000)]
    for key in keys:
        assert isinstance(provider.acquire(key, "tok", hold, 4 * hold, "{}"), Grant)
    for key in keys[::7]:
        assert provider.release(key, "tok") is True
    requests = [RefreshRequest(k, "tok" if i % 11 else "wrong", extended) for i, k in enumerate(keys)]
    answers = provider.refresh(requests)
    assert len(answers) == len(keys)
    for i, answer in enumerate(answers):
        if i % 7 == 0 or i % 11 == 0:
            assert answer is None, i
        else:
            assert answer is not None
            assert extended - 1.0 < answer <= extended, i
    info = provider.peek(keys[1])
    assert info is not None
    assert info.expires_in > hold  # beyond anything the acquire gave
    assert provider.refresh([]) == []


def test_scan_escapes_glob_characters_and_orders_by_key(provider: RedisLockProvider, prefix: str) -> None:
    """Scan treats glob characters in the prefix literally and sorts by key."""
    odd = prefix + "a*[b]?\\c:"
    for key in (odd + "2", odd + "1", prefix + "aXbc:1", prefix + "a*[b]?c:1", prefix + "ab]?\\c:1"):
        assert isinstance(provider.acquire(key, "tok", 30.0, 60.0, "{}"), Grant)
    assert isinstance(provider.acquire(odd + "gone", "tok", 30.0, 60.0, "{}"), Grant)
    assert provider.release(odd + "gone", "tok")
    provider._client.set(odd + "string", "not a lock")
    provider._client.hset(odd + "other-hash", "field", "value")
    assert [info.key for info in provider.scan(odd)] == [odd + "1", odd + "2"]
    assert len(provider.scan(prefix)) == 5


def test_scan_spans_several_chunks(provider: RedisLockProvider, prefix: str) -> None:
    """Scan finds every lease when there are more than one script call's worth."""
    keys = sorted(f"{prefix}many:{i}" for i in range(2_500))
    for key in keys:
        provider.acquire(key, "tok", 30.0, 60.0, "{}")
    assert [info.key for info in provider.scan(prefix + "many:")] == keys


def test_unix_socket_url(private_redis: str) -> None:
    """A unix:// URL reaches a server on a unix socket."""
    provider = RedisLockProvider(private_redis)
    try:
        assert isinstance(provider.acquire("u:key", "tok", 10.0, 60.0, "{}"), Grant)
        info = provider.peek("u:key")
        assert info is not None
        assert info.token == "tok"
        assert provider.release("u:key", "tok") is True
    finally:
        provider.close()


def test_a_rediss_url_serves_locks(private_tls_redis: str) -> None:
    """A rediss:// URL's store grants, shows and releases a lock. Its TLS
    connections read replies through redis-py, to which the packed acquire and release
    were handed as bytes it sent one int at a time: a bare TypeError on every acquire."""
    provider = RedisLockProvider(f"{private_tls_redis}&protocol=2&decode_responses=false")
    try:
        assert isinstance(provider.acquire("tls:key", "tok", 10.0, 60.0, '{"h": 1}'), Grant)
        info = provider.peek("tls:key")
        assert info is not None
        assert (info.token, info.holder) == ("tok", {"h": 1})
        assert provider.release("tls:key", "tok") is True
        assert provider.peek("tls:key") is None
    finally:
        provider.close()


def test_scripts_are_reloaded_after_script_flush(private_redis: str) -> None:
    """Every operation survives SCRIPT FLUSH by resending the script source."""
    provider = RedisLockProvider(private_redis)
    admin = redis.Redis.from_url(private_redis)
    try:
        keys = [f"flush:{i}" for i in range(2_100)]
        admin.script_flush()
        for key in keys:
            assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
        admin.script_flush()
        answers = provider.refresh([RefreshRequest(k, "tok", 20.0) for k in keys])
        assert all(a is not None and a > 19.0 for a in answers)
        admin.script_flush()
        assert len(provider.scan("flush:")) == len(keys)
        admin.script_flush()
        assert provider.release(keys[0], "tok") is True
    finally:
        admin.delete(*admin.keys("flush:*"))
        admin.close()
        provider.close()


@pytest.mark.parametrize("text", ["packed", "pâcked"])  # packed in Python; by hiredis
def test_the_hot_commands_run_alike_however_packed(private_redis: str, text: str) -> None:
    """acquire (with and without a task id) and release (with and without a completion
    record), with a deadline and without, store what they were given whether packed in
    Python (ASCII) or by hiredis (not): the script loaded, and as the first call after SCRIPT
    FLUSH (NOSCRIPT: the source sent once)."""
    provider = RedisLockProvider(private_redis)
    admin = redis.Redis.from_url(private_redis)
    key, holder, fences = f"{text}:k", f'{{"host": "{text}", "pid": 1}}', []
    runs = itertools.product((True, False), (None, 5.0), (False, True))
    try:
        for i, (flush, timeout, once) in enumerate(runs):
            task_id = f"{text}-{i}" if once else None
            if flush:
                admin.script_flush()
            token = f"tok-{text}"
            grant = provider.acquire(key, token, 30.0, 600.0, holder, task_id=task_id, timeout=timeout)
            assert isinstance(grant, Grant)
            fences.append(grant.fence)
            info = provider.peek(key)
            assert info is not None
            assert (info.token, info.holder, info.fence) == (token, {"host": text, "pid": 1}, grant.fence)
            assert 29.0 < info.expires_in <= 30.0
            assert 599.0 < info.hard_expires_in <= 600.0
            if flush:
                admin.script_flush()
            done = None if task_id is None else Completion(task_id, f"{text}!", 2, 300.0)
            assert provider.release(key, "tok-other", done, timeout=timeout) is False
            assert provider.release(key, token, done, timeout=timeout) is True
            assert provider.peek(key) is None
            if task_id is not None:
                record = provider.completion(key, task_id)
                assert record is not None
                assert (record.outcome, record.attempt) == (f"{text}!", 2)
                assert 299_000 < admin.pttl(key) <= 300_000
        assert fences == sorted(set(fences))
    finally:
        admin.delete(key)
        admin.close()
        provider.close()


def test_rediss_url_is_accepted_and_masked() -> None:
    """A rediss:// URL builds a provider whose repr hides the password."""
    provider = RedisLockProvider("rediss://user:s3cret@redis.example.invalid:6380/2")
    assert repr(provider) == "RedisLockProvider('rediss://user:***@redis.example.invalid:6380/2')"
    provider.close()


def test_password_never_shown_and_outage_is_an_error() -> None:
    """An unreachable server raises BackendError quickly, never showing the password."""
    provider = RedisLockProvider("redis://:s3cret@127.0.0.1:1/0?password=s3cret")
    assert "s3cret" not in repr(provider)
    started = time.monotonic()
    for call in (
        lambda: provider.acquire("k", "t", 1.0, 1.0, "{}"),
        lambda: provider.refresh([RefreshRequest("k", "t", 1.0)] * 1500),
        lambda: provider.release("k", "t"),
        lambda: provider.peek("k"),
        lambda: provider.scan("k"),
    ):
        with pytest.raises(BackendError) as raised:
            call()
        assert "s3cret" not in str(raised.value)
        assert str(raised.value).startswith("redis redis://:***@127.0.0.1:1/0?password=***: ")
    assert time.monotonic() - started < 5.0
    provider.close()


def test_bad_urls_are_configuration_errors() -> None:
    """Unknown options, bad values and a missing URL are ConfigurationErrors."""
    with pytest.raises(ConfigurationError, match="ce_bogus"):
        RedisLockProvider("redis://127.0.0.1:6379/0?ce_bogus=1")
    with pytest.raises(ConfigurationError) as raised:
        RedisLockProvider("redis://:s3cret@127.0.0.1:6379/0?socket_timeout=soon")
    assert "s3cret" not in str(raised.value)
    with pytest.raises(ConfigurationError):
        RedisLockProvider()


def test_connection_settings() -> None:
    """URL-built clients get 10 s / 5 s timeouts and no retries unless the URL says otherwise."""
    provider = RedisLockProvider("redis://127.0.0.1:6379/0")
    kwargs = provider._client.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (10.0, 5.0)
    assert kwargs["retry"].get_retries() == 0
    provider.close()
    provider = RedisLockProvider("redis://127.0.0.1:6379/0?socket_timeout=2.5")
    assert provider._client.connection_pool.connection_kwargs["socket_timeout"] == 2.5
    provider.close()


def test_given_client_is_used_and_left_open(prefix: str) -> None:
    """A caller's client (even decode_responses=True) is used and not closed."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    provider = RedisLockProvider(client=client)
    assert "s3cret" not in repr(provider)
    key = prefix + "given"
    assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, '{"pid":1}'), Grant)
    held = provider.acquire(key, "other", 10.0, 60.0, "{}")
    assert isinstance(held, Held)
    assert held.holder is not None
    assert held.holder.holder == {"pid": 1}
    assert [i.key for i in provider.scan(prefix)] == [key]
    provider.close()
    assert client.hget(key, "token") == "tok"
    client.close()


def test_a_key_of_another_type_is_a_backend_error(provider: RedisLockProvider, prefix: str) -> None:
    """Acquiring a key that holds a non-hash value raises BackendError."""
    provider._client.set(prefix + "str", "x")
    with pytest.raises(BackendError, match="WRONGTYPE"):
        provider.acquire(prefix + "str", "tok", 10.0, 60.0, "{}")


def kept_connections(provider: RedisLockProvider) -> list[tuple[Any, float]]:
    """``(connection, last use)`` of each connection the provider's fast path keeps."""
    assert provider._wire is not None
    return provider._wire.kept.idle


def test_the_wire_counts_a_call_s_timeout_from_the_start_it_is_given(
    provider: RedisLockProvider, prefix: str
) -> None:
    """``send_many(..., timeout, start)``: the deadline is ``start + timeout`` (the script
    runner passes the clock it read for the call), not the wire's own later reading. A
    BLPOP the server answers after 0.3 s, sent with 1 s from a start 0.9 s ago, times out
    (at about 0.1 s); counted from the wire's own start it would be answered."""
    wire = provider._wire
    assert wire is not None
    provider.release(prefix + "warm", "t")  # a kept, connected line
    with pytest.raises(redis.exceptions.TimeoutError):
        wire.send_many([("BLPOP", prefix + "never", 0.3)], 1.0, time.monotonic() - 0.9)
    assert wire.send_many([("BLPOP", prefix + "never", 0.01)], 1.0, time.monotonic()) == [None]


def test_the_wire_answers_pipelined_commands_in_order(provider: RedisLockProvider, prefix: str) -> None:
    """Several commands on one wire call: every reply in its command's place, an error
    reply returned there (not raised), the connection left fit for the next call."""
    wire = provider._wire
    assert wire is not None
    key = prefix + "pipelined"
    replies = wire.send_many([("SET", key, "a"), ("INCR", key), ("APPEND", key, "b"), ("GET", key)], 1.0)
    assert replies[0] in (b"OK", True)
    assert isinstance(replies[1], redis.exceptions.ResponseError)
    assert replies[2:] == [2, b"ab"]
    assert wire.send_many([("DEL", key)], 1.0) == [1]


def _kill_own_connection(provider: RedisLockProvider) -> None:
    ((conn, _),) = kept_connections(provider)
    host, port = conn._sock.getsockname()[:2]
    provider._client.client_kill(f"{host}:{port}")  # kills only this provider's own connection


def test_idle_connection_closed_by_server_is_reopened(provider: RedisLockProvider, prefix: str) -> None:
    """A connection idle past Redis's smallest ``timeout`` is checked, and reopened if closed."""
    key = prefix + "killed"
    assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
    _kill_own_connection(provider)
    time.sleep(POLL_AFTER + 0.1)
    assert provider.release(key, "tok") is True


def test_busy_connection_closed_by_server_fails_once_as_an_outage(
    provider: RedisLockProvider, prefix: str
) -> None:
    """Within ``POLL_AFTER`` of its last use a connection is not polled: a kill then fails
    the next command with BackendError (never a "not held" answer), and the one after works."""
    key = prefix + "killed-busy"
    assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, "{}"), Grant)
    _kill_own_connection(provider)
    with pytest.raises(BackendError):
        provider.release(key, "tok")
    assert provider.release(key, "tok") is True


def _armed(sock: socket.socket, option: int) -> float:
    """The kernel timeout ``option`` (``SO_RCVTIMEO``/``SO_SNDTIMEO``) armed on ``sock``, in s."""
    seconds, micros = struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
    return seconds + micros / 1e6


def test_the_kernel_bounds_each_wait_within_the_calls_deadline(private_redis: str, prefix: str) -> None:
    """A kept connection's socket is blocking, each wait bounded by the kernel's timeout
    (no poll() before every send and recv); a call with a short deadline arms a shorter one,
    and a later call with a longer deadline on a paused server still waits out all of its
    own (the short timeout expiring is not taken for it) before it raises BackendError."""
    provider = RedisLockProvider(private_redis)
    admin = redis.Redis.from_url(private_redis)
    key = prefix + "kernel"
    try:
        assert provider.peek(key, timeout=5.0) is None
        ((conn, _),) = kept_connections(provider)
        sock = conn._sock
        assert sock.gettimeout() is None  # blocking: on main a Python timeout, set per call
        assert 0 < _armed(sock, socket.SO_RCVTIMEO) <= SLICE
        assert provider.peek(key, timeout=0.05) is None
        assert 0 < _armed(sock, socket.SO_RCVTIMEO) <= 0.05 + TOLERANCE
        admin.client_pause(2000, all=True)  # every client's commands wait: a silent server
        started = time.monotonic()
        with pytest.raises(BackendError, match="Timeout reading"):
            provider.peek(key, timeout=0.8)
        took = time.monotonic() - started
        assert 0.8 <= took <= 0.8 + TIME_SLACK, f"peek(timeout=0.8) took {took:.3f} s"
        assert kept_connections(provider)[0][0]._sock is None  # the timed-out connection is closed
        assert provider.peek(key, timeout=5.0) is None  # a new one, once the pause ends
    finally:
        admin.client_unpause()
        admin.close()
        provider.close()


def test_fork_safety(provider: RedisLockProvider, prefix: str) -> None:
    """A forked child never shares the parent's connections."""
    parent_key, child_key = prefix + "parent", prefix + "child"
    grant = provider.acquire(parent_key, "parent", 30.0, 60.0, "{}")
    assert isinstance(grant, Grant)
    parent_sockets = {conn._sock.getsockname() for conn, _ in kept_connections(provider)}

    def hammer(key: str, token: str, fence: int) -> None:
        # Replies read off a socket shared with the other process would mismatch here.
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            info = provider.peek(key)
            assert info is not None
            assert (info.token, info.fence) == (token, fence)
            answers = provider.refresh([RefreshRequest(key, token, 30.0), RefreshRequest(key, "x", 1.0)])
            assert answers[1] is None

    ready_r, ready_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process (3.12+)
        pid = os.fork()
    if pid == 0:  # child: must open its own connection, never share the parent's socket
        code = 1
        try:
            # The parent is idle until told: a reused parent socket would go unnoticed by Redis.
            assert isinstance(provider.acquire(parent_key, "child", 30.0, 60.0, "{}"), Held)
            child_grant = provider.acquire(child_key, "child", 30.0, 60.0, "{}")
            assert isinstance(child_grant, Grant)
            assert not {conn._sock.getsockname() for conn, _ in kept_connections(provider)} & parent_sockets
            os.write(ready_w, b"1")
            hammer(child_key, "child", child_grant.fence)
            code = 0
        finally:
            os.write(ready_w, b"0")
            os._exit(code)
    os.read(ready_r, 1)
    hammer(parent_key, "parent", grant.fence)
    _, status = os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    assert os.waitstatus_to_exitcode(status) == 0
    info = provider.peek(child_key)
    assert info is not None
    assert info.token == "child"
    assert provider.release(parent_key, "parent") is True


def test_diagnose(provider: RedisLockProvider, private_redis: str) -> None:
    """diagnose() reports version, scripts, clock and persistence, and an outage as an error;
    with ``timeout=`` (its questions then on the provider's own connections) the same."""
    checks = {d.check: d for d in provider.diagnose()}
    within = {d.check: d for d in provider.diagnose(timeout=10)}
    assert {c: d.status for c, d in within.items()} == {c: d.status for c, d in checks.items()}
    assert {c: d.detail for c, d in within.items() if c != "clock"} == {
        c: d.detail for c, d in checks.items() if c != "clock"
    }
    assert checks["server"].status == "ok"
    assert checks["scripts"].status == "ok"
    assert checks["clock"].status in ("ok", "warn")
    assert "replica" not in checks or checks["replica"].status != "fail"
    private = RedisLockProvider(private_redis)
    try:
        assert {d.check: d.status for d in private.diagnose()}["persistence"] == "warn"  # appendonly no
        assert {d.check: d.status for d in private.diagnose(timeout=10)}["persistence"] == "warn"
    finally:
        private.close()
    dead = RedisLockProvider("redis://:s3cret@127.0.0.1:1/0")
    for timeout in (None, 10):
        with pytest.raises(BackendError) as raised:
            dead.diagnose(timeout=timeout)
        assert "s3cret" not in str(raised.value)


def test_volatile_eviction_policy_is_a_diagnosed_failure(private_redis: str) -> None:
    """With maxmemory set, any policy but noeviction fails diagnose(): lock hashes carry TTLs."""
    admin = redis.Redis.from_url(private_redis)
    provider = RedisLockProvider(private_redis)
    try:
        admin.config_set("maxmemory", "1gb")
        for policy, failed in (("volatile-lru", True), ("allkeys-lfu", True), ("noeviction", False)):
            admin.config_set("maxmemory-policy", policy)
            checks = {d.check: d for d in provider.diagnose()}
            assert ("eviction" in checks and checks["eviction"].status == "fail") is failed, policy
    finally:
        admin.config_set("maxmemory", "0")
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()
        provider.close()


def test_cluster_and_sentinel_urls_parse_without_connecting() -> None:
    """Cluster and Sentinel URLs select the Redis provider and parse offline, passwords masked."""
    cluster = RedisLockProvider("redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:2/0?socket_timeout=2")
    assert scheme_family("redis+cluster://h:1") == scheme_family("rediss+sentinel://h/m") == "redis"
    assert (
        repr(cluster)
        == "RedisLockProvider('redis+cluster://:***@127.0.0.1:1,127.0.0.1:2/0?socket_timeout=2')"
    )
    assert cluster._server.target.client is None  # built on first use
    cluster.close()
    sentinel = RedisLockProvider("redis+sentinel://:s3cret@127.0.0.1:1,[::1]:2/mymaster/3")
    assert "s3cret" not in repr(sentinel)
    pool = sentinel._client.connection_pool
    assert pool.service_name == "mymaster"
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (3, "s3cret")
    assert pool.connection_kwargs["socket_timeout"] == 10.0
    assert pool.connection_kwargs["retry"].get_retries() == 0
    found = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(k["host"], k["port"]) for k in found] == [("127.0.0.1", 1), ("::1", 2)]
    assert all(k.get("password") is None for k in found)
    sentinel.close()
    tls = RedisLockProvider("rediss+sentinel://h/mymaster?ssl_cert_reqs=none")
    assert tls._client.connection_pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    tls.close()


def test_parameters_redis_py_takes_still_build_cluster_and_sentinel_stores_offline() -> None:
    """The query parameters redis-py's cluster client takes from a URL (connection options,
    typed or not, TLS ones on rediss) and a Sentinel URL's pass the URL checks; nothing is
    contacted, the cluster client is still to be built."""
    common = (
        "socket_timeout=2&socket_connect_timeout=1&socket_keepalive=true&retry_on_timeout=false"
        "&max_connections=20&client_name=ce-url&socket_read_size=65536&protocol=2&encoding=utf-8"
    )
    tls = "ssl_cert_reqs=none&ssl_check_hostname=false&ssl_min_version=771"  # TLSv1_2
    for url in (
        f"redis+cluster://ce:s3cret@127.0.0.1:1,127.0.0.1:2/0?{common}&db=0",
        f"rediss+cluster://127.0.0.1:1?{common}&{tls}&username=ce&password=s3cret",
    ):
        cluster = RedisLockProvider(url)
        assert cluster._server.target.client is None  # built on first use
        assert "s3cret" not in repr(cluster)
        cluster.close()
    for url in (
        f"redis+sentinel://:s3cret@127.0.0.1:1,127.0.0.1:2/mymaster/1?{common}&health_check_interval=5",
        f"rediss+sentinel://127.0.0.1:1/mymaster?{common}&{tls}",
    ):
        sentinel = RedisLockProvider(url)
        kw = sentinel._client.connection_pool.connection_kwargs
        assert (kw["client_name"], kw["socket_timeout"], kw["socket_keepalive"]) == ("ce-url", 2.0, True)
        sentinel.close()


@pytest.mark.parametrize(
    "options",
    [
        "protocol=2&decode_responses=false&socket_keepalive=off&retry_on_timeout=0",
        "protocol=3&decode_responses=true&socket_keepalive=yes&retry_on_timeout=on",
        "health_check_interval=1&max_connections=5&client_name=ce-url&socket_timeout=30&db=0"
        "&socket_connect_timeout=2.5&socket_read_size=1024&encoding=latin-1&encoding_errors=replace",
    ],
    ids=["resp2-bytes", "resp3-text", "numbers"],
)
def test_valid_redis_url_options_still_work(options: str) -> None:
    """The Redis URL checks let every valid value through: RESP2 and RESP3 on the store's
    own wire, replies as bytes or as text (decode_responses), redis-py's read path
    (health_check_interval); the store grants, shows and releases a lock."""
    require_server(REDIS_URL)
    provider = RedisLockProvider(f"{REDIS_URL}?{options}")
    key = f"opt:{uuid.uuid4().hex}"
    try:
        assert isinstance(provider.acquire(key, "tok", 10.0, 60.0, '{"h": 1}'), Grant)
        info = provider.peek(key)
        assert info is not None
        assert (info.token, info.holder) == ("tok", {"h": 1})
        assert provider.release(key, "tok") is True
    finally:
        provider.close()


def test_truth_values_in_a_url_are_read_as_redis_py_documents() -> None:
    """``decode_responses=false`` (redis-py passes that parameter on as text, and any text
    is true) and redis-py's own truth values arrive as bools in every URL form, the false
    ones (false, 0, no, off) false; nothing is contacted."""
    query = "decode_responses=false&socket_keepalive=off&retry_on_timeout=yes"
    want = {"decode_responses": False, "socket_keepalive": False, "retry_on_timeout": True}
    for url in (
        f"redis://:s3cret@127.0.0.1:1/0?{query}",
        f"rediss://127.0.0.1:1/0?{query}&ssl_check_hostname=no",
        "unix:///tmp/ce-no-such.sock?decode_responses=false&retry_on_timeout=yes",  # no keepalive
        f"redis+sentinel://:s3cret@127.0.0.1:1/mymaster?{query}",
    ):
        provider = RedisLockProvider(url)
        kw = provider._client.connection_pool.connection_kwargs
        assert {name: kw.get(name, False) for name in want} == want, url
        provider.close()
    for value, truth in (("0", False), ("NO", False), ("Off", False), ("1", True), ("true", True)):
        provider = RedisLockProvider(f"redis://127.0.0.1:1/0?decode_responses={value}")
        assert provider._client.connection_pool.connection_kwargs["decode_responses"] is truth
        provider.close()
    _, cluster = _cluster_factory(f"redis+cluster://127.0.0.1:1?{query}", None)
    assert {name: cluster[name] for name in want} == want


def test_bad_cluster_and_sentinel_urls_are_configuration_errors() -> None:
    """A cluster URL naming a database other than 0, or a Sentinel URL without a service, is refused."""
    for url in (
        "redis+cluster://127.0.0.1:7000/2",
        "redis+cluster://127.0.0.1:7000?db=1",
        "redis+cluster://127.0.0.1:port",
        "redis+cluster://:s3cret@/0",
        "redis+sentinel://:s3cret@127.0.0.1:26379/",
        "redis+sentinel://127.0.0.1:26379/mymaster/notadb",
        "redis+other://127.0.0.1:6379",
    ):
        with pytest.raises(ConfigurationError) as raised:
            RedisLockProvider(url)
        assert "s3cret" not in str(raised.value)


def test_unreachable_cluster_and_sentinel_are_backend_errors() -> None:
    """With nothing listening, cluster and Sentinel providers raise BackendError, never the password."""
    for url in ("redis+cluster://:s3cret@127.0.0.1:1", "redis+sentinel://:s3cret@127.0.0.1:1/mymaster"):
        provider = RedisLockProvider(url)
        started = time.monotonic()
        for call in (
            lambda p=provider: p.acquire("k", "t", 1.0, 1.0, "{}"),
            lambda p=provider: p.refresh([RefreshRequest("k", "t", 1.0), RefreshRequest("j", "t", 1.0)]),
            lambda p=provider: p.scan("k"),
        ):
            with pytest.raises(BackendError) as raised:
                call()
            assert "s3cret" not in str(raised.value)
            assert len(str(raised.value)) < 300
        assert time.monotonic() - started < 5.0
        provider.close()


def test_int_writes_times_as_plain_integers_on_64_and_32_bit_builds(
    provider: RedisLockProvider,
) -> None:
    """The prelude's ``int()`` writes ms and µs times as plain integer text with ``'%d'``
    where a C long holds them (this server), and with ``'%.0f'`` on a 32-bit build, whose
    ``'%d'`` cannot: the same text either way (the build's test simulated by a copy of the
    prelude whose test answers 32 bits)."""
    from celery_exclusive.providers import _redis_scripts

    probe = "string.format('%d', 1099511627776) == '1099511627776'"
    assert _redis_scripts._PRELUDE.count(probe) == 1
    narrow = _redis_scripts._PRELUDE.replace(probe, "false")
    values = [0, 999, 2**31, 2**32 + 1, 1_733_000_000_123, 1_733_000_000_123_456, 2**53 - 1]
    body = (
        "local out = {} for i, v in ipairs({%s}) do out[i] = int(v) end "
        "out[#out + 1] = tostring(long) return out"
    )
    body %= ", ".join(str(v) for v in values)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        wide = [x.decode() for x in client.eval(_redis_scripts._PRELUDE + body, 0)]
        small = [x.decode() for x in client.eval(narrow + body, 0)]
    finally:
        client.close()
    assert wide == [*map(str, values), "true"]
    assert small == [*map(str, values), "false"]


def test_a_script_file_runs_by_hand_with_redis_cli(
    provider: RedisLockProvider, prefix: str, tmp_path: Path
) -> None:
    """``cat prelude.lua acquire.lua`` (as the files' headers say) is exactly what the provider
    sends, and runs as it stands in ``redis-cli --eval``: its grant is a lease the provider sees."""
    from celery_exclusive.providers import _redis_scripts

    exe = shutil.which("redis-cli")
    if exe is None:
        unavailable("redis-cli is not on PATH")
        raise AssertionError  # unreachable: unavailable() skips or fails
    folder = files("celery_exclusive.providers").joinpath("redis_scripts")
    key = prefix + "by-hand"
    for name, args, expected in (
        ("acquire", ["by-hand", "30000", "60000", '{"pid": 1}'], "1"),
        ("release", ["by-hand"], "1"),
    ):
        source = folder.joinpath("prelude.lua").read_text() + folder.joinpath(f"{name}.lua").read_text()
        assert source == getattr(_redis_scripts, name.upper())
        script = tmp_path / f"{name}.lua"
        script.write_text(source)
        ran = subprocess.run(
            [exe, "-u", REDIS_URL, "--eval", str(script), key, ",", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split()[0] == expected, ran.stdout
        if name == "acquire":
            info = provider.peek(key)
            assert info is not None
            assert (info.token, info.holder) == ("by-hand", {"pid": 1})
            assert 29.0 < info.expires_in <= 30.0
    assert provider.peek(key) is None
