"""The lock contract: the behaviour every lock store must have, as a pytest suite.

Each test is one sentence of behaviour. Times are short real leases (about a second);
expiry is always judged by the store's clock. celery-exclusive runs its own five stores
(memory, SQLite, PostgreSQL, MariaDB, Redis) through exactly these tests; a third-party
store runs them with one subclass and one fixture::

    from celery_exclusive.testing.contract import LockContract, open_store

    class TestMyStore(LockContract):
        @pytest.fixture
        def store(self):
            with open_store("mine", provider_factory=my_provider) as store:
                yield store

A store declares what it cannot do with :class:`ContractStore`'s capability fields
(``cross_process``, ``outage``, ``fencing``, ``guard``); the tests needing one then skip
with the reason, as tooz's driver characteristics do. The durations of the tests that a
loaded machine can stretch scale with ``ContractStore.slack`` (default: the
``CE_TIME_SLACK`` environment variable, else :data:`DEFAULT_SLACK`). See docs/testing.md.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest

from celery_exclusive import (
    BackendError,
    ExclusiveResult,
    InvalidArgumentError,
    Lease,
    LeaseState,
    LockedError,
    LockLost,
    LockProvider,
    LockService,
    ReleaseOutcome,
)
from celery_exclusive.providers.base import (
    AcquiresUnless,
    Completion,
    CompletionStore,
    Grant,
    Held,
    RefreshRequest,
    accepts_timeout,
)
from celery_exclusive.testing import _workers

#: Put this string in the credentials of ``ContractStore.outage``'s unreachable store: the
#: outage test checks that it never appears in an error or a repr.
OUTAGE_SECRET = "pw-SECRET"  # noqa: S105 - a marker to look for, not a credential
#: The environment variable :func:`time_slack` reads.
SLACK_ENV = "CE_TIME_SLACK"
#: The slack factor when :data:`SLACK_ENV` is unset: what a shared 2-core CI machine running
#: two test processes at once needs (1 is enough on a quiet machine).
DEFAULT_SLACK = 2.0


def _spawn_context() -> BaseContext:
    """``multiprocessing``'s ``spawn`` context: :class:`ContractStore`'s default ``mp_context``."""
    return multiprocessing.get_context("spawn")


def time_slack() -> float:
    """The timing slack factor: ``CE_TIME_SLACK`` (a finite number > 0) if set, else
    :data:`DEFAULT_SLACK`. Tests multiply the durations a loaded machine can stretch by it
    (a lease's ttl, the window watched); what they prove, in ttls, stays the same."""
    raw = os.environ.get(SLACK_ENV, "").strip()
    if not raw:
        return DEFAULT_SLACK
    try:
        slack = float(raw)
    except ValueError:
        slack = math.nan
    if not (math.isfinite(slack) and slack > 0):
        raise InvalidArgumentError(f"{SLACK_ENV} must be a finite number > 0, got {raw!r}")
    return slack


@dataclass
class ContractStore:
    """One lock store under test, and what it can do.

    ``make(**kwargs)`` returns a new :class:`LockService` on the store, with a key prefix
    unique to the test (``kwargs`` are LockService's and pass through). Other processes
    reach the same store through ``url`` (a URL :class:`LockService` accepts) or
    ``provider_factory`` (a module-level, so picklable, callable returning a provider).

    Capabilities; the tests needing one skip, saying why, where it is absent:

    * ``cross_process``: separate processes exclude each other (False for an in-process store);
    * ``outage``: makes a LockService on this kind of store that cannot be reached, its
      credentials containing :data:`OUTAGE_SECRET` (None: the store cannot be unreachable);
    * ``fencing``: every acquisition of a key gets a greater fence number than the last;
    * ``guard``: opens a transaction on the store's database (a context manager yielding the
      connection) in which ``lease.guard(conn)`` fences writes; None if the store cannot share
      a transaction with the caller's data, and ``lease.guard`` must then refuse clearly.

    ``slack`` multiplies the durations of the timing-sensitive tests (:func:`time_slack`).
    ``mp_context`` is the ``multiprocessing`` context the cross-process tests start their
    processes from: ``spawn`` by default (fresh interpreters, each with the environment as it
    is then); a ``forkserver`` context with the drivers preloaded starts them faster, its
    children seeing the environment of when the forkserver started.
    ``cycles`` is how many acquire/release cycles
    ``test_acquire_release_cycles_leave_nothing_behind`` runs (default 1,000; each is two
    durable commits on a SQL store).
    """

    name: str
    make: Callable[..., LockService]
    url: str | None = None
    provider_factory: Callable[[], LockProvider] | None = None
    cross_process: bool = True
    outage: Callable[[], LockService] | None = None
    fencing: bool = True
    guard: Callable[[], AbstractContextManager[Any]] | None = None
    slack: float = field(default_factory=time_slack)
    mp_context: BaseContext = field(default_factory=_spawn_context)
    cycles: int = 1000

    def service(self, **kwargs: Any) -> LockService:
        """A LockService on this store with this test's unique prefix."""
        return self.make(**kwargs)

    def target(self) -> str | Callable[[], LockProvider]:
        """What another process builds its LockService on: ``url``, else ``provider_factory``."""
        if self.url is not None:
            return self.url
        if self.provider_factory is not None:
            return self.provider_factory
        pytest.skip(f"store {self.name!r} gives neither url nor provider_factory for other processes")


@contextlib.contextmanager
def open_store(
    name: str,
    *,
    url: str | None = None,
    provider_factory: Callable[[], LockProvider] | None = None,
    shared_provider: bool = False,
    **capabilities: Any,
) -> Iterator[ContractStore]:
    """A :class:`ContractStore` on ``url`` or ``provider_factory`` with a unique key prefix.

    Every service it made is closed (its leases released) on exit. With ``shared_provider``
    all services of a test share one provider: an in-process store, whose separate
    providers would not contend. ``capabilities`` are ContractStore's fields.
    """
    if (url is None) == (provider_factory is None):
        raise InvalidArgumentError("give exactly one of url and provider_factory")
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    services: list[LockService] = []
    shared: list[LockProvider] = []

    def make(**kwargs: Any) -> LockService:
        kwargs.setdefault("prefix", prefix)
        if shared_provider and shared:
            service = LockService(shared[0], **kwargs)
        else:
            service = LockService(url if provider_factory is None else provider_factory(), **kwargs)
            shared.append(service.provider)
        services.append(service)
        return service

    try:
        yield ContractStore(name=name, make=make, url=url, provider_factory=provider_factory, **capabilities)
    finally:
        for service in services:
            service.close(release=True)


#: The name the tests' annotations use.
Store = ContractStore


def require_fencing(store: ContractStore) -> None:
    """Skip unless the store hands out increasing fences."""
    if not store.fencing:
        pytest.skip(f"store {store.name!r} gives no fencing numbers")


def wait_until(predicate: object, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return bool(predicate())  # type: ignore[operator]


def test_acquire_then_contend_then_release(store: Store) -> None:
    """A held key is refused to a second caller, who learns the holder, until it is released."""
    first, second = store.service(), store.service()
    lease = first.lock("job", holder={"task_name": "demo.job"})
    state = lease.state  # a local, so mypy does not take the property as fixed
    assert state is LeaseState.HELD
    with pytest.raises(LockedError) as refused:
        second.lock("job")
    assert refused.value.key == "job"
    assert refused.value.holder is not None
    assert refused.value.holder.token == lease.token
    assert refused.value.holder.fence == lease.fence
    assert refused.value.holder.holder["task_name"] == "demo.job"
    assert lease.release() is ReleaseOutcome.RELEASED
    assert lease.state is LeaseState.RELEASED
    again = second.lock("job")
    assert again.fence > lease.fence or not store.fencing
    again.release()


def test_not_reentrant(store: Store) -> None:
    """A second acquisition of a held key in the same process reports not acquired."""
    service = store.service()
    with service.lock("k"):
        assert service.try_lock("k") is None
        result = service.run_exclusive("k", lambda: 1)
        assert result == ExclusiveResult(acquired=False, holder=result.holder)
        assert result.holder is not None


def test_thread_contention_exactly_one_wins(store: Store) -> None:
    """Of sixteen threads racing for one key, exactly one acquires it."""
    service = store.service()
    barrier = threading.Barrier(16)
    won: list[object] = []
    errors: list[BaseException] = []

    def race() -> None:
        try:
            barrier.wait()
            lease = service.try_lock("race", ttl=30)
            if lease is not None:
                won.append(lease)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(won) == 1


def test_process_contention_exactly_one_wins(store: Store) -> None:
    """Of six processes racing for one key, exactly one acquires it."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    ctx: Any = store.mp_context  # typeshed's BaseContext lacks Process; every context has it
    racers = 6
    start, done, results = ctx.Barrier(racers), ctx.Barrier(racers), ctx.Queue()
    prefix = store.service().prefix
    procs = [
        ctx.Process(target=_workers.race_once, args=(store.target(), prefix, "race", (start, done), results))
        for _ in range(racers)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=60) for _ in range(racers)]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert sorted(outcomes) == [False] * (racers - 1) + [True]


def test_processes_lose_no_update_under_the_lock(store: Store, tmp_path: Path) -> None:
    """Four processes doing an unprotected read-modify-write under the lock lose no update."""
    if not store.cross_process:
        pytest.skip(f"store {store.name!r} is not run across processes (cross_process=False)")
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx: Any = store.mp_context
    prefix = store.service().prefix
    procs = [
        ctx.Process(
            target=_workers.increment_under_lock, args=(store.target(), prefix, "counter", str(counter), 25)
        )
        for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    assert counter.read_text() == "100"


def test_independent_keys_do_not_interfere(store: Store) -> None:
    """Holding one key neither blocks nor releases another."""
    service = store.service()
    a = service.lock("a")
    b = service.lock("b")
    assert a.release() is ReleaseOutcome.RELEASED
    assert service.peek("b") is not None
    assert service.peek("a") is None
    b.release()


def test_expiry_reclaims_a_dead_holders_lock_after_the_ttl_and_not_before(store: Store) -> None:
    """A holder that stops refreshing keeps the key for its ttl, then anyone may take it."""
    service = store.service()
    dead = service.provider.acquire(service.prefix + "dead", "dead-token", 1.0, 60.0, "{}")
    assert isinstance(dead, Grant)
    time.sleep(0.4)
    assert service.try_lock("dead") is None
    assert wait_until(lambda: service.peek("dead") is None, timeout=3.0)
    lease = service.lock("dead")
    assert lease.fence > dead.fence or not store.fencing
    lease.release()


def test_wrong_token_refresh_and_release_change_nothing(store: Store) -> None:
    """Refresh and release by a token that does not own the key report so and change nothing."""
    service = store.service()
    lease = service.lock("owned", ttl=5)
    provider, store_key = service.provider, service.prefix + "owned"
    assert provider.refresh([RefreshRequest(store_key, "not-the-owner", 60.0)]) == [None]
    assert provider.release(store_key, "not-the-owner") is False
    info = service.peek("owned")
    assert info is not None
    assert info.token == lease.token
    assert info.expires_in <= 5.0
    assert lease.release() is ReleaseOutcome.RELEASED


def test_double_release_is_harmless(store: Store) -> None:
    """Releasing twice releases once; the second reports not owned and frees nothing else."""
    service = store.service()
    lease = service.lock("twice")
    assert lease.release() is ReleaseOutcome.RELEASED
    successor = service.lock("twice")
    assert lease.release() is ReleaseOutcome.NOT_OWNED
    assert service.provider.release(service.prefix + "twice", lease.token) is False
    info = service.peek("twice")
    assert info is not None
    assert info.token == successor.token
    successor.release()


def test_refresh_after_expiry_fails_even_when_nobody_else_holds_it(store: Store) -> None:
    """An expired lease is not revived by a late refresh, even with the key free."""
    service = store.service()
    store_key = service.prefix + "late"
    grant = service.provider.acquire(store_key, "late-token", 0.3, 60.0, "{}")
    assert isinstance(grant, Grant)
    time.sleep(0.6)
    assert service.provider.refresh([RefreshRequest(store_key, "late-token", 30.0)]) == [None]
    assert service.peek("late") is None


def test_acquire_is_idempotent_for_its_own_token(store: Store) -> None:
    """A retried acquire with the same token (a lost reply) gets the same lease back."""
    service = store.service()
    store_key = service.prefix + "retry"
    first = service.provider.acquire(store_key, "tok", 10.0, 60.0, "{}")
    second = service.provider.acquire(store_key, "tok", 10.0, 60.0, "{}")
    assert isinstance(first, Grant)
    assert isinstance(second, Grant)
    assert second.fence == first.fence
    other = service.provider.acquire(store_key, "other", 10.0, 60.0, "{}")
    assert isinstance(other, Held)
    assert service.provider.release(store_key, "tok") is True


def test_fences_increase_across_release_and_expiry(store: Store) -> None:
    """Every acquisition of a key gets a larger fence: after release and after expiry takeover."""
    require_fencing(store)
    service = store.service()
    store_key = service.prefix + "fence"
    fences = []
    for _ in range(3):
        lease = service.lock("fence")
        fences.append(lease.fence)
        lease.release()
    expiring = service.provider.acquire(store_key, "gone", 0.3, 60.0, "{}")
    assert isinstance(expiring, Grant)
    fences.append(expiring.fence)
    time.sleep(0.6)
    lease = service.lock("fence")
    fences.append(lease.fence)
    lease.release()
    assert fences == sorted(set(fences))


def test_stale_lease_past_its_max_lifetime_is_reclaimed(store: Store) -> None:
    """A lease is never kept past its max lifetime, whatever ttl was asked for."""
    service = store.service()
    grant = service.provider.acquire(service.prefix + "stale", "stale", 30.0, 0.5, "{}")
    assert isinstance(grant, Grant)
    assert grant.ttl <= 0.5
    refreshed = service.provider.refresh([RefreshRequest(service.prefix + "stale", "stale", 30.0)])[0]
    assert refreshed is None or refreshed <= 0.5
    assert wait_until(lambda: service.try_lock("stale") is not None, timeout=3.0)


def test_a_shorter_max_lifetime_does_not_steal_a_live_lease(store: Store) -> None:
    """A caller asking for a short max lifetime cannot take a live lease older than that."""
    holder, competitor = store.service(), store.service()
    lease = holder.lock("patient", ttl=5.0)
    time.sleep(1.2)
    assert competitor.try_lock("patient", ttl=0.5, max_lifetime=1.0) is None
    assert lease.release() is ReleaseOutcome.RELEASED


def test_heartbeat_keeps_a_lock_far_past_its_ttl(store: Store) -> None:
    """With ttl ``slack`` s (2 s by default), the heartbeat holds the key for 3.25 ttls while a
    competitor keeps failing.

    (Each durable refresh has about a third of the ttl: a disk shared with a busy neighbour
    stalls a commit for a few hundred ms now and then, and a 1 s lease is then rightly LOST.)"""
    ttl = 1.0 * store.slack
    holder, competitor = store.service(), store.service()
    lease = holder.lock("long", ttl=ttl)
    started = time.monotonic()
    deadline = started + 3.25 * ttl
    attempts: list[float] = []
    while time.monotonic() < deadline:
        assert competitor.try_lock("long", ttl=ttl) is None
        attempts.append(time.monotonic() - started)
        time.sleep(0.1)
    # Refused in every half ttl of the window (however slow each try is on a loaded store),
    # the last time more than 3 ttls after the grant.
    assert {int(2 * at / ttl) for at in attempts} >= set(range(6)), attempts
    assert attempts[-1] > 3.0 * ttl, attempts
    assert lease.state is LeaseState.HELD
    lease.check()
    assert lease.release() is ReleaseOutcome.RELEASED


def test_heartbeat_stops_at_max_lifetime_and_the_lock_then_expires(store: Store) -> None:
    """A lease refreshed by the heartbeat still ends at its max lifetime, and is then LOST."""
    holder, competitor = store.service(), store.service()
    started = time.monotonic()
    lease = holder.lock("capped", ttl=0.6, max_lifetime=1.5)
    assert wait_until(lambda: competitor.try_lock("capped") is not None, timeout=4.0)
    elapsed = time.monotonic() - started
    assert 1.2 <= elapsed <= 3.5
    assert lease.state is LeaseState.LOST
    assert lease.lost.is_set()
    with pytest.raises(LockLost):
        lease.check()
    assert lease.release() is ReleaseOutcome.NOT_OWNED


def test_on_lost_given_to_lock_is_called_once_at_the_loss(store: Store) -> None:
    """``lock(on_lost=)`` and ``try_lock(on_lost=)`` (one key; a semaphore's slot; with
    ``wait``): the callback is called once, with the lease and a reason, when the heartbeat
    finds the lease gone (released by its token from another service)."""
    holder, other = store.service(), store.service()
    called: list[tuple[Lease, str]] = []

    def lost(lease: Lease, reason: str) -> None:
        called.append((lease, reason))

    options: dict[str, Any] = {"ttl": 0.9 * store.slack, "on_lost": lost}
    tried = holder.try_lock("lost-b", **options)
    assert tried is not None
    leases = [
        holder.lock("lost-a", **options),
        tried,
        holder.lock("lost-c", wait=0, **options),
        holder.lock("lost-d", limit=2, **options),
    ]
    for lease in leases:
        assert lease.state is LeaseState.HELD
        assert other.force_release(lease.store_key[len(holder.prefix) :], lease.token)
    assert wait_until(lambda: len(called) == len(leases), timeout=3.0 * store.slack)
    assert sorted(id(lease) for lease, _ in called) == sorted(map(id, leases))
    assert all(isinstance(reason, str) and reason for _, reason in called)
    assert all(lease.state is LeaseState.LOST for lease in leases)
    time.sleep(0.1)
    assert len(called) == len(leases)  # once each


def test_release_runs_when_the_work_raises(store: Store) -> None:
    """run_exclusive releases the key in finally when the function raises."""
    service = store.service()

    def boom() -> None:
        raise RuntimeError("work failed")

    with pytest.raises(RuntimeError, match="work failed"):
        service.run_exclusive("raises", boom)
    assert service.peek("raises") is None
    assert service.held() == []


def test_run_exclusive_reports_acquired_result_and_on_locked(store: Store) -> None:
    """run_exclusive returns the function's result, or calls on_locked without running it."""
    service = store.service()
    assert service.run_exclusive("r", lambda: 42).result == 42
    called: list[bool] = []
    with service.lock("r"):
        outcome = service.run_exclusive(
            "r", lambda: called.append(True), on_locked=lambda: called.append(False)
        )
    assert outcome.acquired is False
    assert outcome.result is None
    assert called == [False]


def test_outage_is_an_error_not_contention(store: Store) -> None:
    """A store that cannot be reached raises BackendError instead of reporting "not acquired"."""
    if store.outage is None:
        pytest.skip(f"store {store.name!r} cannot be unreachable")
    service = store.outage()
    try:
        for call in (lambda: service.try_lock("k"), lambda: service.run_exclusive("k", lambda: 1)):
            with pytest.raises(BackendError) as raised:
                call()
            assert OUTAGE_SECRET not in str(raised.value)
        assert OUTAGE_SECRET not in repr(service)
    finally:
        service.close()


def test_every_call_takes_a_deadline_and_answers_the_same(store: Store) -> None:
    """Each provider method the service calls per operation takes ``timeout=`` and, well
    within it, answers exactly as documented (a provider whose methods lack the keyword
    still works, in a worker thread of the service: this test then skips, naming them)."""
    service = store.service()
    provider = service.provider
    records = provider if isinstance(provider, CompletionStore) else None
    methods: list[Callable[..., object]] = [
        provider.acquire,
        provider.refresh,
        provider.release,
        provider.peek,
        provider.scan,
    ]
    if records is not None:
        methods += [records.completion, records.completions, records.forget]
    lacking = [getattr(m, "__name__", repr(m)) for m in methods if not accepts_timeout(m)]
    if lacking:
        pytest.skip(f"store {store.name!r}: {', '.join(lacking)} take no timeout= (run in a worker thread)")
    key, t = service.prefix + "deadline", 30.0
    grant = provider.acquire(key, "tok", 20.0, 60.0, "{}", timeout=t)
    assert isinstance(grant, Grant)
    info = provider.peek(key, timeout=t)
    assert info is not None
    assert (info.token, info.fence) == ("tok", grant.fence)
    assert [i.key for i in provider.scan(key, timeout=t)] == [key]
    left = provider.refresh([RefreshRequest(key, "tok", 20.0)], timeout=t)[0]
    assert left is not None
    assert 0 < left <= 20.0
    if records is None:
        assert provider.release(key, "tok", timeout=t) is True
    else:
        assert records.release(key, "tok", Completion("task-1", "success", 0, 60.0), timeout=t) is True
        record = records.completion(key, "task-1", timeout=t)
        assert record is not None
        assert (record.task_id, record.outcome) == ("task-1", "success")
        assert [(r.key, r.task_id) for r in records.completions(key, timeout=t)] == [(key, "task-1")]
        assert records.forget(key, "task-1", timeout=t) is True
        assert records.completion(key, "task-1", timeout=t) is None
    assert provider.peek(key, timeout=t) is None


def test_a_record_never_goes_back_to_an_earlier_attempt(store: Store) -> None:
    """A store that keeps completion records never replaces a live record by one of an
    earlier attempt (a late writer: the record of a run killed at its hard time limit,
    written after the retry it had sent finished), while the release carrying it frees its
    lease all the same; a record of the same attempt or a later one replaces it, and so
    does any record once the stored one has expired."""
    service = store.service()
    if not isinstance(service.provider, CompletionStore):
        pytest.skip(f"store {store.name!r} keeps no completion records")

    def record() -> tuple[str, int] | None:
        found = service.completion("order", "t")
        return None if found is None else (found.outcome, found.attempt)

    service.lock("order", task_id="t").release(Completion("t", "success", 2, 60.0))
    # The worker's main process recording a run it killed: a token that owns nothing.
    assert not service.force_release("order", "record-only", completion=Completion("t", "failure", 1, 60.0))
    assert record() == ("success", 2)
    lease = service.lock("order", task_id="other")
    assert lease.release(Completion("t", "retried", 0, 60.0)) is ReleaseOutcome.RELEASED
    assert service.peek("order") is None
    assert record() == ("success", 2)
    service.force_release("order", "record-only", completion=Completion("t", "failure", 2, 60.0))
    assert record() == ("failure", 2)
    service.force_release("order", "record-only", completion=Completion("t", "retried", 3, 0.2))
    assert record() == ("retried", 3)
    time.sleep(0.5)  # the store's clock: attempt 3's record has expired, so it is none
    service.force_release("order", "record-only", completion=Completion("t", "failure", 1, 60.0))
    assert record() == ("failure", 1)


def test_acquire_unless_where_the_store_offers_it(store: Store) -> None:
    """A store with the optional ``AcquiresUnless`` (dedupe's ``until_done`` marker) takes the
    key only while the blocker is free: refused, it takes nothing and names the lease that
    refused it (the blocker's first, then the key's, holder metadata included); its own live
    grant, asked again, is answered unchanged."""
    service = store.service()
    provider = service.provider
    if not isinstance(provider, AcquiresUnless):
        pytest.skip(f"store {store.name!r} has no acquire_unless (markers are taken in steps)")
    key, blocker = service.prefix + "unless#queued", service.prefix + "unless"
    assert isinstance(provider.acquire(blocker, "run", 30.0, 60.0, '{"task_id": "r"}'), Grant)
    refused = provider.acquire_unless(key, "m1", 30.0, "{}", blocker=blocker)
    assert isinstance(refused, Held)
    assert refused.holder is not None
    assert (refused.holder.key, refused.holder.token, refused.holder.holder) == (
        blocker,
        "run",
        {"task_id": "r"},
    )
    assert provider.peek(key) is None
    assert provider.release(blocker, "run")
    grant = provider.acquire_unless(key, "m1", 30.0, '{"task_id": "a"}', blocker=blocker)
    assert isinstance(grant, Grant)
    again = provider.acquire_unless(key, "m1", 30.0, '{"task_id": "a"}', blocker=blocker)
    assert isinstance(again, Grant)
    assert again.fence == grant.fence
    queued = provider.acquire_unless(key, "m2", 30.0, "{}", blocker=blocker)
    assert isinstance(queued, Held)
    assert queued.holder is not None
    assert (queued.holder.key, queued.holder.token, queued.holder.holder) == (key, "m1", {"task_id": "a"})
    assert isinstance(provider.acquire(blocker, "run2", 30.0, 60.0, "{}"), Grant)
    both = provider.acquire_unless(key, "m3", 30.0, "{}", blocker=blocker)
    assert isinstance(both, Held)
    assert both.holder is not None
    assert (both.holder.key, both.holder.token) == (blocker, "run2")
    assert provider.release(blocker, "run2")
    assert provider.release(key, "m1")


def test_a_skewed_worker_clock_changes_nothing(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """With this process's wall clock an hour off either way, leases expire on the store's time."""
    service = store.service()
    real_time = time.time
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real_time() + skew)
        lease = service.lock("skew", ttl=1.0)
        assert service.try_lock("skew") is None
        lease.release()
        dead = service.provider.acquire(service.prefix + "skew", f"dead{skew}", 0.5, 60.0, "{}")
        assert isinstance(dead, Grant)
        assert service.try_lock("skew") is None
        assert wait_until(lambda: service.peek("skew") is None, timeout=3.0)


def test_acquire_release_cycles_leave_nothing_behind(store: Store) -> None:
    """``store.cycles`` (default 1,000) acquire/release cycles over 7 keys leave no lease in
    the store and no heartbeat running."""
    if store.cycles < 1:
        raise InvalidArgumentError(f"ContractStore.cycles must be >= 1, got {store.cycles!r}")
    service = store.service()
    for i in range(store.cycles):
        with service.lock(f"cycle:{i % 7}", ttl=30):
            pass
    assert service.locks() == []
    assert service.held() == []
    # The idle thread exits within about three of its one-second wakes (heartbeat.IDLE_EXIT).
    assert wait_until(lambda: not service.heartbeat.running, timeout=5.0 * store.slack)


def test_guard_fences_a_transaction_while_the_lease_is_current(store: Store) -> None:
    """lease.guard(conn) passes for the current lease and raises LockLost once it is gone."""
    if store.guard is None:
        pytest.skip(f"store {store.name!r} cannot share a transaction with the caller's data")
    holder, rival = store.service(), store.service()
    lease = holder.lock("guarded", ttl=30)
    with store.guard() as conn:
        lease.guard(conn)
    # The store drops the lease behind its holder's back (its heartbeat has not noticed yet).
    assert holder.provider.release(lease.store_key, lease.token) is True
    assert lease.state is LeaseState.HELD
    with store.guard() as conn, pytest.raises(LockLost):
        lease.guard(conn)
    successor = rival.lock("guarded", ttl=30)
    with store.guard() as conn, pytest.raises(LockLost):
        lease.guard(conn)
    with store.guard() as conn:
        successor.guard(conn)
    successor.release()


def test_guard_is_refused_clearly_where_the_store_cannot_fence(store: Store) -> None:
    """A store without the guard capability rejects lease.guard() with InvalidArgumentError."""
    if store.guard is not None:
        pytest.skip(f"store {store.name!r} supports lease.guard()")
    service = store.service()
    with service.lock("unguarded") as lease, pytest.raises(InvalidArgumentError):
        lease.guard(object())


class LockContract:
    """Every contract test as a method: subclass it as ``Test<YourStore>`` and give the
    subclass (or its conftest) a ``store`` fixture yielding a :class:`ContractStore`."""


for _name, _test in list(globals().items()):
    if _name.startswith("test_") and callable(_test):
        setattr(LockContract, _name, staticmethod(_test))
del _name, _test

__all__ = [
    "DEFAULT_SLACK",
    "OUTAGE_SECRET",
    "SLACK_ENV",
    "ContractStore",
    "LockContract",
    "Store",
    "open_store",
    "time_slack",
    "wait_until",
]
