"""How the lock service composes an acquire's options: ``wait=`` (:mod:`celery_exclusive.waiting`),
``limit=`` (:mod:`celery_exclusive.semaphore`), ``hold_at_least=`` (the cooldown, kept by
:mod:`celery_exclusive._releasing`), several keys (:mod:`celery_exclusive.many`); and the
service's upkeep: its heartbeat with the refresh signals, and sweeping dead rows.

Part of the lock core (it serves :mod:`celery_exclusive.service`, which it does not import:
the service is passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from celery_exclusive import many, semaphore, signals, waiting
from celery_exclusive._acquiring import Acquiring
from celery_exclusive._core import Service
from celery_exclusive._process import holder_json
from celery_exclusive._releasing import Releasing
from celery_exclusive.errors import LockedError
from celery_exclusive.heartbeat import Heartbeat
from celery_exclusive.lease import Lease, LostCallback
from celery_exclusive.providers.base import MAX_TASK_ID_LENGTH, SWEEP_LIMIT, Held, Sweeps, accepts_timeout
from celery_exclusive.validation import check_task_id

#: Seconds between the heartbeat's sweeps of dead rows (``LockService(sweep_interval=)``).
DEFAULT_SWEEP_INTERVAL = 60.0

Durations = tuple["float | timedelta | None", "float | timedelta | None", "float | timedelta | None"]


class Leasing:
    """The service's acquire options and upkeep (see the module docstring)."""

    def __init__(self, service: Service, acquiring: Acquiring, releasing: Releasing) -> None:
        self._service = service
        self._acquiring = acquiring
        self._releasing = releasing

    def _take(
        self,
        key: str,
        durations: Durations,
        holder: Mapping[str, Any] | None,
        wait: float | timedelta | None,
        hold_at_least: float | timedelta | None,
        *,
        limit: int,
        task_id: str | None = None,
        name_holder: bool,
        on_lost: LostCallback | None,
    ) -> Lease | Held:
        """The lease on ``key`` (its cooldown kept) or Held; with ``wait``, retrying until
        that many seconds have passed."""
        cooldown = (
            None if hold_at_least is None else self._releasing.check_cooldown(hold_at_least, durations[2])
        )
        take = self._acquiring.take
        if wait is None:  # the hot path: no extra call
            taken = take(
                key,
                *durations,
                holder,
                name_holder=name_holder,
                task_id=task_id,
                limit=limit,
                on_lost=on_lost,
            )
        else:
            seconds = waiting.check_wait(wait)
            # Each attempt checks these too, but a waiter subscribes to releases (or, on
            # SQLite, marks itself) before its first attempt: bad input must not get that far.
            # (A key that fits has slot keys that fit: semaphore.slot_key.)
            self._check([key], durations, holder)
            taken = waiting.take_waiting(
                lambda final: take(
                    key,
                    *durations,
                    holder,
                    name_holder=name_holder and final,
                    task_id=task_id,
                    limit=limit,
                    on_lost=on_lost,
                ),
                self._service.provider,
                self._service.prefix + key,
                seconds,
                more=semaphore.store_slot_keys(
                    self._service.prefix, key, limit, self._service.provider.max_key_length
                )[1:],
                turns=self._releasing.turns,
                key=key,
                probe=self._probe(key, limit),
            )
        if cooldown is not None and isinstance(taken, Lease):
            self._releasing.cool(taken, cooldown)
        return taken

    def _probe(self, key: str, limit: int) -> Callable[[], bool] | None:
        """Whether ``key`` (a slot of it, for a semaphore) looks free, by peeks, on stores
        whose refused acquire is a write (``waiters_peek``: SQLite's takes the database's
        write lock, and its peeks are in-process reads); None elsewhere."""
        service = self._service
        provider = service.provider
        if getattr(provider, "waiters_peek", False) is not True:
            return None
        slots = semaphore.store_slot_keys(service.prefix, key, limit, provider.max_key_length)
        return lambda: any(service._call("peek", provider.peek, slot) is None for slot in slots)

    def try_lock(
        self,
        key: str,
        durations: Durations,
        *,
        holder: Mapping[str, Any] | None,
        wait: float | timedelta | None,
        hold_at_least: float | timedelta | None,
        limit: int,
        on_lost: LostCallback | None,
    ) -> Lease | None:
        """See :meth:`LockService.try_lock <celery_exclusive.service.LockService.try_lock>`."""
        semaphore.check_limit(limit)
        taken = self._take(
            key, durations, holder, wait, hold_at_least, limit=limit, name_holder=False, on_lost=on_lost
        )
        return taken if isinstance(taken, Lease) else None

    def lock(
        self,
        key: str,
        durations: Durations,
        *,
        holder: Mapping[str, Any] | None,
        task_id: str | None,
        wait: float | timedelta | None,
        hold_at_least: float | timedelta | None,
        limit: int,
        on_lost: LostCallback | None,
    ) -> Lease:
        """See :meth:`LockService.lock <celery_exclusive.service.LockService.lock>`."""
        # check_limit's answer for 1 without its call (True == 1, but is refused there).
        if task_id is not None:  # checked even where it is then ignored (a semaphore)
            check_task_id(task_id, MAX_TASK_ID_LENGTH)
            if not self._service.keeps_records:
                task_id = None
        if (type(limit) is not int or limit != 1) and semaphore.check_limit(limit) > 1:
            task_id = None
        if wait is None and hold_at_least is None:  # _take's hot path, without its call
            taken = self._acquiring.take(
                key, *durations, holder, task_id=task_id, limit=limit, on_lost=on_lost
            )
        else:
            taken = self._take(
                key,
                durations,
                holder,
                wait,
                hold_at_least,
                limit=limit,
                task_id=task_id,
                name_holder=True,
                on_lost=on_lost,
            )
        if isinstance(taken, Held):
            raise LockedError(key, taken.holder)
        return taken

    def lock_many(
        self,
        keys: object,
        durations: Durations,
        holder: Mapping[str, Any] | None,
        wait: float | timedelta | None,
    ) -> many.LeaseSet:
        """See :meth:`LockService.lock_many <celery_exclusive.service.LockService.lock_many>`."""
        taken = self._take_many(keys, durations, holder, wait)
        if isinstance(taken, tuple):
            raise LockedError(taken[0], taken[1].holder)
        return taken

    def try_lock_many(
        self,
        keys: object,
        durations: Durations,
        holder: Mapping[str, Any] | None,
        wait: float | timedelta | None,
    ) -> many.LeaseSet | None:
        """See :meth:`LockService.try_lock_many <celery_exclusive.service.LockService.try_lock_many>`."""
        taken = self._take_many(keys, durations, holder, wait)
        return None if isinstance(taken, tuple) else taken

    def _take_many(
        self,
        keys: object,
        durations: Durations,
        holder: Mapping[str, Any] | None,
        wait: float | timedelta | None,
    ) -> many.LeaseSet | tuple[str, Held]:
        """All of ``keys`` as a LeaseSet, or the first refused key and its Held."""
        service = self._service
        checked = many.check_keys(keys)
        self._check(checked, durations, holder)
        return many.take_all(
            checked,
            lambda key, final: self._acquiring.take(key, *durations, holder, name_holder=final),
            lambda key: service.prefix + key,
            service.provider,
            None if wait is None else waiting.check_wait(wait),
        )

    def _check(self, keys: list[str], durations: Durations, holder: Mapping[str, Any] | None) -> None:
        """InvalidArgumentError unless every store key of ``keys``, the durations and the
        holder are valid (what an attempt checks, for callers that touch the store first)."""
        for key in keys:
            self._service._check_key(key)
        self._acquiring.durations(*durations)
        holder_json(holder)

    # -- upkeep -------------------------------------------------------------------------

    def _heartbeat_sweep(self) -> Callable[[float], int] | None:
        """What the heartbeat calls to sweep (None: off, no prefix, or nothing to sweep)."""
        service = self._service
        provider = service.provider
        if service.sweep_interval is None or not service.prefix or not isinstance(provider, Sweeps):
            return None
        prefix: str = service.prefix
        if accepts_timeout(provider.sweep):
            return lambda timeout: provider.sweep(prefix, SWEEP_LIMIT, timeout=timeout)
        return lambda _timeout: provider.sweep(prefix, SWEEP_LIMIT)

    def new_heartbeat(self) -> Heartbeat:
        """A heartbeat for the service's leases (one per process: a forked child gets its own)."""
        service = self._service
        return Heartbeat(
            service.provider,
            clock=service.clock,
            lose=service._lose,
            refreshed=self._refreshed,
            failed=self._refresh_failed,
            batch_size=service._batch_size,
            thread_factory=service._thread_factory,
            sweep=self._heartbeat_sweep(),
            sweep_interval=service.sweep_interval or DEFAULT_SWEEP_INTERVAL,
            sweep_limit=SWEEP_LIMIT,
        )

    def _refreshed(self, leases: list[Lease], duration: float) -> None:
        if leases:
            signals.send(signals.lock_refreshed, self._service, leases=leases, duration=duration)

    def _refresh_failed(self, leases: list[Lease], error: Exception) -> None:
        signals.send(signals.refresh_failed, self._service, leases=leases, error=error)
