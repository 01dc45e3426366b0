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
from typing import Any, Literal, Protocol

from celery_exclusive.errors import InvalidArgumentError, LockLost
from celery_exclusive.providers.base import Completion, GuardsTransactions, RefreshRequest

logger = logging.getLogger("celery_exclusive")

#: Fraction of the ttl kept as safety margin before the local deadline, capped in seconds.
SAFETY_MARGIN_FRACTION = 0.1
SAFETY_MARGIN_CAP = 10.0


#: What ``lease.on_lost`` and ``lock(on_lost=)`` take: called as ``callback(lease, reason)``.
LostCallback = Callable[["Lease", str], object]


def check_lost_callback(callback: object) -> None:
    """InvalidArgumentError unless ``callback`` (an ``on_lost`` callback) is callable: else
    it would fail only at the loss, in the heartbeat's log."""
    if not callable(callback):
        raise InvalidArgumentError(f"on_lost callback must be callable, got {type(callback).__name__}")


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


class LeaseOwner(Protocol):
    """What a lease needs from the service that made it; ``LockService`` implements it.

    The lease owns its state and every transition of it; the owner keeps the clock, the
    store, and what a loss means beyond the lease (the heartbeat's list, the log, the
    signals, the callbacks). Leases are made by the service only: this Protocol documents
    the seam (and keeps ``lease`` from importing ``service``), it is not a plug-in point.
    """

    @property
    def clock(self) -> Callable[[], float]:
        """The monotonic clock the lease's deadlines run on."""
        ...

    @property
    def provider(self) -> object:
        """The lock store (``Lease.guard`` uses it if it is ``GuardsTransactions``)."""
        ...

    def release(self, lease: Lease, completion: Completion | None = None) -> ReleaseOutcome:
        """Release ``lease`` in the store (see ``LockService.release``)."""
        ...

    def _lose(self, lease: Lease, reason: str) -> None:
        """Make ``lease`` LOST (through ``Lease._mark_lost``) and tell everyone who asked."""
        ...


