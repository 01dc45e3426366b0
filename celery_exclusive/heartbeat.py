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
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_exclusive.errors import BackendError
from celery_exclusive.lease import Lease, LeaseState
from celery_exclusive.providers.base import LockProvider, RefreshRequest, accepts_timeout

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
_refresh_interval = operator.attrgetter("refresh_interval")


def _request(lease: Lease) -> RefreshRequest:
    """The lease's refresh request, made once: it never changes."""
    request = lease._request = RefreshRequest(lease.store_key, lease.token, lease.ttl)
    return request


def call_timeout(leases: Sequence[Lease], now: float) -> float:
    """Seconds from ``now`` a refresh of ``leases`` may take on the socket: until the earliest
    local deadline (after it the leases are LOST anyway), within
    [:data:`MIN_CALL_TIMEOUT`, :data:`CALL_TIMEOUT_CAP`]."""
    left = min(lease._deadline for lease in leases) - now
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
    left = min(lease._deadline for lease in leases) - now
    return float(max(MIN_CALL_TIMEOUT, min(interval, left / 2, CALL_TIMEOUT_CAP)))


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
    ) -> None:
        self.mutex = threading.Lock()
        self._provider = provider
        self._timeouts = accepts_timeout(provider.refresh) and accepts_timeout(provider.release)
        self._clock = clock
        self._lose = lose
        self._refreshed = refreshed
        self._failed = failed
        self._batch_size = batch_size
        self._thread_factory = thread_factory
        self._leases: dict[int, Lease] = {}
        # (store key, token) -> monotonic time after which the store has surely expired it.
        self._pending_release: dict[tuple[str, str], float] = {}
        self._calls: list[_Call] = []  # in flight and not yet abandoned
        self._busy: set[int] = set()  # id() of the leases those calls carry
        self._releasing: _Call | None = None
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
        due = lease._deadline if lease._final else min(lease._deadline, lease._next_refresh)
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
            self._pending_release[(store_key, token)] = until
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
                if self._leases or self._pending_release or self._calls:
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
        with self.mutex:
            active = list(self._leases.values())
            pending = list(self._pending_release.items()) if self._releasing is None else []
            busy = set(self._busy)
        due: list[Lease] = []
        strictly_due = False
        for lease in active:
            if now >= lease._deadline:
                self._lose(lease, "the lease was not confirmed before its local deadline")
                continue
            if id(lease) in busy:
                continue
            if not lease._final and lease._next_refresh - lease.refresh_interval / 2 <= now:
                due.append(lease)
                strictly_due = strictly_due or lease._next_refresh <= now
        started: list[_Call] = []
        if strictly_due:
            # Leases in JEOPARDY (their last call failed or was given up) go in calls of
            # their own: whatever made theirs hang (a slow node, a dead connection) must not
            # take the healthy leases' refresh down with it.
            healthy = [lease for lease in due if lease._state is LeaseState.HELD]
            failing = [lease for lease in due if lease._state is not LeaseState.HELD]
            for group in (healthy, failing):
                for first in range(0, len(group), self._batch_size):
                    batch = group[first : first + self._batch_size]
                    call = self._start(batch, now, refresh_timeout(batch, now), call_timeout(batch, now))
                    if call is None:
                        break  # every slot is taken by calls still in flight: retry next pass
                    started.append(call)
        if pending:
            timeout = RELEASE_RETRY_TIMEOUT * len(pending)
            call = self._start([], now, timeout, timeout, pending)
            if call is not None:
                started.append(call)
        return started

    def _start(
        self,
        leases: Sequence[Lease],
        now: float,
        timeout: float,
        socket_timeout: float,
        releases: list[tuple[tuple[str, str], float]] | None = None,
    ) -> _Call | None:
        """Run one refresh (or the pending releases) in a thread of its own; None if no slot."""
        call = _Call(leases, now, timeout, socket_timeout)
        with self.mutex:
            if len(self._calls) >= MAX_CALLS:
                return None
            self._calls.append(call)
            self._busy.update(map(id, leases))
            if releases is not None:
                self._releasing = call
        # Not thread_factory's: that one makes the heartbeat thread (tests replace it).
        if releases is None:
            thread = threading.Thread(target=self._refresh_call, args=(call,), name="celery-exclusive-call")
        else:
            thread = threading.Thread(
                target=self._retry_releases, args=(call, releases), name="celery-exclusive-call"
            )
        thread.daemon = True
        thread.start()
        return call

    def _finish(self, call: _Call) -> bool:
        """Mark ``call`` answered; False if it had been abandoned already."""
        with self.mutex:
            call.finished = True
            if call.abandoned:
                return False
            self._calls.remove(call)
            self._busy.difference_update(map(id, call.leases))
            if self._releasing is call:
                self._releasing = None
        return True

    def _abandon_overdue(self, now: float) -> None:
        """Give up waiting for every call past its deadline: its leases may be refreshed again."""
        with self.mutex:
            overdue = [c for c in self._calls if not c.finished and now >= c.deadline]
            for call in overdue:
                call.abandoned = True
                self._calls.remove(call)
                self._busy.difference_update(map(id, call.leases))
                if self._releasing is call:
                    self._releasing = None
        for call in overdue:
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
        requests = [lease._request or _request(lease) for lease in leases]
        if self._timeouts:
            return self._provider.refresh(requests, timeout=timeout)
        return self._provider.refresh(requests)

    def _refresh_call(self, call: _Call) -> None:
        leases = call.leases
        sent = call.sent
        try:
            answers = self._send_refresh(leases, call.socket_timeout)
        except Exception as exc:
            if self._finish(call):
                self._jeopardy(leases, sent, exc)
            self._done(call)
            return
        late = not self._finish(call)
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
        shortest = min(map(_refresh_interval, leases))
        if duration > shortest / 2:
            logger.warning(
                "celery-exclusive heartbeat overran: refreshing %d leases took %.3f s "
                "(shortest refresh interval %.3f s)",
                len(leases),
                duration,
                shortest,
            )
        confirmed: list[Lease] = []
        disowned: list[Lease] = []
        final: list[Lease] = []
        live = (LeaseState.HELD, LeaseState.JEOPARDY)
        with self.mutex:  # once per batch: a thousand leases confirm in well under a millisecond
            for lease, granted in zip(leases, answers, strict=True):
                if granted is None:
                    disowned.append(lease)
                    continue
                if lease._state in live:
                    if late and sent + granted - lease._margin <= lease._deadline:
                        continue  # a later refresh already said more
                    lease._confirm(sent, granted, clamped=granted < lease.ttl * 0.99 - 1e-3)
                    confirmed.append(lease)
                if lease._final:
                    final.append(lease)
        for lease in disowned:
            self._lose(lease, "the store no longer lists this token: the lease expired or was taken over")
        for lease in final:
            logger.warning(
                "lock %r reached its max lifetime (%g s); it will be allowed to expire",
                lease.key,
                lease.max_lifetime,
            )
        self._refreshed(confirmed, duration)

    def _jeopardy(self, leases: Sequence[Lease], sent: float, exc: Exception) -> None:
        logger.warning(
            "celery-exclusive could not refresh %d lease(s): %s; will retry before their deadlines",
            len(leases),
            exc,
        )
        with self.mutex:
            for lease in leases:
                if lease._state is LeaseState.HELD:
                    lease._state = LeaseState.JEOPARDY
                # Retry soon, several times before the local deadline, never faster than 20/s.
                remaining = lease._deadline - sent
                lease._next_refresh = sent + min(lease.refresh_interval, max(0.05, remaining / 4))
        self._failed(list(leases), exc)

    def _retry_releases(self, call: _Call, releases: list[tuple[tuple[str, str], float]]) -> None:
        try:
            for (store_key, token), until in releases:
                if call.abandoned:
                    return
                try:
                    if self._timeouts:
                        self._provider.release(store_key, token, timeout=RELEASE_RETRY_TIMEOUT)
                    else:
                        self._provider.release(store_key, token)
                except Exception:
                    if self._clock() < until:
                        continue  # still unknown; the store may still hold it, try again next pass
                with self.mutex:
                    self._pending_release.pop((store_key, token), None)
        finally:
            self._finish(call)
            call.done.set()

    def _next_delay(self) -> float:
        now = self._clock()
        with self.mutex:
            leases = self._leases.values()
            wake = [lease._deadline for lease in leases]
            wake += [
                lease._next_refresh for lease in leases if not lease._final and id(lease) not in self._busy
            ]
            wake += [call.deadline for call in self._calls]
            if self._pending_release:
                wake.append(now + 1.0)
        if not wake:
            return MAX_SLEEP
        return min(max(min(wake) - now, 0.001), MAX_SLEEP)
