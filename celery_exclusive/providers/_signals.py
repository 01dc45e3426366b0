"""What the release listeners share: a key's release counter and its waiters' view of it.

A listener (PostgreSQL ``LISTEN`` in ``_pg_listen``, Redis sharded pub/sub in
``_redis_wake``) keeps one :class:`Watch` per key or channel that someone in the process
waits for, and hands each waiter a :class:`Subscription` on one or more of them
(``providers.base.ReleaseSubscription``; several for a semaphore's slots). The listener owns
the connection handling: it calls :meth:`Watch.signal` for each release heard (or possibly
missed) and :meth:`Watch.break_off` when a watch can signal no more; the subscription turns
those into ``wait``'s answers. Every field of a watch is guarded by the listener's lock,
the one its single Condition ``changed`` wraps (shared by all its watches, so that a
subscription to several can wait for any of them). :class:`Woken` is the releasing side:
which of a provider's releases reached a waiter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any


class SignalsLost(ConnectionError):
    """A subscription cannot signal (closed, or its connection is gone); the waiter polls."""


class Watch:
    """The subscribers of one key in this process and the releases they were sent."""

    __slots__ = ("broken", "changed", "released", "subscribers")

    def __init__(self, changed: threading.Condition) -> None:
        #: The listener's one Condition.
        self.changed = changed
        self.subscribers = 0
        #: Releases signalled so far (a subscription remembers the sum it has seen).
        self.released = 0
        #: Whether it can signal no more: its waiters' ``wait`` raises SignalsLost.
        self.broken = False

    def signal(self) -> None:
        """One release (or a possibly missed one); the caller holds the lock."""
        self.released += 1
        self.changed.notify_all()

    def break_off(self) -> None:
        """No more signals (connection lost, listener closed); the caller holds the lock."""
        self.broken = True
        self.changed.notify_all()


class Subscription:
    """One waiter's view of the releases of one or more watches, by name
    (``providers.base.ReleaseSubscription``): signalled by any, lost when any breaks.

    ``leave(name, watch)`` is called for each, holding the lock, when it closes: the
    listener then counts the subscriber out (and stops listening after the last one).
    """

    __slots__ = ("_changed", "_leave", "_open", "_seen", "_watches")

    def __init__(
        self, changed: threading.Condition, watches: Mapping[str, Watch], leave: Callable[[str, Any], None]
    ) -> None:
        self._changed = changed
        self._watches = watches
        self._leave = leave
        self._seen = self._released()
        self._open = True

    def _released(self) -> int:
        return sum(watch.released for watch in self._watches.values())

    def broken(self) -> bool:
        """Whether a watch of it broke (the caller holds the lock)."""
        return any(watch.broken for watch in self._watches.values())

    def wait(self, timeout: float) -> bool:
        with self._changed:
            if not self._open:
                raise SignalsLost("the subscription is closed")
            self._changed.wait_for(lambda: self._released() != self._seen or self.broken(), max(0.0, timeout))
            released = self._released()
            if released != self._seen:
                self._seen = released
                return True
            if self.broken():
                raise SignalsLost("the release signals were lost (connection gone or listener closed)")
            return False

    def close(self) -> None:
        with self._changed:
            self.close_locked()

    def close_locked(self) -> None:
        """:meth:`close`, the caller holding the lock (a listener abandoning a subscribe)."""
        if self._open:
            self._open = False
            for name, watch in self._watches.items():
                self._leave(name, watch)


class Woken:
    """The keys whose latest release by this provider reached a waiter (``KnowsWaiters``:
    Redis, its release signal reached a subscriber; PostgreSQL, it notified a registered
    waiter), each told once; at most 1024 (then forgotten: a hint, not a record)."""

    __slots__ = ("_keys",)

    def __init__(self) -> None:
        self._keys: set[str] = set()

    def note(self, key: str, reached: bool) -> None:
        if reached:
            if len(self._keys) > 1024:
                self._keys.clear()
            self._keys.add(key)
        elif self._keys:
            self._keys.discard(key)

    def told(self, key: str) -> bool:
        if key in self._keys:
            self._keys.discard(key)
            return True
        return False
