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
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

from celery_exclusive import many, semaphore, signals, waiting
from celery_exclusive._store import StoreCalls, is_store_error  # noqa: F401 (is_store_error's old home)
from celery_exclusive.errors import AlreadyDone, BackendError, InvalidArgumentError, LockedError
from celery_exclusive.heartbeat import Heartbeat
from celery_exclusive.lease import Lease, ReleaseOutcome
from celery_exclusive.providers.base import (
    COMPLETION_OUTCOMES,
    MAX_TASK_ID_LENGTH,
    SWEEP_LIMIT,
    AcquiresAny,
    Completion,
    CompletionInfo,
    CompletionStore,
    Done,
    Grant,
    Held,
    LockInfo,
    LockProvider,
    RefreshRequest,
    Sweeps,
    accepts_timeout,
    encode_holder,
)
from celery_exclusive.urls import mask_url, provider_from_url, resolve_url
from celery_exclusive.validation import (
    MAX_LIFETIME_CAP,
    check_key,
    check_prefix,
    check_task_id,
    lease_durations,
    seconds,
)

T = TypeVar("T")
logger = logging.getLogger("celery_exclusive")

DEFAULT_PREFIX = "task-lock:"
#: Seconds between the heartbeat's sweeps of dead rows (``LockService(sweep_interval=)``).
DEFAULT_SWEEP_INTERVAL = 60.0
#: Environment variable read when ``sweep_interval`` is not given: seconds, or 0/off.
SWEEP_ENV_VAR = "CELERY_EXCLUSIVE_SWEEP_INTERVAL"
_FROM_ENV: Any = object()
DEFAULT_TTL = 15 * 60.0
DEFAULT_MAX_LIFETIME = MAX_LIFETIME_CAP
_HOST = socket.gethostname()[:64]
#: Pause before the one same-token retry of an acquire that failed in flight, in seconds.
ACQUIRE_RETRY_DELAY = 0.05
#: Default ``call_timeout``: seconds an acquire (its retry included), peek or scan may wait
#: for the store before it raises BackendError.
DEFAULT_CALL_TIMEOUT = 10.0
#: Longest a release waits for the store before it reports UNKNOWN (the heartbeat then
#: keeps retrying it in the background), in seconds.
RELEASE_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class ExclusiveResult(Generic[T]):
    """What :meth:`LockService.run_exclusive` did: ``result`` is set only when ``acquired``."""

    acquired: bool
    result: T | None = None
    fence: int | None = None
    holder: LockInfo | None = None


