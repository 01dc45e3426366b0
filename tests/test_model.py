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

* :class:`PrimitivesModel` drives :class:`LockService` clients through the richer primitives
  of issue #13 (``wait=``, semaphores ``limit=1..3``, ``lock_many`` over overlapping key
  sets) on memory (fake clock, leases expire as time is advanced) and on SQLite,
  PostgreSQL, MariaDB and Redis (30 s leases, nothing expires within an example). Its oracle is the
  store as seen just before each call (``peek``), so it needs no model of the heartbeat.

Invariants after every step: at most one client believes it holds each key (leases the
store forgot are excluded: exclusion cannot outlive the store's data, but such a lease must
never come back); the store agrees with the model (``peek`` and ``scan`` show the model's
holder); fences grow with every acquisition of a key. Each example uses its own key prefix;
SQL tables and Redis keys are removed afterwards. Fences must keep growing even after the
store forgot a key: SQL counters outlive the row, Redis fences come from its clock.

Examples are few by default, so CI stays quick; ``CE_LONG=1`` runs ten times as many.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import threading
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
from celery_exclusive.many import LeaseSet
from celery_exclusive.providers.base import Grant, Held, LockProvider, RefreshRequest, encode_holder
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.providers.sql import SqlLockProvider
from celery_exclusive.semaphore import slot_key
from tests.conftest import (
    MYSQL_URL,
    POSTGRES_URL,
    REDIS_URL,
    IdleThread,
    delete_redis_keys,
    drop_lock_table,
    require_server,
)
from tests.faults.servers import PrivateRedis, ServerUnavailable

#: Long mode (``CE_LONG=1``): ten times the examples of every model.
LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
SCALE = 10 if LONG else 1
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


@contextlib.contextmanager
def _own_redis() -> Iterator[str]:
    """The URL of a Redis whose keyspace holds only this test's keys: a private redis-server
    when one can start (else the suite's shared Redis, whose other keys only cost time).

    ``store_agrees`` lists the example's prefix with the provider's ``scan`` after every step;
    SCAN MATCH still walks the whole keyspace, so on the shared server (tens of thousands
    of other sessions' keys) each listing was ~60 SCAN calls and the test took 100-160 s.
    """
    binary = shutil.which("redis-server")
    server = None
    if binary is not None:
        with contextlib.suppress(ServerUnavailable):
            server = PrivateRedis(binary).start()
    try:
        if server is None:
            require_server(REDIS_URL)
        yield REDIS_URL if server is None else server.url
    finally:
        if server is not None:
            server.stop()


def _redis_harness(run: str) -> Iterator[Harness]:
    import redis

    from celery_exclusive.providers.redis import RedisLockProvider

    with _own_redis() as url:
        shared = RedisLockProvider(url)
        other = redis.Redis.from_url(url)
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
            if url == REDIS_URL:
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
                max_examples=harness.examples * SCALE,
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
            max_examples=200 * SCALE,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- the primitives model: wait, limit, lock_many (memory on a fake clock, real stores) ------

#: Plain keys, taken alone or as overlapping sets; the semaphore key, with limit 1..3.
PLAIN = ("p", "q", "r", "s'; --")
SEM = "sem"
MAX_SLOTS = 3
#: A small wait: long enough to be a real wait, short enough for many steps.
SMALL_WAIT = 0.02

key_sets = st.lists(st.sampled_from(PLAIN), min_size=2, max_size=3, unique=True)
waits = st.sampled_from([None, 0.0, SMALL_WAIT])


@dataclass
class PrimitivesStore:
    """One store under the primitives model: a shared provider (fake clock on memory)."""

    name: str
    run: str
    provider: Callable[[Callable[[], float]], LockProvider]
    fake_clock: bool
    ttls: tuple[float, ...] = (30.0,)
    examples: int = 15
    steps: int = 25


@dataclass
class _PrimitivesConfig:
    store: PrimitivesStore | None = None


