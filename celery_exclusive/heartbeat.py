"""One heartbeat thread per service: it keeps every held lease alive in batched round trips.

Each pass refreshes the leases that are due (and those nearly due, to share the round
trip) with one ``provider.refresh`` call per ``batch_size`` leases, marks leases LOST
when the store disowns them or their local deadline passes, and retries releases whose
outcome was unknown. The thread never dies of an exception: it logs and goes on. The
clock and thread factory are injectable, and :meth:`Heartbeat.beat` runs one pass, so
tests can drive it without sleeping.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_exclusive.lease import Lease, LeaseState
from celery_exclusive.providers.base import LockProvider, RefreshRequest

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

logger = logging.getLogger("celery_exclusive")

#: Longest the thread sleeps, in seconds. Releases do not wake it (a thread switch per
#: release costs as much as a fast round trip), so this bounds how long it takes to see
#: that the last lease is gone; one idle wake a second is negligible.
MAX_SLEEP = 1.0
#: The thread exits after this many seconds with no lease; the next lease starts a new one.
IDLE_EXIT = 1.0
#: While a store call blocks, the deadline watcher looks at the leases at least this often.
WATCH_POLL = 0.1
_refresh_interval = operator.attrgetter("refresh_interval")


def _request(lease: Lease) -> RefreshRequest:
    """The lease's refresh request, made once: it never changes."""
    request = lease._request = RefreshRequest(lease.store_key, lease.token, lease.ttl)
    return request


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
        self._clock = clock
        self._lose = lose
        self._refreshed = refreshed
        self._failed = failed
        self._batch_size = batch_size
        self._thread_factory = thread_factory
        self._leases: dict[int, Lease] = {}
        # (store key, token) -> monotonic time after which the store has surely expired it.
        self._pending_release: dict[tuple[str, str], float] = {}
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
                delay = self.beat()
            except Exception:  # the heartbeat must outlive any bug or outage
                logger.warning("celery-exclusive heartbeat pass failed; retrying in 1 s", exc_info=True)
                delay = 1.0
            with self.mutex:
                now = self._clock()
                if self._leases or self._pending_release:
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
        """One pass: refresh what is due, mark what is lost; returns seconds until the next."""
        now = self._clock()
        with self.mutex:
            active = list(self._leases.values())
            pending = list(self._pending_release.items())
        due: list[Lease] = []
        strictly_due = False
        earliest = math.inf  # the first local deadline of the leases still held
        for lease in active:
            if now >= lease._deadline:
                self._lose(lease, "the lease was not confirmed before its local deadline")
                continue
            earliest = min(earliest, lease._deadline)
            if not lease._final and lease._next_refresh - lease.refresh_interval / 2 <= now:
                due.append(lease)
                strictly_due = strictly_due or lease._next_refresh <= now
        if strictly_due or pending:
            with self._watching_deadlines(earliest):
                if strictly_due:
                    for start in range(0, len(due), self._batch_size):
                        self._refresh(due[start : start + self._batch_size])
                for (store_key, token), until in pending:
                    self._retry_release(store_key, token, until)
        return self._next_delay()

    def _refresh(self, leases: Sequence[Lease]) -> None:
        sent = self._clock()
        requests = [lease._request or _request(lease) for lease in leases]
        try:
            answers = self._provider.refresh(requests)
        except Exception as exc:
            self._jeopardy(leases, sent, exc)
            return
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

    def _retry_release(self, store_key: str, token: str, until: float) -> None:
        try:
            self._provider.release(store_key, token)
        except Exception:
            if self._clock() < until:
                return  # still unknown; the store may still hold it, try again next pass
        with self.mutex:
            self._pending_release.pop((store_key, token), None)

    @contextlib.contextmanager
    def _watching_deadlines(self, earliest: float) -> Iterator[None]:
        """Around a pass's store calls: while they block (a silent network can hold one for
        a socket timeout, or forever), a watcher thread declares LOST each lease whose local
        deadline passes, so ``lost`` and ``on_lost`` fire before the store can expire it."""
        done = threading.Event()
        watcher = self._thread_factory(
            target=self._watch_deadlines,
            args=(done, earliest),
            name="celery-exclusive-deadlines",
            daemon=True,
        )
        watcher.start()
        try:
            yield
        finally:
            done.set()

    def _watch_deadlines(self, done: threading.Event, wake_at: float) -> None:
        # Wakes at the first deadline, and every WATCH_POLL to see leases added meanwhile;
        # a pass that ends sooner (the usual case) costs no scan at all.
        while not done.wait(max(min(wake_at - self._clock(), WATCH_POLL), 0.001)):
            now = self._clock()
            with self.mutex:
                leases = list(self._leases.values())
            wake_at = math.inf
            for lease in leases:
                if now >= lease._deadline:
                    self._lose(lease, "the lease was not confirmed before its local deadline (store silent)")
                elif lease._deadline < wake_at:
                    wake_at = lease._deadline

    def _next_delay(self) -> float:
        now = self._clock()
        with self.mutex:
            wake = [lease._deadline for lease in self._leases.values()]
            wake += [lease._next_refresh for lease in self._leases.values() if not lease._final]
            if self._pending_release:
                wake.append(now + 1.0)
        if not wake:
            return MAX_SLEEP
        return min(max(min(wake) - now, 0.001), MAX_SLEEP)
