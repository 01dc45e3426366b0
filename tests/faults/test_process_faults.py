"""Faults of the holder's process: SIGKILL, SIGSTOP past the ttl, a wall clock off by an hour.

The holder is a separate process (``_holder.py``) on the suite's private PostgreSQL or
Redis; a competitor in this process judges, on this process's monotonic clock, when the
key becomes free. A lease's expiry as the store saw it is bracketed by a ``peek`` sent at
``t``: the store expires the lease no earlier than ``t + expires_in``.
"""

from __future__ import annotations

import signal
import time

import pytest

from celery_exclusive import LeaseState, ReleaseOutcome
from tests.conftest import TIME_SLACK
from tests.faults.conftest import LONG, SLACK, Backend, Faults, HolderProcess, faketime_wrapper

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