_primitives = _PrimitivesConfig()


@pytest.fixture(params=["memory", "sqlite", "postgres", "mariadb", "redis"])
def primitives_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PrimitivesStore]:
    """Each store in turn, its keys or table removed afterwards (examples: memory 60, the
    servers 15, a few seconds each; ten times as many with CE_LONG=1)."""
    run = uuid.uuid4().hex[:10]
    name: str = request.param
    if name == "memory":
        yield PrimitivesStore(
            name,
            run,
            provider=lambda clock: MemoryLockProvider(clock=clock),
            fake_clock=True,
            ttls=(3.0, 6.0),
            examples=60 * SCALE,
            steps=35,
        )
        return
    if name == "redis":
        require_server(REDIS_URL)
        from celery_exclusive.providers.redis import RedisLockProvider

        redis_store = RedisLockProvider(REDIS_URL)
        try:
            yield PrimitivesStore(name, run, lambda _clock: redis_store, False, examples=15 * SCALE)
        finally:
            redis_store.close()
            delete_redis_keys(f"x{run}:")
        return
    urls = {"sqlite": f"sqlite:///{tmp_path / 'primitives.sqlite3'}", "postgres": POSTGRES_URL}
    url = urls.get(name, MYSQL_URL)
    if name != "sqlite":
        require_server(url)
    table = f"ce_prim_{run}"
    sql_store = SqlLockProvider(url, table=table)
    try:
        yield PrimitivesStore(name, run, lambda _clock: sql_store, False, examples=15 * SCALE)
    finally:
        sql_store.close()
        drop_lock_table(url, table)


@dataclass
class Taken:
    """A lease some client took (alone, on a semaphore slot, or as part of a set)."""

    lease: Lease
    client: int
    generation: int
    set_id: int | None = None


