"""The lease handle one acquisition returns, and its health states.

A lease's identity (key, token, fence) never changes. Its state moves one way::

    HELD ⇄ JEOPARDY → LOST
      └────────┴──────→ RELEASED

HELD: the last refresh was confirmed. JEOPARDY: refreshes are failing, but the local
deadline has not passed. LOST: the store said the token no longer owns the key, or the
local deadline passed unconfirmed. The local deadline runs on a monotonic clock from when
the last confirmed request was *sent*, minus a safety margin, so a holder always believes
itself lost before the store can give the key to anyone else.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery_exclusive.errors import InvalidArgumentError, LockLost
from celery_exclusive.providers.base import Completion, GuardsTransactions, RefreshRequest

if TYPE_CHECKING:
    from celery_exclusive.service import LockService

logger = logging.getLogger("celery_exclusive")

#: Fraction of the ttl kept as safety margin before the local deadline, capped in seconds.
SAFETY_MARGIN_FRACTION = 0.1
SAFETY_MARGIN_CAP = 10.0


class LeaseState(str, enum.Enum):
    """Health of a lease, as far as its holder can know."""

    HELD = "held"
    JEOPARDY = "jeopardy"
    LOST = "lost"
    RELEASED = "released"


class ReleaseOutcome(str, enum.Enum):
    """What a release achieved: the store confirmed it, said it was not ours, or could not say."""

    RELEASED = "released"
    NOT_OWNED = "not_owned"
    UNKNOWN = "unknown"


def safety_margin(ttl: float) -> float:
    """Seconds subtracted from a granted lease for the local deadline."""
    return min(ttl * SAFETY_MARGIN_FRACTION, SAFETY_MARGIN_CAP)


class Lease:
    """One acquisition of one key: release it once, or use it as a context manager.

    Thread-safe. ``fence`` is greater than every earlier acquisition's of the same key;
    pass it to storage that can reject stale writers. ``lost`` is set when the lease is lost.
    """

    __slots__ = (
        "_deadline",
        "_final",
        "_lost",
        "_margin",
        "_mutex",
        "_next_refresh",
        "_on_lost",
        "_request",
        "_service",
        "_state",
        "acquired_at",
        "fence",
        "hard_deadline",
        "key",
        "max_lifetime",
        "refresh_interval",
        "store_key",
        "token",
        "ttl",
    )

    def __init__(
        self,
        service: LockService,
        *,
        key: str,
        store_key: str,
        token: str,
        fence: int,
        ttl: float,
        refresh_interval: float,
        max_lifetime: float,
        sent_at: float,
        granted: float,
        mutex: threading.Lock,
    ) -> None:
        self._service = service
        self._mutex = mutex
        self.key = key
        self.store_key = store_key
        self.token = token
        self.fence = fence
        self.ttl = ttl
        self.refresh_interval = refresh_interval
        self.max_lifetime = max_lifetime
        self.acquired_at = sent_at
        self.hard_deadline = sent_at + max_lifetime
        self._margin = safety_margin(ttl)
        self._request: RefreshRequest | None = None  # made by the heartbeat's first refresh
        self._lost: threading.Event | None = None  # made on first use of ``lost``
        self._on_lost: list[Callable[[Lease, str], object]] = []
        self._state = LeaseState.HELD
        self._deadline = 0.0
        self._next_refresh = 0.0
        self._final = False
        self._confirm(sent_at, granted, clamped=False)

    def __repr__(self) -> str:
        return f"<Lease key={self.key!r} fence={self.fence} state={self._state.value}>"

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    @property
    def state(self) -> LeaseState:
        """The current health state; LOST is also reported once the local deadline passes."""
        if self._state in (LeaseState.HELD, LeaseState.JEOPARDY) and self._service.clock() >= self._deadline:
            self._service._lose(self, "the lease was not confirmed before its local deadline")
        return self._state

    @property
    def lost(self) -> threading.Event:
        """An event set when the lease is lost (made on first use: an Event costs about 1 KB)."""
        event = self._lost
        if event is None:
            with self._mutex:
                event = self._lost
                if event is None:
                    event = self._lost = threading.Event()
                    if self._state is LeaseState.LOST:
                        event.set()
        return event

    @property
    def held(self) -> bool:
        """True while the lease is HELD or in JEOPARDY."""
        return self.state in (LeaseState.HELD, LeaseState.JEOPARDY)

    @property
    def expires_in(self) -> float:
        """Seconds until the local deadline (conservative: the store's expiry is later)."""
        return self._deadline - self._service.clock()

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is still held (HELD or JEOPARDY)."""
        state = self.state
        if state is LeaseState.LOST:
            raise LockLost(self.key, self.fence, "the lease was lost; another owner may hold the key")
        if state is LeaseState.RELEASED:
            raise LockLost(self.key, self.fence, "the lease was already released")

    def guard(self, connection: Any) -> None:
        """Check inside your transaction that this lease is current, and keep it so (PostgreSQL).

        ``connection`` is the SQLAlchemy ``Connection`` or ``Session`` (or psycopg 3
        connection) of an open transaction on the database holding the lock table. The
        lease's row (this token, this fence, not expired) is locked ``FOR SHARE``, so no
        one can take the key over until your transaction ends: writes it makes to data in
        the same database are truly fenced. Raises :class:`LockLost` if the lease is gone
        (roll back), :class:`InvalidArgumentError` for any store but PostgreSQL::

            with service.lock("rollup") as lease, engine.begin() as conn:
                lease.guard(conn)
                conn.execute(...)          # commits only while the lease is current

        Trade-off: while that transaction lasts, the heartbeat's refresh of the row waits
        too, so keep guarded transactions well shorter than the ttl minus its safety
        margin, and commit before the lease is released (a release waits for them).
        """
        provider = self._service.provider
        if not isinstance(provider, GuardsTransactions) or not provider.supports_guard:
            raise InvalidArgumentError(
                f"lease.guard() needs a PostgreSQL lock store, and this lease is in {provider!r}: "
                "only a lock row in your own PostgreSQL database can share your transaction"
            )
        self.check()
        try:
            provider.guard(connection, self.store_key, self.token, self.fence)
        except LockLost as lost:
            raise LockLost(self.key, self.fence, lost.reason) from None

    def on_lost(self, callback: Callable[[Lease, str], object]) -> None:
        """Call ``callback(lease, reason)`` once when the lease is lost (now, if it already is)."""
        with self._mutex:
            if self._state is not LeaseState.LOST:
                self._on_lost.append(callback)
                return
        callback(self, "the lease was already lost")

    def release(self, completion: Completion | None = None) -> ReleaseOutcome:
        """Release the lease; idempotent. Never raises for a store outage: returns UNKNOWN.

        ``completion`` is recorded on the key by the same store call (see
        :meth:`LockService.completion <celery_exclusive.service.LockService.completion>`).
        """
        if completion is None:
            return self._service.release(self)
        return self._service.release(self, completion)

    # State changes below are made by the service and heartbeat while holding ``_mutex``.

    def _confirm(self, sent_at: float, granted: float, *, clamped: bool) -> None:
        """The store granted ``granted`` seconds to a request sent at ``sent_at``."""
        self._deadline = sent_at + granted - self._margin
        self._next_refresh = sent_at + self.refresh_interval
        # Once the store clamps at the hard deadline, refreshing again cannot help.
        self._final = clamped or self._next_refresh >= self.hard_deadline
        if self._state is LeaseState.JEOPARDY:
            self._state = LeaseState.HELD
