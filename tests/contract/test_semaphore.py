"""Leased semaphores, ``lock(key, limit=N)``, on every store (the ``store`` fixture: memory,
SQLite, PostgreSQL, MariaDB, Redis), issue #13 item 2."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from celery_exclusive import InvalidArgumentError, LockedError, ReleaseOutcome
from celery_exclusive.providers.base import AcquiresAny, Grant
from celery_exclusive.semaphore import MAX_LIMIT, slot_key, slot_keys, slot_of
from celery_exclusive.testing.contract import Store, wait_until
from tests.conftest import POSTGRES_URL, REDIS_URL, require_server
from tests.contract import _semaphore_workers
from tests.contract._processes import process_context

LONG = os.environ.get("CE_LONG") == "1"
CI = os.environ.get("CI") == "true"


def test_n_holders_are_granted_and_the_next_is_refused(store: Store) -> None:
    """Three callers hold a limit=3 key at once, each on its own slot with its own token and
    fence; a fourth is refused (try_lock None, lock LockedError naming a holder)."""
    services = [store.service() for _ in range(4)]
    leases = [service.lock("sem", limit=3, ttl=30) for service in services[:3]]
    assert sorted(lease.store_key for lease in leases) == sorted(
        services[0].prefix + k for k in slot_keys("sem", 3)
    )
    assert len({lease.token for lease in leases}) == 3
    assert all(lease.key == "sem" for lease in leases)
    assert services[3].try_lock("sem", limit=3) is None
    with pytest.raises(LockedError) as raised:
        services[3].lock("sem", limit=3)
    assert raised.value.holder is not None
    assert raised.value.holder.token in {lease.token for lease in leases}
    for lease in leases:
        assert lease.release() is ReleaseOutcome.RELEASED


def test_each_slot_has_its_own_fence(store: Store) -> None:
    """A slot's fence grows across its own acquisitions, whatever the other slots do."""
    service = store.service()
    first = [service.lock("fenced", limit=2, ttl=30) for _ in range(2)]
    by_slot = {lease.store_key: lease.fence for lease in first}
    for lease in first:
        lease.release()
    again = [service.lock("fenced", limit=2, ttl=30) for _ in range(2)]
    for lease in again:
        if store.fencing:
            assert lease.fence > by_slot[lease.store_key]
        lease.release()


def test_release_frees_exactly_one_slot(store: Store) -> None:
    """Releasing one of three holders lets one more in, not two."""
    holder, other = store.service(), store.service()
    leases = [holder.lock("one", limit=3, ttl=30) for _ in range(3)]
    assert leases[1].release() is ReleaseOutcome.RELEASED
    newcomer = other.lock("one", limit=3, ttl=30)
    assert newcomer.store_key == leases[1].store_key
    assert other.try_lock("one", limit=3) is None
    for lease in (leases[0], leases[2], newcomer):
        lease.release()


def test_limit_one_is_the_single_lock(store: Store) -> None:
    """limit=1 takes the key itself: it contends with a plain lock() both ways."""
    service = store.service()
    lease = service.lock("plain", limit=1)
    assert lease.store_key == service.prefix + "plain"
    assert service.try_lock("plain") is None
    lease.release()
    plain = service.lock("plain")
    assert service.try_lock("plain", limit=1) is None
    assert service.try_lock("plain", limit=2) is not None  # slot 2 is free
    plain.release()


def test_a_dead_holders_slot_is_reclaimed_after_its_ttl_and_not_before(store: Store) -> None:
    """A slot whose holder stopped refreshing stays taken for its ttl, then frees itself."""
    service = store.service()
    dead = service.provider.acquire(service.prefix + slot_key("dead", 2), "dead-token", 1.5, 60.0, "{}")
    assert isinstance(dead, Grant)
    alive = service.lock("dead", limit=2, ttl=30)
    assert alive.store_key == service.prefix + "dead"
    time.sleep(0.5)
    assert service.try_lock("dead", limit=2) is None
    assert wait_until(lambda: service.peek(slot_key("dead", 2)) is None, timeout=4.0)
    late = service.lock("dead", limit=2, ttl=30)
    assert late.store_key == service.prefix + slot_key("dead", 2)
    assert late.fence > dead.fence or not store.fencing
    late.release()
    alive.release()


