"""What the lock service's collaborators (:mod:`~celery_exclusive._acquiring`,
:mod:`~celery_exclusive._releasing`, :mod:`~celery_exclusive._leasing`,
:mod:`~celery_exclusive._records`) see of it: its settings, its store and its calls
(the records only the :class:`Store` part).

Part of the lock core. :class:`~celery_exclusive.service.LockService` satisfies it; the
collaborators depend on this Protocol rather than import the service (no import cycle).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from celery_exclusive._store import StoreCalls
from celery_exclusive.heartbeat import Heartbeat
from celery_exclusive.lease import Lease, LeaseOwner
from celery_exclusive.providers.base import LockProvider

T = TypeVar("T")


class Store(Protocol):
    """One store under one key prefix, its calls within deadlines: what the completion
    records need (:class:`~celery_exclusive._prefixed.PrefixedStore` satisfies it)."""

    prefix: str
    provider: LockProvider
    call_timeout: float
    #: The calls ``_call`` makes; a hot path with its own timeout calls ``_calls.call``
    #: directly (one layer less: about 0.3 µs of a memory release's 1 µs). Replaced after a
    #: fork, so read it per call.
    _calls: StoreCalls

    def _call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T: ...


class Service(Store, LeaseOwner, Protocol):
    """The lock service, as its collaborators use it (and as its leases do: a LeaseOwner)."""

    ttl: float
    refresh_interval: float
    max_lifetime: float
    keeps_records: bool
    sweep_interval: float | None
    _refresh_explicit: bool
    _batch_size: int
    #: Read on the hot path instead of ``heartbeat`` (a property) and ``_check_key``'s test.
    _heartbeat: Heartbeat
    #: close() began (no lease is taken), then ended (the store is closed: no call is made).
    _closed: bool
    _ended: bool
    _thread_factory: Callable[..., threading.Thread]

    @property
    def heartbeat(self) -> Heartbeat: ...

    def _check_key(self, key: str) -> None: ...

    def _give_back(self, lease: Lease) -> None: ...
