"""One heartbeat thread per service: it keeps every held lease alive in batched round trips.

Each pass refreshes the leases that are due (and those nearly due, to share the round
trip) with one ``provider.refresh`` call per ``batch_size`` leases, marks leases LOST
when the store disowns them or their local deadline passes, and retries releases whose
outcome was unknown. The thread never dies of an exception: it logs and goes on. The
clock and thread factory are injectable, and :meth:`Heartbeat.beat` runs one pass, so
tests can drive it without sleeping.

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
send time, so it is safe however late it is.
"""

from __future__ import annotations

import logging
import math
import operator
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_exclusive.errors import BackendError
from celery_exclusive.lease import Lease
from celery_exclusive.providers.base import LockProvider, accepts_timeout

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger("celery_exclusive")

#: Longest the thread sleeps, in seconds. Releases do not wake it (a thread switch per
#: release costs as much as a fast round trip), so this bounds how long it takes to see
#: that the last lease is gone; one idle wake a second is negligible.
MAX_SLEEP = 1.0
#: The thread exits after this many seconds with no lease; the next lease starts a new one.
IDLE_EXIT = 1.0
#: Longest any heartbeat store call may take, in seconds, whatever the leases' durations.
CALL_TIMEOUT_CAP = 10.0
#: Shortest deadline a heartbeat call gets, in seconds (a LAN round trip is far shorter).
MIN_CALL_TIMEOUT = 0.05
#: Deadline of each retried release, in seconds.
RELEASE_RETRY_TIMEOUT = 2.0
#: Store calls in flight at once (abandoned ones included); more leases wait for a slot.
MAX_CALLS = 16
#: Deadline of a sweep call (``sweep=``), in seconds; it holds one call slot meanwhile.
SWEEP_TIMEOUT = 5.0
_refresh_interval = operator.attrgetter("refresh_interval")
_FINAL = "lock %r reached its max lifetime (%g s); it will be allowed to expire"
#: (store key, token) of a release to retry, and the time after which the store surely expired it.
_Release = tuple[tuple[str, str], float]


def _deadline(lease: Lease) -> float:
    return lease._deadline_at()


def call_timeout(leases: Sequence[Lease], now: float) -> float:
    """Seconds from ``now`` a refresh of ``leases`` may take on the socket: until the earliest
    local deadline (after it the leases are LOST anyway), within
    [:data:`MIN_CALL_TIMEOUT`, :data:`CALL_TIMEOUT_CAP`]."""
    left = min(map(_deadline, leases)) - now
    return float(max(MIN_CALL_TIMEOUT, min(left, CALL_TIMEOUT_CAP)))


def refresh_timeout(leases: Sequence[Lease], now: float) -> float:
    """Seconds from ``now`` the heartbeat waits for a refresh of ``leases`` before it sends
    another on a fresh connection.

    At most the shortest refresh interval (so a stuck call is given up before the next
    refresh falls due) and half the time left to the earliest local deadline (so one retry
    on a fresh connection still fits before the lease is declared LOST), and at most
    :data:`CALL_TIMEOUT_CAP`; at least :data:`MIN_CALL_TIMEOUT`.
    """
    interval = min(map(_refresh_interval, leases))
    left = min(map(_deadline, leases)) - now
    return float(max(MIN_CALL_TIMEOUT, min(interval, left / 2, CALL_TIMEOUT_CAP)))


def _warn_if_overran(leases: Sequence[Lease], duration: float) -> None:
    shortest = min(map(_refresh_interval, leases))
    if duration > shortest / 2:
        logger.warning(
            "celery-exclusive heartbeat overran: refreshing %d leases took %.3f s "
            "(shortest refresh interval %.3f s)",
            len(leases),
            duration,
            shortest,
        )


class _Call:
    """One store call in flight: its leases (none for releases), send time and deadline."""

    __slots__ = ("abandoned", "deadline", "done", "finished", "leases", "sent", "socket_timeout", "timeout")

    def __init__(self, leases: Sequence[Lease], sent: float, timeout: float, socket_timeout: float) -> None:
        self.leases = leases
        self.sent = sent
        self.timeout = timeout  # the heartbeat stops waiting after this
        self.socket_timeout = max(socket_timeout, timeout)  # the provider gives up after this
        self.deadline = sent + timeout
        self.finished = False
        self.abandoned = False
        self.done = threading.Event()


