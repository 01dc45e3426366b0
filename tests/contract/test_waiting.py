"""``lock(key, wait=)`` and ``lock_many`` on every store (the ``store`` fixture: memory,
SQLite, PostgreSQL, MariaDB, Redis), issue #13 items 1 and 3.

Stores that signal releases (:class:`~celery_exclusive.providers.base.WakesWaiters`, today
memory, Redis and PostgreSQL) must hand over within 50 ms (p50); the others within the poll
bound.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_exclusive import (
    BackendError,
    InvalidArgumentError,
    Lease,
    LockedError,
    LockService,
    ReleaseOutcome,
    waiting,
)
from celery_exclusive.many import MAX_KEYS, LeaseSet
from celery_exclusive.providers.base import Held, KnowsWaiters, WakesOnAny, WakesWaiters
from celery_exclusive.semaphore import slot_key
from celery_exclusive.testing.contract import Store
from celery_exclusive.waiting import POLL_MAX
from tests.conftest import TIME_SLACK
from tests.contract import _wait_workers
from tests.contract._processes import process_context

LONG = os.environ.get("CE_LONG") == "1"
#: How late past its timeout a wait may return (the issue's bound).
OVERSHOOT = 0.1


#: How long the holder holds before each release of the handover trials: 20 trials (the
#: issue's count), each long enough for the waiter to be refused and waiting first.
HOLDS = (0.05, 0.08, 0.12, 0.15) * 5


class Polled:
    """The store's own provider seen without its release signals (no ``subscribe``): its
    waiters poll, as on a store that has none (the ``polled`` handover rows of
    benchmarks/waiting.py are measured the same way)."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self.max_key_length = provider.max_key_length

    def __getattr__(self, name: str) -> Any:
        if name in ("subscribe", "subscribe_any"):
            raise AttributeError(name)
        return getattr(self._provider, name)


def subscribes(service: LockService) -> bool:
    """Whether waiters on ``service``'s store are woken by releases: its provider signals
    (WakesWaiters) and a subscription can be made now (not behind PgBouncer in transaction
    mode, for one). The subscription made here also opens the provider's listener connection
    once, before anything is timed."""
    provider = service.provider
    if not isinstance(provider, WakesWaiters):
        return False
    try:
        provider.subscribe(service.prefix + "warm-up").close()
    except Exception:
        return False
    return True


def handover_latencies(holder: LockService, waiter: LockService, holds: tuple[float, ...]) -> list[float]:
    """Seconds from each release to ``waiter`` (waiting in ``lock(wait=)``) holding the key."""
    for service in (holder, waiter):  # connected before anything is timed
        assert service.peek("handover") is None
    latencies = []
    for hold in holds:
        lease = holder.lock("handover", ttl=30)
        released_at: list[float] = []

        def release_later(
            lease: Lease = lease, hold: float = hold, released_at: list[float] = released_at
        ) -> None:
            time.sleep(hold)
            released_at.append(time.monotonic())
            assert lease.release() is ReleaseOutcome.RELEASED

        thread = threading.Thread(target=release_later)
        thread.start()
        got = waiter.lock("handover", ttl=30, wait=10)
        acquired_at = time.monotonic()
        thread.join()
        got.release()
        latencies.append(acquired_at - released_at[0])
    return latencies


def handovers(url: str, rounds: int = 5) -> list[float]:
    """:func:`handover_latencies` of ``rounds`` handovers between two services of ``url``
    (each release 0.3 s after the grant): a waiter in ``lock(wait=10)`` gets the key each
    time its holder releases it, woken or polling, at the latest by its last attempt at the
    end of the wait."""
    holder, waiter = LockService(url), LockService(url)
    try:
        return handover_latencies(holder, waiter, (0.3,) * rounds)
    finally:
        holder.close(release=True)
        waiter.close(release=True)


