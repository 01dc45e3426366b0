"""The heartbeat's store calls in flight: a thread each, at most :data:`MAX_CALLS` waited
for and :data:`MAX_THREADS` threads alive at once, their deadlines (:func:`refresh_timeout`,
:func:`call_timeout`), and the releases still to retry.

Part of the lock core: it serves :mod:`celery_exclusive.heartbeat` (whose docstring says
why each call has two deadlines) and :mod:`celery_exclusive._refreshing`; the heartbeat
re-exports the deadlines and constants.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from celery_exclusive.lease import Lease
    from celery_exclusive.providers.base import Completion

#: Longest any heartbeat store call may take, in seconds, whatever the leases' durations.
CALL_TIMEOUT_CAP = 10.0
#: Shortest deadline a heartbeat call gets, in seconds (a LAN round trip is far shorter).
MIN_CALL_TIMEOUT = 0.05
#: Deadline of each retried release, in seconds.
RELEASE_RETRY_TIMEOUT = 2.0
#: Store calls the heartbeat waits for at once (not given up yet); more leases wait for a slot.
MAX_CALLS = 16
#: Call threads alive at once, those of calls given up included: such a thread still waits
#: on its connection, until its socket deadline (``Call.socket_timeout``, at most
#: :data:`CALL_TIMEOUT_CAP`). Room for each call waited for to be given up and sent once
#: more on a fresh connection (a dead connection's cure) while the first still waits; past
#: it no call starts (a store gone silent would only get one more connection) until one
#: ends, and a lease with no call is declared LOST at its local deadline as ever.
MAX_THREADS = 2 * MAX_CALLS
#: Least time between two warnings that :data:`MAX_THREADS` kept calls from starting, in seconds.
CAP_WARNING_INTERVAL = 60.0
#: Deadline of a sweep call (``sweep=``), in seconds; it holds one call slot meanwhile.
SWEEP_TIMEOUT = 5.0
#: A lease's refresh interval.
interval_of = operator.attrgetter("refresh_interval")
#: (store key, token) of a release to retry, and the time after which the store surely expired it.
Release = tuple[tuple[str, str], float]

logger = logging.getLogger("celery_exclusive")


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
    interval = min(map(interval_of, leases))
    left = min(map(_deadline, leases)) - now
    return float(max(MIN_CALL_TIMEOUT, min(interval, left / 2, CALL_TIMEOUT_CAP)))


class Call:
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


class InFlight:
    """The heartbeat's store calls in flight, each in a thread of its own, and the releases
    still to retry. A call past its deadline is given up (its leases may be refreshed again
    on another connection) and its thread left to end by itself. A call starts only while
    fewer than :data:`MAX_CALLS` are waited for and fewer than :data:`MAX_THREADS` threads
    are alive; ``freed()`` is called when a thread ends that had kept one from starting.
    Every method takes ``mutex`` (the heartbeat's) itself, unless it says otherwise."""

    def __init__(
        self,
        mutex: threading.Lock,
        release: Callable[[str, str, Completion | None], bool],
        clock: Callable[[], float],
        close_store: Callable[[], None],
        freed: Callable[[], None],
    ) -> None:
        self.mutex = mutex
        self._release = release  # one retried release (with its record, if any), with its deadline
        self._clock = clock
        self._close_store = close_store
        self._freed = freed
        #: Call threads started whose ``_run`` has not returned (given-up calls' included).
        self.threads = 0
        #: Set by the heartbeat's stop(): the service closes the store next, without waiting
        #: for the calls in flight, and each of them closes it again when it ends.
        self.stopped = False
        #: Set when the service's close() begins (it releases the leases held, then stops
        #: the heartbeat): nothing retries a refresh that fails from then on after close.
        self.closing = False
        self.calls: list[Call] = []  # in flight and not yet abandoned
        self.busy: set[int] = set()  # id() of the leases those calls carry
        # (store key, token) -> monotonic time after which the store has surely expired it.
        self.pending_release: dict[tuple[str, str], float] = {}
        # (store key, token) -> the completion record its release writes (a run's, see add_release).
        self.pending_records: dict[tuple[str, str], Completion] = {}
        self.releasing: Call | None = None
        #: Calls refused at the thread cap since its last warning, and when that was (monotonic).
        self._refused = 0
        self._warned_at = -CAP_WARNING_INTERVAL

    def start(
        self,
        leases: Sequence[Lease],
        now: float,
        timeouts: tuple[float, float],
        target: Callable[..., None],
        *args: object,
        releases: bool = False,
    ) -> Call | None:
        """Run ``target(call, *args)`` in a thread of its own; None if no slot is free (see
        :meth:`full`; refusals at :data:`MAX_THREADS` are a WARNING at most each
        :data:`CAP_WARNING_INTERVAL`). ``timeouts``: how long the heartbeat waits for it, and
        how long it may take. A thread that cannot start (RuntimeError) is not counted: the
        call is forgotten and the error raised."""
        call = Call(leases, now, *timeouts)
        with self.mutex:
            refused = self.full()
            warning = self._refused_at_cap() if refused else None
            if not refused:
                self.threads += 1
                self.calls.append(call)
                self.busy.update(map(id, leases))
                if releases:
                    self.releasing = call
        if warning is not None:
            logger.warning(
                "celery-exclusive: all %d heartbeat call threads are busy, %d of them of calls "
                "given up (still waiting on a store that does not answer); %d call(s) could not "
                "start since the last such warning. A lease whose refresh cannot start is "
                "declared LOST at its local deadline.",
                *warning,
            )
        if refused:
            return None
        # Not the heartbeat's thread_factory: that one makes the heartbeat thread (tests replace it).
        thread = threading.Thread(target=self._run, args=(target, call, *args), name="celery-exclusive-call")
        thread.daemon = True
        try:
            thread.start()
        except BaseException:
            with self.mutex:
                self.threads -= 1
                if call in self.calls:
                    self._drop(call)
            raise
        return call

    def _refused_at_cap(self) -> tuple[int, int, int] | None:
        """Count a call refused; (threads, of calls given up, refused) if it was refused at
        :data:`MAX_THREADS` and no warning was given for :data:`CAP_WARNING_INTERVAL`
        (caller holds ``mutex``)."""
        if self.threads < MAX_THREADS:
            return None  # MAX_CALLS waited for: ordinary back-pressure, the calls end by their deadlines
        self._refused += 1
        at = time.monotonic()
        if at - self._warned_at < CAP_WARNING_INTERVAL:
            return None
        refused, self._refused, self._warned_at = self._refused, 0, at
        return self.threads, self.threads - len(self.calls), refused

    def _run(self, target: Callable[..., None], call: Call, *args: object) -> None:
        try:
            target(call, *args)
        finally:
            # Read after the call gave its connection back: if the heartbeat had not stopped
            # by then, the service's close() comes later and closes that connection itself.
            if self.stopped:
                with contextlib.suppress(Exception):  # a thread's last act: nothing to tell
                    self._close_store()  # a connection the call opened on the closed store
            with self.mutex:
                self.threads -= 1
                capped = self.threads == MAX_THREADS - 1
            if capped:
                self._freed()  # a call can start again: the heartbeat need not wait for a deadline

    def full(self) -> bool:
        """True if no call can start now: :data:`MAX_CALLS` waited for, or :data:`MAX_THREADS`
        threads alive (caller holds ``mutex``)."""
        return len(self.calls) >= MAX_CALLS or self.threads >= MAX_THREADS

    def start_refreshes(
        self, due: list[Lease], now: float, batch_size: int, refresh: Callable[[Call], None]
    ) -> list[Call]:
        """Start ``refresh(call)`` for ``due`` in batches of ``batch_size``, in as many calls as
        there are free slots."""
        # Leases in JEOPARDY (their last call failed or was given up) go in calls of their
        # own: whatever made theirs hang (a slow node, a dead connection) must not take the
        # healthy leases' refresh down with it.
        started: list[Call] = []
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

    def _drop(self, call: Call) -> None:
        """Forget ``call`` (caller holds ``mutex``)."""
        self.calls.remove(call)
        self.busy.difference_update(map(id, call.leases))
        if self.releasing is call:
            self.releasing = None

    def finish(self, call: Call) -> bool:
        """Mark ``call`` answered; False if it had been abandoned already."""
        with self.mutex:
            call.finished = True
            if call.abandoned:
                return False
            self._drop(call)
        return True

    def abandon_overdue(self, now: float) -> list[Call]:
        """Give up waiting for every call past its deadline; returns them."""
        with self.mutex:
            overdue = [c for c in self.calls if not c.finished and now >= c.deadline]
            for call in overdue:
                call.abandoned = True
                self._drop(call)
        return overdue

    def add_release(
        self, store_key: str, token: str, until: float, completion: Completion | None = None
    ) -> None:
        """Retry releasing ``token``'s lease on ``store_key`` until confirmed or ``until``,
        writing ``completion`` with it if given (caller holds ``mutex``)."""
        self.pending_release[(store_key, token)] = until
        if completion is not None:
            self.pending_records[(store_key, token)] = completion

    def releases_due(self) -> list[Release]:
        """The releases to retry now: all pending, unless a retry call is still in flight."""
        with self.mutex:
            return list(self.pending_release.items()) if self.releasing is None else []

    def retry_releases(self, call: Call, releases: list[Release]) -> None:
        """Release each of ``releases`` once, in ``call``'s thread; a release the store
        answered for good (``release`` returned True), or past its ``until``, is no longer
        pending."""
        try:
            for (store_key, token), until in releases:
                if call.abandoned:
                    return
                try:
                    final = self._release(store_key, token, self.pending_records.get((store_key, token)))
                except Exception:
                    final = False  # still unknown; the store may still hold it
                if not final and self._clock() < until:
                    # Try again next pass. Found nothing is not final while the store may still
                    # run the lost acquire (PostgreSQL: a dropped session still executing it).
                    continue
                with self.mutex:
                    self.pending_release.pop((store_key, token), None)
                    self.pending_records.pop((store_key, token), None)
        finally:
            self.finish(call)
            call.done.set()

    def wake_times(self) -> list[float]:
        """When the heartbeat must look again for the calls' sake (caller holds ``mutex``)."""
        return [call.deadline for call in self.calls]

    def idle(self) -> bool:
        """True with no call in flight and no release to retry (caller holds ``mutex``)."""
        return not self.calls and not self.pending_release
