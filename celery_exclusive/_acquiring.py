"""How the lock service takes leases: durations, holder metadata, the acquire with its one
same-token retry, a semaphore's first free slot, who holds a contended key, markers.

Part of the lock core (it serves :mod:`celery_exclusive.service`, which it does not import:
the service is passed in).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

from celery_exclusive import semaphore, signals
from celery_exclusive._core import Service
from celery_exclusive._process import EncodedHolder, holder_json, new_token, this, unprefixed
from celery_exclusive._records import Records
from celery_exclusive._store import as_store_error
from celery_exclusive.errors import AlreadyDone, BackendError, InvalidArgumentError
from celery_exclusive.lease import Lease, LostCallback
from celery_exclusive.providers.base import (
    AcquiresAny,
    Done,
    Grant,
    Held,
    LockInfo,
    SetsUp,
    accepts_timeout,
)
from celery_exclusive.validation import lease_durations, seconds

T = TypeVar("T")

#: ``Lease(...)`` in two steps (a plain object, then ``Lease.__init__`` called as a function),
#: for the acquire's hot path: Lease defines no ``__new__``, so the object is the same.
_new_lease = object.__new__
_init_lease = Lease.__init__

_monotonic = time.monotonic

#: Pause before the one same-token retry of an acquire that failed in flight, in seconds.
ACQUIRE_RETRY_DELAY = 0.05


class Acquiring:
    """Takes a service's leases (see :meth:`take`) and markers."""

    def __init__(self, service: Service, records: Records) -> None:
        self._service = service
        self._records = records
        #: Whether the store takes a semaphore's first free slot in one call (checked once:
        #: a runtime Protocol check costs microseconds).
        self._any = isinstance(service.provider, AcquiresAny)
        #: The provider when it has an ``acquire_any`` taking ``timeout=`` (every built-in one
        #: does): then a semaphore's first attempt calls it without StoreCalls.call's frame,
        #: as ``take`` calls ``acquire`` for one key.
        self._any_direct: AcquiresAny | None = (
            service.provider
            if isinstance(service.provider, AcquiresAny) and accepts_timeout(service.provider.acquire_any)
            else None
        )
        #: Set-up still to run before the first lease's clock starts (None once done).
        self._set_up = service.provider if isinstance(service.provider, SetsUp) else None
        #: Whether the provider's acquire takes ``timeout=`` (checked once; every built-in
        #: store's does): then take() calls it without StoreCalls.call's frame.
        self._direct = accepts_timeout(service.provider.acquire)
        #: The longest key (without the prefix) the store takes; both are fixed for the service.
        length = service.provider.max_key_length
        self._room = sys.maxsize if length is None else length - len(service.prefix)
        self._longest = length

    def take(  # noqa: PLR0912, PLR0915, PLR0917 - the hot paths of one key and of a semaphore, inline
        self,
        key: str,
        ttl: float | timedelta | None,
        refresh_interval: float | timedelta | None,
        max_lifetime: float | timedelta | None,
        holder: Mapping[str, Any] | None,
        name_holder: bool = True,
        task_id: str | None = None,
        limit: int = 1,
        on_lost: LostCallback | None = None,
        holder_text: str | None = None,
    ) -> Lease | Held:
        """The lease on ``key``, or Held naming its holder (key unprefixed): what ``lock``
        raises as LockedError, without the cost of an exception on the contended path.
        Without ``name_holder`` (and no lock_contended receiver) the store's Held is returned
        as it is, its holder's key still prefixed: ``try_lock`` only needs to know it failed.
        ``on_lost`` (checked callable by the caller) is the lease's first loss callback.
        ``holder_text`` (with ``holder`` None): the holder's stored JSON, made for this
        process by a :class:`~celery_exclusive._process.HolderTemplate` (:meth:`HolderTemplate.text`),
        without the mapping it would attach it to."""
        service = self._service
        # check_key's whole test of the usual key (ASCII, no NUL, within the store's length),
        # inline; anything else gets the full check and its message. A semaphore's slot keys
        # fit where its key does (semaphore.slot_key).
        if (
            type(key) is not str
            or not key.isascii()
            or "\x00" in key
            or not 0 < len(key) <= self._room
            or service._closed
        ):
            service._check_key(key)
        ttl_s, interval_s, lifetime_s = (
            (service.ttl, service.refresh_interval, service.max_lifetime)  # durations()'s first test
            if ttl is None and refresh_interval is None and max_lifetime is None
            else self.durations(ttl, refresh_interval, max_lifetime)
        )
        # holder_json's answer; a HolderTemplate's holder (a task run's) without its call.
        encoded = (
            (this.holder if holder_text is None else holder_text)
            if holder is None
            else holder.json
            if type(holder) is EncodedHolder and holder.made_for is this.holder
            else holder_json(holder)
        )
        store_key = service.prefix + key
        token = new_token()
        if self._set_up is not None:
            service._call("set up", self._set_up.set_up)
            self._set_up = None
        clock = service.clock
        sent = clock()
        if limit == 1:
            # The first attempt; a failed one goes to _after_failure (retry, background release).
            # Its budget starts on time.monotonic(): the service's own reading when that is
            # its clock (the default), no second one.
            start = sent if clock is _monotonic else _monotonic()
            try:  # a provider keeping the deadline (every built-in one) without StoreCalls.call
                # The usual calls, without star-args; task_id only when given: a third-party
                # provider may not take it.
                if self._direct:
                    answer = (
                        service.provider.acquire(
                            store_key, token, ttl_s, lifetime_s, encoded, timeout=service.call_timeout
                        )
                        if task_id is None
                        else service.provider.acquire(
                            store_key,
                            token,
                            ttl_s,
                            lifetime_s,
                            encoded,
                            timeout=service.call_timeout,
                            task_id=task_id,
                        )
                    )
                else:
                    answer = service._calls.call(
                        "acquire",
                        service.provider.acquire,
                        store_key,
                        token,
                        ttl_s,
                        lifetime_s,
                        encoded,
                        timeout=service.call_timeout,
                        **({} if task_id is None else {"task_id": task_id}),
                    )
            except BaseException as exc:
                once: dict[str, Any] = {} if task_id is None else {"task_id": task_id}
                args = (store_key, token, ttl_s, lifetime_s, encoded)
                answer = self._after_failure(as_store_error("acquire", exc), start, sent, *args, once)
        else:
            keys = semaphore.store_slot_keys(service.prefix, key, limit, self._longest)
            direct = self._any_direct
            if direct is not None:
                # The first attempt in one store call, without acquire_slot's and _retried's
                # frames and StoreCalls.call's (the hot path); a failed one goes to
                # _any_after_failure (the same retry, by _retried's rules).
                start = time.monotonic()
                try:
                    got = direct.acquire_any(
                        keys, token, ttl_s, lifetime_s, encoded, timeout=service.call_timeout
                    )
                except BaseException as exc:
                    error = as_store_error("acquire", exc)
                    got = self._any_after_failure(
                        error, start + service.call_timeout, sent, keys, token, (ttl_s, lifetime_s), encoded
                    )
                if type(got) is Held or isinstance(got, Held):
                    answer = got
                else:
                    store_key, answer = keys[got[0]], got[1]
            else:
                slot, answer = self.acquire_slot(
                    keys, token, ttl=ttl_s, max_lifetime=lifetime_s, holder=encoded
                )
                store_key = keys[slot - 1]
        if type(answer) is not Grant and not isinstance(answer, Grant):
            return self._refused(key, store_key, answer, name_holder=name_holder)
        heartbeat = service._heartbeat
        # Lease(...), without type.__call__'s way to a Python __init__ (slot_tp_init: the
        # arguments copied and the method looked up again): about 0.45k instructions.
        lease = _new_lease(Lease)
        _init_lease(
            lease,
            service,
            key,
            store_key,
            token,
            answer.fence,
            ttl_s,
            interval_s,
            lifetime_s,
            sent,
            answer.ttl,
            heartbeat.mutex,
        )
        if on_lost is not None:  # lease.on_lost's list, set before the heartbeat can see the lease
            lease._on_lost = [on_lost]
        heartbeat.add(lease)
        if service._closed:  # close() began since the test above: the lease is given back
            service._give_back(lease)
            raise InvalidArgumentError("this LockService is closed")
        if signals.lock_acquired.receivers:  # signals.send's test, without its call
            signals.lock_acquired.send(sender=service, key=key, lease=lease)
        return lease

    def _refused(self, key: str, store_key: str, answer: Held | Done, *, name_holder: bool) -> Held:
        """What ``take`` answers when the store did not grant ``key``: AlreadyDone raised for a
        completion record, else Held (see :meth:`take` on ``name_holder``)."""
        if isinstance(answer, Done):
            raise AlreadyDone(key, self._records.unprefixed(answer.record))
        if not name_holder and not signals.lock_contended.receivers:
            return answer  # a failed try_lock, the hot path under contention
        return self._contended(key, store_key, answer)

    def _contended(self, key: str, store_key: str, answer: Held) -> Held:
        """Held naming the holder of ``key`` (unprefixed), after the lock_contended signal."""
        found = answer.holder if answer.holder is not None else self._winner(store_key)
        holder_info = None if found is None else unprefixed(found, self._service.prefix)
        signals.send(signals.lock_contended, self._service, key=key, holder=holder_info)
        return Held(holder_info)

    def durations(
        self, ttl: object, refresh_interval: object, max_lifetime: object
    ) -> tuple[float, float, float]:
        service = self._service
        if ttl is None and refresh_interval is None and max_lifetime is None:
            return service.ttl, service.refresh_interval, service.max_lifetime
        lifetime = service.max_lifetime if max_lifetime is None else seconds("max_lifetime", max_lifetime)
        interval = None if refresh_interval is None else seconds("refresh_interval", refresh_interval)
        if ttl is None:
            # Keep the service's explicit interval unless a shorter max_lifetime caps the ttl under it.
            if (
                interval is None
                and service._refresh_explicit
                and service.refresh_interval < min(service.ttl, lifetime)
            ):
                interval = service.refresh_interval
            return lease_durations(service.ttl, interval, lifetime, ttl_explicit=False)
        return lease_durations(seconds("ttl", ttl), interval, lifetime, ttl_explicit=True)

    def _after_failure(  # noqa: PLR0917 - take()'s state, by position
        self,
        exc: BaseException,
        start: float,
        sent: float,
        store_key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        once: dict[str, Any],
    ) -> Grant | Held | Done:
        """:meth:`take`'s acquire of one key, whose first attempt (made at ``start``, ``sent``
        on the service clock) raised ``exc`` (:meth:`_retried`'s rules, spelt out for one key):
        a store failure with time left in ``call_timeout`` is retried once with the same token
        after :data:`ACQUIRE_RETRY_DELAY`; otherwise (or if the retry fails too) the token is
        released in the background (the store may have recorded the lease) and the exception
        propagates."""
        service = self._service
        if not isinstance(exc, BackendError) or (
            start + service.call_timeout - time.monotonic() < ACQUIRE_RETRY_DELAY + 0.1
        ):
            self._release_in_background((store_key,), token, sent + min(ttl, max_lifetime))
            raise exc
        time.sleep(ACQUIRE_RETRY_DELAY)
        sent = service.clock()
        try:
            return service._calls.call(
                "acquire",
                service.provider.acquire,
                store_key,
                token,
                ttl,
                max_lifetime,
                holder,
                timeout=start + service.call_timeout - time.monotonic(),
                **once,
            )
        except BaseException:
            self._release_in_background((store_key,), token, sent + min(ttl, max_lifetime))
            raise

    def _release_in_background(self, store_keys: Sequence[str], token: str, until: float) -> None:
        """An attempt failed after the store may have recorded ``token``'s lease: release it
        from ``store_keys`` once the store answers (until ``until``)."""
        for store_key in store_keys:
            self._service._heartbeat.retry_release(store_key, token, until=until)

    def acquire_slot(
        self, keys: Sequence[str], token: str, *, ttl: float, max_lifetime: float, holder: str
    ) -> tuple[int, Grant | Held]:
        """The first free slot (1-based) of the semaphore whose slots' store keys are ``keys``
        and its Grant, or ``(1, Held)``: one store call where the provider has ``acquire_any``,
        else one acquire per slot in order; either way a retried attempt releases the token's
        other slots, which its lost reply may hold. (``take`` makes a provider's ``acquire_any``
        taking ``timeout=`` its first attempt itself, and :meth:`_any_after_failure` the retry.)"""
        service = self._service
        provider = service.provider
        life = min(ttl, max_lifetime)
        attempts: list[float] = []
        if self._any:
            acquire_any = cast("AcquiresAny", provider).acquire_any  # self._any says so
            call = service._calls.call

            def in_one_call(timeout: float) -> tuple[int, Grant] | Held:
                attempts.append(service.clock())
                got = call("acquire", acquire_any, keys, token, ttl, max_lifetime, holder, timeout=timeout)
                if len(attempts) > 1 and not isinstance(got, Held):
                    # On a cluster one call per hash slot: the lost reply may hold another slot.
                    for other in [*keys[: got[0]], *keys[got[0] + 1 :]]:
                        service.heartbeat.retry_release(other, token, until=attempts[0] + life)
                return got

            answer = self._retried(in_one_call, keys, token, life)
            return (1, answer) if isinstance(answer, Held) else (answer[0] + 1, answer[1])

        def in_order(timeout: float) -> tuple[int, Grant | Held | Done]:
            attempts.append(service.clock())
            end = time.monotonic() + timeout
            first: Grant | Held | Done | None = None
            for i, store_key in enumerate(keys):
                args = (store_key, token, ttl, max_lifetime, holder)
                got = service._call(
                    "acquire", provider.acquire, *args, timeout=max(end - time.monotonic(), 0.01)
                )
                if isinstance(got, Grant):
                    if len(attempts) > 1:
                        for other in [*keys[:i], *keys[i + 1 :]]:
                            service.heartbeat.retry_release(other, token, until=attempts[0] + life)
                    return i, got
                first = got if first is None else first
            assert first is not None  # limit >= 2 slots were tried
            return 0, first

        index, found = self._retried(in_order, keys, token, life)
        if isinstance(found, Done):  # pragma: no cover - no task_id is sent for a semaphore
            raise AssertionError("a completion record answered a semaphore acquire")
        return (index + 1, found) if isinstance(found, Grant) else (1, found)

    def _any_after_failure(  # noqa: PLR0917 - take()'s state, by position
        self,
        exc: BaseException,
        budget_end: float,
        first: float,
        keys: Sequence[str],
        token: str,
        durations: tuple[float, float],
        holder: str,
    ) -> tuple[int, Grant] | Held:
        """:meth:`take`'s ``acquire_any`` call whose first attempt (sent at ``first`` on
        the service clock) raised ``exc``, by :meth:`_retried`'s rules: a store failure with
        time left before ``budget_end`` is retried once with the same token, and a retry's
        grant releases the token's other slots (the lost reply may hold one); otherwise the
        token is released from every slot in the background and the exception propagates."""
        service = self._service
        ttl, max_lifetime = durations
        life = min(ttl, max_lifetime)
        if not isinstance(exc, BackendError) or budget_end - time.monotonic() < ACQUIRE_RETRY_DELAY + 0.1:
            self._release_in_background(keys, token, first + life)
            raise exc
        time.sleep(ACQUIRE_RETRY_DELAY)
        sent = service.clock()
        assert self._any_direct is not None  # the only caller's test
        acquire_any = self._any_direct.acquire_any
        try:
            got = service._calls.call(
                "acquire",
                acquire_any,
                keys,
                token,
                ttl,
                max_lifetime,
                holder,
                timeout=budget_end - time.monotonic(),
            )
        except BaseException:
            self._release_in_background(keys, token, sent + life)
            raise
        if not isinstance(got, Held):
            for other in [*keys[: got[0]], *keys[got[0] + 1 :]]:
                service.heartbeat.retry_release(other, token, until=first + life)
        return got

    def _retried(self, call: Callable[[float], T], store_keys: Sequence[str], token: str, life: float) -> T:
        """``call(timeout)``, retried once with the same token: the store recognises its own
        token, so a retry after a lost reply returns the lease the first attempt took instead
        of orphaning it.

        Both attempts together take at most ``call_timeout`` (the retry gets what is left, and
        none if less than 0.1 s is). An exception that is not the store's (a signal handler's,
        such as Celery's SoftTimeLimitExceeded) propagates unchanged; the token is then
        released from ``store_keys`` in the background, as the store may have recorded a lease."""
        service = self._service
        budget_end = time.monotonic() + service.call_timeout
        for attempt in (1, 2):
            sent = service.clock()
            try:
                return call(budget_end - time.monotonic())
            except BackendError:
                if attempt == 2 or budget_end - time.monotonic() < ACQUIRE_RETRY_DELAY + 0.1:
                    # The store may have recorded the lease before failing: release it once it answers.
                    self._release_in_background(store_keys, token, sent + life)
                    raise
                time.sleep(ACQUIRE_RETRY_DELAY)
            except BaseException:
                self._release_in_background(store_keys, token, sent + life)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _winner(self, store_key: str) -> LockInfo | None:
        """Who holds a key whose acquire lost a race and could not say (PostgreSQL: the
        racing insert committed after the statement's snapshot); None if already gone."""
        try:
            return self._service._call("peek", self._service.provider.peek, store_key)
        except BackendError:  # the key was held: that stands even if this extra look fails
            return None