def test_lowering_the_limit_keeps_higher_slots_until_released(store: Store) -> None:
    """Slots above a new, lower limit keep their holders; new acquires use slots <= limit."""
    service = store.service()
    leases = [service.lock("shrink", limit=3, ttl=30) for _ in range(3)]
    assert service.try_lock("shrink", limit=2) is None
    top = next(lease for lease in leases if lease.store_key.endswith(slot_key("shrink", 3)))
    assert top.held
    top.release()
    assert service.try_lock("shrink", limit=2) is None  # slot 3 is not used any more
    raised = service.lock("shrink", limit=3)  # a raised limit is immediate
    raised.release()
    for lease in leases:
        lease.release()


def test_locks_list_each_slot(store: Store) -> None:
    """locks() lists every held slot; slot_of reads a listed key back to (key, slot)."""
    service = store.service()
    leases = [service.lock("listed", limit=3, ttl=30) for _ in range(2)]
    found = [info for info in service.locks("") if slot_of(info.key)[0] == "listed"]
    assert sorted(slot_of(info.key)[1] for info in found) == [1, 2]
    assert service.peek(slot_key("listed", 2)) is not None
    for lease in leases:
        lease.release()
    assert [info for info in service.locks("") if slot_of(info.key)[0] == "listed"] == []


@pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1, True, 2.0, "3", None])
def test_a_bad_limit_is_refused_before_the_store_is_touched(store: Store, limit: object) -> None:
    """A service on an unreachable store answers InvalidArgumentError, not BackendError."""
    service = store.outage() if store.outage is not None else store.service()
    for call in (service.lock, service.try_lock):
        with pytest.raises(InvalidArgumentError, match="limit"):
            call("bad", limit=limit)  # type: ignore[operator]


def test_one_call_where_the_store_offers_it(store: Store) -> None:
    """Every store of ours takes a slot in one store call (AcquiresAny): memory (one mutex),
    Redis (one script), PostgreSQL (one statement), SQLite and MariaDB (one transaction)."""
    assert isinstance(store.service().provider, AcquiresAny)


def oracle_counter(store: Store) -> tuple[str, str, str]:
    """Where the oracle counts holders: another real store than the one under test, a
    PostgreSQL row for the Redis stores (standalone, Sentinel, Cluster), a Redis hash for
    every other; its name unique to the test."""
    name = f"ce_oracle_{uuid.uuid4().hex[:12]}"
    url = POSTGRES_URL if store.name.startswith("redis") else REDIS_URL
    require_server(url)
    return ("postgres" if store.name.startswith("redis") else "redis", url, name)


