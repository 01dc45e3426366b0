"""The lock service: policy (prefix, defaults, validation, heartbeat) over one provider.

Usable without Celery::

    service = LockService("postgresql://localhost/app")
    outcome = service.run_exclusive("community-pr:42", process)   # ExclusiveResult
    with service.lock("rollup") as lease:                           # LockedError if held
        ...
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from celery_exclusive import _options, _records, many

# Names re-exported from where they lived before the lock core was split (tests, users).
from celery_exclusive._acquiring import ACQUIRE_RETRY_DELAY, Acquiring  # noqa: F401
from celery_exclusive._leasing import Leasing
from celery_exclusive._options import FROM_ENV, SWEEP_ENV_VAR  # noqa: F401
from celery_exclusive._prefixed import PrefixedStore
from celery_exclusive._process import HOST as _HOST  # noqa: F401
from celery_exclusive._process import (
    new_token,  # noqa: F401
)
from celery_exclusive._process import this as _this
from celery_exclusive._releasing import RELEASE_TIMEOUT, Releasing
from celery_exclusive._store import (
    is_store_error,  # noqa: F401
)
from celery_exclusive.errors import InvalidArgumentError, LockedError
from celery_exclusive.heartbeat import Heartbeat
from celery_exclusive.lease import Lease, LostCallback, ReleaseOutcome, check_lost_callback
from celery_exclusive.providers.base import (
    MAX_TASK_ID_LENGTH,
    Completion,
    Held,
    LockInfo,
    LockProvider,
)
from celery_exclusive.semaphore import MAX_LIMIT
from celery_exclusive.urls import mask_url
from celery_exclusive.validation import MAX_LIFETIME_CAP, check_key, check_task_id, refused_call

T = TypeVar("T")
_logger = logging.getLogger("celery_exclusive")
#: ``callable``, typed so that testing a value typed callable is not unreachable code to mypy.
_callable: Callable[[object], bool] = callable

DEFAULT_PREFIX = "task-lock:"
DEFAULT_TTL = 15 * 60.0
DEFAULT_MAX_LIFETIME = MAX_LIFETIME_CAP
#: Default ``call_timeout``: seconds an acquire (its retry included), peek or scan may wait
#: for the store before it raises BackendError.
DEFAULT_CALL_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class ExclusiveResult(Generic[T]):
    """What :meth:`LockService.run_exclusive` did: ``result`` is set only when ``acquired``."""

    acquired: bool
    result: T | None = None
    fence: int | None = None
    holder: LockInfo | None = None


class LockService(PrefixedStore):
    """Acquires, keeps alive and releases leases on one lock store.

    ``store`` is a provider or a URL; None reads ``CELERY_EXCLUSIVE_URL``. One service per
    process is the intended use: it owns one heartbeat thread for all its leases. Safe to
    use from several threads, and across ``fork`` (a child starts with no leases and never
    reuses the parent's connections; its copies of the parent's leases are RELEASED, and
    releasing one there answers NOT_OWNED without touching the store).

    Every store call has a deadline: ``call_timeout`` for acquiring (its retry included),
    inspecting (``peek``, ``locks``, the completion records) and ``force_release``; at most
    :data:`RELEASE_TIMEOUT` for a lease's release. Past it the call raises BackendError
    (a release reports UNKNOWN) however silent the store is.
    """

    def __init__(
        self,
        store: LockProvider | str | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl: float | timedelta = DEFAULT_TTL,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta = DEFAULT_MAX_LIFETIME,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_batch_size: int = 1000,
        thread_factory: Callable[..., threading.Thread] = threading.Thread,
        call_timeout: float | timedelta = DEFAULT_CALL_TIMEOUT,
        sweep_interval: float | timedelta | None = FROM_ENV,
    ) -> None:
        durations = (ttl, refresh_interval, max_lifetime)
        callables = {"clock": clock, "thread_factory": thread_factory}
        options = _options.checked(
            prefix, durations, call_timeout, sweep_interval, heartbeat_batch_size, **callables
        )
        url, provider = _options.store_from(store)
        super().__init__(provider, url=url, prefix=options.prefix, call_timeout=options.call_timeout)
        #: Seconds between sweeps of dead rows by the heartbeat; None: off (see :meth:`sweep`).
        self.sweep_interval = options.sweep_interval
        self.ttl, self.refresh_interval, self.max_lifetime = options.durations
        self._refresh_explicit = options.refresh_explicit  # read by _acquiring
        self._batch_size = options.batch_size
        self.clock = clock
        self._thread_factory = thread_factory
        self._acquiring = Acquiring(self, self._records)
        self._releasing = Releasing(self)
        self._leasing = Leasing(self, self._acquiring, self._releasing)
        self._heartbeat = self._leasing.new_heartbeat()
        _live_services.add(self)

    def __repr__(self) -> str:
        where = mask_url(self._url) if self._url else repr(self.provider)
        return f"<LockService {where} prefix={self.prefix!r}>"

    @property
    def heartbeat(self) -> Heartbeat:
        """The heartbeat keeping this service's leases alive."""
        return self._heartbeat

    def held(self) -> list[Lease]:
        """The leases this process holds through this service."""
        return self._heartbeat.held()

    # -- acquiring ------------------------------------------------------------------------

    def try_lock(
        self,
        key: str,
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        wait: float | timedelta | None = None,
        hold_at_least: float | timedelta | None = None,
        limit: int = 1,
        on_lost: LostCallback | None = None,
    ) -> Lease | None:
        """Acquire ``key`` and keep it alive; None if someone else holds it (with ``limit``,
        if ``limit`` others do).

        With ``wait`` (seconds or a timedelta), retry until it is free or the time is up (see
        :mod:`celery_exclusive.waiting`); None only then. ``hold_at_least``, ``limit``,
        ``on_lost``: see :meth:`lock`."""
        if on_lost is not None and not _callable(on_lost):  # check_lost_callback's test, inline
            check_lost_callback(on_lost)
        if wait is None and hold_at_least is None and limit == 1 and type(limit) is int:  # the hot path
            # By position (name_holder, task_id, limit, on_lost): keywords cost a name match each.
            taken = self._acquiring.take(
                key, ttl, refresh_interval, max_lifetime, holder, False, None, 1, on_lost
            )
            return taken if type(taken) is Lease else None
        if wait is None and hold_at_least is None and type(limit) is int and 1 < limit <= MAX_LIMIT:
            # A semaphore's hot path (Leasing.try_lock's, limit checked so, without its call).
            taken = self._acquiring.take(
                key,
                ttl,
                refresh_interval,
                max_lifetime,
                holder,
                name_holder=False,
                limit=limit,
                on_lost=on_lost,
            )
            return taken if type(taken) is Lease else None
        durations = (ttl, refresh_interval, max_lifetime)
        return self._leasing.try_lock(
            key,
            durations,
            holder=holder,
            wait=wait,
            hold_at_least=hold_at_least,
            limit=limit,
            on_lost=on_lost,
        )

    def lock(
        self,
        key: str,
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        wait: float | timedelta | None = None,
        hold_at_least: float | timedelta | None = None,
        limit: int = 1,
        on_lost: LostCallback | None = None,
    ) -> Lease:
        """Acquire ``key`` and keep it alive, or raise :class:`LockedError` naming the holder.

        With ``wait`` (seconds or a timedelta, finite, >= 0), retry until it is free or the time is up,
        woken early by the holder's release where the store signals it (see
        :mod:`celery_exclusive.waiting`); LockedError only then.

        With ``hold_at_least`` (a cooldown, at most ``max_lifetime``), a release within that
        long of the grant does not free the key: it shortens the lease to end ``hold_at_least``
        after the grant and stops keeping it alive (one refresh, on the store's clock; a
        completion is still recorded, in a second call). Others see the key held until then;
        a crash meanwhile changes nothing, as nothing refreshes it any more.

        Not re-entrant: a key this process already holds is reported as held. The lease
        is a context manager that releases on exit; otherwise call ``lease.release()``.
        With ``task_id``, a live completion record of that id on ``key`` (written by
        ``lease.release(completion)``) makes it raise :class:`AlreadyDone` instead, checked
        in the same store call. Raises :class:`BackendError` when the store is unreachable
        (never LockedError).

        With ``limit`` (1 to :data:`~celery_exclusive.semaphore.MAX_LIMIT`), a leased
        semaphore: up to ``limit`` holders at once, each lease on its own slot (own token,
        fence, heartbeat, release); LockedError names a holder when all slots are taken. See
        :mod:`celery_exclusive.semaphore` (slot keys, changing the limit; ``task_id`` is
        ignored for ``limit > 1``).

        ``on_lost``: called as ``on_lost(lease, reason)`` once if the lease is lost, as
        :meth:`Lease.on_lost <celery_exclusive.lease.Lease.on_lost>` registers it, but in
        place from the grant on (no lock taken, no loss between the grant and the call to
        miss); not callable: :class:`InvalidArgumentError` before the store is asked.
        """
        if on_lost is not None and not _callable(on_lost):  # check_lost_callback's test, inline
            check_lost_callback(on_lost)
        if wait is None and hold_at_least is None and limit == 1 and type(limit) is int:
            # The hot path: Leasing.lock's, without its call.
            if task_id is not None:
                # check_task_id's whole test of the usual id (a non-empty ASCII str without
                # NUL, within the length), inline; anything else gets the full check.
                if not (
                    type(task_id) is str
                    and 0 < len(task_id) <= MAX_TASK_ID_LENGTH
                    and task_id.isascii()
                    and "\x00" not in task_id
                ):
                    check_task_id(task_id, MAX_TASK_ID_LENGTH)
                if not self.keeps_records:
                    task_id = None
            # By position (name_holder, task_id, limit, on_lost): keywords cost a name match each.
            taken = self._acquiring.take(
                key, ttl, refresh_interval, max_lifetime, holder, True, task_id, 1, on_lost
            )
            # The usual answer first: an isinstance() that fails also looks up the object's
            # __class__ as an attribute (about 0.25k instructions on Python 3.11).
            if type(taken) is Lease:
                return taken
            if isinstance(taken, Held):
                raise LockedError(key, taken.holder)
            return taken
        if wait is None and hold_at_least is None and type(limit) is int and 1 < limit <= MAX_LIMIT:
            # A semaphore's hot path: Leasing.lock's (limit checked so; task_id checked, then
            # ignored), without its call.
            if task_id is not None:
                check_task_id(task_id, MAX_TASK_ID_LENGTH)
            taken = self._acquiring.take(
                key, ttl, refresh_interval, max_lifetime, holder, limit=limit, on_lost=on_lost
            )
            # The usual answer first: an isinstance() that fails also looks up the object's
            # __class__ as an attribute (about 0.25k instructions on Python 3.11).
            if type(taken) is Lease:
                return taken
            if isinstance(taken, Held):
                raise LockedError(key, taken.holder)
            return taken
        return self._leasing.lock(
            key,
            (ttl, refresh_interval, max_lifetime),
            holder=holder,
            task_id=task_id,
            wait=wait,
            hold_at_least=hold_at_least,
            limit=limit,
            on_lost=on_lost,
        )

    def lock_many(
        self,
        keys: list[str] | tuple[str, ...],
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        wait: float | timedelta | None = None,
    ) -> many.LeaseSet:
        """Acquire every key or none (see :mod:`celery_exclusive.many`): a LeaseSet, or
        :class:`LockedError` naming the first refused key. Keys are taken in a canonical
        order, so overlapping calls never deadlock; ``wait`` as for :meth:`lock`."""
        return self._leasing.lock_many(keys, (ttl, refresh_interval, max_lifetime), holder, wait)

    def try_lock_many(
        self,
        keys: list[str] | tuple[str, ...],
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        wait: float | timedelta | None = None,
    ) -> many.LeaseSet | None:
        """:meth:`lock_many`, answering None instead of raising LockedError."""
        return self._leasing.try_lock_many(keys, (ttl, refresh_interval, max_lifetime), holder, wait)

    def run_exclusive(
        self,
        key: str,
        fn: Callable[[], T],
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        on_locked: Callable[[], object] | None = None,
        holder: Mapping[str, Any] | None = None,
    ) -> ExclusiveResult[T]:
        """Run ``fn`` holding ``key``; if it is held, call ``on_locked()`` and don't run ``fn``.

        The lease is released in ``finally``, whether ``fn`` returned or raised. Both are
        called without arguments: one that cannot be is refused before the store is asked.
        """
        for name, function in (
            (("fn", fn), ("on_locked", on_locked)) if on_locked is not None else (("fn", fn),)
        ):
            if not callable(function):
                raise InvalidArgumentError(f"{name} must be callable")
            refused = refused_call(function)
            if refused is not None:
                raise InvalidArgumentError(f"{name} must be callable with no arguments; {refused}")
        lease = self._acquiring.take(key, ttl, refresh_interval, max_lifetime, holder)
        if isinstance(lease, Held):
            if on_locked is not None:
                on_locked()
            return ExclusiveResult(acquired=False, holder=lease.holder)
        try:
            result = fn()
        finally:
            lease.release()
        return ExclusiveResult(acquired=True, result=result, fence=lease.fence)

    # -- releasing ------------------------------------------------------------------------

    def release(self, lease: Lease, completion: Completion | None = None) -> ReleaseOutcome:
        """Release ``lease`` if its token still owns the key; never raises for an outage.

        Returns RELEASED, NOT_OWNED (it had expired or been taken over: the work may have
        overlapped another holder's, so this is logged as a warning) or UNKNOWN (the store
        did not answer; the heartbeat keeps retrying the release until it can tell; or the
        service was closed: nothing is sent, see :meth:`close`).
        With ``completion``, the same store call records it on the lease's key (see
        :meth:`completion`); on UNKNOWN the record may be missing (the retried release
        does not carry it). An exception that is not the store's (a signal handler's, such
        as Celery's SoftTimeLimitExceeded) propagates unchanged, and the heartbeat finishes
        the release in the background.
        """
        if completion is None:  # for_release's answer, without its call
            return self._releasing.release(lease, None)
        if completion is _records._last_checked and self.keeps_records:
            # The record checked_completion made and checked last (immutable): for_release's
            # answer, without its two calls (check_completion returns it unchecked).
            return self._releasing.release(lease, completion)
        return self._releasing.release(lease, self._records.for_release(completion))

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, *, release: bool = True) -> None:
        """End the service, for good.

        From when close() begins no lease is taken: lock() and the other acquiring calls
        raise InvalidArgumentError, and one under way gives back the lease it got and raises
        so too. Then the leases held are released (with ``release=False`` they are left to
        end at their ttl, nothing refreshing them), the heartbeat stops and the store is
        closed. From then on nothing touches the store: peek, locks, force_release, mark,
        the completion records and sweep raise InvalidArgumentError, a lease's release()
        answers UNKNOWN without a store call (its key ends at its ttl), and a call under
        way when the store was closed (the heartbeat's too) closes again the connection it
        opened.

        Bounded on a store that does not answer: the releases it leaves unanswered get
        :data:`RELEASE_TIMEOUT` (2 s) in all, the leases left then end at their ttl, and
        close() does not wait for the heartbeat's calls in flight. On a silent store it
        takes about 2 s (``release=False``: no store call, at once)."""
        with self._heartbeat.mutex:
            if self._closed:
                return
            self._closed = True
            self._heartbeat.closing()
        if release:
            self._release_held()
        self._heartbeat.stop()
        self._ended = True  # before the store is closed: a call ending after closes it again
        self.provider.close()

    def _release_held(self) -> None:
        """Release the leases held, the unanswered releases within RELEASE_TIMEOUT in all:
        a silent store (packets dropped) costs one release deadline, not one per lease."""
        unanswered = 0.0
        held = self.held()
        for done, lease in enumerate(held):
            left = RELEASE_TIMEOUT - unanswered
            if left <= 0:
                _logger.warning(
                    "close(): the store left releases unanswered for %g s; %d lease(s) not "
                    "released end at their ttl",
                    RELEASE_TIMEOUT,
                    len(held) - done,
                )
                return
            started = time.monotonic()
            if self._releasing.release(lease, None, left) is ReleaseOutcome.UNKNOWN:
                unanswered += time.monotonic() - started

    def __enter__(self) -> LockService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        # The parent's leases are the parent's: the child neither refreshes nor releases them.
        # Its copies are RELEASED, so a release there (a ``with`` block the child leaves, a
        # ``finally``) cannot delete the parent's lease with the token the copy carries.
        inherited = self._heartbeat.inherited()
        self._heartbeat = self._leasing.new_heartbeat()
        self._releasing.after_fork_in_child()
        for lease in inherited:
            lease._left_to_parent(self._heartbeat.mutex)
        super()._after_fork_in_child()

    # -- internals ------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        """Check the service is open and ``key`` is a valid key for it."""
        if self._closed:
            raise InvalidArgumentError("this LockService is closed")
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)  # PrefixedStore's

    def _give_back(self, lease: Lease) -> None:
        """Delete ``lease``, taken while close() ran (see :meth:`close`)."""
        self._releasing.give_back(lease)

    def _lose(self, lease: Lease, reason: str) -> None:
        """Make ``lease`` LOST (if it is live) and tell everyone: log, signal, callbacks."""
        self._releasing.lose(lease, reason)


_live_services: weakref.WeakSet[LockService] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _this.reset()
    for service in list(_live_services):
        service._after_fork_in_child()


def _release_at_exit() -> None:
    for service in list(_live_services):
        if not service._closed:
            for lease in service.held():
                service.release(lease)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_release_at_exit)
