"""The Redis store through Sentinel (``redis+sentinel://``): a private primary and sentinel.

Only discovery and normal operation (the single lock, semaphores, waiting and lock_many:
the semaphore and waiting contract tests run through the sentinel too) are tested here;
what a failover does to leases (async replication can lose them) is tested in
tests/faults/test_failover.py and documented in docs/scaling.md.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.sentinel

from celery_exclusive import BackendError, LockService, ReleaseOutcome
from celery_exclusive.providers._redis_wire import POLL_AFTER
from celery_exclusive.providers.base import AcquiresAny, Grant, RefreshRequest
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.semaphore import slot_key, slot_keys, slot_of
from celery_exclusive.testing.contract import wait_until
from tests.conftest import TIME_SLACK, Store
from tests.contract import test_waiting as _waiting

# The semaphore contract through the sentinel (on the `store` fixture below).
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

# Waiting and several keys through the sentinel (tests/contract/test_waiting.py): the woken
# handover, waits that end at their timeout or after a SIGKILLed holder's ttl, lock_many,
# a releaser giving way, and not taking the next turn from a longer waiter after it; the
# two 8-process tests with CE_LONG=1 (below).
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
    test_wait_ends_at_its_timeout_and_answers_as_without_wait,
)
from tests.scale._servers import (
    assert_child_forked_mid_connect_connects_itself,
    binary,
    free_port,
    frozen,
    processes,
    redis_tls_args,
    start,
    wait_for,
)
from tests.scale.conftest import contract_store

#: The 8-process waiting tests (~7 s each here, at load ~24) run only with CE_LONG=1 through
#: the sentinel: once it has named the primary, the provider's code is the standalone
#: server's, where they run in the default mode (tests/contract/test_waiting.py).
long_only = pytest.mark.skipif(os.environ.get("CE_LONG") != "1", reason="8 processes: CE_LONG=1 only here")


@long_only
def test_no_waiting_process_is_starved(store: Store) -> None:
    """tests/contract/test_waiting.py's, through the sentinel."""
    _waiting.test_no_waiting_process_is_starved(store)


@long_only
def test_overlapping_random_key_sets_never_deadlock_or_overlap(store: Store, tmp_path: Path) -> None:
    """tests/contract/test_waiting.py's, through the sentinel."""
    _waiting.test_overlapping_random_key_sets_never_deadlock_or_overlap(store, tmp_path)


def _start_sentinel(
    started: list[Any], folder: Path, primary_port: int, tls: tuple[Path, Path] | None = None
) -> int:
    """Start a sentinel monitoring the primary on ``primary_port`` as ``mymaster`` (never
    failing it over: down after 60 s); its port once it names the primary. ``tls``:
    (certificate, key) to take TLS only and reach the primary over TLS."""
    sentinel_port = free_port()
    while sentinel_port == primary_port:
        sentinel_port = free_port()
    config = folder / f"sentinel-{sentinel_port}.conf"  # sentinel rewrites it: must be writable
    config.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor mymaster 127.0.0.1 {primary_port} 1\n"
        "sentinel down-after-milliseconds mymaster 60000\n"
    )
    args = [binary("redis-server"), str(config), "--sentinel"]
    secure: dict[str, Any] = {}
    if tls is not None:
        args += [*redis_tls_args(*tls), "--tls-port", str(sentinel_port)]
        secure = {"ssl": True, "ssl_ca_certs": str(tls[0])}
    proc = start(started, args, folder / f"{sentinel_port}.log")
    watcher = redis.Redis(host="127.0.0.1", port=sentinel_port, socket_timeout=5, **secure)
    found = [b"127.0.0.1", str(primary_port).encode()]
    wait_for(
        lambda: watcher.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster") == found,
        f"private sentinel on port {sentinel_port}",
        proc,
    )
    watcher.close()
    return sentinel_port


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """A private primary and one sentinel monitoring it as ``mymaster``: (primary, sentinel) ports."""
    server = binary("redis-server")
    folder: Path = tmp_path_factory.mktemp("sentinel")
    primary_port = free_port()
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
        yield primary_port, _start_sentinel(started, folder, primary_port)