class _ThisProcess:
    """Who this process is, as holder metadata and a token prefix; rebuilt in a forked child
    (so the hot path neither asks the kernel for its pid nor encodes the same JSON again)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        pid = os.getpid()
        self.meta: dict[str, Any] = {"host": _HOST, "pid": pid}
        self.holder = encode_holder(self.meta)
        self.token_prefix = f"{_HOST}:{pid}:"


_this = _ThisProcess()


def new_token() -> str:
    """A fresh owner token: host, pid, wall time (for people) and 64 random bits."""
    return f"{_this.token_prefix}{int(time.time() * 1000)}:{secrets.token_hex(8)}"


def _check_batch_size(size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InvalidArgumentError(f"heartbeat_batch_size must be a positive int, got {size!r}")
    return size


def _store_from(store: LockProvider | str | None) -> tuple[str | None, LockProvider]:
    """The URL (None for a provider given as such) and the provider of ``store``."""
    if store is None or isinstance(store, str):
        url = resolve_url(store)
        return url, provider_from_url(url)
    if isinstance(store, LockProvider):
        return None, store
    raise InvalidArgumentError(f"store must be a URL or a LockProvider, got {type(store).__name__}")


def _check_holder(holder: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if holder is None:
        return {}
    if not isinstance(holder, Mapping) or not all(isinstance(k, str) for k in holder):
        raise InvalidArgumentError("holder must be a mapping with str keys")
    return holder


def _sweep_interval(value: object) -> float | None:
    """The heartbeat's sweep interval in seconds, None for off; from the environment
    (``CELERY_EXCLUSIVE_SWEEP_INTERVAL``: seconds, or 0/off) when not given."""
    if value is _FROM_ENV:
        raw = os.environ.get(SWEEP_ENV_VAR, "").strip().lower()
        if not raw:
            return DEFAULT_SWEEP_INTERVAL
        if raw in ("0", "off", "false", "no"):
            return None
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{SWEEP_ENV_VAR} must be seconds or 0/off, got {raw!r}") from None
    if value is None or value is False or value == 0:
        return None
    return seconds("sweep_interval", value)


def _check_filter(prefix: object, *, text: bool = True) -> str:
    """A key filter: a str without NUL (and, with ``text``, valid Unicode)."""
    if not isinstance(prefix, str) or "\x00" in prefix:
        raise InvalidArgumentError("prefix must be a str without NUL characters")
    if text:
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("prefix must be valid Unicode text (no lone surrogates)") from None
    return prefix


def _unprefix(key: str, prefix: str) -> str:
    return key[len(prefix) :] if key.startswith(prefix) else key


def _unprefixed(info: LockInfo, prefix: str) -> LockInfo:
    return LockInfo(
        _unprefix(info.key, prefix),
        info.token,
        info.fence,
        info.age,
        info.expires_in,
        info.hard_expires_in,
        info.holder,
    )


class LockService:
    """Acquires, keeps alive and releases leases on one lock store.

    ``store`` is a provider or a URL; None reads ``CELERY_EXCLUSIVE_URL``. One service per
    process is the intended use: it owns one heartbeat thread for all its leases. Safe to
    use from several threads, and across ``fork`` (a child starts with no leases and never
    reuses the parent's connections).

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
        sweep_interval: float | timedelta | None = _FROM_ENV,
    ) -> None:
        self.prefix = check_prefix(prefix)
        #: Seconds between sweeps of dead rows by the heartbeat; None: off (see :meth:`sweep`).
        self.sweep_interval = _sweep_interval(sweep_interval)
        self.call_timeout = seconds("call_timeout", call_timeout)
        self.ttl, self.refresh_interval, self.max_lifetime = lease_durations(
            seconds("ttl", ttl),
            None if refresh_interval is None else seconds("refresh_interval", refresh_interval),
            seconds("max_lifetime", max_lifetime),
            ttl_explicit=True,
        )
        self._refresh_explicit = refresh_interval is not None  # read by _Leasing
        self._batch_size = _check_batch_size(heartbeat_batch_size)
        for name, value in (("clock", clock), ("thread_factory", thread_factory)):
            if not callable(value):
                raise InvalidArgumentError(f"{name} must be callable, got {type(value).__name__}")
        self._url, self.provider = _store_from(store)
        self.clock = clock
        #: Whether the store keeps completion records (see ``completion()``).
        self.keeps_records = isinstance(self.provider, CompletionStore)
        self._thread_factory = thread_factory
        self._calls = StoreCalls()
        self._records = _Records(self)
        self._leasing = _Leasing(self)
        self._closed = False
        self._heartbeat = self._leasing.new_heartbeat()
        #: Leases taken with ``hold_at_least``: (seconds, when the grant arrived on self.clock).
        #: Popped at release (or loss), so a lease never outlives its use here.
        self._cooldowns: dict[Lease, tuple[float, float]] = {}
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
        wait: float | None = None,
        hold_at_least: float | timedelta | None = None,
        limit: int = 1,
    ) -> Lease | None:
        """Acquire ``key`` and keep it alive; None if someone else holds it (with ``limit``,
        if ``limit`` others do).

        With ``wait`` (seconds), retry until it is free or the time is up (see
        :mod:`celery_exclusive.waiting`); None only then. ``hold_at_least``, ``limit``: see
        :meth:`lock`."""
        semaphore.check_limit(limit)
        cooldown = (
            None if hold_at_least is None else self._leasing.check_cooldown(hold_at_least, max_lifetime)
        )
        if wait is None:
            taken = self._leasing.take(
                key, ttl, refresh_interval, max_lifetime, holder, name_holder=False, limit=limit
            )
        else:
            taken = waiting.take_waiting(
                lambda _final: self._leasing.take(
                    key, ttl, refresh_interval, max_lifetime, holder, name_holder=False, limit=limit
                ),
                self.provider,
                self.prefix + key,
                waiting.check_wait(wait),
            )
        if isinstance(taken, Lease):
            self._leasing.cool(taken, cooldown)
            return taken
        return None

    def lock(
        self,
        key: str,
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        wait: float | None = None,
        hold_at_least: float | timedelta | None = None,
        limit: int = 1,
    ) -> Lease:
        """Acquire ``key`` and keep it alive, or raise :class:`LockedError` naming the holder.

        With ``wait`` (seconds, finite, >= 0), retry until it is free or the time is up,
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
        """
        if semaphore.check_limit(limit) > 1:
            task_id = None
        if task_id is not None:
            check_task_id(task_id, MAX_TASK_ID_LENGTH)
            if not self.keeps_records:
                task_id = None
        cooldown = (
            None if hold_at_least is None else self._leasing.check_cooldown(hold_at_least, max_lifetime)
        )
        if wait is None:
            taken = self._leasing.take(
                key, ttl, refresh_interval, max_lifetime, holder, task_id=task_id, limit=limit
            )
        else:
            taken = waiting.take_waiting(
                lambda final: self._leasing.take(
                    key,
                    ttl,
                    refresh_interval,
                    max_lifetime,
                    holder,
                    name_holder=final,
                    task_id=task_id,
                    limit=limit,
                ),
                self.provider,
                self.prefix + key,
                waiting.check_wait(wait),
            )
        if isinstance(taken, Held):
            raise LockedError(key, taken.holder)
        self._leasing.cool(taken, cooldown)
        return taken

    def lock_many(
        self,
        keys: list[str] | tuple[str, ...],
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        wait: float | None = None,
    ) -> many.LeaseSet:
        """Acquire every key or none (see :mod:`celery_exclusive.many`): a LeaseSet, or
        :class:`LockedError` naming the first refused key. Keys are taken in a canonical
        order, so overlapping calls never deadlock; ``wait`` as for :meth:`lock`."""
        taken = self._take_many(
            keys,
            ttl=ttl,
            refresh_interval=refresh_interval,
            max_lifetime=max_lifetime,
            holder=holder,
            wait=wait,
        )
        if isinstance(taken, tuple):
            raise LockedError(taken[0], taken[1].holder)
        return taken

    def try_lock_many(
        self,
        keys: list[str] | tuple[str, ...],
        *,
        ttl: float | timedelta | None = None,
        refresh_interval: float | timedelta | None = None,
        max_lifetime: float | timedelta | None = None,
        holder: Mapping[str, Any] | None = None,
        wait: float | None = None,
    ) -> many.LeaseSet | None:
        """:meth:`lock_many`, answering None instead of raising LockedError."""
        taken = self._take_many(
            keys,
            ttl=ttl,
            refresh_interval=refresh_interval,
            max_lifetime=max_lifetime,
            holder=holder,
            wait=wait,
        )
        return None if isinstance(taken, tuple) else taken

    def _take_many(
        self,
        keys: object,
        *,
        ttl: float | timedelta | None,
        refresh_interval: float | timedelta | None,
        max_lifetime: float | timedelta | None,
        holder: Mapping[str, Any] | None,
        wait: float | None,
    ) -> many.LeaseSet | tuple[str, Held]:
        checked = many.check_keys(keys)
        for key in checked:
            self._check_key(key)
        self._leasing.durations(ttl, refresh_interval, max_lifetime)
        _check_holder(holder)
        return many.take_all(
            checked,
            lambda key, final: self._leasing.take(
                key, ttl, refresh_interval, max_lifetime, holder, name_holder=final
            ),
            lambda key: self.prefix + key,
            self.provider,
            None if wait is None else waiting.check_wait(wait),
        )

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

        The lease is released in ``finally``, whether ``fn`` returned or raised.
        """
        if on_locked is not None and not callable(on_locked):
            raise InvalidArgumentError("on_locked must be callable")
        if not callable(fn):
            raise InvalidArgumentError("fn must be callable")
        lease = self._leasing.take(key, ttl, refresh_interval, max_lifetime, holder)
        if isinstance(lease, Held):
            if on_locked is not None:
                on_locked()
            return ExclusiveResult(acquired=False, holder=lease.holder)
        try:
            result = fn()
        finally:
            lease.release()
        return ExclusiveResult(acquired=True, result=result, fence=lease.fence)

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
        return self._leasing.mark(key, ttl, holder)

    # -- releasing ------------------------------------------------------------------------

    def release(self, lease: Lease, completion: Completion | None = None) -> ReleaseOutcome:
        """Release ``lease`` if its token still owns the key; never raises for an outage.

        Returns RELEASED, NOT_OWNED (it had expired or been taken over: the work may have
        overlapped another holder's, so this is logged as a warning) or UNKNOWN (the store
        did not answer; the heartbeat keeps retrying the release until it can tell).
        With ``completion``, the same store call records it on the lease's key (see
        :meth:`completion`); on UNKNOWN the record may be missing (the retried release
        does not carry it).
        """
        return self._leasing.release(lease, self._records.for_release(completion))

    def force_release(self, key: str, token: str) -> bool:
        """Release exactly the lease ``token`` holds on ``key`` (operators, worker hooks)."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        if not isinstance(token, str) or not token:
            raise InvalidArgumentError("token must be a non-empty str")
        return bool(self._call("release", self.provider.release, self.prefix + key, token))

    # -- inspecting -----------------------------------------------------------------------

    def peek(self, key: str) -> LockInfo | None:
        """The live lease on ``key`` (key shown without the prefix), or None if free."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        info = self._call("peek", self.provider.peek, self.prefix + key)
        return None if info is None else _unprefixed(info, self.prefix)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every live lease whose key (without the service prefix) starts with ``prefix``, and
        the higher slots (``{key}#i``, see :mod:`celery_exclusive.semaphore`) of such keys."""
        found = self._call("scan", self.provider.scan, self.prefix + _check_filter(prefix))
        if prefix and not prefix.startswith("{"):  # "" already covers every slot key
            slots = self._call("scan", self.provider.scan, self.prefix + "{" + prefix)
            found = sorted([*found, *slots], key=lambda info: semaphore.slot_of(info.key[len(self.prefix) :]))
        return [_unprefixed(info, self.prefix) for info in found]

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
        full = self.prefix + _check_filter(prefix)
        if not full:
            raise InvalidArgumentError(
                "sweep needs a non-empty key prefix: the lock table may hold other applications' rows"
            )
        provider = self.provider
        if not isinstance(provider, Sweeps):
            return 0
        if accepts_timeout(provider.sweep):
            return int(self._call("sweep", provider.sweep, full, limit, timeout=self.call_timeout))
        return int(self._call("sweep", provider.sweep, full, limit))

    def _heartbeat_sweep(self) -> Callable[[float], int] | None:
        """What the heartbeat calls to sweep (None: off, no prefix, or nothing to sweep)."""
        provider = self.provider
        if self.sweep_interval is None or not self.prefix or not isinstance(provider, Sweeps):
            return None
        prefix = self.prefix
        if accepts_timeout(provider.sweep):
            return lambda timeout: provider.sweep(prefix, SWEEP_LIMIT, timeout=timeout)
        return lambda _timeout: provider.sweep(prefix, SWEEP_LIMIT)

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, *, release: bool = True) -> None:
        """Stop the heartbeat, release held leases (unless ``release=False``), close the store."""
        if self._closed:
            return
        if release:
            for lease in self.held():
                self.release(lease)
        self._closed = True
        self._heartbeat.stop()
        self.provider.close()

    def __enter__(self) -> LockService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        # The parent's leases are the parent's: the child neither refreshes nor releases them.
        self._heartbeat = self._leasing.new_heartbeat()
        self._calls = StoreCalls()  # the parent's stuck calls have no thread here

    # -- internals ------------------------------------------------------------------------

    def _check_key(self, key: str) -> None:
        """Check the service is open and ``key`` is a valid key for it."""
        if self._closed:
            raise InvalidArgumentError("this LockService is closed")
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """Call the provider within ``timeout`` seconds (default ``call_timeout``); the
        driver's and the network's exceptions become BackendError, any other propagates."""
        return self._calls.call(
            what, method, *args, timeout=self.call_timeout if timeout is None else timeout, **kwargs
        )

    def _lose(self, lease: Lease, reason: str) -> None:
        """Make ``lease`` LOST (if it is live) and tell everyone: log, signal, callbacks."""
        self._leasing.lose(lease, reason)