def assert_woken_handovers(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five :func:`handovers` on ``url`` with polling slowed to pauses of 60 s, so that a
    waiter nobody wakes gets the key only by its last attempt, at the end of its 10 s wait
    (measured: 9.7 s); each is taken within half of it, so the release's signal woke it."""
    monkeypatch.setattr(waiting, "POLL_MIN", 60.0)
    monkeypatch.setattr(waiting, "POLL_MAX", 60.0)
    latencies = handovers(url)
    assert max(latencies) < 5.0, latencies


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


@pytest.mark.parametrize("signals", ["as-is", "hidden"])
def test_a_waiter_acquires_soon_after_the_release(
    store: Store, monkeypatch: pytest.MonkeyPatch, signals: str
) -> None:
    """20 handovers. Where releases wake waiters, the waiter holds the key within 50 ms of the
    release (p50; p99 within the poll bound, plus 0.3 s for a loaded machine's round trips)
    with its polling slowed to pauses of 1-2 s, so that only the signal can be that quick
    (at the real bound, polling alone hands over in ~15-20 ms, under the 50 ms asked).
    Where they do not, or with the signals hidden (``hidden``: the waiter's provider has no
    ``subscribe``), it polls and hands over within the poll bound (p50 within POLL_MAX plus
    50 ms, p99 as above)."""
    holder, waiter = store.service(), store.service()
    woken = subscribes(waiter)
    if signals == "hidden":
        if not woken:
            pytest.skip(f"store {store.name!r} does not wake waiters: the as-is case polls already")
        polled = LockService(Polled(waiter.provider), prefix=waiter.prefix)
        try:
            latencies = handover_latencies(holder, polled, HOLDS[:10])
        finally:
            polled.close(release=True)
        woken = False
    else:
        if woken:
            monkeypatch.setattr(waiting, "POLL_MIN", 2.0)
            monkeypatch.setattr(waiting, "POLL_MAX", 2.0)
        latencies = handover_latencies(holder, waiter, HOLDS)
    assert p99(latencies) <= POLL_MAX + 0.3, latencies
    assert statistics.median(latencies) <= (0.05 if woken else POLL_MAX + 0.05), latencies


@pytest.mark.parametrize("slot", [1, 2])
def test_a_semaphore_waiter_is_woken_by_the_release_of_any_slot(
    store: Store, monkeypatch: pytest.MonkeyPatch, slot: int
) -> None:
    """A waiter on a full limit=2 key acquires soon after either slot is released: with its
    polling slowed to pauses of 2.5-5 s, only the release signal can bring it in within 1.5 s."""
    if not isinstance(store.service().provider, WakesOnAny):
        pytest.skip(f"store {store.name!r} has no subscribe_any: its semaphore waiters poll")
    holder, waiter = store.service(), store.service()
    waiter.provider.subscribe(waiter.prefix + "warm-up").close()  # the listener connection, made once
    monkeypatch.setattr(waiting, "POLL_MIN", 5.0)
    monkeypatch.setattr(waiting, "POLL_MAX", 5.0)
    leases = [holder.lock("woken", limit=2, ttl=30) for _ in range(2)]
    target = next(lease for lease in leases if lease.store_key == holder.prefix + slot_key("woken", slot))
    released_at: list[float] = []

    def release_later() -> None:
        time.sleep(0.5)
        released_at.append(time.monotonic())
        assert target.release() is ReleaseOutcome.RELEASED

    thread = threading.Thread(target=release_later)
    thread.start()
    got = waiter.lock("woken", limit=2, ttl=30, wait=20)
    acquired_at = time.monotonic()
    thread.join()
    assert got.store_key == target.store_key
    assert acquired_at - released_at[0] < 1.5
    for lease in (got, *leases):
        lease.release()


def round_trip(service: LockService, key: str) -> float:
    """The slowest of three refused attempts without wait: a wait's last attempt may add it."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        assert service.try_lock(key) is None
        times.append(time.monotonic() - started)
    return max(times)


def test_wait_ends_at_its_timeout_and_answers_as_without_wait(store: Store) -> None:
    """A wait on a key that stays held returns None / raises LockedError naming the holder,
    no earlier than the timeout and at most 100 ms (plus the last attempt's round trip) after."""
    holder, waiter = store.service(), store.service()
    lease = holder.lock("stays", ttl=30, holder={"task_name": "demo.stays"})
    for wait in (0.0, 0.25, 0.6):
        slack = OVERSHOOT + round_trip(waiter, "stays")
        started = time.monotonic()
        assert waiter.try_lock("stays", wait=wait) is None
        elapsed = time.monotonic() - started
        assert wait <= elapsed <= wait + slack, (wait, elapsed, slack)
    slack = OVERSHOOT + round_trip(waiter, "stays")
    started = time.monotonic()  # a timedelta, as every other duration takes
    assert waiter.try_lock("stays", wait=timedelta(milliseconds=300)) is None
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed <= 0.3 + slack, (elapsed, slack)
    slack = OVERSHOOT + round_trip(waiter, "stays")
    started = time.monotonic()
    with pytest.raises(LockedError) as refused:
        waiter.lock("stays", wait=0.4)
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed <= 0.4 + slack, (elapsed, slack)
    assert refused.value.key == "stays"
    assert refused.value.holder is not None
    assert refused.value.holder.token == lease.token
    assert refused.value.holder.holder["task_name"] == "demo.stays"
    lease.release()


def test_no_probe_is_made_once_the_wait_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait with a probe (SQLite's read before each retry) makes none after its deadline,
    only the last attempt, so it ends one store round trip past its timeout, not two."""
    waiters: list[waiting.Waiter] = []

    def recorded(*args: Any, **kwargs: Any) -> waiting.Waiter:
        waiters.append(original(*args, **kwargs))
        return waiters[-1]

    original = waiting.Waiter
    monkeypatch.setattr(waiting, "Waiter", recorded)
    finals: list[bool] = []
    probed_with: list[float] = []

    def attempt(final: bool) -> Held:
        finals.append(final)
        return Held(None)

    def probe() -> bool:
        probed_with.append(waiters[0].remaining())
        return False

    assert isinstance(waiting.take_waiting(attempt, object(), "k", 0.3, probe=probe), Held)
    assert finals[0] is False
    assert finals[-1] is True
    assert finals.count(True) == 1
    assert probed_with
    assert min(probed_with) > 0, probed_with


def test_a_waiter_on_a_sigkilled_holders_key_acquires_after_the_ttl(store: Store) -> None:
    """The holder's process dies holding the key: the waiter gets it once the ttl ran out,
    not before, with a greater fence."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    ctx = process_context()
    ready = ctx.Queue()
    service = store.service()
    ttl = 1.0
    proc = ctx.Process(
        target=_wait_workers.hold_until_killed, args=(store.target(), service.prefix, "doomed", ttl, ready)
    )
    proc.start()
    try:
        fence = ready.get(timeout=60)
        taken_by_child = time.monotonic()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        lease = service.lock("doomed", wait=10)
        waited = time.monotonic() - taken_by_child
    finally:
        proc.join(30)
    assert lease.fence > fence or not store.fencing
    # The child's heartbeat ran until the kill, so the key is free a ttl after the kill at the
    # earliest (a little less: the store's clock started the lease before we heard of it).
    assert ttl * 0.5 <= waited <= ttl + POLL_MAX + 2.0, waited
    lease.release()


def test_an_outage_during_a_wait_is_an_error(store: Store) -> None:
    """A wait on an unreachable store raises BackendError, never answers "not acquired"."""
    if store.outage is None:
        pytest.skip(f"store {store.name!r} cannot be unreachable")
    service = store.outage()
    try:
        for call in (
            lambda: service.try_lock("k", wait=0.5),
            lambda: service.lock("k", wait=0.5),
            lambda: service.try_lock_many(["a", "b"], wait=0.5),
        ):
            with pytest.raises(BackendError):
                call()
    finally:
        service.close()


@pytest.mark.parametrize(
    "wait", [-0.1, math.nan, math.inf, -math.inf, "1", True, [1], timedelta(seconds=-1), timedelta(days=2)]
)
def test_a_bad_wait_is_refused_before_the_store_is_touched(store: Store, wait: object) -> None:
    """On an unreachable store too: InvalidArgumentError, not BackendError."""
    service = store.outage() if store.outage is not None else store.service()
    try:
        for call in (
            lambda: service.try_lock("k", wait=wait),  # type: ignore[arg-type]
            lambda: service.lock("k", wait=wait),  # type: ignore[arg-type]
            lambda: service.lock_many(["a", "b"], wait=wait),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidArgumentError):
                call()
    finally:
        service.close()


class Recording:
    """The store's own provider, recording the name of every method called through it."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self.max_key_length = provider.max_key_length
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._provider, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return found(*args, **kwargs)

        return call


@pytest.mark.parametrize(
    ("key", "options"),
    [
        ("", {}),
        ("nul\x00", {}),
        ("k", {"ttl": -1}),
        ("k", {"ttl": math.nan}),
        ("k", {"ttl": 5, "refresh_interval": 5}),
        ("k", {"holder": ["not", "a", "mapping"]}),
        ("k", {"holder": {1: "int key"}}),
        ("k", {"limit": 2, "ttl": 0}),
    ],
)
def test_bad_arguments_with_wait_are_refused_before_the_store_is_touched(
    store: Store, key: str, options: dict[str, Any]
) -> None:
    """A bad key, duration or holder with ``wait=``: InvalidArgumentError, and not one call
    reached the store (a waiter subscribes to releases, or on SQLite marks itself, before
    its first attempt; the arguments must be checked before that)."""
    plain = store.service()
    recording = Recording(plain.provider)
    service = LockService(recording, prefix=plain.prefix)
    try:
        for call in (service.lock, service.try_lock):
            recording.calls.clear()
            with pytest.raises(InvalidArgumentError):
                call(key, wait=0.2, **options)
            assert recording.calls == [], recording.calls
    finally:
        service.close(release=False)


@pytest.mark.parametrize(
    "keys",
    [
        [],
        ["a", "a"],
        ["a", "b", "a"],
        "ab",
        [f"k{i}" for i in range(MAX_KEYS + 1)],
        ["a", 1],
        ["a", ""],
        None,
    ],
)
def test_a_bad_key_list_is_refused_before_the_store_is_touched(store: Store, keys: object) -> None:
    service = store.outage() if store.outage is not None else store.service()
    try:
        with pytest.raises(InvalidArgumentError):
            service.lock_many(keys)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            service.try_lock_many(keys)  # type: ignore[arg-type]
    finally:
        service.close()


def test_lock_many_is_all_or_none(store: Store) -> None:
    """One held key refuses the set and leaves the others free; a free set is all taken,
    each key with its own fence, and released together."""
    first, second = store.service(), store.service()
    blocker = first.lock("b", ttl=30)
    with pytest.raises(LockedError) as refused:
        second.lock_many(["c", "b", "a"])
    assert refused.value.key == "b"
    assert refused.value.holder is not None
    assert refused.value.holder.token == blocker.token
    assert second.try_lock_many(["a", "b", "c"]) is None
    assert second.peek("a") is None
    assert second.peek("c") is None
    assert second.held() == []
    blocker.release()
    taken = second.lock_many(["c", "b", "a"], ttl=30)
    assert isinstance(taken, LeaseSet)
    assert taken.keys == ["a", "b", "c"]  # canonical order
    assert taken.held
    assert set(taken.fences) == {"a", "b", "c"}
    assert {info.key: info.token for info in second.locks()} == {lease.key: lease.token for lease in taken}
    assert first.try_lock("a") is None
    with taken:
        taken.check()
    assert not taken.held
    assert second.locks() == []
    assert second.held() == []


def test_lock_many_waits_without_holding_anything(store: Store) -> None:
    """While it waits on a refused key, a lock_many caller holds none of its other keys."""
    first, second = store.service(), store.service()
    blocker = first.lock("m", ttl=30)
    done: list[LeaseSet | None] = []
    thread = threading.Thread(target=lambda: done.append(second.try_lock_many(["z", "m", "a"], wait=10)))
    thread.start()
    time.sleep(0.3)
    # The waiter holds neither "a" (before the refused key) nor "z": a third party gets both.
    for key in ("a", "z"):
        other = first.try_lock(key, wait=1.0)
        assert other is not None
        other.release()
    blocker.release()
    thread.join(15)
    assert done
    assert done[0] is not None
    assert done[0].keys == ["a", "m", "z"]
    assert done[0].release() == dict.fromkeys(["z", "m", "a"], ReleaseOutcome.RELEASED)


def test_overlapping_random_key_sets_never_deadlock_or_overlap(store: Store, tmp_path: Path) -> None:
    """8 processes lock random 3-of-6 key sets in random order (a few seconds; 20 s with
    CE_LONG=1, and on until each got a set): no key is ever held by two at once (an
    external oracle: O_EXCL marker files), no wait runs out while nobody is served (a
    deadlock), and every process gets a set. A wait that runs out while others are served
    is starvation, which a loaded machine causes on a polling store (a first lock_many of
    5.4 s was measured on SQLite with 12 busy loops beside it): counted and printed, not
    failed; the cap (30 s x TIME_SLACK) ends a run that starves a process for good."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    ctx = process_context()
    results, start, progress = ctx.Queue(), ctx.Barrier(8), ctx.Value("i", 0)
    prefix = store.service().prefix
    keys = [f"res{i}" for i in range(6)]
    seconds = 20.0 if LONG else 3.0
    cap, wait = 30.0 * TIME_SLACK, 5.0 * TIME_SLACK
    procs = [
        ctx.Process(
            target=_wait_workers.lock_random_sets,
            args=(store.target(), prefix),
            kwargs={
                "keys": keys,
                "seconds": seconds,
                "cap": cap,
                "wait": wait,
                "busy_dir": str(tmp_path),
                "seed": seed,
                "results": results,
                "start": start,
                "progress": progress,
            },
        )
        for seed in range(8)
    ]
    for proc in procs:
        proc.start()
    reports = sorted(results.get(timeout=cap + wait + 90) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert all(overlaps == 0 for _, _, overlaps, _, _ in reports), reports
    assert all(stalls == 0 for _, _, _, stalls, _ in reports), reports
    assert all(acquired > 0 for _, acquired, _, _, _ in reports), reports
    print(
        f"{store.name}: acquisitions per process {[acquired for _, acquired, _, _, _ in reports]},"
        f" starved waits {sum(starved for *_, starved in reports)}"
    )


def jain_index(counts: list[int]) -> float:
    """Jain's fairness index: 1.0 when every count is equal, 1/n when one got everything."""
    total = sum(counts)
    return total * total / (len(counts) * sum(c * c for c in counts)) if total else 0.0


#: Acquisitions the 8 starvation-test processes make together (per process; CE_LONG=1: 100):
#: if each turn went to one of the 8 at random, the chance that one of them got none of
#: 160 would be 8 x (7/8)^160, about 4e-9.
TURNS_EACH = 100 if LONG else 20


def test_no_waiting_process_is_starved(store: Store) -> None:
    """8 processes loop lock(wait=) / hold 5 ms / release on one key until they were served
    8 x 20 times together (8 x 100 with CE_LONG=1): each got at least one of those turns.
    The window is counted in turns, not seconds, so a loaded machine lengthens it instead
    of shrinking the sample (the time cap, 10 s x TIME_SLACK, only ends a run that hangs or
    crawls; it must still have made 5 turns per process). The shares, Jain's index and each
    process's longest wait in turns (acquisitions by others during it) are printed (issue
    #13 item 1); they are not judged: there is no queue, and under CPU load the processes
    the scheduler runs first win more turns (README, *Limitations*, has measured shares).
    SQLite, whose waiters starved each other (3 of 8 got no turn), is held to the same
    bar since its releasers give way."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    ctx = process_context()
    processes = 8
    turns = TURNS_EACH * processes
    results, start, served = ctx.Queue(), ctx.Barrier(processes), ctx.Value("i", 0)
    prefix = store.service().prefix
    cap = 10.0 * TIME_SLACK * (5 if LONG else 1)
    began = time.monotonic()
    procs = [
        ctx.Process(
            target=_wait_workers.take_turns,
            args=(store.target(), prefix, "fair"),
            kwargs={"seconds": cap, "start": start, "results": results, "served": served, "turns": turns},
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    reports = sorted(results.get(timeout=cap + 90) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    took = time.monotonic() - began
    counts = sorted(count for _, count, _ in reports)
    total = sum(counts)
    print(
        f"{store.name}: {total} turns by {processes} processes in {took:.1f} s, shares"
        f" {' '.join(f'{100 * count / total:.1f}%' for count in counts) if total else '-'},"
        f" Jain {jain_index(counts):.3f}, longest waits (turns)"
        f" {sorted(worst for _, _, worst in reports)}"
    )
    # Enough turns for "at least one each" to mean something: all of them unless the cap cut
    # the run short (a handover that slow is a failure of its own below 5 per process).
    assert total == turns or total >= 5 * processes, (total, turns, took)
    assert min(counts) >= 1, (reports, jain_index(counts))


def test_a_releaser_gives_way_to_a_waiter(store: Store) -> None:
    """A service that releases a key another one waits for, and at once waits for it again,
    lets the waiter in first (the store said someone waited: KnowsWaiters, on SQLite,
    PostgreSQL and Redis). Before, the releaser took the key back at once nearly every time
    (PostgreSQL before its releases told: the waiter first 3-6 times of 10 at load 18-29)."""
    if store.name in ("memory", "mariadb"):
        # memory has no KnowsWaiters; MariaDB/MySQL share SQLite's provider class, whose
        # had_waiters says False there (no waiter marks: see README, Limitations).
        pytest.skip(f"store {store.name!r} does not tell a releaser about waiters")
    assert isinstance(store.service().provider, KnowsWaiters)
    holder, waiter = store.service(), store.service()
    first = []
    for _ in range(10):
        lease = holder.lock("turn", ttl=30)
        order: list[str] = []

        def wait_then_hold(order: list[str] = order) -> None:
            got = waiter.lock("turn", ttl=30, wait=10)
            order.append("waiter")
            time.sleep(0.01)
            got.release()

        thread = threading.Thread(target=wait_then_hold)
        thread.start()
        time.sleep(0.1)  # the waiter was refused and waits (marked or subscribed)
        lease.release()
        again = holder.lock("turn", ttl=30, wait=10)
        order.append("holder")
        again.release()
        thread.join(15)
        first.append(order[0])
    assert first.count("waiter") >= 8, first


def test_a_releaser_that_gave_way_does_not_take_the_next_turn_from_a_longer_waiter(store: Store) -> None:
    """A releases the key while X and Y wait and waits again at once, giving way; whichever
    of X and Y takes the key releases it 0.03 s later (A still giving way): then the other
    one, which waited longer than A, takes it, not A. Before GIVE_WAY_DEFER, A took that
    turn 4-7 times of 10 on PostgreSQL and Redis (Redis 7.0 sends a release to the
    channel's newest subscriber first, and A subscribed last), and with 8 processes on one
    key one turn in 9-20 % went to the holder of two turns before (BENCHMARKS.md, Waiting)."""
    if store.name in ("memory", "mariadb"):
        pytest.skip(f"store {store.name!r} does not tell a releaser about waiters")
    a, x, y = store.service(), store.service(), store.service()
    if not subscribes(a):
        # SQLite gives way by polling: no release signal ends it, so the 2 ms do not apply
        # (its 75 ms pause races the other waiter's next look, 25-50 ms apart)
        pytest.skip(f"store {store.name!r} does not wake waiters: no signal ends its giving way")
    outcome = []
    for trial in range(10):
        key = f"longer{trial}"  # a key of its own: no service gives way from an earlier trial
        order: list[str] = []
        lease = a.lock(key, ttl=30)

        def wait_hold(service: LockService, name: str, key: str = key, order: list[str] = order) -> None:
            got = service.lock(key, ttl=30, wait=10)
            order.append(name)
            # the first holds less than GIVE_WAY: a is still giving way at its release
            time.sleep(0.03 if len(order) == 1 else 0.01)
            got.release()

        threads = [threading.Thread(target=wait_hold, args=(y, "y"))]
        threads[0].start()
        time.sleep(0.1)  # y waits (subscribed or marked) before x
        threads.append(threading.Thread(target=wait_hold, args=(x, "x")))
        threads[1].start()
        time.sleep(0.1)
        lease.release()
        again = a.lock(key, ttl=30, wait=10)  # gives way: x and y were told about
        order.append("a")
        again.release()
        for thread in threads:
            thread.join(15)
        outcome.append(order[1])
    assert outcome.count("a") <= 2, outcome


def test_a_releaser_nobody_waits_for_does_not_give_way(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without waiters, a release followed by lock(wait=) takes the key again at once."""
    service = store.service()
    service.lock("alone", ttl=30).release()

    def no_giving_way(self: waiting.Waiter) -> None:
        raise AssertionError("gave way to nobody")

    monkeypatch.setattr(waiting.Waiter, "give_way", no_giving_way)
    for _ in range(3):
        service.lock("alone", ttl=30, wait=5).release()


class FailsOnKey:
    """The store's own provider, except that acquiring a key ending in ``boom`` raises
    ``error`` (a fault injected between two keys of one lock_many)."""

    def __init__(self, provider: Any, error: BaseException) -> None:
        self._provider, self._error = provider, error
        self.max_key_length = provider.max_key_length

    def acquire(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.endswith("boom"):
            raise self._error
        return self._provider.acquire(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)


@pytest.mark.parametrize("error", [BackendError("injected outage"), KeyError("injected bug")])
def test_lock_many_rolls_back_when_a_later_key_fails(store: Store, error: BaseException) -> None:
    """An error on the second key (canonical order: a, boom, c) releases the first and
    propagates; nothing of the set stays held."""
    plain = store.service()
    faulty = LockService(FailsOnKey(plain.provider, error), prefix=plain.prefix, call_timeout=1.0)
    try:
        with pytest.raises(type(error)):
            faulty.lock_many(["c", "boom", "a"])
        assert faulty.held() == []
        assert plain.peek("a") is None
        assert plain.peek("c") is None
    finally:
        faulty.close(release=True)
