"""Stateful models of the lock: Hypothesis drives several clients against each store.

Two machines:

* :class:`ProviderModel` works at the provider level with explicit tokens, on every store
  (memory with a fake clock; SQLite, PostgreSQL, MariaDB and Redis on real servers). Each
  client keeps its *beliefs* (token, fence, local deadline = sent + granted - margin), as
  the service does, so beliefs are exact even on wall time: normal leases last 30 s, far
  beyond one example, and expiry is made real by shortening one lease to 50 ms and
  sleeping past it (sparingly).
* :class:`ServiceModel` drives :class:`LockService` clients (heartbeat run by hand) on one
  memory store, everything on one fake clock; a client believes it holds a key while
  ``lease.check()`` passes.

Invariants after every step: at most one client believes it holds each key (leases the
store forgot are excluded: exclusion cannot outlive the store's data, but such a lease must
never come back); the store agrees with the model (``peek`` and ``scan`` show the model's
holder); fences grow with every acquisition of a key. Each example uses its own key prefix;
SQL tables and Redis keys are removed afterwards. Fences must keep growing even after the
store forgot a key: SQL counters outlive the row, Redis fences come from its clock.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_exclusive import Lease, LockLost, LockService, ReleaseOutcome
from celery_exclusive.lease import safety_margin
from celery_exclusive.providers.base import Grant, Held, LockProvider, RefreshRequest, encode_holder
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import (
    MYSQL_URL,
    POSTGRES_URL,
    REDIS_URL,
    IdleThread,
    delete_redis_keys,
    drop_lock_table,
    require_server,
)

N_CLIENTS = 3
KEYS = ("a", "b/'; DROP TABLE x; --")
#: Expiry used to make a lease lapse on purpose (seconds), and how long to wait past it.
SHORT = 0.05
LAPSE = 3 * SHORT
#: A real server's example may lapse at most this many leases (each one sleeps LAPSE).
MAX_LAPSES = 2

clients = st.integers(0, N_CLIENTS - 1)
keys = st.sampled_from(KEYS)
_examples = itertools.count()


# -- stores -------------------------------------------------------------------------------------


@dataclass
class Harness:
    """One store under test: a provider per example and a way to make the store forget a key."""

    name: str
    run: str
    provider: Callable[[Callable[[], float]], LockProvider]
    forget: Callable[[LockProvider, str], None]
    fake_clock: bool
    ttls: tuple[float, ...] = (30.0,)
    life: float = 60.0
    examples: int = 40
    steps: int = 25


def _forget_memory(provider: LockProvider, key: str) -> None:
    assert isinstance(provider, MemoryLockProvider)
    with provider._mutex:  # the lease vanishes; the fence counter stays (as on SQL stores)
        provider._rows.pop(key, None)


def _memory_harness(run: str) -> Iterator[Harness]:
    yield Harness(
        "memory",
        run,
        provider=lambda clock: MemoryLockProvider(clock=clock),
        forget=_forget_memory,
        fake_clock=True,
        ttls=(4.0, 9.0),
        life=12.0,  # reached within an example, so refreshes get clamped at the hard deadline
        examples=200,
        steps=30,
    )


def _sql_harness(name: str, url: str, run: str) -> Iterator[Harness]:
    table = f"ce_model_{run}"
    shared = SqlLockProvider(url, table=table)
    engine = sa.create_engine(url)

    def forget(provider: LockProvider, key: str) -> None:
        lock_rows = shared.table
        with engine.begin() as conn:
            conn.execute(lock_rows.delete().where(lock_rows.c.key == key))

    try:
        yield Harness(name, run, provider=lambda _clock: shared, forget=forget, fake_clock=False)
    finally:
        shared.close()
        engine.dispose()
        drop_lock_table(url, table)


def _redis_harness(run: str) -> Iterator[Harness]:
    import redis

    from celery_exclusive.providers.redis import RedisLockProvider

    shared = RedisLockProvider(REDIS_URL)
    other = redis.Redis.from_url(REDIS_URL)
    try:
        yield Harness(
            "redis",
            run,
            provider=lambda _clock: shared,
            forget=lambda _provider, key: other.delete(key),  # a separate client, as an operator would
            fake_clock=False,
        )
    finally:
        shared.close()
        other.close()
        delete_redis_keys(f"m{run}:")


@pytest.fixture(params=["memory", "sqlite", "postgres", "mariadb", "redis"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Each store in turn, isolated by a unique table or key prefix and cleaned up afterwards."""
    run = uuid.uuid4().hex[:10]
    name: str = request.param
    if name == "memory":
        yield from _memory_harness(run)
    elif name == "sqlite":
        yield from _sql_harness(name, f"sqlite:///{tmp_path / 'model.sqlite3'}", run)
    elif name == "postgres":
        require_server(POSTGRES_URL)
        yield from _sql_harness(name, POSTGRES_URL, run)
    elif name == "mariadb":
        require_server(MYSQL_URL)
        yield from _sql_harness(name, MYSQL_URL, run)
    else:
        require_server(REDIS_URL)
        yield from _redis_harness(run)


