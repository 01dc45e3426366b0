"""In-process lock store, for tests and single-process programs (``memory://``).

Public so users can unit-test their own exclusive tasks without a server. Leases live in
this process only: it gives no exclusion across processes. Its clock is swappable so tests
can move time without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
    decode_holder,
)
from celery_exclusive.urls import split_options


@dataclass(slots=True)
class _Row:
    token: str
    fence: int
    created_at: float
    expires_at: float
    deadline: float
    holder: str


def _alive(row: _Row, now: float) -> bool:
    return row.expires_at > now and row.deadline > now


class _Subscription:
    """One waiter's view of the releases of one or more keys on a MemoryLockProvider."""

    def __init__(self, provider: MemoryLockProvider, keys: tuple[str, ...]) -> None:
        self._provider, self._keys = provider, keys
        self._seen = self._count()
        self._open = True

    def _count(self) -> int:
        """(holding the Condition) Releases of the keys so far."""
        watched = self._provider._watched
        return sum(watched[key][1] for key in self._keys if key in watched)

    def wait(self, timeout: float) -> bool:
        cond = self._provider._released
        with cond:
            if not self._open:
                return False
            cond.wait_for(lambda: self._count() != self._seen, timeout=max(timeout, 0.0))
            now = self._count()
            signalled, self._seen = now != self._seen, now
            return signalled

    def close(self) -> None:
        with self._provider._released:
            if not self._open:
                return
            self._open = False
            for key in self._keys:
                watch = self._provider._watched.get(key)
                if watch is not None:
                    watch[0] -= 1
                    if watch[0] <= 0:
                        del self._provider._watched[key]


