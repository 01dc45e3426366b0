"""Split brain: the old primary is ISOLATED, alive, while its standby is promoted.

The failover tests kill the primary; here it keeps running, cut off by an nftables rule
on this host that drops every packet to and from its TCP port (``netns.PortIsolation``):
the majority side (a holder and a rival on the multi-host / Sentinel URL, the standby's
replication stream, the sentinel) loses it without a reset. One client stays on the old
primary's side through its Unix socket, which the rule does not touch: what it is told
is what a client partitioned together with the old primary would be told.

Parties and keys (ttl 3 s, 6 s in long mode; refreshed every ttl/3):

* ``job:*`` — held by the majority holder from before the cut; it must reconnect to the
  new primary (or declare LOST before the rival gets the key);
* ``old:*`` — held by the old-side holder from before the cut (replicated); its refreshes
  now reach only the isolated primary; a rival on the new primary tries each every 50 ms;
* ``split:*`` — free keys the old side and the rival both acquire during the partition;
* ``after:*`` — taken right after the heal by a fresh majority client.

A *double* holder is a rival grant answered while the other party had not declared its
lease LOST, or a split key granted to both sides. Measured and asserted:

* PostgreSQL, ``synchronous_commit = on`` with a synchronous standby: every write on the
  isolated primary waits for the standby that is gone, so the old side is granted nothing
  and confirms no refresh: 0 double holders, during the partition and after the heal.
  The multi-host URL, though, tries its hosts in order, and a silent (not dead) first host
  costs each connection attempt its whole ``connect_timeout`` (at least 2 s, libpq's
  minimum): the baseline ``hosts-in-order`` (old primary listed first) loses every
  majority lease, and after the heal connects to the old primary again, which is still
  read-write and blocks every write. ``load_balance_hosts=random`` (libpq >= 16) keeps
  them;
* Redis Sentinel without ``ce_wait_replicas``: the isolated master keeps acknowledging
  writes: the old side keeps its leases and is granted the split keys while the rival
  holds them on the new master (double holders), until the heal turns it into a replica;
* with ``ce_wait_replicas=1`` every such write fails as BackendError: 0 double holders
  (and with a second replica the new master keeps granting meanwhile).

Short mode (CI): Redis with ``ce_wait_replicas``, one partition of 5 s (about 13 s in all).
``CE_LONG=1``: partitions of 30 s, PostgreSQL, and the baselines (Redis without WAIT;
PostgreSQL hosts tried in order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from celery_exclusive import BackendError, Lease, LeaseState, LockService
from celery_exclusive.lease import safety_margin
from tests.faults.conftest import (
    IN_CI,
    LONG,
    SLACK,
    Attempt,
    Competitor,
    Faults,
    cpu_wait,
    loss_timing,
    wait_until,
)
from tests.faults.netns import NetnsUnavailable, PortIsolation
from tests.faults.test_failover import close_quietly, pg_set, retrying, sentinel_set

pytestmark = pytest.mark.slow

TTL = 6.0 if LONG else 3.0
HELD = 20  # job:* on the majority side
OLD = 10  # old:* on the old primary's side
SPLIT = 10  # split:* taken by both sides during the partition
AFTER = 5  # after:* taken right after the heal
PARTITION = 30.0 if LONG else 5.0  # longer than the ttl: the old side's leases expire
OLD_SIDE_TIMEOUT = 3.0  # call_timeout of the old side and of the client after the heal
#: Long mode only: the baselines (what goes wrong, measured), and PostgreSQL's safe case, which
#: takes 40-65 s here (CI's budget has room for one case).
LONG_ONLY = pytest.mark.skipif(not LONG, reason="long mode only (CE_LONG=1): a baseline, or slow")


@pytest.fixture
def isolation() -> Iterator[list[PortIsolation]]:
    """Isolations made by the test (``PortIsolation(port)`` appended); always removed."""
    made: list[PortIsolation] = []
    try:
        yield made
    finally:
        for each in made:
            each.close()


def isolate(made: list[PortIsolation], port: int) -> PortIsolation:
    try:
        cut = PortIsolation(port, "s")
    except NetnsUnavailable as exc:
        if IN_CI:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    made.append(cut)
    return cut


@dataclass
class Side:
    """One party's leases and when each was declared LOST (test clock)."""

    service: LockService
    leases: dict[str, Lease] = field(default_factory=dict)
    lost_at: dict[str, float] = field(default_factory=dict)
    #: Its heartbeat thread's :func:`cpu_wait` when the cut began, and at each loss.
    waited: float | None = None
    lost_wait: dict[str, float | None] = field(default_factory=dict)

    def hold(self, key: str) -> None:
        lease = self.service.lock(key)
        self.leases[key] = lease
        lease.on_lost(self._lost)

    def _lost(self, lease: Lease, _reason: str) -> None:
        self.lost_at.setdefault(lease.key, time.monotonic())
        self.lost_wait.setdefault(lease.key, cpu_wait(self.service.heartbeat._thread))