class _InFlight:
    """The heartbeat's store calls in flight, each in a thread of its own, and the releases
    still to retry. At most :data:`MAX_CALLS` at once; a call past its deadline is given up
    (its leases may be refreshed again on another connection) and its thread left to end
    by itself. Every method takes ``mutex`` (the heartbeat's) itself."""

    def __init__(
        self, mutex: threading.Lock, release: Callable[[str, str], object], clock: Callable[[], float]
    ) -> None:
        self.mutex = mutex
        self._release = release  # one retried release, with its deadline
        self._clock = clock
        self.calls: list[_Call] = []  # in flight and not yet abandoned
        self.busy: set[int] = set()  # id() of the leases those calls carry
        # (store key, token) -> monotonic time after which the store has surely expired it.
        self.pending_release: dict[tuple[str, str], float] = {}
        self.releasing: _Call | None = None

    def start(
        self,
        leases: Sequence[Lease],
        now: float,
        timeouts: tuple[float, float],
        target: Callable[..., None],
        *args: object,
        releases: bool = False,
    ) -> _Call | None:
        """Run ``target(call, *args)`` in a thread of its own; None if no slot is free.
        ``timeouts``: how long the heartbeat waits for it, and how long it may take."""
        call = _Call(leases, now, *timeouts)
        with self.mutex:
            if len(self.calls) >= MAX_CALLS:
                return None
            self.calls.append(call)
            self.busy.update(map(id, leases))
            if releases:
                self.releasing = call
        # Not the heartbeat's thread_factory: that one makes the heartbeat thread (tests replace it).
        thread = threading.Thread(target=target, args=(call, *args), name="celery-exclusive-call")
        thread.daemon = True
        thread.start()
        return call

    def start_refreshes(
        self, due: list[Lease], now: float, batch_size: int, refresh: Callable[[_Call], None]
    ) -> list[_Call]:
        """Start ``refresh(call)`` for ``due`` in batches of ``batch_size``, in as many calls as
        there are free slots."""
        # Leases in JEOPARDY (their last call failed or was given up) go in calls of their
        # own: whatever made theirs hang (a slow node, a dead connection) must not take the
        # healthy leases' refresh down with it.
        started: list[_Call] = []
        failing = [lease for lease in due if lease._failing()]
        healthy = [lease for lease in due if not lease._failing()] if failing else due
        for group in (healthy, failing):
            for first in range(0, len(group), batch_size):
                batch = group[first : first + batch_size]
                timeouts = (refresh_timeout(batch, now), call_timeout(batch, now))
                call = self.start(batch, now, timeouts, refresh)
                if call is None:
                    break  # every slot is taken by calls still in flight: retry next pass
                started.append(call)
        return started

    def _drop(self, call: _Call) -> None:
        """Forget ``call`` (caller holds ``mutex``)."""
        self.calls.remove(call)
        self.busy.difference_update(map(id, call.leases))
        if self.releasing is call:
            self.releasing = None

    def finish(self, call: _Call) -> bool:
        """Mark ``call`` answered; False if it had been abandoned already."""
        with self.mutex:
            call.finished = True
            if call.abandoned:
                return False
            self._drop(call)
        return True

    def abandon_overdue(self, now: float) -> list[_Call]:
        """Give up waiting for every call past its deadline; returns them."""
        with self.mutex:
            overdue = [c for c in self.calls if not c.finished and now >= c.deadline]
            for call in overdue:
                call.abandoned = True
                self._drop(call)
        return overdue

    def add_release(self, store_key: str, token: str, until: float) -> None:
        """Retry releasing ``token``'s lease on ``store_key`` until confirmed or ``until``
        (caller holds ``mutex``)."""
        self.pending_release[(store_key, token)] = until

    def releases_due(self) -> list[_Release]:
        """The releases to retry now: all pending, unless a retry call is still in flight."""
        with self.mutex:
            return list(self.pending_release.items()) if self.releasing is None else []

    def retry_releases(self, call: _Call, releases: list[_Release]) -> None:
        """Release each of ``releases`` once, in ``call``'s thread; a release the store
        answered, or past its ``until``, is no longer pending."""
        try:
            for (store_key, token), until in releases:
                if call.abandoned:
                    return
                try:
                    self._release(store_key, token)
                except Exception:
                    if self._clock() < until:
                        continue  # still unknown; the store may still hold it, try again next pass
                with self.mutex:
                    self.pending_release.pop((store_key, token), None)
        finally:
            self.finish(call)
            call.done.set()

    def wake_times(self) -> list[float]:
        """When the heartbeat must look again for the calls' sake (caller holds ``mutex``)."""
        return [call.deadline for call in self.calls]

    def idle(self) -> bool:
        """True with no call in flight and no release to retry (caller holds ``mutex``)."""
        return not self.calls and not self.pending_release


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

    def due(self, now: float, inflight: _InFlight) -> bool:
        if self.at == math.inf:
            self.at = now + random.uniform(0.0, self.interval)
        if self.running or now < self.at or len(inflight.calls) > MAX_CALLS // 2:
            return False
        self.running = True
        return True

    def run(self, call: _Call, clock: Callable[[], float], inflight: _InFlight) -> None:
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
        self._provider = provider
        self._timeouts = accepts_timeout(provider.refresh) and accepts_timeout(provider.release)
        self._clock = clock
        self._lose = lose
        self._refreshed = refreshed
        self._failed = failed
        self._batch_size = batch_size
        self._thread_factory = thread_factory
        self._leases: dict[int, Lease] = {}
        self._inflight = _InFlight(self.mutex, self._release_once, clock)
        self._pending_release = self._inflight.pending_release  # the same dict (tests look at it)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # When the sleeping thread wakes by itself (clock time); +inf while it is awake
        # (or starting), when it scans every lease before it sleeps again.
        self._wake_at = math.inf

    def add(self, lease: Lease) -> None:
        """Start keeping ``lease`` alive.

        The thread is woken only if ``lease`` is due before it would wake anyway: waking it
        for every acquisition costs a thread switch per lock, which measured as much as the
        round trip of an uncontended Redis acquire.
        """
        due = lease._wake_at()
        with self.mutex:
            self._leases[id(lease)] = lease
            wake = not self._start_thread() and due < self._wake_at
        if wake:
            self._wake.set()

    def _start_thread(self) -> bool:
        """Start the thread unless it is running (caller holds ``mutex``); True if started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._stop.clear()
        self._wake_at = math.inf
        self._thread = self._thread_factory(target=self._run, name="celery-exclusive-heartbeat", daemon=True)
        self._thread.start()
        return True

    def discard(self, lease: Lease) -> None:
        """Stop refreshing ``lease`` (caller holds ``mutex``)."""
        self._leases.pop(id(lease), None)

    def retry_release(self, store_key: str, token: str, until: float) -> None:
        """Keep releasing ``token``'s lease on ``store_key`` until the store answers or ``until``.

        For releases whose outcome was unknown and acquisitions whose reply was lost: the
        token is kept until a release is confirmed, so no lease is orphaned for its ttl.
        """
        with self.mutex:
            self._inflight.add_release(store_key, token, until)
            self._start_thread()
        self._wake.set()

    def held(self) -> list[Lease]:
        """The leases currently kept alive."""
        with self.mutex:
            return list(self._leases.values())

    @property
    def running(self) -> bool:
        """True while the heartbeat thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (leases are not released: that is the service's job)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
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
                self._pass()
                delay = self._next_delay()
            except Exception:  # the heartbeat must outlive any bug or outage
                logger.warning("celery-exclusive heartbeat pass failed; retrying in 1 s", exc_info=True)
                delay = 1.0
            with self.mutex:
                now = self._clock()
                if self._leases or not self._inflight.idle():
                    idle_since = None
                else:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= IDLE_EXIT:
                        self._thread = None  # add() starts a fresh thread under this mutex
                        return
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
        self._abandon_overdue(self._clock())
        return self._next_delay()

    def _pass(self) -> list[_Call]:
        """Lose what is past its deadline, give up overdue calls, start calls for what is due."""
        now = self._clock()
        self._abandon_overdue(now)
        due = self._due(now)
        started = (
            self._inflight.start_refreshes(due, now, self._batch_size, self._refresh_call) if due else []
        )
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
            call = self._inflight.start(
                [], now, (SWEEP_TIMEOUT, SWEEP_TIMEOUT), self._sweep.run, self._clock, self._inflight
            )
            if call is not None:
                started.append(call)
            else:
                self._sweep.running = False
        return started

    def _due(self, now: float) -> list[Lease]:
        """The leases to refresh now (none unless one is strictly due: the others ride along);
        the ones past their local deadline are lost on the way."""
        with self.mutex:
            active = list(self._leases.values())
            busy = set(self._inflight.busy)
        due: list[Lease] = []
        strictly_due = False
        for lease in active:
            what = lease._due(now)
            if what == "lost":
                self._lose(lease, "the lease was not confirmed before its local deadline")
            elif what != "later" and id(lease) not in busy:
                due.append(lease)
                strictly_due = strictly_due or what == "now"
        return due if strictly_due else []

    def _abandon_overdue(self, now: float) -> None:
        """Give up waiting for every call past its deadline: its leases may be refreshed again."""
        for call in self._inflight.abandon_overdue(now):
            if call.leases:
                error = BackendError(
                    f"lock store gave no answer to a refresh within {call.timeout:.3g} s; "
                    "trying again on another connection"
                )
                self._jeopardy(call.leases, call.sent, error)
            call.done.set()

    def _refresh(self, leases: Sequence[Lease]) -> None:
        """Refresh ``leases`` now, in the calling thread (``celery_exclusive.testing``'s
        fake-clock passes); the heartbeat thread itself only starts calls."""
        sent = self._clock()
        try:
            answers = self._send_refresh(leases, call_timeout(leases, sent))
        except Exception as exc:
            self._jeopardy(leases, sent, exc)
            return
        self._apply(leases, sent, answers, late=False)

    def _send_refresh(self, leases: Sequence[Lease], timeout: float) -> list[float | None]:
        requests = [lease._refresh_request() for lease in leases]
        if self._timeouts:
            return self._provider.refresh(requests, timeout=timeout)
        return self._provider.refresh(requests)

    def _refresh_call(self, call: _Call) -> None:
        leases = call.leases
        sent = call.sent
        try:
            answers = self._send_refresh(leases, call.socket_timeout)
        except Exception as exc:
            if self._inflight.finish(call):
                self._jeopardy(leases, sent, exc)
            self._done(call)
            return
        late = not self._inflight.finish(call)
        try:
            self._apply(leases, sent, answers, late=late)
        finally:
            self._done(call)

    def _done(self, call: _Call) -> None:
        call.done.set()
        self._wake.set()  # the thread recomputes its wake-up: these leases are due later now

    def _apply(
        self, leases: Sequence[Lease], sent: float, answers: list[float | None], *, late: bool
    ) -> None:
        duration = self._clock() - sent
        _warn_if_overran(leases, duration)
        confirmed: list[Lease] = []
        disowned: list[Lease] = []
        final: list[Lease] = []
        with self.mutex:  # once per batch: a thousand leases confirm in well under a millisecond
            for lease, granted in zip(leases, answers, strict=True):
                if granted is None:
                    disowned.append(lease)
                    continue
                if lease._confirm(sent, granted, late=late):
                    confirmed.append(lease)
                    if lease._final_reached():
                        final.append(lease)
        for lease in disowned:
            self._lose(lease, "the store no longer lists this token: the lease expired or was taken over")
        for lease in final:
            logger.warning(_FINAL, lease.key, lease.max_lifetime)
        self._refreshed(confirmed, duration)

    def _jeopardy(self, leases: Sequence[Lease], sent: float, exc: Exception) -> None:
        logger.warning(
            "celery-exclusive could not refresh %d lease(s): %s; will retry before their deadlines",
            len(leases),
            exc,
        )
        with self.mutex:
            for lease in leases:
                lease._jeopardise(sent)
        self._failed(list(leases), exc)

    def _release_once(self, store_key: str, token: str) -> None:
        if self._timeouts:
            self._provider.release(store_key, token, timeout=RELEASE_RETRY_TIMEOUT)
        else:
            self._provider.release(store_key, token)

    def _next_delay(self) -> float:
        now = self._clock()
        with self.mutex:
            busy = self._inflight.busy
            wake = [lease._wake_at(refreshing=id(lease) in busy) for lease in self._leases.values()]
            wake += self._inflight.wake_times()
            if self._inflight.pending_release:
                wake.append(now + 1.0)
            if self._sweep is not None and self._leases and not self._sweep.running:
                wake.append(max(self._sweep.at, now + 0.25))  # 0.25: not a spin while slots are busy
        if not wake:
            return MAX_SLEEP
        return min(max(min(wake) - now, 0.001), MAX_SLEEP)
