"""Faults of the holder's process: SIGKILL, SIGSTOP past the ttl, a wall clock off by an hour.

The holder is a separate process (``_holder.py``) on the suite's private PostgreSQL or
Redis; a competitor in this process judges, on this process's monotonic clock, when the
key becomes free. A lease's expiry as the store saw it is bracketed by a ``peek`` sent at
``t``: the store expires the lease no earlier than ``t + expires_in``.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import pytest

from celery_exclusive import LeaseState, ReleaseOutcome
from tests.conftest import TIME_SLACK
from tests.faults.conftest import LONG, SLACK, Backend, Faults, HolderProcess, faketime_wrapper, wait_until

pytestmark = pytest.mark.slow

KEY = "job"
TTL = 1.5
INTERVAL = 0.5
#: Clock tolerance between the store's clock and ours (same machine: rates agree).
EPS = 0.01
#: The skewed-clock cases of the short mode: each store's holder an hour off one way, each
#: way on one store (either way puts any wall-clock reading an hour from the truth, far past
#: the ttl). ``CE_LONG=1`` runs both ways on both stores.
SHORT_SKEWS = {("postgres", "+1h"), ("redis", "-1h")}


def kill_and_take_over(
    faults: Faults, backend: Backend, holder: HolderProcess, token: str, fence: int, *, ttl: float = TTL
) -> dict[str, float]:
    """SIGKILL ``holder`` (holding with ``ttl``); a competitor must get the key after the
    store's expiry, on time."""
    competitor_service = faults.service(backend.url(application_name="ce-competitor"))
    assert competitor_service.try_lock(KEY) is None, "a live holder's key was granted"
    peek_sent = time.monotonic()
    live = competitor_service.peek(KEY)
    assert live is not None
    assert live.token == token
    killed = holder.signal(signal.SIGKILL)
    # The lease was confirmed within the last refresh interval (plus scheduling noise).
    assert live.expires_in > ttl - INTERVAL - SLACK
    not_before = peek_sent + live.expires_in
    competitor = faults.competitor(competitor_service, KEY)
    grant = competitor.wait_grant(ttl + 10)
    assert grant is not None, "the dead holder's lease never expired"
    assert grant.answered >= not_before - EPS, "granted before the dead holder's lease expired"
    assert grant.sent <= killed + ttl + SLACK, "the dead holder's lease outlived its ttl"
    assert grant.lease is not None
    assert grant.lease.fence > fence
    assert grant.lease.release() is ReleaseOutcome.RELEASED
    return {"kill_to_grant_s": round(grant.answered - killed, 3), "earliest_s": round(not_before - killed, 3)}


def test_killed_holder_expires_after_ttl(backend: Backend, faults: Faults) -> None:
    """A SIGKILLed holder's key goes to another caller once its ttl has run out, not before."""
    rounds = 5 if LONG else 1
    figures = []
    for _ in range(rounds):
        holder = faults.holder(backend.url(), KEY, ttl=TTL, refresh_interval=INTERVAL)
        _, acquired = holder.wait("acquired", 30)
        time.sleep(TTL)  # outlive one ttl first: only the heartbeat can have kept it
        figures.append(kill_and_take_over(faults, backend, holder, acquired["token"], acquired["fence"]))
    faults.record(store=backend.name, kills=rounds, violations=0, rounds=figures)


def test_stopped_holder_learns_it_lost(backend: Backend, faults: Faults) -> None:
    """A holder SIGSTOPped past its ttl loses the key, learns LOST on SIGCONT, cannot free the new lease."""
    holder = faults.holder(backend.url(), KEY, ttl=TTL, refresh_interval=INTERVAL)
    _, acquired = holder.wait("acquired", 30)
    competitor_service = faults.service(backend.url(application_name="ce-competitor"))
    stopped = holder.signal(signal.SIGSTOP)
    competitor = faults.competitor(competitor_service, KEY)
    grant = competitor.wait_grant(TTL + 10)
    assert grant is not None, "a stopped holder's lease never expired"
    assert grant.lease is not None
    assert grant.sent >= stopped
    time.sleep(0.2)
    resumed = holder.signal(signal.SIGCONT)
    lost_at, lost = holder.wait("lost", TTL + SLACK)  # reported by its own heartbeat, unasked
    state = holder.ask("state", "state")
    assert state["state"] == LeaseState.LOST.value
    assert state["check"].startswith("LockLost")
    released = holder.ask("release", "released")
    assert released["outcome"] == ReleaseOutcome.NOT_OWNED.value
    live = competitor_service.peek(KEY)
    assert live is not None
    assert live.token == grant.lease.token, "the stale holder's release removed the new lease"
    assert grant.lease.state is LeaseState.HELD
    assert grant.lease.fence > acquired["fence"]
    faults.record(
        store=backend.name,
        stop_to_grant_s=round(grant.answered - stopped, 3),
        cont_to_lost_report_s=round(lost_at - resumed, 3),
        lost_reason=lost["reason"],
        violations=0,
    )


