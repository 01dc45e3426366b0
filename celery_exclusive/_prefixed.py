"""One lock store under one key prefix, as operators and observers use it: look (``peek``,
``locks``), release a lease by its token, take markers (detached leases, see
:mod:`._marking`), read and forget completion records, sweep.

Part of the lock core. :class:`PrefixedStore` holds no lease and has no heartbeat; every
call it makes runs within ``call_timeout`` (:class:`~celery_exclusive._store.StoreCalls`)
and shows keys without the prefix. :class:`~celery_exclusive.service.LockService` is a
PrefixedStore that also takes, keeps alive and releases leases.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from celery_exclusive import _marking, semaphore
from celery_exclusive._process import check_filter, unprefixed
from celery_exclusive._records import Records
from celery_exclusive._store import StoreCalls
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    MAX_TASK_ID_LENGTH,
    SWEEP_LIMIT,
    AcquiresUnless,
    Completion,
    CompletionInfo,
    CompletionStore,
    Held,
    LockInfo,
    LockProvider,
    MarksLater,
    RefreshRequest,
    Sweeps,
)
from celery_exclusive.validation import (
    GUARD_INFIX,
    check_key,
    check_token,
    marker_scan,
    markers_listed,
    seconds,
    shown,
)

T = TypeVar("T")


class PrefixedStore:
    """``provider``'s keys under ``prefix`` (both already checked), each call within
    ``call_timeout`` seconds; ``url`` is where it came from (None for a provider given as such)."""

    #: A marker's ttl when ``mark`` is given none (LockService: its ``max_lifetime``).
    max_lifetime: float

    def __init__(self, provider: LockProvider, *, url: str | None, prefix: str, call_timeout: float) -> None:
        self.prefix = prefix
        self.call_timeout = call_timeout
        self._url = url
        self.provider = provider
        #: LockService.close() began: no lease is taken from then on.
        self._closed = False
        #: LockService.close() closed the store: no call is made from then on.
        self._ended = False
        #: Whether the store keeps completion records (see ``completion()``).
        self.keeps_records = isinstance(provider, CompletionStore)
        self._calls = StoreCalls()
        self._records = Records(self)
        self._checks_unless = isinstance(provider, AcquiresUnless)
        self._marks_later = isinstance(provider, MarksLater)

    # -- inspecting -----------------------------------------------------------------------

    def peek(self, key: str) -> LockInfo | None:
        """The live lease on ``key`` (key shown without the prefix), or None if free."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        info = self._call("peek", self.provider.peek, self.prefix + key)
        return None if info is None else unprefixed(info, self.prefix)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every live lease whose key (without the service prefix) starts with ``prefix``, the
        higher slots (``{key}#i``, see :mod:`celery_exclusive.semaphore`) of such keys, and
        their markers shortened to fit the store (``<start>~<hash>#queued``, ``#rerun``,
        ``#id:<task id>``: :func:`~celery_exclusive.validation.markers_listed` says which)."""
        found = [
            unprefixed(info, self.prefix)
            for info in self._call("scan", self.provider.scan, self.prefix + check_filter(prefix))
        ]
        if not prefix:  # "" covers every key
            return found
        limit = self.provider.max_key_length
        order = {id(info): semaphore.slot_of(info.key) for info in found}
        added = False
        if not prefix.startswith("{"):  # else the scan by prefix covered the slot keys
            start = semaphore.slot_scan(prefix, prefix=self.prefix, max_length=limit)
            braced = self._call("scan", self.provider.scan, self.prefix + start)
            listed = semaphore.slots_listed(
                prefix, [info.key for info in found], prefix=self.prefix, max_length=limit
            )
            for info in (unprefixed(each, self.prefix) for each in braced):
                slot = listed(info.key)
                if slot is not None:
                    found.append(info)
                    order[id(info)] = slot
            added = True
        longest = len(GUARD_INFIX) + MAX_TASK_ID_LENGTH
        wider = marker_scan(prefix, prefix=self.prefix, max_length=limit, longest_suffix=longest)
        if wider is not None:
            keys = [key for key, _ in order.values()]  # a slot's: its semaphore's key
            marker = markers_listed(prefix, keys, prefix=self.prefix, max_length=limit)
            for info in (
                unprefixed(each, self.prefix)
                for each in self._call("scan", self.provider.scan, self.prefix + wider)
            ):
                stands_for = marker(info.key)
                if stands_for is not None:
                    found.append(info)
                    order[id(info)] = (stands_for, 1)
                    added = True
        return sorted(found, key=lambda info: order[id(info)]) if added else found

    def force_release(
        self, key: str, token: str, *, completion: Completion | None = None, keep_for: float | None = None
    ) -> bool:
        """Release exactly the lease ``token`` holds on ``key`` (operators, worker hooks).

        With ``completion``, the same store call records it on ``key`` whether or not the
        token still owned it, as a lease's own release does (a worker's main process ending
        a run it killed); ignored by a store that keeps no records. With ``keep_for``
        (seconds, > 0), the lease is not deleted but ends that long from now (never past
        its hard deadline), as the release of a ``hold_at_least`` lease keeps the rest of
        its cooldown; the record then takes a second call."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        check_token(token)
        done = self._records.for_release(completion)
        if keep_for is not None:
            left = seconds("keep_for", keep_for)
            if left <= 0:
                raise InvalidArgumentError(f"keep_for must be positive, got {shown(keep_for)}")
            answers = self._call(
                "release", self.provider.refresh, [RefreshRequest(self.prefix + key, token, left)]
            )
            if done is not None:  # a token that owns nothing: the store writes the record only
                self._call("record", self.provider.release, self.prefix + key, "cooldown:" + token, done)
            return bool(answers) and answers[0] is not None
        if done is None:
            return bool(self._call("release", self.provider.release, self.prefix + key, token))
        return bool(self._call("release", self.provider.release, self.prefix + key, token, done))

    # -- markers ------------------------------------------------------------------------

    def mark(
        self, key: str, *, ttl: float | timedelta | None = None, holder: Mapping[str, Any] | None = None
    ) -> str | None:
        """Take ``key`` as a *marker*: a detached lease that no heartbeat keeps or releases.

        It lives ``ttl`` seconds (default: the service's ``max_lifetime``; at most 24 h),
        surviving this process, until someone deletes it with ``force_release(key, token)``
        (whoever deletes it owns what it marks) or it expires. ``holder`` is stored with it
        and read back by :meth:`peek`. Returns the marker's token, or None when ``key`` is
        held. One store call, not retried (a marker whose reply was lost stays in place,
        which is what its writer wanted) and bounded by ``call_timeout``; an outage raises
        :class:`BackendError`, any exception that is not the store's propagates unchanged.
        """
        taken = self.try_mark(key, ttl=ttl, holder=holder)
        return taken if isinstance(taken, str) else None

    def try_mark(
        self,
        key: str,
        *,
        ttl: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        unless: str | None = None,
    ) -> str | Held:
        """:meth:`mark` answering Held (the live lease that refused it: ``unless``'s first, else
        ``key``'s; None if it changed mid-call) instead of None; with ``unless``, taken only
        while that key is free too: one store call where the store checks both at once
        (``AcquiresUnless``: every built-in store; Redis Cluster only for keys of one hash
        slot), else two or three (take, look, give back)."""
        lifetime = self.max_lifetime if ttl is None else seconds("ttl", ttl)
        return _marking.take(self, key, lifetime, holder, unless)

    def begin_mark(
        self,
        key: str,
        *,
        ttl: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        unless: str | None = None,
        token: str,
    ) -> _marking.PendingMark:
        """:meth:`try_mark` in two halves, with the marker's ``token`` chosen by the caller (a
        fresh one per marker, e.g. ``new_token()``): the request goes out now and
        ``answer()`` of what this returns reads its answer (exactly once: until then it
        holds a connection), so the caller can work during the round trip. Stores that cannot
        split a call (all but Redis) answer now: then ``ready`` is True."""
        check_token(token)  # else a marker no one could release
        lifetime = self.max_lifetime if ttl is None else seconds("ttl", ttl)
        return _marking.take_later(self, key, lifetime, holder, unless, token=token)

    # -- completion records -----------------------------------------------------------

    def completion(self, key: str, task_id: str) -> CompletionInfo | None:
        """The live completion record of ``task_id`` on ``key`` (key without the prefix).

        Records are written by ``lease.release(completion)`` and read by
        ``lock(..., task_id=...)``; a store that keeps none (a third-party provider without
        the :class:`~celery_exclusive.providers.base.CompletionStore` methods) answers None,
        ``[]`` and False here, and ``lock``/``release`` then ignore records.
        """
        return self._records.completion(key, task_id)

    def completions(self, prefix: str = "") -> list[CompletionInfo]:
        """Every live completion record on a key (without the prefix) starting with ``prefix``."""
        return self._records.completions(prefix)

    def forget(self, key: str, task_id: str) -> bool:
        """Delete the completion record of ``task_id`` on ``key``; True if a live one existed.

        A later copy of that task's message then runs its body again.
        """
        return self._records.forget(key, task_id)

    # -- housekeeping ---------------------------------------------------------------------

    @property
    def sweeps(self) -> bool:
        """Whether the store keeps dead leases as rows to sweep (SQL stores, memory); Redis
        keys expire by themselves."""
        return isinstance(self.provider, Sweeps)

    def sweep(self, prefix: str = "", *, limit: int = SWEEP_LIMIT) -> int:
        """Delete up to ``limit`` dead leases and ``limit`` expired completion records on
        keys (without the service prefix) starting with ``prefix``; the rows deleted.

        Only rows dead on the store's clock are deleted (a live lease never is); fences stay
        increasing. The heartbeat does this by itself every ``sweep_interval`` seconds while
        the process uses the service. 0 on a store without rows to sweep (Redis).
        """
        # At most a signed 64-bit int: beyond it PostgreSQL's and SQLite's LIMIT fail
        # (a BackendError, an OverflowError), after the connection was made.
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 2**63 - 1:
            raise InvalidArgumentError(f"limit must be a positive int below 2**63, got {shown(limit)}")
        full = self.prefix + check_filter(prefix)
        if not full:
            raise InvalidArgumentError(
                "sweep needs a non-empty key prefix: the lock table may hold other applications' rows"
            )
        if not isinstance(self.provider, Sweeps):
            return 0
        return int(self._call("sweep", self.provider.sweep, full, limit))

    # -- internals ------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        """Check ``key`` is a valid key for this store."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """Call the provider within ``timeout`` seconds (default ``call_timeout``); the
        driver's and the network's exceptions become BackendError, any other propagates.
        InvalidArgumentError once the store is closed; a call under way then closes again
        what it opened."""
        if self._ended:
            raise InvalidArgumentError("this LockService is closed")
        try:
            return self._calls.call(
                what, method, *args, timeout=self.call_timeout if timeout is None else timeout, **kwargs
            )
        finally:
            self._close_again()

    def _close_again(self) -> None:
        """Close the store again if LockService.close() closed it during a call."""
        if self._ended:
            self.provider.close()

    def _after_fork_in_child(self) -> None:
        self._calls = StoreCalls()  # the parent's stuck calls have no thread here