class MemoryLockProvider:
    """Leases in a dict guarded by a mutex; ``clock`` is seconds on any monotonic scale."""

    max_key_length = 1024

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._mutex = threading.Lock()
        self._rows: dict[str, _Row] = {}
        self._fences: dict[str, int] = {}
        # (key, task id) -> (outcome, attempt, recorded at, expires at)
        self._done: dict[tuple[str, str], tuple[str, int, float, float]] = {}
        # Release signals (WakesWaiters): key -> [subscriber count, releases so far], kept
        # only while someone listens, so unwatched keys cost nothing.
        self._released = threading.Condition(threading.Lock())
        self._watched: dict[str, list[int]] = {}

    @classmethod
    def from_url(cls, url: str) -> MemoryLockProvider:
        """The provider of a ``memory://`` URL, which takes no options (a misspelt one
        must not pass silently)."""
        split_options(url, ())
        return cls()

    def __repr__(self) -> str:
        return "MemoryLockProvider()"

    def _live(self, key: str, now: float) -> _Row | None:
        row = self._rows.get(key)
        if row is not None and (row.expires_at <= now or row.deadline <= now):
            del self._rows[key]
            return None
        return row

    def _info(self, key: str, row: _Row, now: float) -> LockInfo:
        return LockInfo(
            key=key,
            token=row.token,
            fence=row.fence,
            age=now - row.created_at,
            expires_in=row.expires_at - now,
            hard_expires_in=row.deadline - now,
            holder=decode_holder(row.holder),
        )

    def _record(self, key: str, task_id: str, now: float) -> CompletionInfo | None:
        found = self._done.get((key, task_id))
        if found is None:
            return None
        outcome, attempt, at, expires = found
        if expires <= now:
            del self._done[(key, task_id)]
            return None
        return CompletionInfo(key, task_id, outcome, attempt, now - at, expires - now)

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        task_id: str | None = None,
        timeout: float | None = None,  # nothing here can block on a network
    ) -> Grant | Held | Done:
        with self._mutex:
            now = self._clock()
            if task_id is not None and (record := self._record(key, task_id, now)) is not None:
                return Done(record)
            return self._take(key, token, ttl, max_lifetime, holder, now=now)

    def _take(
        self, key: str, token: str, ttl: float, max_lifetime: float, holder: str, *, now: float
    ) -> Grant | Held:
        """``acquire`` without the record check (holding the mutex)."""
        row = self._live(key, now)
        if row is not None:
            if row.token == token:
                return Grant(row.fence, row.expires_at - now)
            return Held(self._info(key, row, now))
        return self._grant(key, token, ttl, max_lifetime, holder, now=now)

    def _grant(
        self, key: str, token: str, ttl: float, max_lifetime: float, holder: str, *, now: float
    ) -> Grant:
        """Write a new lease on the free ``key`` (holding the mutex)."""
        fence = self._fences.get(key, 0) + 1
        self._fences[key] = fence
        granted = min(ttl, max_lifetime)
        self._rows[key] = _Row(token, fence, now, now + granted, now + max_lifetime, holder)
        return Grant(fence, granted)

    def acquire_unless(
        self,
        key: str,
        token: str,
        ttl: float,
        holder: str,
        *,
        blocker: str,
        timeout: float | None = None,
    ) -> Grant | Held:
        """``key`` unless ``blocker`` is live (``AcquiresUnless``), under one hold of the mutex."""
        with self._mutex:
            now = self._clock()
            blocking = self._live(blocker, now)
            if blocking is not None:
                return Held(self._info(blocker, blocking, now))
            return self._take(key, token, ttl, ttl, holder, now=now)

    def acquire_any(
        self,
        keys: Sequence[str],
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Grant] | Held:
        """The first free of ``keys`` (a semaphore's slots), under one hold of the mutex."""
        with self._mutex:
            now = self._clock()
            rows = [self._live(key, now) for key in keys]
            for i, row in enumerate(rows):
                if row is not None and row.token == token:
                    return i, Grant(row.fence, row.expires_at - now)
            for i, row in enumerate(rows):
                if row is None:
                    return i, self._grant(keys[i], token, ttl, max_lifetime, holder, now=now)
            first = rows[0]
            return Held(None if first is None else self._info(keys[0], first, now))

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        answers: list[float | None] = []
        with self._mutex:
            now = self._clock()
            for request in requests:
                row = self._live(request.key, now)
                if row is None or row.token != request.token:
                    answers.append(None)
                    continue
                row.expires_at = min(now + request.ttl, row.deadline)
                answers.append(row.expires_at - now)
        return answers

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        with self._mutex:
            now = self._clock()
            if completion is not None:
                stored = self._record(key, completion.task_id, now)
                if stored is None or stored.attempt <= completion.attempt:  # never an earlier attempt
                    self._done[(key, completion.task_id)] = (
                        completion.outcome,
                        completion.attempt,
                        now,
                        now + completion.retain,
                    )
            row = self._live(key, now)
            if row is None or row.token != token:
                return False
            del self._rows[key]
        self._signal_release(key)
        return True

    def subscribe(self, key: str) -> _Subscription:
        """Listen for releases of ``key`` (WakesWaiters): a Condition, no polling needed."""
        return self.subscribe_any([key])

    def subscribe_any(self, keys: Sequence[str]) -> _Subscription:
        """Listen for releases of any of ``keys`` (WakesOnAny: a semaphore's slots)."""
        unique = tuple(dict.fromkeys(keys))
        with self._released:
            for key in unique:
                self._watched.setdefault(key, [0, 0])[0] += 1
            return _Subscription(self, unique)

    def _signal_release(self, key: str) -> None:
        with self._released:
            watch = self._watched.get(key)
            if watch is not None:
                watch[1] += 1
                self._released.notify_all()

    def completion(self, key: str, task_id: str, *, timeout: float | None = None) -> CompletionInfo | None:
        with self._mutex:
            return self._record(key, task_id, self._clock())

    def completions(self, prefix: str, *, timeout: float | None = None) -> list[CompletionInfo]:
        with self._mutex:
            now = self._clock()
            found = [self._record(k, t, now) for k, t in sorted(self._done) if k.startswith(prefix)]
            return [record for record in found if record is not None]

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        with self._mutex:
            live = self._record(key, task_id, self._clock()) is not None
            self._done.pop((key, task_id), None)
            return live

    def sweep(self, prefix: str, limit: int = SWEEP_LIMIT, *, timeout: float | None = None) -> int:
        """Delete up to ``limit`` dead leases and ``limit`` expired records under ``prefix``
        (``Sweeps``); fences are kept per key apart from the rows, so they still grow."""
        with self._mutex:
            now = self._clock()
            dead = [k for k, r in self._rows.items() if k.startswith(prefix) and not _alive(r, now)][:limit]
            old = [p for p, r in self._done.items() if p[0].startswith(prefix) and r[3] <= now][:limit]
            for key in dead:
                del self._rows[key]
            for pair in old:
                del self._done[pair]
            return len(dead) + len(old)

    def peek(self, key: str, *, timeout: float | None = None) -> LockInfo | None:
        with self._mutex:
            now = self._clock()
            row = self._live(key, now)
            return None if row is None else self._info(key, row, now)

    def scan(self, prefix: str, *, timeout: float | None = None) -> list[LockInfo]:
        with self._mutex:
            now = self._clock()
            keys = sorted(k for k in self._rows if k.startswith(prefix))
            rows = ((k, self._live(k, now)) for k in keys)
            return [self._info(k, row, now) for k, row in rows if row is not None]

    def close(self) -> None:
        """Nothing to close; leases stay until released or expired."""

    def diagnose(self) -> list[Diagnosis]:
        with self._mutex:
            held = len(self._rows)
        return [
            Diagnosis("store", "warn", "memory:// excludes only within this process"),
            Diagnosis("leases", "ok", f"{held} lease(s) in this process"),
        ]