@pytest.mark.parametrize("offset", ["+1h", "-1h"])
def test_skewed_wall_clock_changes_nothing(backend: Backend, faults: Faults, offset: str) -> None:
    """A holder whose wall clock is an hour off keeps its lease, and its lease still expires on schedule."""
    if not LONG and (backend.name, offset) not in SHORT_SKEWS:
        pytest.skip("the short mode skews each store's clock one way (CE_LONG=1: both ways)")
    skew = 3600.0 if offset.startswith("+") else -3600.0
    wrapper = faketime_wrapper(offset)
    # Held for several ttls, under libfaketime: the ttl scales with the machine's load (a
    # loaded CI run once lost the 1.5 s lease here, its refreshes starved for over a second).
    ttl = TTL * TIME_SLACK
    holder = faults.holder(
        backend.url(), KEY, ttl=ttl, refresh_interval=INTERVAL, wrapper=wrapper, skew=0.0 if wrapper else skew
    )
    _, acquired = holder.wait("acquired", 30)
    assert abs(acquired["wall"] - time.time() - skew) < 60, "the holder's wall clock is not skewed"
    if wrapper is not None:
        assert abs(acquired["datetime"] - time.time() - skew) < 60
    competitor_service = faults.service(backend.url(application_name="ce-competitor"))
    hold_until = time.monotonic() + (10 if LONG else 2) * ttl
    checks = 0
    while time.monotonic() < hold_until:
        state = holder.ask("state", "state")
        assert state["state"] == LeaseState.HELD.value, state
        assert state["check"] == "ok"
        assert competitor_service.try_lock(KEY) is None
        checks += 1
        time.sleep(0.1)
    figures = kill_and_take_over(faults, backend, holder, acquired["token"], acquired["fence"], ttl=ttl)
    faults.record(
        store=backend.name,
        offset=offset,
        clock="libfaketime" if wrapper else "patched time.time",
        checks_held=checks,
        violations=0,
        **figures,
    )


def test_a_call_thread_that_cannot_start_is_not_counted(
    backend: Backend, faults: Faults, caplog: pytest.LogCaptureFixture
) -> None:
    """For a while this process cannot start a thread (a thread stack of 16 TiB cannot be
    mapped): the heartbeat's refresh calls fail to start, and the heartbeat says so and
    tries again. A failed start is undone: once threads start again the lease is refreshed
    and no call thread is counted that does not run (one used to stay counted per failed
    start, and MAX_THREADS of them left no call startable: every lease then LOST)."""
    caplog.set_level(logging.WARNING, logger="celery_exclusive")
    service = faults.service(backend.url(application_name="ce-nothread"), ttl=3.0, refresh_interval=0.25)
    lease = service.lock(KEY)
    inflight = service.heartbeat._inflight
    log = faults.refresh_log(service)

    def start_failed() -> bool:
        return any(
            record.exc_info is not None and "can't start new thread" in str(record.exc_info[1])
            for record in caplog.records
        )

    normal = threading.stack_size(2**44)
    try:
        assert wait_until(start_failed, 5 * TIME_SLACK), caplog.text
    finally:
        threading.stack_size(normal)
    resumed = time.monotonic()
    assert wait_until(lambda: log.confirmed_since(resumed, 1), 3 * TIME_SLACK)
    assert wait_until(lambda: inflight.threads == 0, 2 * TIME_SLACK), (
        f"{inflight.threads} call thread(s) counted"
    )
    assert lease.state is LeaseState.HELD
    assert lease.release() is ReleaseOutcome.RELEASED


def test_a_sweep_whose_thread_cannot_start_is_tried_again(backend: Backend, faults: Faults) -> None:
    """The heartbeat's sweep is due while this process cannot start a thread, and no refresh
    is (a long ttl): the sweep's call fails to start. Once threads start again the sweep
    runs again (a sweep whose start failed used to stay "running": none ever again)."""
    service = faults.service(backend.url(application_name="ce-nosweep"), ttl=60.0, sweep_interval=0.2)
    lease = service.lock(KEY)
    sweeper = service.heartbeat._sweep
    if sweeper is None:
        pytest.skip(f"the {backend.name} store has no heartbeat sweep")
    assert wait_until(lambda: sweeper.at != math.inf, 5 * TIME_SLACK)
    normal = threading.stack_size(2**44)
    try:
        # The sweep fell due and could not start: it is "running" with no thread, or failed.
        swept_at = sweeper.at
        time.sleep(1.0)
        assert sweeper.at == swept_at, "a sweep ran while no thread could start"
    finally:
        threading.stack_size(normal)
    assert wait_until(lambda: sweeper.at != swept_at, 5 * TIME_SLACK), "no sweep after threads start again"
    assert lease.release() is ReleaseOutcome.RELEASED
