"""Markers: detached leases that no heartbeat keeps or releases (``LockService.mark``).

Part of the lock core. A marker is one store call (two or three where ``unless`` is asked
of a store without ``AcquiresUnless``, or of Redis Cluster keys in two slots), never
retried: a marker whose reply was lost stays in place, which is what its writer wanted,
and expires with its ttl.
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

    def _check_key(self, key: str) -> None: ...

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T: ...


def take(
    store: MarkingStore, key: str, lifetime: float, holder: Mapping[str, Any] | None, unless: str | None
) -> str | Held:
    """The new marker's token on ``key`` (unprefixed) for ``lifetime`` seconds, or Held
    naming the live lease that refused it (unprefixed; None if it changed mid-call); see
    ``LockService.try_mark``."""
    store._check_key(key)
    if unless is not None:
        store._check_key(unless)
    if lifetime > MAX_LIFETIME_CAP:
        raise InvalidArgumentError(f"ttl is {lifetime:g} s; the hard cap is 24 h")
    encoded = holder_json(holder)
    token = new_token()
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
    if isinstance(answer, Grant):
        return token
    found = answer.holder if isinstance(answer, Held) else None
    return Held(None if found is None else unprefixed(found, store.prefix))