@dataclass
class Tally:
    """What the split did, per group of keys."""

    kept: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    double: dict[str, int] = field(default_factory=dict)
    #: Rival grants answered before the holder's local deadline (the store's expiry broken).
    early: dict[str, int] = field(default_factory=dict)
    old_side_split_granted: int = 0
    old_side_split_refused: int = 0
    rival_split_granted: int = 0
    after_granted: int = 0
    after_refused: int = 0
    promote_s: float = 0.0
    #: Redis: heal -> the old master is a replica again, and -> the old side's last lease LOST.
    demoted_s: float | None = None
    old_side_lost_s: float | None = None
    #: Leases of each group declared LOST while the partition lasted, and after the heal.
    lost_during: dict[str, int] = field(default_factory=dict)
    lost_after_heal: dict[str, int] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)


def doubles(side: Side, grants: dict[str, Attempt | None], tally: Tally, group: str) -> None:
    """A rival grant answered while ``side`` had not declared that key's lease LOST, or
    before its local deadline (taken after the competitors stopped: final for a lost lease)."""
    count = early = 0
    for key, grant in grants.items():
        if grant is None:
            continue
        lost = side.lost_at.get(key)
        waits = (
            side.waited,
            side.lost_wait[key] if key in side.lost_wait else cpu_wait(side.service.heartbeat._thread),
        )
        deadline = time.monotonic() + side.leases[key].expires_in
        early += deadline >= grant.answered
        if lost is None or lost >= grant.answered or deadline >= grant.answered:
            count += lost is None or lost >= grant.answered
            late = "never" if lost is None else f"{lost - grant.answered:+.3f} s"
            timing = loss_timing(deadline, lost, grant, safety_margin(TTL), waits)
            tally.details.append(f"{key}: rival granted, holder LOST {late}; {timing}")
    tally.double[group] = count
    tally.early[group] = early


def settle(side: Side, final: LockService, tally: Tally, group: str, healed: float) -> None:
    """Kept: still believed held and the new primary's lease has its token; else lost."""
    kept = lost = 0
    tally.lost_during[group] = sum(at < healed for at in side.lost_at.values())
    tally.lost_after_heal[group] = sum(at >= healed for at in side.lost_at.values())
    for key, lease in side.leases.items():
        if lease.state is LeaseState.LOST:
            lost += 1
            continue
        info = retrying(lambda key=key: final.peek(key))
        if info is not None and info.token == lease.token:
            kept += 1
        else:
            lost += 1
            tally.details.append(f"{key}: believed held, the new primary has {info and info.token}")
    tally.kept[group], tally.lost[group] = kept, lost


def at_once(
    service: LockService, keys: list[str], retry_for: float = 0.0
) -> list[Lease | BackendError | None]:
    """``service.try_lock`` of every key, each in its own thread (an outage retried for
    ``retry_for`` s): the lease, None (held), or the BackendError, in ``keys`` order."""
    outcomes: list[Lease | BackendError | None] = [None] * len(keys)

    def take(i: int) -> None:
        try:
            outcomes[i] = retrying(lambda: service.try_lock(keys[i]), retry_for)
        except BackendError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


