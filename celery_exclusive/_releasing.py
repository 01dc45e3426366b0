"""How the lock service ends leases: release (with its ``hold_at_least`` cooldown and the
background retry of a release the store did not answer) and loss.

Part of the lock core (it serves :mod:`celery_exclusive.service`, which it does not import:
the service is passed in).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery_exclusive import signals, waiting
from celery_exclusive._core import Service
from celery_exclusive._store import as_store_error
from celery_exclusive.errors import BackendError, InvalidArgumentError
from celery_exclusive.lease import Lease, ReleaseOutcome
from celery_exclusive.providers.base import Completion, RefreshRequest, accepts_timeout
from celery_exclusive.validation import seconds

logger = logging.getLogger("celery_exclusive")

#: Longest a release waits for the store before it reports UNKNOWN (the heartbeat then
#: keeps retrying it in the background), in seconds.
RELEASE_TIMEOUT = 2.0
#: A global read, not an enum class attribute (read through ``EnumType.__getattr__``'s
#: hook on Python 3.11: about 850 instructions).
_RELEASED = ReleaseOutcome.RELEASED


def release_later(
    service: Service, key: str, token: str, within: float, completion: Completion | None = None
) -> None:
    """Release ``token``'s lease on ``key`` in the background, writing ``completion`` with it
    where ``service`` keeps records: its heartbeat retries each second until the store
    answers or ``within`` seconds have passed (by when the lease has surely expired)."""
    record = completion if service.keeps_records else None
    until = service.clock() + within
    service.heartbeat.retry_release(service.prefix + key, token, until=until, completion=record)


class Releasing:
    """Releases and loses a service's leases; keeps the cooldowns of ``hold_at_least`` leases."""

    def __init__(self, service: Service) -> None:
        self._service = service
        #: Leases taken with ``hold_at_least``: (seconds, when the grant arrived on the clock).
        #: Popped at release (or loss), so a lease never outlives its use here.
        self._cooldowns: dict[Lease, tuple[float, float]] = {}
        #: Whether the provider's release takes ``timeout=`` (checked once; every built-in
        #: store's does): then release() calls it without StoreCalls.call's frame.
        self._direct = accepts_timeout(service.provider.release)
        #: The keys whose next wait gives way to their waiters (noted at each release).
        self.turns = waiting.Turns(service.provider)
        self._had_waiters = self.turns.had_waiters
        #: The set behind the store's ``had_waiters`` where it says so (``woken_keys``:
        #: Redis, PostgreSQL), tested inline after each release, without the call.
        woken = getattr(service.provider, "woken_keys", None) if self._had_waiters is not None else None
        self._woken_keys: set[str] | None = woken if type(woken) is set else None

    def after_fork_in_child(self) -> None:
        """Forget the parent's cooldowns: its leases are not the child's to release."""
        self._cooldowns = {}

    def check_cooldown(self, hold_at_least: float | timedelta, max_lifetime: object) -> float:
        cooldown = seconds("hold_at_least", hold_at_least)
        lifetime = (
            self._service.max_lifetime if max_lifetime is None else seconds("max_lifetime", max_lifetime)
        )
        if cooldown > lifetime:
            raise InvalidArgumentError(
                f"hold_at_least ({cooldown:g} s) must not exceed max_lifetime ({lifetime:g} s)"
            )
        return cooldown

    def cool(self, lease: Lease, cooldown: float | None) -> None:
        if cooldown is not None:
            self._cooldowns[lease] = (cooldown, self._service.clock())

    def _release_cooling(
        self, lease: Lease, left: float, completion: Completion | None, within: float | None = None
    ) -> ReleaseOutcome:
        """End a ``hold_at_least`` lease ``left`` seconds from now instead of deleting it.

        A refresh sets the expiry to ``min(store now + ttl, hard deadline)`` on every store, so
        it shortens a lease as well as it extends one. The completion record is written by a
        release under a token that owns nothing (a store writes the record whether or not the
        token owns the key, and deletes only what it owns).
        """
        service = self._service
        timeout = min(service.call_timeout, RELEASE_TIMEOUT, RELEASE_TIMEOUT if within is None else within)
        try:
            answers = service._call(
                "release",
                service.provider.refresh,
                [RefreshRequest(lease.store_key, lease.token, left)],
                timeout=timeout,
            )
            if completion is not None:
                service._call(
                    "record",
                    service.provider.release,
                    lease.store_key,
                    "cooldown:" + lease.token,
                    completion,
                    timeout=timeout,
                )
        except BackendError as exc:
            # The lease then ends at its own expiry (no heartbeat keeps it): later than asked.
            logger.warning(
                "could not shorten lock %r (fence %d) to its cooldown: %s", lease.key, lease.fence, exc
            )
            outcome = ReleaseOutcome.UNKNOWN
            if completion is not None:  # the record is still owed: a token owning nothing writes it
                service._heartbeat.retry_release(
                    lease.store_key,
                    "cooldown:" + lease.token,
                    until=lease._deadline_at() + lease.ttl,
                    completion=completion,
                )
        else:
            outcome = (
                ReleaseOutcome.RELEASED if answers and answers[0] is not None else ReleaseOutcome.NOT_OWNED
            )
        signals.send(
            signals.lock_released,
            service,
            key=lease.key,
            lease=lease,
            outcome=outcome,
            held_for=service.clock() - lease.acquired_at,
        )
        return outcome

    def release(  # noqa: PLR0912, PLR0915 - the hot path, inline
        self, lease: Lease, completion: Completion | None, within: float | None = None
    ) -> ReleaseOutcome:
        """See :meth:`LockService.release` (``completion`` already checked); ``within``: a
        shorter deadline for the store call, in seconds (``LockService.close``'s)."""
        service = self._service
        try:
            mine = lease._service is service  # an attribute read: no getattr() call
        except AttributeError:
            mine = False
        if not mine:
            # Checked before the lease is marked released: another service would mark it,
            # miss it in its own heartbeat and delete from its own store, leaving the key
            # held with nothing refreshing it (or releasing it) until its ttl.
            raise InvalidArgumentError(
                f"release() takes a Lease taken through this service, got {_described(lease)}: "
                "release it with lease.release() or through the service that took it"
            )
        heartbeat = service._heartbeat
        # ``with heartbeat.mutex``, spelt out: a with block looks up the lock's __enter__ and
        # __exit__ on its type and binds __exit__ (about 0.5k instructions per release).
        mutex = heartbeat.mutex
        mutex.acquire()
        try:
            was_lost = lease._mark_released()
            if was_lost is None:
                return ReleaseOutcome.NOT_OWNED
            heartbeat.discard(lease)
        finally:
            mutex.release()
        if service._ended:
            logger.warning(
                "lock %r (fence %d) released after its service was closed: it ends at its ttl",
                lease.key,
                lease.fence,
            )
            held_for = service.clock() - lease.acquired_at
            outcome = ReleaseOutcome.UNKNOWN
            signals.send(
                signals.lock_released, service, key=lease.key, lease=lease, outcome=outcome, held_for=held_for
            )
            return outcome
        cooling = self._cooldowns.pop(lease, None) if self._cooldowns else None
        if cooling is not None and not was_lost:
            left = cooling[0] - (service.clock() - cooling[1])
            if left > 0.001:
                return self._release_cooling(lease, left, completion, within)
        # Delete the lease from the store (recording ``completion``); UNKNOWN when the store
        # does not answer, the heartbeat then retrying the release in the background.
        timeout = service.call_timeout
        timeout = RELEASE_TIMEOUT if timeout > RELEASE_TIMEOUT else timeout  # min(), without its call
        if within is not None and within < timeout:
            timeout = within
        try:  # a provider keeping the deadline (every built-in one) without StoreCalls.call
            if self._direct:  # the usual calls, without a star-args tuple
                owned = (
                    service.provider.release(lease.store_key, lease.token, timeout=timeout)
                    if completion is None
                    else service.provider.release(lease.store_key, lease.token, completion, timeout=timeout)
                )
            else:
                # ``completion`` only when given: a third-party provider may not take it.
                args = (
                    (lease.store_key, lease.token)
                    if completion is None
                    else (lease.store_key, lease.token, completion)
                )
                owned = service._calls.call("release", service.provider.release, *args, timeout=timeout)
        except BaseException as exc:
            error = as_store_error("release", exc)
            if not isinstance(error, BackendError):
                # A signal handler's exception (SoftTimeLimitExceeded, KeyboardInterrupt) or a
                # bug, perhaps before the request went out: the lease is no longer kept, so
                # the heartbeat finishes the release (else the key stays held until its ttl).
                service._heartbeat.retry_release(
                    lease.store_key,
                    lease.token,
                    until=lease._deadline_at() + lease.ttl,
                    completion=completion,
                )
                raise
            outcome = self._unanswered(lease, error, completion)
        else:
            outcome = _RELEASED if owned else self._not_owned(lease, warn=not was_lost)
            if owned:
                woken = self._woken_keys
                if woken is not None:  # Woken.told inline: an empty set (the usual) holds no key
                    if woken and lease.store_key in woken:
                        woken.discard(lease.store_key)
                        self.turns.note(lease.key)  # Turns.released, without its frame
                elif self._had_waiters is not None and self._had_waiters(lease.store_key):
                    self.turns.note(lease.key)
        if self._service._ended:  # close() closed the store during the call: closed again
            service.provider.close()
        if signals.lock_released.receivers:  # signals.send's test, before reading the clock
            held_for = service.clock() - lease.acquired_at
            signals.lock_released.send(
                sender=service, key=lease.key, lease=lease, outcome=outcome, held_for=held_for
            )
        return outcome

    def give_back(self, lease: Lease) -> None:
        """Delete ``lease``, taken while close() ran, from the store (unless close() released
        it already), even if close() closed the store: then closed again after. Logged if
        the store does not answer (the key ends at its ttl: the heartbeat has stopped)."""
        service = self._service
        heartbeat = service._heartbeat
        with heartbeat.mutex:
            if lease._mark_released() is None:
                return
            heartbeat.discard(lease)
        timeout = min(service.call_timeout, RELEASE_TIMEOUT)
        try:
            service._calls.call(
                "release", service.provider.release, lease.store_key, lease.token, timeout=timeout
            )
        except BackendError as exc:
            logger.warning("could not release lock %r (fence %d) at close: %s", lease.key, lease.fence, exc)
        finally:
            if service._ended:
                service.provider.close()

    def _unanswered(self, lease: Lease, exc: BackendError, completion: Completion | None) -> ReleaseOutcome:
        """UNKNOWN, the release (and its ``completion`` record) retried by the heartbeat in
        the background; not once close() has begun: the heartbeat stops and retries nothing."""
        if self._service._closed:
            logger.warning(
                "could not release lock %r (fence %d) at close: %s; it ends at its ttl%s",
                lease.key,
                lease.fence,
                exc,
                ", its completion record unwritten" if completion is not None else "",
            )
            return ReleaseOutcome.UNKNOWN
        logger.warning("could not release lock %r (fence %d): %s; will retry", lease.key, lease.fence, exc)
        self._service._heartbeat.retry_release(
            lease.store_key, lease.token, until=lease._deadline_at() + lease.ttl, completion=completion
        )
        return ReleaseOutcome.UNKNOWN

    def _not_owned(self, lease: Lease, *, warn: bool) -> ReleaseOutcome:
        """NOT_OWNED, logged as a warning unless the lease was known to be lost already."""
        if warn:
            logger.warning(
                "lock %r (fence %d) was no longer held at release: it expired or was taken "
                "over, so the protected work may have overlapped another holder's",
                lease.key,
                lease.fence,
            )
        return ReleaseOutcome.NOT_OWNED

    def lose(self, lease: Lease, reason: str) -> None:
        """Make ``lease`` LOST (if it is live) and tell everyone: log, signal, callbacks."""
        service = self._service
        with service.heartbeat.mutex:
            lost = lease._mark_lost()
            if lost is None:
                return
            service.heartbeat.discard(lease)
            self._cooldowns.pop(lease, None)
        callbacks, event = lost
        if event is not None:  # None unless someone asked for it; ``lost`` then sets it itself
            event.set()
        logger.warning("lock %r (fence %d) LOST: %s", lease.key, lease.fence, reason)
        signals.send(signals.lock_lost, service, key=lease.key, lease=lease, reason=reason)
        for callback in callbacks:
            try:
                callback(lease, reason)
            except Exception:
                logger.exception("on_lost callback for lock %r failed", lease.key)


def _described(lease: object) -> str:
    """What was passed as a lease, for an error message."""
    if isinstance(lease, Lease):
        return f"the lease of {lease.key!r} (fence {lease.fence}) of another service"
    return type(lease).__name__