def test_semaphore_oracle_never_more_than_limit_holders(store: Store) -> None:
    """Processes hammering one limit=3 key (issue #13): a counter in another store
    (:func:`oracle_counter`), counted up after each acquire returns and down before each
    release, never sees more than 3 holders at once, and sees 3. 16 x 200 with CE_LONG=1."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    procs_n, iterations = (16, 200) if LONG else ((6, 25) if CI else (16, 40))
    ctx = process_context()
    counter = oracle_counter(store)
    _semaphore_workers.create_counter(counter)
    start, results = ctx.Barrier(procs_n), ctx.Queue()
    prefix = store.service().prefix
    procs = [
        ctx.Process(
            target=_semaphore_workers.count_under_semaphore,
            args=(store.target(), prefix, "oracle"),
            kwargs={
                "limit": 3,
                "iterations": iterations,
                "counter": counter,
                "start": start,
                "results": results,
            },
        )
        for _ in range(procs_n)
    ]
    try:
        for proc in procs:
            proc.start()
        reports = [results.get(timeout=600) for _ in range(procs_n)]
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
        now, peak = _semaphore_workers.read_counter(counter)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        _semaphore_workers.drop_counter(counter)
    assert peak == 3, f"most holders at once: {peak} (counted in {counter[0]})"
    assert now == 0  # every holder that counted itself in counted itself out
    assert sum(r[0] for r in reports) > 0
    assert sum(r[1] for r in reports) <= procs_n * iterations // 10  # waits rarely run out
    if store.fencing:  # each slot's fences, merged over processes, are all distinct
        merged: dict[str, list[int]] = {}
        for _, _, fences in reports:
            for key, seen in fences.items():
                merged.setdefault(key, []).extend(seen)
        assert set(merged) <= {prefix + k for k in slot_keys("oracle", 3)}
        for seen in merged.values():
            assert len(set(seen)) == len(seen)


def test_sigkilled_holders_slots_free_after_the_ttl_only(store: Store) -> None:
    """Two holders SIGKILLed: their slots stay taken until their ttl (2 s), then free."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    ctx = process_context()
    ready = ctx.Queue()
    prefix = store.service().prefix
    procs = [
        ctx.Process(
            target=_semaphore_workers.hold_slot_until_killed,
            args=(store.target(), prefix, "killed"),
            kwargs={"limit": 3, "ttl": 2.0, "ready": ready},
        )
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        taken = {ready.get(timeout=60) for _ in procs}
        assert len(taken) == 2
        service = store.service()
        mine = service.lock("killed", limit=3, ttl=30)
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed_at = time.monotonic()
        for proc in procs:
            proc.join(30)
        while time.monotonic() - killed_at < 1.0:  # well inside the ttl: still taken
            assert service.try_lock("killed", limit=3) is None
            time.sleep(0.1)
        assert wait_until(lambda: all(service.peek(k[len(prefix) :]) is None for k in taken), timeout=5.0)
        late = [service.lock("killed", limit=3, ttl=30) for _ in range(2)]
        assert {lease.store_key for lease in late} == taken
        for lease in (*late, mine):
            lease.release()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def test_locks_with_a_filter_include_the_higher_slots(store: Store) -> None:
    """locks("listed") finds {listed}#2 too, ordered with its key; unrelated keys stay out,
    those starting "{listed" that are no slot of such a key too (they used to be listed)."""
    service = store.service()
    leases = [service.lock("filtered", limit=3, ttl=30) for _ in range(3)]
    other = service.lock("other", limit=2, ttl=30)
    braced = [service.lock(key, ttl=30) for key in ("{filtered-not-a-slot", "{filtered}x", "{filtered}#1")]
    assert [info.key for info in service.locks("filtered")] == slot_keys("filtered", 3)
    for lease in (*leases, other, *braced):
        lease.release()


def test_locks_by_a_long_key_include_its_hashed_slots(store: Store) -> None:
    """A key too long for ``{key}#i`` has slots ``{<start>~<hash>}#i``, which keep only the
    key's start: locks() by the key itself, or by a start longer than the one kept, still
    lists them (by the hash of the key, or of a listed key that starts so), and not the
    slots of another long key that shares the kept start."""
    service = store.service()
    longest = service.provider.max_key_length - len(service.prefix)
    base = f"long-{uuid.uuid4().hex[:8]}-"
    first, second, third = (base + "k" * (longest - len(base) - 1) + end for end in "abc")
    held = {key: [service.lock(key, limit=3, ttl=30) for _ in range(3)] for key in (first, second, third)}
    assert "~" in slot_key(first, 2, prefix=service.prefix, max_length=service.provider.max_key_length)
    held[third][0].release()  # slot 1 of the third is free: its hashed slots are found by the key's hash
    try:

        def listed(prefix: str) -> list[str]:
            return [info.key for info in service.locks(prefix)]

        def slots(key: str, *numbers: int) -> list[str]:
            return [
                slot_key(key, n, prefix=service.prefix, max_length=service.provider.max_key_length)
                for n in numbers
            ]

        assert listed(first) == slots(first, 1, 2, 3)
        assert listed(third) == slots(third, 2, 3)
        assert listed(first[:-1]) == [*slots(first, 1, 2, 3), *slots(second, 1, 2, 3)]
        assert sorted(listed(base)) == sorted(
            [*slots(first, 1, 2, 3), *slots(second, 1, 2, 3), *slots(third, 2, 3)]
        )
    finally:
        for leases in held.values():
            for lease in leases:
                lease.release()


def test_a_waiter_on_a_full_semaphore_gets_the_slot_a_holder_releases(store: Store) -> None:
    """lock(limit=2, wait=) on a full key acquires once one holder releases (polled or woken),
    and gives up at its timeout when nobody does."""
    holder, waiter = store.service(), store.service()
    leases = [holder.lock("full", limit=2, ttl=30) for _ in range(2)]
    started = time.monotonic()
    assert waiter.try_lock("full", limit=2, wait=0.3) is None
    assert 0.25 <= time.monotonic() - started < 0.3 + 1.0
    releaser = threading.Timer(0.2, leases[1].release)
    releaser.start()
    got = waiter.lock("full", limit=2, wait=10)
    releaser.join()
    assert got.store_key == leases[1].store_key
    got.release()
    leases[0].release()


def test_a_peeking_store_retries_a_full_semaphore_by_reads_only(store: Store) -> None:
    """On a store whose refused acquire is a write (``waiters_peek``: SQLite's takes the
    database's write lock), a waiter on a full ``limit=2`` key retries only once a peek finds
    a slot free: while both stay held it makes its first attempt, the one right after it
    marks itself waiting and the one at the deadline, and takes the freed slot after that."""
    holder, waiter = store.service(), store.service()
    if getattr(waiter.provider, "waiters_peek", False) is not True:
        pytest.skip(f"store {store.name!r} has no waiters_peek: its waiters retry by attempts")
    leases = [holder.lock("peeked", limit=2, ttl=30) for _ in range(2)]
    attempts: list[float] = []
    original = waiter.provider.acquire_any  # type: ignore[attr-defined]

    def counted(*args: object, **kwargs: object) -> object:
        attempts.append(time.monotonic())
        return original(*args, **kwargs)

    waiter.provider.acquire_any = counted  # type: ignore[attr-defined]
    assert waiter.try_lock("peeked", limit=2, wait=1.0) is None
    assert len(attempts) == 3, attempts
    releaser = threading.Timer(0.3, leases[0].release)
    releaser.start()
    got = waiter.lock("peeked", limit=2, wait=10)
    releaser.join()
    assert got.store_key == leases[0].store_key
    got.release()
    leases[1].release()


def test_a_lost_reply_is_retried_with_the_same_token_and_keeps_one_slot(store: Store) -> None:
    """A semaphore acquire whose store call took a slot but failed in flight (a connection
    error after the grant) is retried once with the same token: the store recognises it, the
    lease is the slot the lost reply took, and no other slot is held."""
    service = store.service()
    original = service.provider.acquire_any  # type: ignore[attr-defined]
    calls: list[str] = []

    def lost_once(*args: object, **kwargs: object) -> object:
        calls.append(str(args[1]))
        answer = original(*args, **kwargs)
        if len(calls) == 1:
            raise ConnectionError("reply lost")
        return answer

    other = service.lock("lost-reply", limit=3, ttl=30)  # slot 1 held by someone else
    service.provider.acquire_any = lost_once  # type: ignore[attr-defined]
    lease = service.lock("lost-reply", limit=3, ttl=30)
    assert len(calls) == 2, calls  # one retry
    assert calls[0] == calls[1]  # with the same token
    assert lease.store_key == service.prefix + slot_key("lost-reply", 2)
    assert sorted(info.key for info in service.locks()) == ["lost-reply", slot_key("lost-reply", 2)]
    lease.release()
    other.release()


def test_a_failure_that_is_not_the_stores_propagates_and_frees_the_slot(store: Store) -> None:
    """An exception from the acquire that is not the store's (a signal handler's, say) is not
    retried: it propagates unchanged, and the slot its call may have taken is released in the
    background."""
    service = store.service()
    original = service.provider.acquire_any  # type: ignore[attr-defined]

    def interrupted(*args: object, **kwargs: object) -> object:
        original(*args, **kwargs)
        raise RuntimeError("interrupted after the grant")

    service.provider.acquire_any = interrupted  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="interrupted after the grant"):
        service.lock("interrupted", limit=3, ttl=30)
    service.provider.acquire_any = original  # type: ignore[attr-defined]
    assert wait_until(lambda: not service.locks(), timeout=10 * store.slack)


@pytest.mark.parametrize("key", ["", 5, "nul\x00key"])
def test_a_bad_key_is_refused_for_a_semaphore_too(store: Store, key: object) -> None:
    """The key itself is checked (not only its slot key ``{key}#N``, always a str)."""
    with pytest.raises(InvalidArgumentError, match="lock key"):
        store.service().lock(key, limit=3)  # type: ignore[arg-type]


def test_a_bad_task_id_is_refused_for_a_semaphore_too(store: Store) -> None:
    """``task_id`` is ignored for ``limit > 1`` (CHANGELOG), but a bad one is still refused
    before the store is touched, on the semaphore's hot path too."""
    with pytest.raises(InvalidArgumentError, match="task_id"):
        store.service().lock("bad-task-id", limit=3, task_id="")