# -- the provider-level model -------------------------------------------------------------------


@dataclass
class Belief:
    """What one client thinks it holds: valid until ``deadline`` on the client's clock."""

    token: str
    fence: int
    deadline: float
    forgotten: bool = False  # the store lost this lease; the client has not found out yet


@dataclass
class Holder:
    """The model's view of a key's live lease (expiry times on the store's clock)."""

    token: str
    fence: int
    client: int
    expires_at: float
    deadline: float


@dataclass
class _Config:
    harness: Harness | None = None


_config = _Config()


class ProviderModel(RuleBasedStateMachine):
    """Clients acquire, refresh, release, die and lose leases; the model predicts every answer."""

    def __init__(self) -> None:
        super().__init__()
        harness = _config.harness
        assert harness is not None
        self.h = harness
        self.now = 0.0  # the fake clock (memory); real stores use their own and time.monotonic
        self.provider = harness.provider(lambda: self.now)
        self.prefix = f"m{harness.run}:{next(_examples)}:"
        self.beliefs: list[dict[str, Belief]] = [{} for _ in range(N_CLIENTS)]
        # The last token each client acquired each key with, kept across its death.
        self.tokens: list[dict[str, str]] = [{} for _ in range(N_CLIENTS)]
        self.holders: dict[str, Holder] = {}
        self.floor: dict[str, int] = dict.fromkeys(KEYS, 0)
        self.lapses = 0

    # helpers

    def sk(self, key: str) -> str:
        return self.prefix + key

    def client_now(self) -> float:
        return self.now if self.h.fake_clock else time.monotonic()

    def holder(self, key: str) -> Holder | None:
        """The live holder of ``key`` in the model (expired leases are dropped)."""
        found = self.holders.get(key)
        if found is not None and (found.expires_at <= self.now or found.deadline <= self.now):
            del self.holders[key]
            return None
        return found

    def prune(self, client: int) -> dict[str, Belief]:
        """The client's beliefs, without those whose local deadline passed (it knows they are lost)."""
        now = self.client_now()
        beliefs = self.beliefs[client]
        for key in [k for k, b in beliefs.items() if b.deadline <= now]:
            del beliefs[key]
        return beliefs

    def store_expiry(self, ttl: float) -> tuple[float, float]:
        if not self.h.fake_clock:
            return float("inf"), float("inf")
        # Mirrors MemoryLockProvider exactly, so float boundaries agree.
        return self.now + min(ttl, self.h.life), self.now + self.h.life

    # rules

    @rule(client=clients, key=keys, data=st.data())
    def acquire(self, client: int, key: str, data: st.DataObject) -> None:
        """A client tries to take a key with a fresh token; a lost reply is retried with it."""
        ttl = data.draw(st.sampled_from(self.h.ttls), label="ttl")
        retry = data.draw(st.booleans(), label="retry")
        beliefs = self.prune(client)
        token = f"c{client}-{uuid.uuid4().hex[:12]}"
        expected = self.holder(key)
        sent = self.client_now()
        meta = encode_holder({"client": client})
        answer = self.provider.acquire(self.sk(key), token, ttl, self.h.life, meta)
        if expected is not None:
            assert isinstance(answer, Held), f"{key!r} is held by {expected}, yet {answer} was granted"
            assert answer.holder is not None
            assert (answer.holder.token, answer.holder.fence) == (expected.token, expected.fence)
            assert answer.holder.holder == {"client": expected.client}
            return
        assert isinstance(answer, Grant), f"{key!r} is free in the model, but the store said {answer}"
        assert answer.fence > self.floor[key], f"fence went from {self.floor[key]} to {answer.fence}"
        assert abs(answer.ttl - min(ttl, self.h.life)) < 0.01
        self.floor[key] = answer.fence
        self.tokens[client][key] = token
        expires_at, deadline = self.store_expiry(ttl)
        self.holders[key] = Holder(token, answer.fence, client, expires_at, deadline)
        beliefs[key] = Belief(token, answer.fence, sent + answer.ttl - safety_margin(ttl))
        if retry:  # the same token again: the store hands back the same lease, unchanged
            again = self.provider.acquire(self.sk(key), token, ttl, self.h.life, meta)
            assert isinstance(again, Grant)
            assert again.fence == answer.fence
            assert again.ttl <= answer.ttl + 0.01

    @rule(client=clients, data=st.data())
    def heartbeat(self, client: int, data: st.DataObject) -> None:
        """A client refreshes every lease it believes it holds, in one batched call."""
        ttl = data.draw(st.sampled_from(self.h.ttls), label="ttl")
        beliefs = self.prune(client)
        held = list(beliefs.items())
        sent = self.client_now()
        answers = self.provider.refresh([RefreshRequest(self.sk(k), b.token, ttl) for k, b in held])
        assert len(answers) == len(held)
        for (key, belief), answer in zip(held, answers, strict=True):
            current = self.holder(key)
            if current is None or current.token != belief.token:
                assert answer is None, f"refresh revived or extended a lease it does not own on {key!r}"
                del beliefs[key]  # the client learns it lost the key
                continue
            assert answer is not None, f"the owner's refresh of {key!r} was refused"
            if self.h.fake_clock:
                current.expires_at = min(self.now + ttl, current.deadline)
                assert answer == current.expires_at - self.now
            else:
                assert 0 < answer <= ttl + 0.01
            belief.deadline = sent + answer - safety_margin(ttl)

    @rule(client=clients, key=keys, data=st.data())
    def delayed_refresh(self, client: int, key: str, data: st.DataObject) -> None:
        """A refresh with a client's last token arrives late (maybe after expiry, or its death)."""
        token = self.tokens[client].get(key)
        if token is None:
            return
        ttl = data.draw(st.sampled_from(self.h.ttls), label="ttl")
        current = self.holder(key)
        sent = self.client_now()
        (answer,) = self.provider.refresh([RefreshRequest(self.sk(key), token, ttl)])
        belief = self.prune(client).get(key)
        if current is None or current.token != token:
            assert answer is None, f"a late refresh revived or extended a dead lease on {key!r}"
            if belief is not None and belief.token == token:
                del self.beliefs[client][key]
            return
        assert answer is not None, f"the owner's refresh of {key!r} was refused"
        if self.h.fake_clock:
            current.expires_at = min(self.now + ttl, current.deadline)
        if belief is not None and belief.token == token:  # a client that gave up ignores the answer
            belief.deadline = sent + answer - safety_margin(ttl)

    @rule(client=clients, key=keys)
    def release(self, client: int, key: str) -> None:
        """A client releases a key it believes it holds: True exactly when it still owned it."""
        beliefs = self.prune(client)
        belief = beliefs.pop(key, None)
        if belief is None:
            return
        current = self.holder(key)
        owned = current is not None and current.token == belief.token
        assert self.provider.release(self.sk(key), belief.token) is owned
        if owned:
            del self.holders[key]

    @precondition(lambda self: self.h.fake_clock or self.lapses < MAX_LAPSES)
    @rule(key=keys)
    def lapse(self, key: str) -> None:
        """Time passes for one lease: its holder's last refresh grants 50 ms, then that passes."""
        current = self.holder(key)
        if current is None:
            return
        sent = self.client_now()
        (answer,) = self.provider.refresh([RefreshRequest(self.sk(key), current.token, SHORT)])
        assert answer is not None
        assert 0 < answer <= SHORT + 0.001
        belief = self.beliefs[current.client].get(key)
        if belief is not None and belief.token == current.token:
            belief.deadline = sent + answer - safety_margin(SHORT)
        self.lapses += 1
        if self.h.fake_clock:
            current.expires_at = min(self.now + SHORT, current.deadline)
            self.now += LAPSE
        else:
            time.sleep(LAPSE)
            del self.holders[key]

    @precondition(lambda self: self.h.fake_clock)
    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 10.0]))
    def advance(self, seconds: float) -> None:
        """Time passes for everyone (fake clock only)."""
        self.now += seconds

    @rule(client=clients)
    def kill(self, client: int) -> None:
        """A client dies without releasing: its leases stay in the store until they expire."""
        self.beliefs[client] = {}

    @rule(key=keys)
    def forget(self, key: str) -> None:
        """The store loses the key behind everyone's back (cache cleared, key deleted)."""
        self.h.forget(self.provider, self.sk(key))
        self.holders.pop(key, None)
        for beliefs in self.beliefs:
            if key in beliefs:
                beliefs[key].forgotten = True

    # invariants

    @invariant()
    def at_most_one_believer(self) -> None:
        """At most one client believes it holds each key, and it is the model's holder."""
        now = self.client_now()
        for key in KEYS:
            believers = [
                (client, beliefs[key])
                for client, beliefs in enumerate(self.beliefs)
                if key in beliefs and beliefs[key].deadline > now and not beliefs[key].forgotten
            ]
            assert len(believers) <= 1, f"several clients believe they hold {key!r}: {believers}"
            if believers:
                current = self.holder(key)
                assert current is not None
                assert current.token == believers[0][1].token

    @invariant()
    def store_agrees(self) -> None:
        """peek shows the model's holder of each key (token and fence), scan lists exactly those."""
        for key in KEYS:
            current = self.holder(key)
            info = self.provider.peek(self.sk(key))
            if current is None:
                assert info is None, f"{key!r} is free in the model, but the store shows {info}"
            else:
                assert info is not None, f"the store lost {key!r}, held by {current}"
                assert (info.token, info.fence) == (current.token, current.fence)
                assert info.fence <= self.floor[key]
        listed = [info.key for info in self.provider.scan(self.prefix)]
        assert listed == sorted(self.sk(k) for k in KEYS if self.holder(k) is not None)