#: What a heartbeat pass has to do with one lease (see :meth:`Lease._due`).
_Due = Literal["lost", "later", "soon", "now"]
#: The states as module constants: ``LeaseState.HELD`` is a class attribute read through
#: Python 3.11's ``EnumType.__getattr__`` hook (about 850 instructions, against one global
#: read), and the acquire and release read three of them per lease.
_HELD, _JEOPARDY, _LOST, _RELEASED = (
    LeaseState.HELD,
    LeaseState.JEOPARDY,
    LeaseState.LOST,
    LeaseState.RELEASED,
)
_LIVE = (_HELD, _JEOPARDY)


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

    def __init__(  # noqa: PLR0917 - by position from the acquire's hot path (keywords work too)
        self,
        service: LeaseOwner,
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
        self.hard_deadline = hard_deadline = sent_at + max_lifetime
        margin = ttl * SAFETY_MARGIN_FRACTION  # safety_margin(ttl), without its call
        self._margin = margin = margin if margin < SAFETY_MARGIN_CAP else SAFETY_MARGIN_CAP
        self._request: RefreshRequest | None = None  # made by the heartbeat's first refresh
        self._lost: threading.Event | None = None  # made on first use of ``lost``
        self._on_lost: list[Callable[[Lease, str], object]] | None = None  # made by on_lost()
        # HELD from its acquisition: _confirm(sent_at, granted, clamped=False), inline.
        self._state = _HELD
        self._deadline = sent_at + granted - margin
        self._next_refresh = next_refresh = sent_at + refresh_interval
        self._final = next_refresh >= hard_deadline

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
        # Reading the state past the local deadline makes the lease LOST, with everything a
        # loss does (``lost`` set, ``on_lost`` callbacks, the lock_lost signal), not only a
        # LOST answer: the holder must never see LOST while its callbacks wait for the next
        # heartbeat pass (which may be a second away, or never come under a test's idle
        # thread), and two readers must never see different states of one lease.
        if self._state in _LIVE and self._service.clock() >= self._deadline:
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
                    if self._state is _LOST:
                        event.set()
        return event

    @property
    def held(self) -> bool:
        """True while the lease is HELD or in JEOPARDY."""
        return self.state in (_HELD, _JEOPARDY)

    @property
    def expires_in(self) -> float:
        """Seconds until the local deadline (conservative: the store's expiry is later)."""
        return self._deadline - self._service.clock()

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is still held (HELD or JEOPARDY)."""
        state = self.state
        if state is _LOST:
            raise LockLost(self.key, self.fence, "the lease was lost; another owner may hold the key")
        if state is _RELEASED:
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
        check_lost_callback(callback)
        with self._mutex:
            if self._state is not _LOST:
                if self._on_lost is None:
                    self._on_lost = []
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

    # The transitions. The owner and its heartbeat call them holding ``_mutex`` (the
    # heartbeat's, shared by every lease of one service) and never write the fields (hot
    # paths read a few: Heartbeat.add its _wake_at's).

    def _confirm(
        self, sent_at: float, granted: float, *, clamped: bool | None = None, late: bool = False
    ) -> bool:
        """The store granted ``granted`` seconds to a refresh sent at ``sent_at``: True if that
        extended the lease (False if it is no longer live, or ``late`` and already extended
        further by a later refresh). ``clamped`` (default: judged from ``granted``) says the
        store clamped it at the hard deadline, after which refreshing cannot help."""
        if self._state not in _LIVE:
            return False
        if late and sent_at + granted - self._margin <= self._deadline:
            return False  # a later refresh already said more
        if clamped is None:
            clamped = granted < self.ttl * 0.99 - 1e-3
        self._deadline = sent_at + granted - self._margin
        self._next_refresh = sent_at + self.refresh_interval
        self._final = clamped or self._next_refresh >= self.hard_deadline
        if self._state is _JEOPARDY:
            self._state = _HELD
        return True

    def _jeopardise(self, sent_at: float) -> None:
        """A refresh sent at ``sent_at`` failed or was given up: JEOPARDY, and retry soon,
        several times before the local deadline, never faster than 20 a second."""
        if self._state is _HELD:
            self._state = _JEOPARDY
        remaining = self._deadline - sent_at
        self._next_refresh = sent_at + min(self.refresh_interval, max(0.05, remaining / 4))

    def _mark_lost(self) -> tuple[list[Callable[[Lease, str], object]], threading.Event | None] | None:
        """Make the lease LOST; None if it was not live. Else the ``on_lost`` callbacks to call
        and the ``lost`` event to set (None unless someone asked for it), outside the mutex."""
        if self._state not in _LIVE:
            return None
        self._state = _LOST
        callbacks, self._on_lost = self._on_lost or [], None
        return callbacks, self._lost

    def _left_to_parent(self, mutex: threading.Lock) -> None:
        """In a forked child, this copy of a parent's lease: RELEASED here (never refreshed
        or released by the child: ``release()`` answers NOT_OWNED without a store call, and
        its callbacks are dropped), guarded by the child's ``mutex`` (the parent's may have
        been held at the fork by a thread the child does not have)."""
        self._mutex = mutex
        if self._state in _LIVE:
            self._state = _RELEASED
        self._on_lost = None

    def _mark_released(self) -> bool | None:
        """Make the lease RELEASED; None if it already was, else whether it had been LOST."""
        if self._state is _RELEASED:
            return None
        was_lost = self._state is _LOST
        self._state = _RELEASED
        return was_lost

    def _due(self, now: float) -> _Due:
        """What the heartbeat must do at ``now``: lose the lease (past its local deadline),
        refresh it ("now"), refresh it if a round trip goes anyway (within half an interval
        of due: "soon"), or nothing yet ("later"; always, once at its max lifetime)."""
        if now >= self._deadline:
            return "lost"
        if self._final or self._next_refresh - self.refresh_interval / 2 > now:
            return "later"
        return "now" if self._next_refresh <= now else "soon"

    def _live(self) -> bool:
        """True while HELD or in JEOPARDY (the state as it is, without the deadline test)."""
        return self._state in _LIVE

    def _failing(self) -> bool:
        """True unless HELD: its last refresh failed (its retries go in calls of their own)."""
        return self._state is not _HELD

    def _final_reached(self) -> bool:
        """True once refreshing cannot extend the lease (its max lifetime is reached)."""
        return self._final

    def _wake_at(self, *, refreshing: bool = False) -> float:
        """When the heartbeat must next look at the lease: its local deadline, or its next
        refresh if earlier (unless ``refreshing``: a call for it is in flight, or it is final)."""
        if refreshing or self._final:
            return self._deadline
        deadline, next_refresh = self._deadline, self._next_refresh
        return next_refresh if next_refresh < deadline else deadline  # min(), without its call

    def _deadline_at(self) -> float:
        """The local deadline, on the owner's clock."""
        return self._deadline

    def _refresh_request(self) -> RefreshRequest:
        """The lease's refresh request, made on first use (it never changes)."""
        request = self._request
        if request is None:
            request = self._request = RefreshRequest(self.store_key, self.token, self.ttl)
        return request
