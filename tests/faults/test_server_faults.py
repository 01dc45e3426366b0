"""Faults of the lock store itself: PostgreSQL restarted or its sessions terminated, Redis
restarted without persistence or flushed. Only the suite's private servers are touched.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from celery_exclusive import Lease, LeaseState, ReleaseOutcome
from tests.faults.conftest import (
    LONG,
    SLACK,
    Backend,
    Faults,
    failures_before_success,
    wait_until,
    warm_pool,
)

pytestmark = pytest.mark.slow

#: PostgreSQL outages must fit in ttl - margin - interval (2.2 s here) for leases to survive.
PG_TTL = 3.0
INTERVAL = 0.5
REDIS_TTL = 2.0


class StateMonitor:
    """Polls each lease's state every few ms (as a task calling ``check()`` would); records changes."""

    def __init__(self, leases: list[Lease]) -> None:
        self.leases = leases
        self.changes: list[tuple[float, str, LeaseState]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ce-fault-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = {lease.key: LeaseState.HELD for lease in self.leases}
        while not self._stop.wait(0.005):
            for lease in self.leases:
                state = lease.state
                if state is not last[lease.key]:
                    last[lease.key] = state
                    self.changes.append((time.monotonic(), lease.key, state))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def seen(self, state: LeaseState) -> int:
        return sum(1 for _, _, s in self.changes if s is state)

    def longest(self, state: LeaseState) -> float:
        """The longest time any lease stayed in ``state`` (0 if never)."""
        longest, since = 0.0, {}
        for at, key, s in self.changes:
            if s is state:
                since[key] = at
            elif key in since:
                longest = max(longest, at - since.pop(key))
        return longest


@pytest.mark.parametrize("fault", ["restart", "crash_restart", "terminate_backend"])
def test_postgres_outage_keeps_leases(pg_backend: Backend, faults: Faults, fault: str) -> None:
    """Leases outlive short PostgreSQL restarts and killed sessions; nobody else gets a key meanwhile."""
    pg = pg_backend.server
    keys = [f"job-{i}" for i in range(3)]
    holder = faults.service(
        pg_backend.url(application_name="ce-holder"), ttl=PG_TTL, refresh_interval=INTERVAL
    )
    leases = [holder.lock(key) for key in keys]
    lost: list[str] = []
    for lease in leases:
        lease.on_lost(lambda lease, reason: lost.append(f"{lease.key}: {reason}"))
    refreshes = faults.refresh_log(holder)
    monitor = StateMonitor(leases)
    rival = faults.service(pg_backend.url(application_name="ce-competitor"))
    competitors = [faults.competitor(rival, key, interval=0.05) for key in keys]
    rounds = 10 if LONG else 2
    outages, stale_failures = [], []
    try:
        for round_no in range(rounds):
            warm_pool(holder)  # several idle pooled connections, all made stale by the fault
            time.sleep(random.uniform(INTERVAL, 2 * INTERVAL))
            began = time.monotonic()
            if fault == "restart":
                pg.restart("fast")
            elif fault == "crash_restart":
                pg.restart("immediate")  # no checkpoint: crash recovery on start
            else:
                assert pg.terminate("ce-holder") >= 1
            up = time.monotonic()
            outages.append(round(up - began, 3))
            # Odd rounds: a caller meets the stale pool first; even rounds: the heartbeat does.
            user_first = round_no % 2 == 1
            failures = failures_before_success(lambda: holder.peek(keys[0])) if user_first else 0
            assert wait_until(lambda up=up: refreshes.confirmed_since(up, len(keys)), INTERVAL + SLACK), (
                "the heartbeat did not confirm the leases again after the fault"
            )
            if not user_first:
                failures = failures_before_success(lambda: holder.peek(keys[0]))
            # One call meets a dead pooled connection (two if the heartbeat's races the
            # caller's); then the whole pool reconnects instead of failing call after call.
            stale = failures + sum(1 for at, _ in refreshes.failed if at > up)
            stale_failures.append(stale)
            assert stale <= 2, f"{stale} calls failed on stale pooled connections after the fault"
    finally:
        monitor.stop()
        for competitor in competitors:
            competitor.stop()
    assert not lost, lost
    assert monitor.seen(LeaseState.LOST) == 0
    assert all(lease.state is LeaseState.HELD for lease in leases)
    assert holder.heartbeat.running
    assert refreshes.failed, "no refresh failed: the fault was not injected"
    assert monitor.seen(LeaseState.JEOPARDY) >= 1, "failed refreshes did not put leases in JEOPARDY"
    grants = [c.first_grant for c in competitors if c.first_grant is not None]
    assert not grants, "a competitor got a key while its holder believed it held it"
    for lease in leases:
        assert lease.release() is ReleaseOutcome.RELEASED
    faults.record(
        store="postgres",
        fault=fault,
        faults=rounds,
        outage_s=outages,
        refresh_failures=len(refreshes.failed),
        longest_jeopardy_s=round(monitor.longest(LeaseState.JEOPARDY), 3),
        calls_failed_after_recovery=stale_failures,
        competitor_attempts=sum(len(c.attempts) for c in competitors),
        competitor_errors=sum(c.count("error") for c in competitors),
        violations=len(grants),
    )


@pytest.mark.parametrize("fault", ["restart", "flushall"])
def test_redis_data_loss_is_noticed(redis_backend: Backend, faults: Faults, fault: str) -> None:
    """Redis restarted without persistence, or flushed: every holder learns LOST within a refresh interval."""
    redis = redis_backend.server
    rounds = 5 if LONG else 1
    figures = []
    for round_no in range(rounds):
        holders = [
            faults.service(redis_backend.url(), ttl=REDIS_TTL, refresh_interval=INTERVAL) for _ in range(2)
        ]
        leases = [service.lock(f"job-{round_no}-{i}") for i, service in enumerate(holders * 3)]
        lost_at: dict[str, float] = {}
        for lease in leases:
            lease.on_lost(lambda lease, _reason, seen=lost_at: seen.setdefault(lease.key, time.monotonic()))
        time.sleep(random.uniform(INTERVAL, 2 * INTERVAL))
        began = time.monotonic()
        if fault == "restart":
            _, done = redis.restart()
        else:
            assert redis.command("FLUSHALL")
            done = time.monotonic()
        bound = INTERVAL + SLACK
        assert wait_until(lambda leases=leases, lost_at=lost_at: len(lost_at) == len(leases), bound + 1), (
            f"only {len(lost_at)} of {len(leases)} leases learned they were lost"
        )
        assert min(lost_at.values()) >= began
        slowest = max(lost_at.values()) - done
        assert slowest <= bound, f"a holder learned LOST {slowest:.3f} s after the data loss"
        assert all(lease.state is LeaseState.LOST for lease in leases)
        assert all(service.heartbeat.running or not service.held() for service in holders)
        # The keys are free again, and fences still grow: they come from Redis's clock too,
        # not only from the counter the data loss erased.
        rival = faults.service(redis_backend.url())
        fresh = rival.lock(leases[0].key)
        assert leases[0].release() is ReleaseOutcome.NOT_OWNED
        assert fresh.state is LeaseState.HELD
        assert fresh.fence > leases[0].fence
        fresh.release()
        figures.append(
            {
                "fault_to_last_lost_s": round(slowest, 3),
                "fault_to_first_lost_s": round(min(lost_at.values()) - done, 3),
                "outage_s": round(done - began, 3),
            }
        )
    faults.record(store="redis", fault=fault, faults=rounds, leases_per_fault=6, rounds=figures, violations=0)
