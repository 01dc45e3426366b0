"""Markers: detached leases that no heartbeat keeps or releases (``LockService.mark``).

Part of the lock core. A marker is one store call (two or three where ``unless`` is asked
of a store without ``AcquiresUnless``, or of Redis Cluster keys in two slots), never
retried: a marker whose reply was lost stays in place, which is what its writer wanted,
and expires with its ttl. On a store that can send a request now and read its answer
later (``MarksLater``: Redis) a marker can be taken in those two halves
(:func:`take_later`), the caller working during the round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

from celery_exclusive._process import holder_json, new_token, unprefixed
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    AcquiresUnless,
    Done,
    Grant,
    Held,
    LockProvider,
    MarksLater,
    acquire_unless_in_steps,
)
from celery_exclusive.validation import MAX_LIFETIME_CAP

T = TypeVar("T")


class MarkingStore(Protocol):
    """What taking a marker needs of the store it is taken in (a PrefixedStore)."""

    prefix: str
    provider: LockProvider
    #: Whether ``provider`` is an ``AcquiresUnless`` (checked once: a runtime Protocol
    #: check costs microseconds, and a deduplicated send pays for each).
    _checks_unless: bool
    #: Whether ``provider`` is a ``MarksLater`` (checked once, as ``_checks_unless``).
    _marks_later: bool

    def _check_key(self, key: str) -> None: ...

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T: ...


def _checked(store: MarkingStore, key: str, lifetime: float, unless: str | None) -> None:
    store._check_key(key)
    if unless is not None:
        store._check_key(unless)
    if lifetime > MAX_LIFETIME_CAP:
        raise InvalidArgumentError(f"ttl is {lifetime:g} s; the hard cap is 24 h")


def take(
    store: MarkingStore,
    key: str,
    lifetime: float,
    holder: Mapping[str, Any] | None,
    unless: str | None,
    *,
    token: str | None = None,
) -> str | Held:
    """The new marker's token (``token``, default a new one) on ``key`` (unprefixed) for
    ``lifetime`` seconds, or Held naming the live lease that refused it (unprefixed; None if
    it changed mid-call); see ``LockService.try_mark``."""
    _checked(store, key, lifetime, unless)
    encoded = holder_json(holder)
    token = token or new_token()
    store_key = store.prefix + key
    provider = store.provider
    answer: Grant | Held | Done
    if unless is None:
        answer = store._call("mark", provider.acquire, store_key, token, lifetime, lifetime, encoded)
    elif store._checks_unless:
        acquire_unless = cast("AcquiresUnless", provider).acquire_unless
        blocker = store.prefix + unless
        answer = store._call("mark", acquire_unless, store_key, token, lifetime, encoded, blocker=blocker)
    else:
        answer = acquire_unless_in_steps(
            lambda: store._call("mark", provider.acquire, store_key, token, lifetime, lifetime, encoded),
            lambda: store._call("peek", provider.peek, store.prefix + unless),
            lambda: store._call("release", provider.release, store_key, token),
        )
    return _answer(store, token, answer)


def _answer(store: MarkingStore, token: str, answer: Grant | Held | Done) -> str | Held:
    if isinstance(answer, Grant):
        return token
    found = answer.holder if isinstance(answer, Held) else None
    return Held(None if found is None else unprefixed(found, store.prefix))


class PendingMark:
    """A marker asked for whose answer is read by :meth:`answer` (``PrefixedStore.begin_mark``);
    ``ready`` when the store answered already (it cannot split the call)."""

    __slots__ = ("_reply", "_store", "_token", "ready")

    def __init__(
        self, store: MarkingStore, token: str, reply: Callable[[], Grant | Held] | str | Held
    ) -> None:
        self._store, self._token, self._reply = store, token, reply
        self.ready = not callable(reply)

    def answer(self) -> str | Held:
        """The marker's token or the Held that refused it (see ``try_mark``); call it once:
        a store failure is raised here (BackendError) as by ``try_mark``."""
        reply = self._reply
        if not callable(reply):
            return reply
        self._reply = Held(None)  # a second call must not read the connection again
        return _answer(self._store, self._token, self._store._call("mark", _read_reply, reply))


def _read_reply(reply: Callable[[], Grant | Held], *, timeout: float | None = None) -> Grant | Held:
    """Read a reply (its deadline was set when the request went out: ``timeout`` is unused;
    the keyword keeps StoreCalls from running the read in a worker thread)."""
    return reply()


def take_later(
    store: MarkingStore,
    key: str,
    lifetime: float,
    holder: Mapping[str, Any] | None,
    unless: str | None,
    *,
    token: str,
) -> PendingMark:
    """:func:`take` with ``token``, its request sent now and its answer read by
    ``PendingMark.answer`` (on a store without ``MarksLater``: taken now, answered already)."""
    if not store._marks_later:
        return PendingMark(store, token, take(store, key, lifetime, holder, unless, token=token))
    _checked(store, key, lifetime, unless)
    encoded = holder_json(holder)
    acquire_later = cast("MarksLater", store.provider).acquire_later
    blocker = None if unless is None else store.prefix + unless
    reply = store._call("mark", acquire_later, store.prefix + key, token, lifetime, encoded, blocker=blocker)
    return PendingMark(store, token, reply)
