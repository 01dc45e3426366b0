"""One lock store under one key prefix, as operators and observers use it: look (``peek``,
``locks``), release a lease by its token, read and forget completion records, sweep.

Part of the lock core. :class:`PrefixedStore` holds no lease and has no heartbeat; every
call it makes runs within ``call_timeout`` (:class:`~celery_exclusive._store.StoreCalls`)
and shows keys without the prefix. :class:`~celery_exclusive.service.LockService` is a
PrefixedStore that also takes, keeps alive and releases leases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from celery_exclusive import semaphore
from celery_exclusive._process import check_filter, unprefixed
from celery_exclusive._records import Records
from celery_exclusive._store import StoreCalls
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    CompletionInfo,
    CompletionStore,
    LockInfo,
    LockProvider,
    Sweeps,
)
from celery_exclusive.validation import check_key

T = TypeVar("T")


class PrefixedStore:
    """``provider``'s keys under ``prefix`` (both already checked), each call within
    ``call_timeout`` seconds; ``url`` is where it came from (None for a provider given as such)."""

    def __init__(self, provider: LockProvider, *, url: str | None, prefix: str, call_timeout: float) -> None:
        self.prefix = prefix
        self.call_timeout = call_timeout
        self._url = url
        self.provider = provider
        #: Whether the store keeps completion records (see ``completion()``).
        self.keeps_records = isinstance(provider, CompletionStore)
        self._calls = StoreCalls()
        self._records = Records(self)

    # -- inspecting -----------------------------------------------------------------------

    def peek(self, key: str) -> LockInfo | None:
        """The live lease on ``key`` (key shown without the prefix), or None if free."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        info = self._call("peek", self.provider.peek, self.prefix + key)
        return None if info is None else unprefixed(info, self.prefix)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every live lease whose key (without the service prefix) starts with ``prefix``, and
        the higher slots (``{key}#i``, see :mod:`celery_exclusive.semaphore`) of such keys."""
        found = self._call("scan", self.provider.scan, self.prefix + check_filter(prefix))
        if prefix and not prefix.startswith("{"):  # "" already covers every slot key
            slots = self._call("scan", self.provider.scan, self.prefix + "{" + prefix)
            found = sorted([*found, *slots], key=lambda info: semaphore.slot_of(info.key[len(self.prefix) :]))
        return [unprefixed(info, self.prefix) for info in found]

    def force_release(self, key: str, token: str) -> bool:
        """Release exactly the lease ``token`` holds on ``key`` (operators, worker hooks)."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        if not isinstance(token, str) or not token:
            raise InvalidArgumentError("token must be a non-empty str")
        return bool(self._call("release", self.provider.release, self.prefix + key, token))

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
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgumentError(f"limit must be a positive int, got {limit!r}")
        full = self.prefix + check_filter(prefix)
        if not full:
            raise InvalidArgumentError(
                "sweep needs a non-empty key prefix: the lock table may hold other applications' rows"
            )
        if not isinstance(self.provider, Sweeps):
            return 0
        return int(self._call("sweep", self.provider.sweep, full, limit))

    # -- internals ------------------------------------------------------------------------

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """Call the provider within ``timeout`` seconds (default ``call_timeout``); the
        driver's and the network's exceptions become BackendError, any other propagates."""
        return self._calls.call(
            what, method, *args, timeout=self.call_timeout if timeout is None else timeout, **kwargs
        )

    def _after_fork_in_child(self) -> None:
        self._calls = StoreCalls()  # the parent's stuck calls have no thread here