def split_acquires(old_side: LockService, rival: LockService, tally: Tally) -> None:
    """Both sides try each free split key at the same time; what each was granted (held
    until the services close)."""
    keys = [f"split:{i}" for i in range(SPLIT)]
    old_outcomes: list[Lease | BackendError | None] = []
    old_thread = threading.Thread(target=lambda: old_outcomes.extend(at_once(old_side, keys)))
    old_thread.start()
    rival_outcomes = at_once(rival, keys, retry_for=10)
    old_thread.join(60)
    tally.old_side_split_granted = sum(isinstance(o, Lease) for o in old_outcomes)
    tally.old_side_split_refused = sum(isinstance(o, BackendError) for o in old_outcomes)
    tally.rival_split_granted = sum(isinstance(r, Lease) for r in rival_outcomes)
    pairs = zip(old_outcomes, rival_outcomes, strict=True)
    tally.double["split"] = sum(isinstance(o, Lease) and isinstance(r, Lease) for o, r in pairs)


def after_heal(fresh: LockService, tally: Tally) -> None:
    """A fresh majority client takes each ``after:*`` key at once; counted."""
    for i, outcome in enumerate(at_once(fresh, [f"after:{i}" for i in range(AFTER)])):
        if isinstance(outcome, BackendError):
            tally.after_refused += 1
            tally.details.append(f"after:{i}: {str(outcome)[-100:]}")
        elif outcome is not None:
            tally.after_granted += 1
            outcome.release()


def play(
    faults: Faults,
    cut: PortIsolation,
    *,
    majority_url: str,
    old_url: str,
    final_url: str | Callable[[], str],
    promote: Any,
    demoted: Any = None,
) -> Tally:
    """The scenario on one replicated set: hold, isolate, promote, race, heal, count."""
    services: list[LockService] = []

    def service(url: str, **options: Any) -> LockService:
        services.append(LockService(url, prefix=faults.prefix, ttl=TTL, **options))
        return services[-1]

    competitors: dict[str, Competitor] = {}
    try:
        tally = Tally()
        holder, old = Side(service(majority_url)), Side(service(old_url, call_timeout=OLD_SIDE_TIMEOUT))
        rival = service(majority_url)
        for i in range(HELD):
            holder.hold(f"job:{i}")
        for i in range(OLD):
            old.hold(f"old:{i}")
        holder.waited, old.waited = (cpu_wait(side.service.heartbeat._thread) for side in (holder, old))
        began = cut.start()
        tally.promote_s = promote() - began
        for key in (*holder.leases, *old.leases):
            competitors[key] = Competitor(rival, key, interval=0.05).start()
        split_acquires(old.service, rival, tally)
        time.sleep(max(0.0, began + PARTITION - time.monotonic()))
        healed = cut.heal()
        after_heal(service(majority_url, call_timeout=OLD_SIDE_TIMEOUT), tally)
        time.sleep(TTL + SLACK)  # every lease still believed held has been refreshed since
        for competitor in competitors.values():
            competitor.stop()
        if demoted is not None:  # Redis: the sentinel makes the old master a replica
            assert wait_until(demoted, 60, 0.05), "the sentinel did not demote the old master"
            tally.demoted_s = time.monotonic() - healed
            live = old.leases.values()
            if wait_until(lambda: all(lease.state is LeaseState.LOST for lease in live), TTL + SLACK):
                tally.old_side_lost_s = max(old.lost_at.values()) - healed
        doubles(holder, {k: competitors[k].first_grant for k in holder.leases}, tally, "job")
        doubles(old, {k: competitors[k].first_grant for k in old.leases}, tally, "old")
        final = service(final_url if isinstance(final_url, str) else final_url())
        settle(holder, final, tally, "job", healed)
        settle(old, final, tally, "old", healed)
        return tally
    finally:
        cut.close()
        for competitor in competitors.values():
            competitor.stop()
        close_quietly(*services)


