"""One heartbeat thread per service: it keeps every held lease alive in batched round trips.

Each pass refreshes the leases that are due (and those nearly due, to share the round
trip) with one ``provider.refresh`` call per ``batch_size`` leases, marks leases LOST
when the store disowns them or their local deadline passes, and retries releases whose
outcome was unknown. The thread never dies of an exception: it logs and goes on. The
clock and thread factory are injectable, and :meth:`Heartbeat.beat` runs one pass, so
tests can drive it without sleeping.

This module owns the thread and its schedule (which leases are due, when to wake, when to
sweep); :mod:`celery_exclusive._refreshing` sends the refreshes and applies their answers;
:mod:`celery_exclusive._inflight` holds the calls in flight and their deadlines.

Deadlines. Every store call runs in a thread of its own. The heartbeat thread never waits
for a call: it dispatches it and goes on watching every lease's local deadline, so a call
stuck in TCP retransmission (a partition that healed after the request vanished) cannot
starve the other leases. A refresh has two deadlines derived from its leases. After
:func:`refresh_timeout` (at most an interval) the heartbeat gives up waiting: the leases go
to JEOPARDY and are refreshed again on another connection (the stuck one stays with the
stuck call), in calls apart from the healthy leases', so one lease's hanging call cannot
take theirs down. The call itself may go on until :func:`call_timeout` (the earliest local
deadline: an answer after it is useless), which the provider enforces on the socket
(``timeout=``); a slow store that answers by then still extends the leases.
An answer that still arrives is applied if it extends a lease: it was measured from its
send time, so it is safe however late it is. At most :data:`MAX_CALLS` calls are waited
for and :data:`MAX_THREADS` call threads alive (given-up calls' included, each holding a
connection until its socket deadline); a lease due when no call can start waits for a
slot, and is declared LOST at its local deadline if none comes in time.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

# The deadlines and limits of the heartbeat's calls: defined with the calls, public here.
from celery_exclusive._inflight import (
    CALL_TIMEOUT_CAP,  # noqa: F401
    MAX_CALLS,
    MAX_THREADS,  # noqa: F401
    MIN_CALL_TIMEOUT,  # noqa: F401
    RELEASE_RETRY_TIMEOUT,
    SWEEP_TIMEOUT,
    Call,
    InFlight,
    call_timeout,  # noqa: F401
    refresh_timeout,  # noqa: F401
)
from celery_exclusive._refreshing import Refreshing
from celery_exclusive.lease import Lease
from celery_exclusive.providers.base import Completion, LockProvider

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger("celery_exclusive")

#: Longest the thread sleeps, in seconds. Releases do not wake it (a thread switch per
#: release costs as much as a fast round trip), so this bounds how long it takes to see
#: that the last lease is gone; one idle wake a second is negligible.
MAX_SLEEP = 1.0
#: Why a lease past its local deadline is lost (as ``Lease.state`` says it too).
_PAST_DEADLINE = "the lease was not confirmed before its local deadline"
#: The thread exits after this many seconds with no lease held or added; the next lease
#: starts a new one. Counted from the last acquisition, not the last release: a stream of
#: short locks keeps one thread (waking once a second), instead of a thread started, with
#: its switches and GIL hand-overs, every second or two.
IDLE_EXIT = 1.0


class _Sweeper:
    """When the heartbeat sweeps dead rows (``sweep(timeout) -> rows``), and the sweep call.

    Every ``interval`` seconds (jittered to 80-100 % of it, so processes started together
    spread out and no gap exceeds it), the first one within an interval of the first pass;
    soon again after a full batch, to work through a backlog. Never while a sweep is in
    flight or while refreshes use more than half the call slots. A failure is logged at
    debug level and changes nothing else: leases never depend on it.
    """

    def __init__(self, sweep: Callable[[float], int], interval: float, limit: int) -> None:
        self._sweep = sweep
        self.interval = interval
        self.limit = limit
        self.at = math.inf  # when the next sweep is due (heartbeat clock); set on the first pass
        self.running = False

    def due(self, now: float, inflight: InFlight) -> bool:
        if self.at == math.inf:
            self.at = now + random.uniform(0.0, self.interval)
        if self.running or now < self.at or len(inflight.calls) > MAX_CALLS // 2:
            return False
        self.running = True
        return True

    def run(self, call: Call, clock: Callable[[], float], inflight: InFlight) -> None:
        removed = 0
        try:
            removed = self._sweep(SWEEP_TIMEOUT)
            if removed:
                logger.debug("celery-exclusive heartbeat swept %d dead row(s)", removed)
        except Exception as exc:  # the sweep is housekeeping: it never affects a lease
            logger.debug("celery-exclusive heartbeat sweep failed: %s", exc)
        finally:
            pause = 0.05 if removed >= self.limit else random.uniform(0.8, 1.0)
            self.at = clock() + self.interval * pause
            self.running = False
            inflight.finish(call)
            call.done.set()


class Heartbeat:
    """Refreshes the registered leases; ``mutex`` guards every lease's state."""

    def __init__(
        self,
        provider: LockProvider,
        *,
        clock: Callable[[], float],
        lose: Callable[[Lease, str], None],
        refreshed: Callable[[list[Lease], float], None],
        failed: Callable[[list[Lease], Exception], None],
        batch_size: int = 1000,
        thread_factory: Callable[..., threading.Thread] = threading.Thread,
        sweep: Callable[[float], int] | None = None,
        sweep_interval: float = 60.0,
        sweep_limit: int = 500,
    ) -> None:
        self.mutex = threading.Lock()
        # sweep(timeout) deletes dead rows; run every ~sweep_interval while the thread runs.
        self._sweep = _Sweeper(sweep, sweep_interval, sweep_limit) if sweep is not None else None
        self._clock = clock
        self._lose = lose
        self._batch_size = batch_size
        self._thread_factory = thread_factory
        self._leases: dict[int, Lease] = {}
        #: Leases added since the thread last looked (see add()): appended without the mutex,
        #: taken into ``_leases`` by whoever holds it next (:meth:`_adopt`).
        self._fresh: deque[Lease] = deque()
        #: Set by every add(), cleared by the thread when it judges idleness (see IDLE_EXIT).
        self._added = False
        self._wake = threading.Event()
        self._refreshing = Refreshing(
            provider,
            mutex=self.mutex,
            clock=clock,
            lose=lose,
            refreshed=refreshed,
            failed=failed,
            wake=self._wake,
        )
        self._inflight = self._refreshing.inflight
        self._pending_release = self._inflight.pending_release  # the same dict (tests look at it)
        self._stop = threading.Event()
        #: Set by stop(): no thread starts again (the service is closed).
        self._ended = False
        self._thread: threading.Thread | None = None
        # When the sleeping thread wakes by itself (clock time); +inf while it is awake
        # (or starting), when it scans every lease before it sleeps again.
        self._wake_at = math.inf

    def add(self, lease: Lease) -> None:
        """Start keeping ``lease`` alive.

        Neither the mutex nor the thread's event is touched while the thread runs and the
        lease is not due before the thread wakes anyway (at most :data:`MAX_SLEEP` away): the
        lease is appended to ``_fresh`` (atomic), and the thread takes it in at its next pass,
        by when a short run has released it already. Waking the thread for every acquisition
        would cost a thread switch per lock, as much as the round trip of an uncontended Redis
        acquire. The thread clears ``_thread`` (under the mutex) before it looks at ``_fresh``
        a last time and exits, so a lease appended before that read is seen by it, and one
        appended after sees ``_thread`` None here and starts a new thread.
        """
        self._fresh.append(lease)
        self._added = True
        if self._thread is None:  # not running: the first lease, or the thread went idle
            with self.mutex:
                if self._start_thread():
                    return
        # lease._wake_at() inline: its next refresh, or its local deadline if earlier or final.
        deadline, next_refresh = lease._deadline, lease._next_refresh
        if (deadline if lease._final or deadline < next_refresh else next_refresh) < self._wake_at:
            self._wake.set()

    def _adopt(self) -> None:
        """Take the leases added since into ``_leases``, dropping those already released or
        lost (caller holds ``mutex``: one taker at a time)."""
        fresh, leases = self._fresh, self._leases
        while fresh:
            lease = fresh.popleft()
            if lease._live():
                leases[id(lease)] = lease

    def _start_thread(self) -> bool:
        """Start the thread unless it is running or the heartbeat was stopped (caller holds
        ``mutex``); True if started."""
        if self._ended or (self._thread is not None and self._thread.is_alive()):
            return False
        self._stop.clear()
        self._wake_at = math.inf
        self._thread = self._thread_factory(target=self._run, name="celery-exclusive-heartbeat", daemon=True)
        self._thread.start()
        return True

    def discard(self, lease: Lease) -> None:
        """Stop refreshing ``lease`` (caller holds ``mutex``).

        A lease not taken in yet is dropped from ``_fresh`` too when it is the newest there
        (a short run's, released before the thread's next pass), so nothing keeps it, its
        holder and callbacks alive for up to a second (into the garbage collector's older
        generations). Only the mutex holder takes from ``_fresh``; add() appends without it,
        so a lease appended between the test and the pop is put back (its order does not
        matter: the next taker adopts every live one). ``_fresh`` is looked at first: a
        lease is in it or in ``_leases``, never both (:meth:`_adopt` moves it under the
        mutex), and a short run's is the newest there."""
        fresh = self._fresh
        if fresh and fresh[-1] is lease:
            newest = fresh.pop()
            if newest is not lease:  # another thread's add() came in between: keep it
                fresh.append(newest)
        else:
            self._leases.pop(id(lease), None)

    def retry_release(
        self, store_key: str, token: str, until: float, completion: Completion | None = None
    ) -> None:
        """Keep releasing ``token``'s lease on ``store_key`` until the store answers or ``until``.

        For releases whose outcome was unknown and acquisitions whose reply was lost: the
        token is kept until a release is confirmed, so no lease is orphaned for its ttl.
        ``completion``: the run's record, written by each retried release (else a copy of
        the run's message arriving later would find neither lease nor record, and run again).
        A release carrying one is retried for as long as the record is to be kept
        (``completion.retain``) if that is longer than ``until``: the store writes the record
        whether or not the token still owns the key, and a copy of the message may arrive at
        any time in that span, so an outage longer than the lease's ttl must not lose it.
        """
        if completion is not None:
            until = max(until, self._clock() + completion.retain)
        with self.mutex:
            self._inflight.add_release(store_key, token, until, completion)
            self._start_thread()
        self._wake.set()

    def releasing(self, store_key: str, token: str) -> bool:
        """Whether the release of ``token``'s lease on ``store_key`` is still being retried
        (:meth:`retry_release`): the store has not confirmed it, so the lease may still hold
        the key. False once it got through or its ``until`` passed."""
        with self.mutex:
            return (store_key, token) in self._inflight.pending_release

    def held(self) -> list[Lease]:
        """The leases currently kept alive."""
        with self.mutex:
            self._adopt()
            return list(self._leases.values())

    def inherited(self) -> list[Lease]:
        """In a forked child, the leases this (the parent's) heartbeat kept: read without the
        mutex, which a parent's thread may have held at the fork (the child has one thread)."""
        return [*self._leases.values(), *self._fresh]

    @property
    def running(self) -> bool:
        """True while the heartbeat thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def closing(self) -> None:
        """Note that the service's close() has begun (caller holds ``mutex``): it releases
        the leases and stops the heartbeat next, so a refresh failing from now on is not
        said to be retried (see :meth:`stop`)."""
        self._inflight.closing = True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread for good (no lease added or release retried later starts it
        again), waiting up to ``timeout`` for it to end (it makes no store call itself:
        at once). Leases are not released: that is the service's job. The store calls it
        started are not waited for (on a silent store each would take its deadline, up to
        :data:`CALL_TIMEOUT_CAP`): the service closes the store next, and each such call
        closes it again when it ends, so a connection it opened is not left open."""
        with self.mutex:
            self._ended = True
            self._inflight.stopped = True
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self.mutex:
                if self._thread is threading.current_thread():
                    self._thread = None  # add() starts a fresh thread under this mutex

    def _loop(self) -> None:
        delay = 0.0
        idle_since: float | None = None
        while not self._stop.is_set():
            self._wake.wait(delay)
            self._wake.clear()
            with self.mutex:
                self._wake_at = math.inf  # until it sleeps again, every add() wakes it
            if self._stop.is_set():
                return
            try:
                self._pass(apart=True)
                delay = self._next_delay()
            except Exception:  # the heartbeat must outlive any bug or outage
                logger.warning("celery-exclusive heartbeat pass failed; retrying in 1 s", exc_info=True)
                delay = 1.0
            with self.mutex:
                now = self._clock()
                self._adopt()
                if self._leases or self._added or not self._inflight.idle():
                    self._added = False
                    idle_since = None
                else:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= IDLE_EXIT:
                        self._thread = None  # add() starts a fresh thread under this mutex
                        if not self._fresh:  # read after the write above: see add()
                            return
                        self._thread = threading.current_thread()  # a lease came meanwhile
                        idle_since, delay = None, 0.0  # a pass now takes it in
                    else:
                        delay = min(delay, IDLE_EXIT - (now - idle_since) + 0.01)
                # Set under the mutex that add() holds: a lease added after this is
                # compared with the wake-up the thread will really have.
                self._wake_at = now + delay

    def beat(self) -> float:
        """One pass: refresh what is due, mark what is lost; returns seconds until the next.

        Waits for the calls it started, each until its deadline (the thread never does).
        """
        for call in self._pass():
            call.done.wait(max(call.deadline - self._clock(), 0.0) + 0.05)
        self._refreshing.abandon_overdue(self._clock())
        return self._next_delay()

    def _pass(self, *, apart: bool = False) -> list[Call]:
        """Lose what is past its deadline (``apart``: in a thread of its own, see
        :meth:`_lose_apart`), give up overdue calls, start calls for what is due."""
        now = self._clock()
        self._refreshing.abandon_overdue(now)
        lost: list[Lease] = []
        due = self._due(now, lost)
        if lost:
            if apart:
                self._lose_apart(lost)
            else:
                for lease in lost:
                    self._lose(lease, _PAST_DEADLINE)
        started = self._refreshing.start(due, now, self._batch_size) if due else []
        pending = self._inflight.releases_due()
        if pending:
            timeout = RELEASE_RETRY_TIMEOUT * len(pending)
            call = self._inflight.start(
                [], now, (timeout, timeout), self._inflight.retry_releases, pending, releases=True
            )
            if call is not None:
                started.append(call)
        if self._sweep is not None and self._sweep.due(now, self._inflight):
            # After the refreshes, in a call thread of its own: it never delays them.
            call = None
            try:
                call = self._inflight.start(
                    [], now, (SWEEP_TIMEOUT, SWEEP_TIMEOUT), self._sweep.run, self._clock, self._inflight
                )
            finally:
                if call is None:  # refused, or its thread did not start: due again next pass
                    self._sweep.running = False
            if call is not None:
                started.append(call)
        return started

    def _lose_apart(self, lost: list[Lease]) -> None:
        """Lose ``lost`` (past their local deadlines) in a thread of their own: a loss runs the
        holder's ``on_lost`` callbacks and ``lock_lost`` receivers, and one that blocks (a
        release of the lost lease while the store is down takes 2 s) must not keep this
        thread from refreshing the other leases, which would be lost in turn."""

        def lose() -> None:
            for lease in lost:
                self._lose(lease, _PAST_DEADLINE)

        with self.mutex:  # not looked at again meanwhile (the thread's next pass may come first)
            for lease in lost:
                self.discard(lease)
        try:
            self._thread_factory(target=lose, name="celery-exclusive-lost", daemon=True).start()
        except RuntimeError:  # no new thread (the interpreter is shutting down): here, then
            lose()

    def _due(self, now: float, lost: list[Lease]) -> list[Lease]:
        """The leases to refresh now (none unless one is strictly due: the others ride along);
        the ones past their local deadline go to ``lost``."""
        with self.mutex:
            self._adopt()
            active = list(self._leases.values())
            busy = set(self._inflight.busy)
        due: list[Lease] = []
        strictly_due = False
        for lease in active:
            what = lease._due(now)
            if what == "lost":
                lost.append(lease)
            elif what != "later" and id(lease) not in busy:
                due.append(lease)
                strictly_due = strictly_due or what == "now"
        return due if strictly_due else []

    def _refresh(self, leases: Sequence[Lease]) -> None:
        """Refresh ``leases`` now, in the calling thread (``celery_exclusive.testing``'s
        fake-clock passes); the heartbeat thread itself only starts calls."""
        self._refreshing.refresh_now(leases)

    def _next_delay(self) -> float:
        now = self._clock()
        with self.mutex:
            self._adopt()
            busy = self._inflight.busy
            # No call can start: a due lease waits for a slot (a call's answer or deadline, a
            # thread's end wakes the thread) or its local deadline, not its refresh time (a spin).
            full = self._inflight.full()
            wake = [lease._wake_at(refreshing=full or id(lease) in busy) for lease in self._leases.values()]
            wake += self._inflight.wake_times()
            if self._inflight.pending_release:
                wake.append(now + 1.0)
            if self._sweep is not None and self._leases and not self._sweep.running:
                wake.append(max(self._sweep.at, now + 0.25))  # 0.25: not a spin while slots are busy
        if not wake:
            return MAX_SLEEP
        return min(max(min(wake) - now, 0.001), MAX_SLEEP)