class _Leasing:
    """How a service takes, releases and loses leases: the durations, the holder metadata,
    the acquire with its one same-token retry, who holds a contended key, markers."""

    def __init__(self, service: LockService) -> None:
        self._service = service
        #: Whether the store takes a semaphore's first free slot in one call (checked once:
        #: a runtime Protocol check costs microseconds).
        self._any = isinstance(service.provider, AcquiresAny)

    def take(
        self,
        key: str,
        ttl: float | timedelta | None,
        refresh_interval: float | timedelta | None,
        max_lifetime: float | timedelta | None,
        holder: Mapping[str, Any] | None,
        *,
        name_holder: bool = True,
        task_id: str | None = None,
        limit: int = 1,
    ) -> Lease | Held:
        """The lease on ``key``, or Held naming its holder (key unprefixed): what ``lock``
        raises as LockedError, without the cost of an exception on the contended path.
        Without ``name_holder`` (and no lock_contended receiver) the store's Held is returned
        as it is, its holder's key still prefixed: ``try_lock`` only needs to know it failed."""
        service = self._service
        service._check_key(key if limit == 1 else semaphore.slot_key(key, limit))
        ttl_s, interval_s, lifetime_s = self.durations(ttl, refresh_interval, max_lifetime)
        encoded = _this.holder if holder is None else encode_holder({**_this.meta, **_check_holder(holder)})
        store_key = service.prefix + key
        token = new_token()
        sent = service.clock()
        if limit == 1:
            answer = self._acquire(store_key, token, ttl_s, lifetime_s, encoded, task_id=task_id)
        else:
            slot, answer = self._acquire_slot(
                key, limit, token, ttl=ttl_s, max_lifetime=lifetime_s, holder=encoded
            )
            store_key = service.prefix + semaphore.slot_key(key, slot)
        if isinstance(answer, Done):
            raise AlreadyDone(key, service._records.unprefixed(answer.record))
        if not isinstance(answer, Grant):
            if not name_holder and not signals.lock_contended.receivers:
                return answer  # a failed try_lock, the hot path under contention
            return self._contended(key, store_key, answer)
        lease = Lease(
            service,
            key=key,
            store_key=store_key,
            token=token,
            fence=answer.fence,
            ttl=ttl_s,
            refresh_interval=interval_s,
            max_lifetime=lifetime_s,
            sent_at=sent,
            granted=answer.ttl,
            mutex=service.heartbeat.mutex,
        )
        service.heartbeat.add(lease)
        signals.send(signals.lock_acquired, service, key=key, lease=lease)
        return lease

    def _contended(self, key: str, store_key: str, answer: Held) -> Held:
        """Held naming the holder of ``key`` (unprefixed), after the lock_contended signal."""
        found = answer.holder if answer.holder is not None else self._winner(store_key)
        holder_info = None if found is None else _unprefixed(found, self._service.prefix)
        signals.send(signals.lock_contended, self._service, key=key, holder=holder_info)
        return Held(holder_info)

    def mark(self, key: str, ttl: float | timedelta | None, holder: Mapping[str, Any] | None) -> str | None:
        """See :meth:`LockService.mark`."""
        service = self._service
        service._check_key(key)
        lifetime = service.max_lifetime if ttl is None else seconds("ttl", ttl)
        if lifetime > MAX_LIFETIME_CAP:
            raise InvalidArgumentError(f"ttl is {lifetime:g} s; the hard cap is 24 h")
        encoded = encode_holder({**_this.meta, **_check_holder(holder)})
        token = new_token()
        args = (service.prefix + key, token, lifetime, lifetime, encoded)
        answer = service._call("mark", service.provider.acquire, *args)
        return token if isinstance(answer, Grant) else None

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
            self._service._cooldowns[lease] = (cooldown, self._service.clock())

    def _release_cooling(self, lease: Lease, left: float, completion: Completion | None) -> ReleaseOutcome:
        """End a ``hold_at_least`` lease ``left`` seconds from now instead of deleting it.

        A refresh sets the expiry to ``min(store now + ttl, hard deadline)`` on every store, so
        it shortens a lease as well as it extends one. The completion record is written by a
        release under a token that owns nothing (a store writes the record whether or not the
        token owns the key, and deletes only what it owns).
        """
        service = self._service
        timeout = min(service.call_timeout, RELEASE_TIMEOUT)
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

    def release(self, lease: Lease, completion: Completion | None) -> ReleaseOutcome:
        """See :meth:`LockService.release` (``completion`` already checked)."""
        service = self._service
        with service.heartbeat.mutex:
            was_lost = lease._mark_released()
            if was_lost is None:
                return ReleaseOutcome.NOT_OWNED
            service.heartbeat.discard(lease)
        cooling = service._cooldowns.pop(lease, None)
        if cooling is not None and not was_lost:
            left = cooling[0] - (service.clock() - cooling[1])
            if left > 0.001:
                return self._release_cooling(lease, left, completion)
        record = () if completion is None else (completion,)  # a third-party provider may not take it
        timeout = min(service.call_timeout, RELEASE_TIMEOUT)
        try:
            owned = bool(
                service._call(
                    "release",
                    service.provider.release,
                    lease.store_key,
                    lease.token,
                    *record,
                    timeout=timeout,
                )
            )
        except BackendError as exc:
            logger.warning(
                "could not release lock %r (fence %d): %s; will retry", lease.key, lease.fence, exc
            )
            service.heartbeat.retry_release(
                lease.store_key, lease.token, until=lease._deadline_at() + lease.ttl
            )
            outcome = ReleaseOutcome.UNKNOWN
        else:
            outcome = ReleaseOutcome.RELEASED if owned else ReleaseOutcome.NOT_OWNED
            if not owned and not was_lost:
                logger.warning(
                    "lock %r (fence %d) was no longer held at release: it expired or was taken "
                    "over, so the protected work may have overlapped another holder's",
                    lease.key,
                    lease.fence,
                )
        held_for = service.clock() - lease.acquired_at
        signals.send(
            signals.lock_released, service, key=lease.key, lease=lease, outcome=outcome, held_for=held_for
        )
        return outcome

    def lose(self, lease: Lease, reason: str) -> None:
        """Make ``lease`` LOST (if it is live) and tell everyone: log, signal, callbacks."""
        service = self._service
        with service.heartbeat.mutex:
            lost = lease._mark_lost()
            if lost is None:
                return
            service.heartbeat.discard(lease)
            service._cooldowns.pop(lease, None)
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
            sweep=service._heartbeat_sweep(),
            sweep_interval=service.sweep_interval or DEFAULT_SWEEP_INTERVAL,
            sweep_limit=SWEEP_LIMIT,
        )

    def _refreshed(self, leases: list[Lease], duration: float) -> None:
        if leases:
            signals.send(signals.lock_refreshed, self._service, leases=leases, duration=duration)

    def _refresh_failed(self, leases: list[Lease], error: Exception) -> None:
        signals.send(signals.refresh_failed, self._service, leases=leases, error=error)

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

    def _acquire(
        self, store_key: str, token: str, ttl: float, max_lifetime: float, holder: str, *, task_id: str | None
    ) -> Grant | Held | Done:
        """Acquire, retrying once with the same token (see :meth:`_retried`)."""
        service = self._service
        once = {} if task_id is None else {"task_id": task_id}  # a third-party provider may not take it
        args = (store_key, token, ttl, max_lifetime, holder)
        return self._retried(
            lambda timeout: service._call(
                "acquire", service.provider.acquire, *args, timeout=timeout, **once
            ),
            (store_key,),
            token,
            min(ttl, max_lifetime),
        )

    def _acquire_slot(
        self, key: str, limit: int, token: str, *, ttl: float, max_lifetime: float, holder: str
    ) -> tuple[int, Grant | Held]:
        """The first free slot (1-based) of semaphore ``key`` and its Grant, or ``(1, Held)``:
        one store call where the provider has ``acquire_any``, else one acquire per slot in order
        (a retried attempt then releases the token's other slots, which its lost reply may hold)."""
        service = self._service
        provider = service.provider
        keys = [service.prefix + slot for slot in semaphore.slot_keys(key, limit)]
        life = min(ttl, max_lifetime)
        if self._any:
            any_store = cast("AcquiresAny", provider)  # self._any says so
            answer = self._retried(
                lambda timeout: service._call(
                    "acquire", any_store.acquire_any, keys, token, ttl, max_lifetime, holder, timeout=timeout
                ),
                keys,
                token,
                life,
            )
            return (1, answer) if isinstance(answer, Held) else (answer[0] + 1, answer[1])
        attempts: list[float] = []

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
                        for other in keys[:i] + keys[i + 1 :]:
                            service.heartbeat.retry_release(other, token, until=attempts[0] + life)
                    return i, got
                first = got if first is None else first
            assert first is not None  # limit >= 2 slots were tried
            return 0, first

        index, found = self._retried(in_order, keys, token, life)
        if isinstance(found, Done):  # pragma: no cover - no task_id is sent for a semaphore
            raise AssertionError("a completion record answered a semaphore acquire")
        return (index + 1, found) if isinstance(found, Grant) else (1, found)

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
                    for store_key in store_keys:
                        service.heartbeat.retry_release(store_key, token, until=sent + life)
                    raise
                time.sleep(ACQUIRE_RETRY_DELAY)
            except BaseException:
                for store_key in store_keys:
                    service.heartbeat.retry_release(store_key, token, until=sent + life)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _winner(self, store_key: str) -> LockInfo | None:
        """Who holds a key whose acquire lost a race and could not say (PostgreSQL: the
        racing insert committed after the statement's snapshot); None if already gone."""
        try:
            return self._service._call("peek", self._service.provider.peek, store_key)
        except BackendError:  # the key was held: that stands even if this extra look fails
            return None