@pytest.mark.parametrize(
    "balance",
    [
        pytest.param(False, marks=LONG_ONLY, id="hosts-in-order"),
        pytest.param(True, marks=LONG_ONLY, id="load_balance_hosts"),  # 40-65 s: not in CI's budget
    ],
)
def test_postgres_isolated_primary_grants_nothing(
    faults: Faults, isolation: list[PortIsolation], balance: bool
) -> None:
    """synchronous_commit = on with a synchronous standby: the isolated old primary takes
    writes but never commits them to anyone, so nobody on its side is granted or confirmed
    anything, and after the heal a client that reaches it again is refused, not granted."""
    with pg_set(sync=True) as pair:
        standby = pair.standby
        assert standby is not None
        primary = pair.primary
        hosts = f"host=127.0.0.1:{primary.port}&host=127.0.0.1:{standby.port}"
        tail = "&target_session_attrs=read-write&connect_timeout=2&application_name=ce-split"
        if balance:
            tail += "&load_balance_hosts=random"
        majority = f"postgresql+psycopg://postgres@/postgres?{hosts}{tail}"
        old_side = (
            f"postgresql+psycopg://postgres@/postgres?host={primary.root}&port={primary.port}"
            "&application_name=ce-old-side"
        )
        final = f"postgresql+psycopg://postgres@127.0.0.1:{standby.port}/postgres"
        cut = isolate(isolation, primary.port)

        def promote() -> float:
            standby.promote()
            return time.monotonic()

        tally = play(faults, cut, majority_url=majority, old_url=old_side, final_url=final, promote=promote)
        faults.record(store="postgres", sync=True, balance=balance, partition_s=PARTITION, **vars(tally))
        assert tally.old_side_split_granted == 0, tally
        assert tally.rival_split_granted == SPLIT, tally
        # The library's guarantee first (every committed write survives the failover), then
        # what the heartbeat does in time unless a holder gets no CPU for the margin.
        assert sum(tally.early.values()) == 0, tally
        assert sum(tally.double.values()) == 0, tally
        assert tally.kept["old"] == 0, tally  # its refreshes never committed: LOST
        assert tally.lost["job"] + tally.kept["job"] == HELD


@pytest.mark.parametrize(
    ("wait", "replicas"),
    [
        pytest.param(False, 1, marks=LONG_ONLY, id="async"),
        pytest.param(True, 1, id="ce_wait_replicas"),
        pytest.param(True, 2, marks=LONG_ONLY, id="ce_wait_replicas-two-replicas"),
    ],
)
def test_redis_isolated_master_under_sentinel(
    faults: Faults, isolation: list[PortIsolation], wait: bool, replicas: int
) -> None:
    """Without WAIT the isolated master acknowledges what it cannot replicate: its side keeps
    its leases and is granted the split keys while the rival holds them (double holders),
    lost on heal. With ce_wait_replicas=1 each such write is a BackendError: none."""
    with sentinel_set(unix_socket=True, second=replicas == 2) as (primary, _replica, _proxy, sentinel):
        options = "socket_timeout=2&socket_connect_timeout=1"
        if wait:
            options += "&ce_wait_replicas=1&ce_wait_timeout=0.2"
        majority = f"{sentinel.url}?{options}"
        old_side = f"unix://{primary.root / 'redis.sock'}?db=0&{options}"
        cut = isolate(isolation, primary.port)

        def promote() -> float:
            assert wait_until(lambda: sentinel.primary() not in (None, primary.port), 30, 0.02), "no failover"
            return time.monotonic()

        def demoted() -> bool:  # the sentinel turns the old master into a replica once it sees it
            role = primary.command("ROLE")
            return isinstance(role, list) and role[0] == b"slave"

        tally = play(
            faults,
            cut,
            majority_url=majority,
            old_url=old_side,
            final_url=lambda: f"redis://127.0.0.1:{sentinel.primary()}/0",
            promote=promote,
            demoted=demoted if LONG or not wait else None,  # CI: not the ~12 s the sentinel takes
        )
        faults.record(
            store="redis-sentinel",
            wait_replicas=int(wait),
            replicas=replicas,
            partition_s=PARTITION,
            **vars(tally),
        )
        if wait:  # every acknowledged write reached the new master: the guarantee holds
            assert sum(tally.early.values()) == 0, tally
        assert tally.double["job"] == 0, tally
        if wait:
            # Every write the isolated master could not replicate failed. With one replica the
            # new master has none left to acknowledge either, so it grants and confirms nothing
            # until the old master rejoins as its replica (the price, measured); with two, the
            # sentinel points the other one at it.
            assert tally.old_side_split_refused == SPLIT, tally
            assert sum(tally.double.values()) == 0, tally
            if replicas == 2:
                assert tally.rival_split_granted == SPLIT, tally
        else:
            # The isolated master acknowledged both the split grants and the old side's
            # refreshes: double holders, until the heal makes it a replica.
            assert tally.old_side_split_granted == SPLIT, tally
            assert tally.rival_split_granted == SPLIT, tally
            assert tally.double["split"] == SPLIT, tally
            assert tally.double["old"] <= OLD, tally