# -- the service-level model (memory store, fake clock) ------------------------------------------


@dataclass
class Tracked:
    """A lease some client took, and what the model knows about it."""

    lease: Lease
    client: int
    generation: int
    forgotten: bool = False


@dataclass
class _Fleet:
    services: list[LockService] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)


class ServiceModel(RuleBasedStateMachine):
    """LockService clients on one memory store and one fake clock; beliefs are ``lease.check()``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.provider = MemoryLockProvider(clock=self.clock)
        self.prefix = f"s{next(_examples)}:"
        self.fleet = _Fleet()
        for _ in range(N_CLIENTS):
            self.fleet.services.append(self.new_service())
            self.fleet.generations.append(0)
        self.leases: list[Tracked] = []
        self.released: set[str] = set()
        self.floor: dict[str, int] = dict.fromkeys(KEYS, 0)

    def clock(self) -> float:
        return self.now

    def new_service(self) -> LockService:
        return LockService(self.provider, prefix=self.prefix, clock=self.clock, thread_factory=IdleThread)

    def alive(self, tracked: Tracked) -> bool:
        return self.fleet.generations[tracked.client] == tracked.generation

    @staticmethod
    def believes(lease: Lease) -> bool:
        try:
            lease.check()
        except LockLost:
            return False
        return True

    @rule(client=clients, key=keys, ttl=st.sampled_from([3.0, 6.0]), life=st.sampled_from([None, 8.0]))
    def lock(self, client: int, key: str, ttl: float, life: float | None) -> None:
        """A client tries a key: it gets a lease exactly when the store showed the key free."""
        before = self.provider.peek(self.prefix + key)
        lease = self.fleet.services[client].try_lock(key, ttl=ttl, max_lifetime=life)
        assert (lease is None) == (before is not None)
        if lease is not None:
            assert lease.fence > self.floor[key]
            self.floor[key] = lease.fence
            self.leases.append(Tracked(lease, client, self.fleet.generations[client]))

    @rule(
        client=clients,
        order=st.permutations(KEYS),
        wait=st.sampled_from([None, 0.0]),
        ttl=st.sampled_from([3.0, 6.0]),
    )
    def lock_many(self, client: int, order: list[str], wait: float | None, ttl: float) -> None:
        """A client tries every key at once: all when the store showed them all free, else
        none, and the store then shows exactly what it showed before (rolled back)."""
        before = {key: self.provider.peek(self.prefix + key) for key in KEYS}
        taken = self.fleet.services[client].try_lock_many(order, ttl=ttl, wait=wait)
        after = {key: self.provider.peek(self.prefix + key) for key in KEYS}
        assert (taken is None) == any(info is not None for info in before.values())
        if taken is None:
            assert {k: None if i is None else i.token for k, i in after.items()} == {
                k: None if i is None else i.token for k, i in before.items()
            }
            return
        assert taken.keys == sorted(KEYS)
        for lease in taken:
            assert lease.fence > self.floor[lease.key]
            self.floor[lease.key] = lease.fence
            self.leases.append(Tracked(lease, client, self.fleet.generations[client]))

    @rule(client=clients, key=keys)
    def try_lock_wait_zero(self, client: int, key: str) -> None:
        """``wait=0`` answers exactly as a call without wait."""
        before = self.provider.peek(self.prefix + key)
        lease = self.fleet.services[client].try_lock(key, wait=0)
        assert (lease is None) == (before is not None)
        if lease is not None:
            assert lease.fence > self.floor[key]
            self.floor[key] = lease.fence
            self.leases.append(Tracked(lease, client, self.fleet.generations[client]))

    @rule(client=clients)
    def heartbeat(self, client: int) -> None:
        """One heartbeat pass of a client: refresh what is due, mark lost what is gone."""
        self.fleet.services[client].heartbeat.beat()

    @rule(client=clients, key=keys)
    def release(self, client: int, key: str) -> None:
        """A client releases its latest lease on a key: RELEASED exactly when the store had it."""
        mine = [
            t
            for t in self.leases
            if t.client == client and self.alive(t) and t.lease.key == key and not t.lease.lost.is_set()
        ]
        if not mine:
            return
        lease = mine[-1].lease
        before = self.provider.peek(self.prefix + key)
        outcome = lease.release()
        owned = before is not None and before.token == lease.token
        assert outcome is (ReleaseOutcome.RELEASED if owned else ReleaseOutcome.NOT_OWNED)
        if owned:
            self.released.add(lease.token)

    @rule(seconds=st.sampled_from([0.25, 1.0, 2.5, 7.0]))
    def advance(self, seconds: float) -> None:
        """Time passes for everyone."""
        self.now += seconds

    @rule(client=clients)
    def kill(self, client: int) -> None:
        """A client process dies: its leases are neither refreshed nor released; a new one starts."""
        self.fleet.services[client].close(release=False)
        self.fleet.services[client] = self.new_service()
        self.fleet.generations[client] += 1

    @rule(key=keys)
    def forget(self, key: str) -> None:
        """The store loses a key behind everyone's back."""
        _forget_memory(self.provider, self.prefix + key)
        for tracked in self.leases:
            if tracked.lease.key == key:
                tracked.forgotten = True

    @invariant()
    def at_most_one_believer(self) -> None:
        """At most one live client's lease on each key passes ``check()``, and the store shows it."""
        for key in KEYS:
            believers = [
                t
                for t in self.leases
                if t.lease.key == key and self.alive(t) and not t.forgotten and self.believes(t.lease)
            ]
            assert len(believers) <= 1, f"several clients believe they hold {key!r}: {believers}"
            info = self.provider.peek(self.prefix + key)
            if believers:
                assert info is not None
                assert info.token == believers[0].lease.token
                assert info.fence == believers[0].lease.fence

    @invariant()
    def nothing_comes_back(self) -> None:
        """A released or forgotten lease never shows up in the store again."""
        for key in KEYS:
            info = self.provider.peek(self.prefix + key)
            if info is None:
                continue
            assert info.token not in self.released
            gone = {t.lease.token for t in self.leases if t.forgotten and t.lease.key == key}
            assert info.token not in gone

    def teardown(self) -> None:
        for service in self.fleet.services:
            service.close(release=False)


# -- the tests ---------------------------------------------------------------------------------


def test_provider_model(harness: Harness) -> None:
    """Random clients against one store never disagree with the model or with each other."""
    _config.harness = harness
    try:
        run_state_machine_as_test(
            ProviderModel,
            settings=settings(
                max_examples=harness.examples,
                stateful_step_count=harness.steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        _config.harness = None


def test_service_model() -> None:
    """LockService clients on a fake clock never both believe they hold a key."""
    run_state_machine_as_test(
        ServiceModel,
        settings=settings(
            max_examples=200,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