@pytest.fixture(scope="module")
def second_sentinel(sentinel: tuple[int, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A second sentinel monitoring the ``sentinel`` fixture's primary: its port."""
    with processes() as started:
        yield _start_sentinel(started, tmp_path_factory.mktemp("sentinel2"), sentinel[0])


@pytest.fixture
def store(sentinel: tuple[int, int]) -> Iterator[Store]:
    """The primary, found through the sentinel, as the semaphore contract tests' store."""
    yield from contract_store("redis-sentinel", f"redis+sentinel://127.0.0.1:{sentinel[1]}/mymaster/0")


def test_a_semaphore_through_sentinel(sentinel: tuple[int, int]) -> None:
    """limit=3 through the sentinel: each slot taken in one script call on the primary
    (AcquiresAny), three holders with their own tokens and fences, a fourth refused; the
    primary holds exactly the slot hashes, peek and locks() show each slot's holder, and a
    released slot is taken again with a greater fence."""
    primary_port, sentinel_port = sentinel
    prefix = f"sem{uuid.uuid4().hex[:8]}:"
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0"
    services = [LockService(url, prefix=prefix) for _ in range(4)]
    direct = redis.Redis(port=primary_port)
    try:
        assert isinstance(services[0].provider, AcquiresAny)
        leases = [service.lock("tenant", limit=3, ttl=30) for service in services[:3]]
        assert [lease.store_key for lease in leases] == [prefix + k for k in slot_keys("tenant", 3)]
        assert len({lease.token for lease in leases}) == 3
        assert services[3].try_lock("tenant", limit=3) is None
        for lease in leases:
            assert direct.hget(lease.store_key, "token").decode() == lease.token
            assert 0 < direct.pttl(lease.store_key) <= 30_000  # a slot's hash expires with its lease
        for slot, lease in enumerate(leases, start=1):
            info = services[3].peek(slot_key("tenant", slot))
            assert info is not None
            assert (info.token, info.fence) == (lease.token, lease.fence)
        listed = services[3].locks("tenant")
        assert [slot_of(info.key) for info in listed] == [("tenant", 1), ("tenant", 2), ("tenant", 3)]
        assert leases[2].release() is ReleaseOutcome.RELEASED
        again = services[3].lock("tenant", limit=3, ttl=30)
        assert again.store_key == leases[2].store_key
        assert again.fence > leases[2].fence
        for lease in (leases[0], leases[1], again):
            assert lease.release() is ReleaseOutcome.RELEASED
        assert direct.exists(*(prefix + k for k in slot_keys("tenant", 3))) == 0
    finally:
        for service in services:
            service.close(release=True)
        direct.close()


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
        assert {d.check: d.status for d in provider.diagnose(timeout=10)} == checks
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


def test_every_call_ends_at_its_deadline_on_a_silent_sentinel() -> None:
    """A sentinel that accepts connections and never answers: every entry point of a new
    service (call_timeout=0.5) raises BackendError within its deadline plus slack. The
    lookup of the primary ran on the sentinel's sockets with their own timeout (10 s)."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepts
    url = f"redis+sentinel://127.0.0.1:{silent.getsockname()[1]}/mymaster/0"
    service = LockService(url, call_timeout=0.5, prefix="silent-sentinel:")
    bound = 0.5 + 0.5 * TIME_SLACK
    calls: dict[str, tuple[float, Callable[[], object]]] = {
        "lock": (0, lambda: service.lock("k")),
        "try_lock": (0, lambda: service.try_lock("k")),
        "try_lock wait": (0.3, lambda: service.try_lock("k", wait=0.3)),
        "lock wait": (0.3, lambda: service.lock("k", wait=0.3)),
        "lock_many": (0, lambda: service.lock_many(["a", "b"])),
        "peek": (0, lambda: service.peek("k")),
        "locks": (0, service.locks),
        "force_release": (0, lambda: service.force_release("k", "a-token")),
        "mark": (0, lambda: service.mark("k")),
        "run_exclusive": (0, lambda: service.run_exclusive("k", lambda: None)),
    }
    try:
        for name, (wait, call) in calls.items():
            started = time.monotonic()
            with pytest.raises(BackendError, match="sentinel"):
                call()
            elapsed = time.monotonic() - started
            assert elapsed <= wait + bound, (name, elapsed)
    finally:
        silent.close()  # first: the failed acquires' background releases then fail at once
        service.close(release=False)


def test_calls_end_at_their_deadline_on_a_silent_primary_the_sentinel_names(
    sentinel: tuple[int, int],
) -> None:
    """The sentinel answers, the primary it names is frozen (SIGSTOP): a new service's
    lock, peek and locks (call_timeout=0.5) each raise BackendError within the deadline
    plus slack; thawed, the service works, and each later call is one round trip to the
    primary only (the sentinel is asked when a connection is made, never per call)."""
    primary_port, sentinel_port = sentinel
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0"
    direct = redis.Redis(port=primary_port, socket_timeout=5)
    watcher = redis.Redis(port=sentinel_port, socket_timeout=5)
    service = LockService(url, call_timeout=0.5, prefix=f"silent-primary{uuid.uuid4().hex[:8]}:")
    bound = 0.5 + 0.5 * TIME_SLACK
    try:
        pid = int(cast(dict[str, Any], direct.info("server"))["process_id"])
        with frozen(pid, at_most=3 * bound + 1):
            for name, call in (
                ("lock", lambda: service.lock("k")),
                ("peek", lambda: service.peek("k")),
                ("locks", service.locks),
            ):
                started = time.monotonic()
                with pytest.raises(BackendError):
                    call()
                elapsed = time.monotonic() - started
                assert elapsed <= bound, (name, elapsed)
        assert wait_until(lambda: _locked_once(service), 10.0)
        asked = _commands(watcher)
        for _ in range(20):
            service.lock("k").release()
            assert service.peek("k") is None
        assert _commands(watcher) == asked + 1  # the INFO asking it
    finally:
        service.close()
        direct.close()
        watcher.close()


def _locked_once(service: LockService) -> bool:
    try:
        service.lock("k").release()
    except BackendError:
        return False
    return True


def _commands(sentinel: redis.Redis) -> int:
    return int(cast(dict[str, Any], sentinel.info("stats"))["total_commands_processed"])


def test_a_child_forked_during_a_lookup_asks_the_sentinel_itself(sentinel: tuple[int, int]) -> None:
    """A child forked while its parent's lookup of the primary hangs on the frozen sentinel
    looks the primary up on its own once the sentinel is thawed: its lock() succeeds. The
    parent's lookup thread is not in the child: waiting for it failed every call there."""
    _, sentinel_port = sentinel
    watcher = redis.Redis(port=sentinel_port, socket_timeout=5)
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/0"
    service = LockService(url, call_timeout=0.5, prefix=f"fork-lookup{uuid.uuid4().hex[:8]}:")
    try:
        pid = int(cast(dict[str, Any], watcher.info("server"))["process_id"])
        assert_child_forked_mid_connect_connects_itself(service, [pid], at_most=5.0)
    finally:
        service.close()
        watcher.close()


def _pid(port: int) -> int:
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        return int(cast(dict[str, Any], client.info("server"))["process_id"])
    finally:
        client.close()


def _connections() -> list[tuple[str, int]]:
    """This process's established IPv4 TCP connections: (local ``ip:port``, remote port),
    read from Linux's ``/proc`` (the socket inodes of ``/proc/self/fd`` in ``/proc/net/tcp``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    with open("/proc/net/tcp") as table:
        for row in list(table)[1:]:
            fields = row.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if state == "01" and inode in inodes:  # ESTABLISHED
                ip, port = local.split(":")
                address = socket.inet_ntoa(int(ip, 16).to_bytes(4, "little"))
                found.append((f"{address}:{int(port, 16)}", int(remote.split(":")[1], 16)))
    return found


def _sockets_to(*ports: int) -> int:
    """This process's open TCP connections to ``ports`` (loopback)."""
    return sum(1 for _, port in _connections() if port in ports)


def _drop_connections_to(port: int, direct: redis.Redis) -> None:
    """The server on ``port`` closes every connection this process has to it but ``direct``'s."""
    own = direct.client_info()["addr"]
    for local, remote in _connections():
        if remote == port and local != own:
            direct.client_kill(local)


def test_a_frozen_first_sentinel_is_passed_over_within_the_call_deadline(
    sentinel: tuple[int, int], second_sentinel: int
) -> None:
    """Sentinels [frozen (SIGSTOP), live], the primary live: a new service's lock() and
    release() succeed within call_timeout (the lookup waited out the frozen sentinel's
    10 s socket timeout, failing every call meanwhile), and the live sentinel, which
    answered, is asked first from then on: a reconnect's lookup opens no second
    connection to the frozen one."""
    primary_port, first = sentinel
    url = f"redis+sentinel://127.0.0.1:{first},127.0.0.1:{second_sentinel}/mymaster/0"
    service = LockService(url, call_timeout=TIME_SLACK, prefix=f"frozen-first{uuid.uuid4().hex[:8]}:")
    direct = redis.Redis(port=primary_port, socket_timeout=5)
    try:
        with frozen(_pid(first), at_most=30.0):
            lease = service.lock("k")
            assert lease.release() is ReleaseOutcome.RELEASED
            asked = _sockets_to(first)  # the first lookup's ask, waiting on it still (or timed out)
            _drop_connections_to(primary_port, direct)
            time.sleep(POLL_AFTER + 0.1)  # idle long enough to be checked, found closed, reconnected
            lease = service.lock("k")  # a new connection: a new lookup
            assert lease.release() is ReleaseOutcome.RELEASED
            assert _sockets_to(first) <= asked
    finally:
        service.close(release=False)
        direct.close()


def test_a_call_joining_a_longer_calls_lookup_is_answered_within_its_own_deadline(
    sentinel: tuple[int, int], second_sentinel: int
) -> None:
    """Sentinels [frozen, live]: a lookup started by a call with 60 s to go is hurried by a
    lock() (call_timeout 2 s * slack) joining it, which succeeds: the lookup used to keep
    to the first call's time, and the joiner failed at its deadline."""
    _, first = sentinel
    url = f"redis+sentinel://127.0.0.1:{first},127.0.0.1:{second_sentinel}/mymaster/0"
    service = LockService(url, call_timeout=TIME_SLACK, prefix=f"join-lookup{uuid.uuid4().hex[:8]}:")
    slow: list[object] = []
    before = _sockets_to(first)
    try:
        with frozen(_pid(first), at_most=30.0):
            thread = threading.Thread(target=lambda: slow.append(service.provider.peek("x", timeout=60.0)))
            thread.start()
            assert wait_until(lambda: _sockets_to(first) > before, 5.0)  # its lookup asks the frozen one
            lease = service.lock("k")
            assert lease.release() is ReleaseOutcome.RELEASED
            thread.join(30)
            assert slow == [None]  # the long call was answered by the same lookup
    finally:
        service.close(release=False)


def test_closing_a_service_closes_its_connections_to_the_sentinels(
    sentinel: tuple[int, int], second_sentinel: int
) -> None:
    """Five services made, used and closed in turn leave no connection to the sentinels
    open (each kept its connection to the sentinel that named the primary after close())."""
    ports = (sentinel[1], second_sentinel)
    url = f"redis+sentinel://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/mymaster/0"
    prefix = f"close-sentinels{uuid.uuid4().hex[:8]}:"
    before = _sockets_to(*ports)
    services = []  # kept: a closed service's sockets must not wait for the garbage collector
    for _ in range(5):
        service = LockService(url, prefix=prefix)
        services.append(service)
        service.lock("k").release()
        assert _sockets_to(*ports) > before  # it did ask a sentinel
        service.close()
    assert _sockets_to(*ports) == before


def test_no_password_in_errors_when_the_sentinels_are_unreachable(sentinel: tuple[int, int]) -> None:
    """Sentinels [refusing, silent]: the BackendError of a service from a URL with the
    primary's password, and of one on a client you built with a sentinel password
    (``sentinel_kwargs``) too, names neither password, nor does any error it chains."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepts
    hosts = [("127.0.0.1", free_port()), ("127.0.0.1", silent.getsockname()[1])]
    listed = ",".join(f"{host}:{port}" for host, port in hosts)
    url = f"redis+sentinel://:primary-s3cret@{listed}/mymaster/0?socket_timeout=0.3"
    manager = redis.sentinel.Sentinel(
        hosts,
        sentinel_kwargs={"password": "sentinel-s3cret", "socket_timeout": 0.3},
        password="primary-s3cret",
    )
    services = [
        LockService(url, call_timeout=0.5, prefix="no-password:"),
        LockService(RedisLockProvider(client=manager.master_for("mymaster")), call_timeout=0.5, prefix="np:"),
    ]
    try:
        for service in services:
            for call in (partial(service.lock, "k"), partial(service.peek, "k"), service.provider.diagnose):
                with pytest.raises(BackendError) as raised:
                    call()
                chained: BaseException | None = raised.value
                while chained is not None:
                    for text in (str(chained), repr(chained)):
                        assert "s3cret" not in text
                    chained = chained.__cause__ or chained.__context__
    finally:
        silent.close()
        for service in services:
            service.close(release=False)
        for client in manager.sentinels:
            client.close()


def test_a_store_on_a_sentinel_client_you_built_says_which_and_hides_both_passwords(
    sentinel: tuple[int, int],
) -> None:
    """``RedisLockProvider(client=Sentinel(...).master_for(...))``: its repr (and the
    service's) names the service, the role, the sentinels and the db, not an address its
    pool does not have (``<client ?:?/0>``) and no password; a driver error that quotes the
    sentinels' own password (``sentinel_kwargs``) or the primary's, here a real sentinel's
    "unknown command" reply echoing its argument, is masked in the store's error and in
    the whole traceback, chained driver errors included."""
    sentinel_pw, primary_pw = "Zq8SENTINELpw", "Zq8PRIMARYpw"
    manager = redis.sentinel.Sentinel(
        [("127.0.0.1", sentinel[1])], sentinel_kwargs={"password": sentinel_pw}, password=primary_pw
    )
    provider = RedisLockProvider(client=manager.master_for("mymaster", db=2))
    service = LockService(provider, prefix=f"sentinel-repr-{uuid.uuid4().hex[:6]}:")
    try:
        shown = f"<client sentinel mymaster primary via 127.0.0.1:{sentinel[1]}, db 2>"
        assert repr(provider) == f"RedisLockProvider({shown!r})"
        assert shown in repr(service)
        service.lock("k").release()  # the client works through the sentinel
        texts = []
        for pw, client in ((sentinel_pw, manager.sentinels[0]), (primary_pw, provider._client)):
            with pytest.raises(BackendError) as raised, provider._translated:
                client.execute_command("CE-NO-SUCH-COMMAND", pw)
            texts.append("".join(traceback.format_exception(raised.value)))
            assert "unknown command" in texts[-1], texts[-1]
            assert "The above exception" in texts[-1], texts[-1]  # the driver's error, chained
    finally:
        service.close()
        for client in manager.sentinels:
            client.close()
    leaks = [text for text in texts if sentinel_pw in text or primary_pw in text]
    assert not leaks, leaks[0]
