"""Test helpers for your own exclusive tasks: an app-wide memory store on a clock you move.

With the pytest plugin (installed with the package, active only when a test asks for its
fixtures) a test takes ``exclusive_store``; without pytest, use :class:`ExclusiveStore`
directly::

    def test_second_sync_is_skipped(exclusive_store):
        exclusive_store.hold(sync_pr.lock_key_for((42,)))     # someone else runs it
        assert_skipped(sync_pr.delay(42))                     # eager: the body never ran

Every service of the app (``get_lock_service(app)``, so every task of it) uses the store
while it is installed; leases expire only when the test moves :attr:`ExclusiveStore.clock`.
The store lives in this process: Celery's embedded worker
(``celery.contrib.testing.worker.start_worker``, solo or threads pool) and eager mode
share it, a prefork worker does not. See docs/testing.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery_exclusive import _lazy
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.lease import Lease
from celery_exclusive.providers.base import Grant, LockInfo, encode_holder
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.service import DEFAULT_PREFIX, LockService
from celery_exclusive.validation import check_key, check_prefix, seconds

if TYPE_CHECKING:
    from celery_exclusive.policies import is_skipped, skip_marker

# Like the package's: the Celery integration (task, worker, policies) is imported on first
# use, so ``import celery_exclusive.testing`` imports none of it and connects no receiver.
_LAZY = {"is_skipped": "celery_exclusive.policies", "skip_marker": "celery_exclusive.policies"}


def __getattr__(name: str) -> Any:
    return _lazy.load(globals(), _LAZY, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ExclusiveStore",
    "FakeClock",
    "Hold",
    "assert_coalesced",
    "assert_not_skipped",
    "assert_skipped",
    "is_skipped",
    "skip_marker",
]

#: Holder metadata of a :meth:`ExclusiveStore.hold` unless the test gives its own.
DEFAULT_HOLDER: dict[str, Any] = {"host": "elsewhere", "pid": 0, "task_name": "held-by-test"}
#: Most heartbeat passes one :meth:`ExclusiveStore.advance` runs (a bound on its cost).
MAX_ADVANCE_STEPS = 100_000


class FakeClock:
    """A monotonic clock that moves only when told: ``clock()`` is now, in seconds."""

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = seconds("start", start)
        self._mutex = threading.Lock()

    def __call__(self) -> float:
        with self._mutex:
            return self._now

    def __repr__(self) -> str:
        return f"FakeClock({self()!r})"

    def advance(self, by: float | timedelta) -> float:
        """Move the clock ``by`` seconds (or a timedelta) forward; returns the new time."""
        step = seconds("by", by)
        with self._mutex:
            self._now += step
            return self._now


class _NoThread(threading.Thread):
    """The heartbeat's thread in tests: exits at once, so only the test's clock drives refreshes."""

    def __init__(self, **_: Any) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        return


class Hold:
    """A key made to look held by someone else (:meth:`ExclusiveStore.hold`)."""

    def __init__(self, store: ExclusiveStore, key: str, token: str, fence: int, holder: dict[str, Any]):
        self._store = store
        self.key = key
        self.token = token
        self.fence = fence
        self.holder = holder

    def __repr__(self) -> str:
        return f"<Hold key={self.key!r} fence={self.fence}>"

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> bool:
        """Let the key go; False if it was no longer held by this hold (expired, lost)."""
        return self._store.provider.release(self._store.prefix + self.key, self.token)


class ExclusiveStore:
    """One in-memory lock store with a :class:`FakeClock`, used by every service of an app.

    ``install(app)`` makes ``get_lock_service(app)`` (and so every task of the app) use
    it until :meth:`close`. Keys are given as tasks compute them, without the prefix:
    ``task.lock_key_for(args, kwargs)``.
    """

    def __init__(self, *, clock: FakeClock | None = None, prefix: str | None = None) -> None:
        if clock is not None and not isinstance(clock, FakeClock):
            raise InvalidArgumentError(f"clock must be a FakeClock, got {type(clock).__name__}")
        if prefix is not None:
            check_prefix(prefix)
        self.clock = clock if clock is not None else FakeClock()
        self.provider = MemoryLockProvider(clock=self.clock)
        self._prefix = prefix
        self._services: list[LockService] = []
        self._installed: list[tuple[Any, LockService | None]] = []
        self._tokens = itertools.count(1)

    def __repr__(self) -> str:
        return f"<ExclusiveStore {len(self.provider.scan(''))} lease(s) at {self.clock()!r}>"

    @property
    def prefix(self) -> str:
        """The key prefix of the first installed app (or the given one, or the default)."""
        if self._prefix is None:
            self._prefix = self._services[0].prefix if self._services else DEFAULT_PREFIX
        return self._prefix

    @property
    def service(self) -> LockService:
        """The service of the first installed app (one made on this store if none is)."""
        if not self._services:
            self._services.append(self._new_service(prefix=self.prefix))
        return self._services[0]

    def _new_service(self, **options: Any) -> LockService:
        return LockService(self.provider, clock=self.clock, thread_factory=_NoThread, **options)

    # -- wiring ---------------------------------------------------------------------------

    def install(self, app: Any = None) -> LockService:
        """Make ``app`` (default: the current app) use this store; returns its service."""
        from celery_exclusive.worker import _current, _forget_cached_services, _resolve_app, app_settings

        app = _resolve_app(app)
        if not hasattr(app, "conf") or not hasattr(app, "tasks"):
            raise InvalidArgumentError(f"install() needs a Celery app, got {type(app).__name__}")
        settings = app_settings(app)
        if self._prefix is not None and settings.prefix != self._prefix:
            raise InvalidArgumentError(
                f"app {app.main!r} uses key prefix {settings.prefix!r}, this store {self._prefix!r}: "
                "one ExclusiveStore serves apps of one prefix"
            )
        service = self._new_service(
            prefix=settings.prefix,
            ttl=settings.lease_ttl,
            max_lifetime=settings.max_lifetime,
            refresh_interval=settings.refresh_interval,
        )
        state = _current()
        with state.mutex:
            self._installed.append((app, state.services.get(app)))
            state.services[app] = service
        _forget_cached_services(app)  # tasks that ran before must not keep the app's old service
        self._services.append(service)
        self._prefix = settings.prefix
        return service

    def close(self) -> None:
        """Give every installed app its previous service back and drop this store's leases."""
        if not self._installed and not self._services:
            return
        from celery_exclusive.worker import _current, _forget_cached_services

        state = _current()
        with state.mutex:
            restored = [app for app, _ in self._installed]
            for app, previous in reversed(self._installed):
                if previous is None:
                    state.services.pop(app, None)
                else:
                    state.services[app] = previous
            self._installed.clear()
        for app in restored:
            _forget_cached_services(app)
        for service in self._services:
            service.close(release=True)
        self._services.clear()

    def __enter__(self) -> ExclusiveStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- making situations ----------------------------------------------------------------

    def hold(self, key: str, *, holder: Mapping[str, Any] | None = None, ttl: float = 3600.0) -> Hold:
        """Make ``key`` look held by another worker for ``ttl`` seconds of :attr:`clock`.

        Tasks then meet their ``on_locked`` policy (skip, retry, raise, rerun). ``holder``
        is the metadata they see (``LockedError.holder.holder``, the skip marker's
        ``holder``); add ``"hands_on_reruns": True`` to play a holder with the rerun
        policy, to which ``on_locked="rerun"`` requests coalesce (for a key within 6
        characters of the store's longest, whose rerun marker is made to fit the store,
        also ``"hands_on_fitted": True``, as this version's rerun runs say). Raises
        :class:`InvalidArgumentError` if the key is already held.
        """
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        if holder is not None and (
            not isinstance(holder, Mapping) or not all(isinstance(k, str) for k in holder)
        ):
            raise InvalidArgumentError("holder must be a mapping with str keys")
        ttl = seconds("ttl", ttl)
        meta = dict(DEFAULT_HOLDER if holder is None else holder)
        token = f"held-by-test:{next(self._tokens)}"
        answer = self.provider.acquire(self.prefix + key, token, ttl, ttl, encode_holder(meta))
        if not isinstance(answer, Grant):
            raise InvalidArgumentError(f"key {key!r} is already held ({getattr(answer, 'holder', None)!r})")
        return Hold(self, key, token, answer.fence, meta)

    def expire(self, key: str) -> bool:
        """Let the store expire ``key``'s lease now, as when its holder stopped refreshing.

        The key is free at once; a run of this process holding it finds out at its next
        heartbeat (:meth:`heartbeat` runs one now). False if the key was free.
        """
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        info = self.provider.peek(self.prefix + key)
        return info is not None and self.provider.release(self.prefix + key, info.token)

    def lose(self, lease: Lease | str, reason: str = "lost by the test (celery_exclusive.testing)") -> Lease:
        """Make a lease held by this process LOST now: the store drops it and its holder knows.

        ``lease`` is a :class:`Lease` (``self.lock`` in a task body) or the key of one.
        Its ``lost`` event, ``on_lost`` callbacks and ``lock_on_lost`` policy act exactly
        as when the heartbeat finds the lease gone (``"terminate"`` interrupts the body).
        """
        found = self.lease(lease) if isinstance(lease, str) else lease
        if not isinstance(found, Lease):
            raise InvalidArgumentError(f"no lease of this process holds {lease!r}")
        self.provider.release(found.store_key, found.token)
        found._service._lose(found, reason)
        return found

    def advance(self, by: float | timedelta) -> None:
        """Let ``by`` seconds (or a timedelta) pass with healthy heartbeats.

        The clock moves in steps no longer than the shortest refresh interval of the
        leases held, each followed by a heartbeat pass: this process's leases are kept
        (up to their max lifetime), while holds and leases whose holder stopped
        refreshing expire as their ttl runs out. After :data:`MAX_ADVANCE_STEPS` steps the
        rest of the time passes in one jump (lease refresh intervals that short are rare).
        """
        left = seconds("by", by)
        for steps in range(1, MAX_ADVANCE_STEPS + 1):
            intervals = [lease.refresh_interval for lease in self._leases()]
            step = left if steps == MAX_ADVANCE_STEPS else min([left, *intervals])
            self.clock.advance(step)
            self.heartbeat()
            left -= step
            if left <= 0:
                return

    def heartbeat(self) -> None:
        """Run one heartbeat pass of every installed service now: refresh what is due, and
        mark LOST the leases the store no longer holds for this process."""
        for service in self._services:
            due = service.held()
            if due:
                service.heartbeat._refresh(due)
            service.heartbeat.beat()

    # -- looking ----------------------------------------------------------------------------

    def _leases(self) -> list[Lease]:
        return [lease for service in self._services for lease in service.held()]

    def lease(self, key: str) -> Lease | None:
        """The lease this process holds on ``key`` through an installed app, or None."""
        for lease in self._leases():
            if lease.key == key:
                return lease
        return None

    def peek(self, key: str) -> LockInfo | None:
        """The live lease on ``key`` (whoever holds it), or None if the key is free."""
        check_key(key, prefix=self.prefix, max_length=self.provider.max_key_length)
        info = self.provider.peek(self.prefix + key)
        return None if info is None else self._unprefixed(info)

    def locks(self) -> list[LockInfo]:
        """Every live lease under this store's prefix (keys without the prefix)."""
        return [self._unprefixed(info) for info in self.provider.scan(self.prefix)]

    def _unprefixed(self, info: LockInfo) -> LockInfo:
        return dataclasses.replace(info, key=info.key[len(self.prefix) :])