class PrimitivesModel(RuleBasedStateMachine):
    """Clients wait, take semaphore slots and key sets; the store seen before each call
    decides what the call must answer."""

    def __init__(self) -> None:
        super().__init__()
        store = _primitives.store
        assert store is not None
        self.s = store
        self.now = 0.0
        self.provider = store.provider(self.clock)
        self.prefix = f"x{store.run}:{next(_examples)}:"
        self.services = [self.new_service() for _ in range(N_CLIENTS)]
        self.generations = [0] * N_CLIENTS
        self.taken: list[Taken] = []
        self.sets: dict[int, tuple[int, int, LeaseSet]] = {}  # id -> (client, generation, set)
        self.released: set[str] = set()
        self.floor: dict[str, int] = {}

    # helpers

    def clock(self) -> float:
        return self.now if self.s.fake_clock else time.monotonic()

    def new_service(self) -> LockService:
        clock = self.clock if self.s.fake_clock else time.monotonic
        return LockService(self.provider, prefix=self.prefix, clock=clock, thread_factory=IdleThread)

    def store_keys(self) -> list[str]:
        return [*PLAIN, *(slot_key(SEM, slot) for slot in range(1, MAX_SLOTS + 1))]

    def shown(self, key: str) -> str | None:
        """The token the store shows on ``key`` (unprefixed), None if it is free."""
        info = self.provider.peek(self.prefix + key)
        return None if info is None else info.token

    def alive(self, taken: Taken) -> bool:
        return self.generations[taken.client] == taken.generation

    def granted(self, lease: Lease, client: int, set_id: int | None = None) -> None:
        """A new lease: its fence beats every earlier one of its store key."""
        floor = self.floor.get(lease.store_key, 0)
        assert lease.fence > floor, f"{lease.store_key!r}: fence {lease.fence} after {floor}"
        self.floor[lease.store_key] = lease.fence
        self.taken.append(Taken(lease, client, self.generations[client], set_id))

    def live(self, client: int) -> list[Taken]:
        """The client's leases not released, newest first."""
        return [
            t
            for t in reversed(self.taken)
            if t.client == client and self.alive(t) and t.lease.token not in self.released
        ]

    @staticmethod
    def believes(lease: Lease) -> bool:
        try:
            lease.check()
        except LockLost:
            return False
        return True

    # rules

    @rule(client=clients, key=st.sampled_from(PLAIN), wait=waits, data=st.data())
    def lock(self, client: int, key: str, wait: float | None, data: st.DataObject) -> None:
        """A plain key, maybe with a small wait: a lease exactly when the store showed it
        free; a refused wait returns no earlier than its timeout."""
        ttl = data.draw(st.sampled_from(self.s.ttls), label="ttl")
        before = self.shown(key)
        started = time.monotonic()
        lease = self.services[client].try_lock(key, ttl=ttl, wait=wait)
        elapsed = time.monotonic() - started
        assert (lease is None) == (before is not None), (key, before, lease)
        if lease is None:
            assert elapsed >= (wait or 0.0), f"a {wait} s wait gave up after {elapsed:.4f} s"
            return
        self.granted(lease, client)

    @rule(client=clients, limit=st.integers(1, MAX_SLOTS), wait=st.sampled_from([None, SMALL_WAIT]))
    def lock_slot(self, client: int, limit: int, wait: float | None) -> None:
        """A slot of the semaphore with ``limit``: granted exactly when one of slots
        1..limit was free, on a free one, with a token no other holder has; refused when all
        ``limit`` were held (never more holders than the limit)."""
        before = {slot: self.shown(slot_key(SEM, slot)) for slot in range(1, limit + 1)}
        lease = self.services[client].try_lock(SEM, ttl=self.s.ttls[-1], limit=limit, wait=wait)
        free = [slot for slot, token in before.items() if token is None]
        if lease is None:
            assert not free, f"limit={limit} refused with slots {free} free: {before}"
            return
        assert free, f"limit={limit} granted a slot while all were held: {before}"
        assert lease.key == SEM
        assert lease.store_key in {self.prefix + slot_key(SEM, slot) for slot in free}, lease.store_key
        assert lease.token not in before.values()
        self.granted(lease, client)

    @rule(client=clients, keys=key_sets.flatmap(st.permutations), wait=waits)
    def lock_many(self, client: int, keys: list[str], wait: float | None) -> None:
        """An overlapping key set, in any order: all taken when all were free, else none,
        and then the store shows exactly what it showed before."""
        before = {key: self.shown(key) for key in PLAIN}
        taken = self.services[client].try_lock_many(keys, ttl=self.s.ttls[-1], wait=wait)
        if taken is None:
            assert any(before[key] is not None for key in keys), (keys, before)
            assert {key: self.shown(key) for key in PLAIN} == before, "a refused set left something held"
            return
        assert all(before[key] is None for key in keys), (keys, before)
        assert taken.keys == sorted(keys)
        assert len({lease.token for lease in taken}) == len(keys)
        set_id = len(self.sets)
        self.sets[set_id] = (client, self.generations[client], taken)
        for lease in taken:
            self.granted(lease, client, set_id)

    @rule(waiter=clients, data=st.data())
    def handover(self, waiter: int, data: st.DataObject) -> None:
        """A waiter (wait=10 s) gets a key, or a slot, that its holder releases meanwhile."""
        held = [
            t
            for t in self.taken
            if t.set_id is None
            and self.alive(t)
            and t.lease.token not in self.released
            and self.shown(t.lease.store_key[len(self.prefix) :]) == t.lease.token
        ]
        if not held:
            return
        target = data.draw(st.sampled_from(held), label="released")
        lease = target.lease
        limit = MAX_SLOTS if lease.key == SEM else 1
        got: list[Lease | None] = []
        thread = threading.Thread(
            target=lambda: got.append(
                self.services[waiter].try_lock(lease.key, ttl=30.0, limit=limit, wait=10.0)
            )
        )
        thread.start()
        time.sleep(0.01)
        assert lease.release() is ReleaseOutcome.RELEASED
        self.released.add(lease.token)
        thread.join(30)
        assert got, "the waiter did not return"
        assert got[0] is not None, f"the waiter missed the release of {lease.store_key!r}"
        self.granted(got[0], waiter)

    @rule(client=clients)
    def release(self, client: int) -> None:
        """A client releases its newest lease (not part of a set): RELEASED exactly when the
        store showed it."""
        mine = [t for t in self.live(client) if t.set_id is None]
        if not mine:
            return
        lease = mine[0].lease
        owned = self.shown(lease.store_key[len(self.prefix) :]) == lease.token
        outcome = lease.release()
        assert outcome is (ReleaseOutcome.RELEASED if owned else ReleaseOutcome.NOT_OWNED)
        self.released.add(lease.token)

    @rule(client=clients)
    def release_set(self, client: int) -> None:
        """A client releases a key set together: each key RELEASED exactly when the store
        showed its lease, and none of them is held by it afterwards."""
        mine = [
            (set_id, leases)
            for set_id, (owner, generation, leases) in self.sets.items()
            if owner == client
            and self.generations[owner] == generation
            and not any(lease.token in self.released for lease in leases)
        ]
        if not mine:
            return
        _, leases = mine[-1]
        owned = {lease.key: self.shown(lease.key) == lease.token for lease in leases}
        outcomes = leases.release()
        assert outcomes == {
            key: ReleaseOutcome.RELEASED if mine_ else ReleaseOutcome.NOT_OWNED
            for key, mine_ in owned.items()
        }
        for lease in leases:
            self.released.add(lease.token)
            assert self.shown(lease.key) != lease.token

    @rule(client=clients)
    def heartbeat(self, client: int) -> None:
        """One heartbeat pass of a client."""
        self.services[client].heartbeat.beat()

    @precondition(lambda self: self.s.fake_clock)
    @rule(seconds=st.sampled_from([0.5, 2.0, 4.0, 7.0]))
    def advance(self, seconds: float) -> None:
        """Time passes for everyone (fake clock only: memory)."""
        self.now += seconds

    @rule(client=clients)
    def kill(self, client: int) -> None:
        """A client dies: its leases are neither refreshed nor released; a new one starts.
        (The old service is dropped, not closed: closing would close the shared provider.)"""
        self.services[client] = self.new_service()
        self.generations[client] += 1

    # invariants

    @invariant()
    def one_believer_per_key(self) -> None:
        """At most one live lease believes it holds each key and each semaphore slot, and the
        store shows that one; no slot beyond the largest limit is ever taken."""
        for key in self.store_keys():
            store_key = self.prefix + key
            believers = [
                t
                for t in self.taken
                if t.lease.store_key == store_key
                and self.alive(t)
                and t.lease.token not in self.released
                and self.believes(t.lease)
            ]
            assert len(believers) <= 1, f"several clients believe they hold {key!r}: {believers}"
            if believers:
                info = self.provider.peek(store_key)
                assert info is not None, f"{key!r} is believed held, but the store shows it free"
                assert (info.token, info.fence) == (believers[0].lease.token, believers[0].lease.fence)
        assert self.shown(slot_key(SEM, MAX_SLOTS + 1)) is None

    @invariant()
    def nothing_comes_back(self) -> None:
        """A released lease never shows up in the store again."""
        for key in self.store_keys():
            assert self.shown(key) not in self.released


def test_primitives_model(primitives_store: PrimitivesStore) -> None:
    """wait=, limit= and lock_many never disagree with the store or give a key to two."""
    _primitives.store = primitives_store
    try:
        run_state_machine_as_test(
            PrimitivesModel,
            settings=settings(
                max_examples=primitives_store.examples,
                stateful_step_count=primitives_store.steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        _primitives.store = None
