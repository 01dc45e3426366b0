"""How the heartbeat refreshes its leases: it sends each batch in a call of its own (see
:mod:`celery_exclusive._inflight`) and turns what comes back into lease states.

Part of the lock core (it serves :mod:`celery_exclusive.heartbeat`). An answer confirms
the leases it extends (measured from the call's send time, so it is safe however late it
arrives), loses those the store no longer lists; a call that fails or is given up at its
deadline puts its leases in JEOPARDY, to be refreshed again on another connection. Every
lease transition is made under the heartbeat's ``mutex``, once per batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_exclusive._inflight import RELEASE_RETRY_TIMEOUT, Call, InFlight, call_timeout, interval_of
from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import Completion, LockProvider, accepts_timeout

if TYPE_CHECKING:
    from collections.abc import Sequence

    from celery_exclusive.lease import Lease

logger = logging.getLogger("celery_exclusive")

_FINAL = "lock %r reached its max lifetime (%g s); it will be allowed to expire"


def _warn_if_overran(leases: Sequence[Lease], duration: float) -> None:
    shortest = min(map(interval_of, leases))
    if duration > shortest / 2:
        logger.warning(
            "celery-exclusive heartbeat overran: refreshing %d leases took %.3f s "
            "(shortest refresh interval %.3f s)",
            len(leases),
            duration,
            shortest,
        )


class Refreshing:
    """Sends a heartbeat's refreshes and applies their answers (see the module docstring).

    ``lose(lease, reason)``, ``refreshed(leases, duration)`` and ``failed(leases, error)`` are
    the service's: a lease the store disowned, the leases a call confirmed, the leases a failed
    or given-up call put in JEOPARDY. ``wake`` is set after each answer, so the heartbeat
    recomputes its wake-up. :attr:`inflight` holds the calls (and the releases to retry).
    """

    def __init__(
        self,
        provider: LockProvider,
        *,
        mutex: threading.Lock,
        clock: Callable[[], float],
        lose: Callable[[Lease, str], None],
        refreshed: Callable[[list[Lease], float], None],
        failed: Callable[[list[Lease], Exception], None],
        wake: threading.Event,
    ) -> None:
        self._provider = provider
        self._timeouts = accepts_timeout(provider.refresh) and accepts_timeout(provider.release)
        self._mutex = mutex
        self._clock = clock
        self._lose = lose
        self._refreshed = refreshed
        self._failed = failed
        self._wake = wake
        self.inflight = InFlight(mutex, self.release_once, clock, provider.close, wake.set)

    def start(self, due: list[Lease], now: float, batch_size: int) -> list[Call]:
        """Start the refreshes of ``due`` (in batches, as call slots allow); the calls started."""
        return self.inflight.start_refreshes(due, now, batch_size, self._call)

    def abandon_overdue(self, now: float) -> None:
        """Give up waiting for every call past its deadline: its leases may be refreshed again."""
        for call in self.inflight.abandon_overdue(now):
            if call.leases:
                error = BackendError(
                    f"lock store gave no answer to a refresh within {call.timeout:.3g} s; "
                    "trying again on another connection"
                )
                self._jeopardy(call.leases, call.sent, error)
            call.done.set()

    def refresh_now(self, leases: Sequence[Lease]) -> None:
        """Refresh ``leases`` now, in the calling thread (``celery_exclusive.testing``'s
        fake-clock passes); the heartbeat thread itself only starts calls."""
        sent = self._clock()
        try:
            answers = self._send(leases, call_timeout(leases, sent))
        except Exception as exc:
            self._jeopardy(leases, sent, exc)
            return
        self._apply(leases, sent, answers, late=False)

    def _send(self, leases: Sequence[Lease], timeout: float) -> list[float | None]:
        requests = [lease._refresh_request() for lease in leases]
        if self._timeouts:
            return self._provider.refresh(requests, timeout=timeout)
        return self._provider.refresh(requests)

    def _call(self, call: Call) -> None:
        leases = call.leases
        sent = call.sent
        try:
            answers = self._send(leases, call.socket_timeout)
        except Exception as exc:
            if self.inflight.finish(call):
                self._jeopardy(leases, sent, exc)
            self._done(call)
            return
        late = not self.inflight.finish(call)
        try:
            self._apply(leases, sent, answers, late=late)
        finally:
            self._done(call)

    def _done(self, call: Call) -> None:
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
        with self._mutex:  # once per batch: a thousand leases confirm in well under a millisecond
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
        inflight = self.inflight
        if inflight.stopped or inflight.closing:
            # A call that failed once close() began: nothing retries it after close (the
            # heartbeat stops when close() has released the leases). The leases close()
            # released (or gave up releasing, and said so) are not live.
            leases = [lease for lease in leases if lease._live()]
            if not leases:
                return
            if inflight.stopped:
                logger.warning(
                    "celery-exclusive could not refresh %d lease(s) after close: %s; nothing "
                    "refreshes them any more, they end at their ttl",
                    len(leases),
                    exc,
                )
            else:
                logger.warning(
                    "celery-exclusive could not refresh %d lease(s) while close() releases: %s; "
                    "nothing refreshes them after it, they end at their ttl unless it releases them",
                    len(leases),
                    exc,
                )
        else:
            logger.warning(
                "celery-exclusive could not refresh %d lease(s): %s; will retry before their deadlines",
                len(leases),
                exc,
            )
        with self._mutex:
            for lease in leases:
                lease._jeopardise(sent)
        self._failed(list(leases), exc)

    def release_once(self, store_key: str, token: str, completion: Completion | None = None) -> bool:
        """One retried release (writing ``completion``, a run's record, if given: the store
        writes it whether or not the token still owns the key); True if it is final: the
        store released the lease, or found none of ``token``'s and runs no statement that
        could still record one (a provider's ``settled``: PostgreSQL's dropped sessions
        still executing; other stores have none)."""
        provider = self._provider
        args = (store_key, token) if completion is None else (store_key, token, completion)
        if self._timeouts:
            if provider.release(*args, timeout=RELEASE_RETRY_TIMEOUT):
                return True
        elif provider.release(*args):
            return True
        settled = getattr(provider, "settled", None)
        return settled is None or bool(settled(timeout=RELEASE_RETRY_TIMEOUT))