class _Records:
    """The service's completion records (see :meth:`LockService.completion`): key checks,
    the prefix, and None/[]/False from a store that keeps none."""

    def __init__(self, service: LockService) -> None:
        self._service = service
        self._store = service.provider if isinstance(service.provider, CompletionStore) else None

    def for_release(self, completion: Completion | None) -> Completion | None:
        """``completion`` checked, or None when there is none or the store keeps no records."""
        if completion is None:
            return None
        _check_completion(completion)
        return completion if self._store is not None else None

    def _store_key(self, key: str, task_id: str) -> str:
        service = self._service
        check_key(key, prefix=service.prefix, max_length=service.provider.max_key_length)
        check_task_id(task_id, MAX_TASK_ID_LENGTH)
        return service.prefix + key

    def completion(self, key: str, task_id: str) -> CompletionInfo | None:
        store_key = self._store_key(key, task_id)
        if self._store is None:
            return None
        found = self._service._call("read a record", self._store.completion, store_key, task_id)
        return None if found is None else self.unprefixed(found)

    def completions(self, prefix: str) -> list[CompletionInfo]:
        _check_filter(prefix, text=False)
        if self._store is None:
            return []
        found = self._service._call("list records", self._store.completions, self._service.prefix + prefix)
        return [self.unprefixed(record) for record in found]

    def forget(self, key: str, task_id: str) -> bool:
        store_key = self._store_key(key, task_id)
        if self._store is None:
            return False
        return bool(self._service._call("forget a record", self._store.forget, store_key, task_id))

    def unprefixed(self, record: CompletionInfo) -> CompletionInfo:
        return CompletionInfo(
            _unprefix(record.key, self._service.prefix),
            record.task_id,
            record.outcome,
            record.attempt,
            record.age,
            record.expires_in,
        )


def _check_completion(completion: object) -> None:
    if not isinstance(completion, Completion):
        raise InvalidArgumentError(f"completion must be a Completion, got {type(completion).__name__}")
    check_task_id(completion.task_id, MAX_TASK_ID_LENGTH)
    if completion.outcome not in COMPLETION_OUTCOMES:
        raise InvalidArgumentError(f"completion outcome must be one of {COMPLETION_OUTCOMES}")
    attempt = completion.attempt
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise InvalidArgumentError(f"completion attempt must be an int >= 0, got {attempt!r}")
    seconds("completion retain", completion.retain)


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