# -- assertions -------------------------------------------------------------------------------


def _value(result: Any, timeout: float) -> Any:
    """A task's return value from an AsyncResult/EagerResult, or ``result`` itself."""
    if isinstance(result, Mapping) or not callable(getattr(result, "get", None)):
        return result
    return result.get(timeout=timeout)


def _assert_marker(result: Any, kind: str, key: str | None, timeout: float) -> dict[str, Any]:
    from celery_exclusive.policies import MARKER_FIELD

    value = _value(result, timeout)
    if not (isinstance(value, Mapping) and value.get(MARKER_FIELD) == kind):
        raise AssertionError(f"expected the {kind!r} marker of an exclusive task, got {value!r}")
    if key is not None and value.get("key") != key:
        raise AssertionError(f"expected the {kind!r} marker for key {key!r}, got key {value.get('key')!r}")
    return dict(value)


def assert_skipped(result: Any, *, key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """Assert ``result`` (a value or an AsyncResult) is a skip marker, for ``key`` if given.

    Returns the marker: ``{"celery_exclusive": "skipped", "key": ..., "holder": {...}}``.
    """
    from celery_exclusive.policies import SKIPPED

    return _assert_marker(result, SKIPPED, key, timeout)


def assert_coalesced(result: Any, *, key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """Assert ``result`` is the marker of an ``on_locked="rerun"`` request that coalesced."""
    from celery_exclusive.policies import COALESCED

    return _assert_marker(result, COALESCED, key, timeout)


def assert_not_skipped(result: Any, *, timeout: float = 10.0) -> Any:
    """Assert the task's body ran (its result is no skip or coalesce marker); returns it."""
    from celery_exclusive.policies import is_skipped

    value = _value(result, timeout)
    if is_skipped(value):
        raise AssertionError(f"expected the task's own result, got the marker {value!r}")
    return value
