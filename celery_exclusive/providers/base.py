"""The provider contract: single atomic operations on one lock store.

A provider stores leases; it knows nothing of defaults, prefixes or heartbeats (those are
the service's). Keys reach it already prefixed. Durations are seconds as ``float``.
Expiry is decided by the store's own clock, never the caller's.

Every method either returns its documented answer or raises
:class:`~celery_exclusive.errors.BackendError` when the store cannot be reached or
fails: "not acquired" and "not owned" are answers, an outage is not.

Deadlines. Every method the service calls per operation (``acquire``, ``refresh``,
``release``, ``peek``, ``scan``, the :class:`CompletionStore` methods and ``sweep``) takes
an optional keyword ``timeout`` (seconds, None for the provider's own network timeouts): a call that has
no answer after about that long (connecting included) raises BackendError and abandons its
connection, which is never reused. A store that cannot block (in memory) accepts and
ignores it. A provider enforces it however its store allows (the built-in ones: Redis on
the socket of a client it built; PostgreSQL through psycopg by shutting the socket down;
MariaDB/MySQL through PyMySQL the same way; SQLite by lowering its busy timeout); where it
cannot (a client or driver it did not choose), the driver's own timeouts apply. Providers
written before this keyword existed, or whose methods lack it, still work: the service
checks each method with :func:`accepts_timeout` and runs the ones without it in a worker
thread that it stops waiting for at the deadline (the heartbeat does the same for refresh).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# The record types live in a leaf module that errors imports too; this is their public home
# (re-exported as the same objects: ``X as X`` marks the re-export for mypy).
from celery_exclusive._info import CompletionInfo as CompletionInfo  # noqa: PLC0414
from celery_exclusive._info import LockInfo as LockInfo  # noqa: PLC0414

#: ``object.__setattr__``, read once: the frozen dataclass's generated ``__init__`` looks it
#: up per field (a global and an attribute read, a bound wrapper made each time).
_set = object.__setattr__


@dataclass(frozen=True, slots=True)
class Grant:
    """A successful acquisition: the fence number and the seconds the store granted."""

    fence: int
    ttl: float

    def __init__(self, fence: int, ttl: float) -> None:
        # The generated frozen __init__'s stores, without its per-field lookups (one Grant
        # per acquire, on every store: about 0.5k instructions fewer each).
        _set(self, "fence", fence)
        _set(self, "ttl", ttl)


@dataclass(frozen=True, slots=True)
class Held:
    """A failed acquisition: the key is held; ``holder`` is None if it changed mid-call."""

    holder: LockInfo | None


#: Outcomes a completion record can carry: a final success or failure, or an attempt that
#: ended by handing over to ``self.retry()`` (later attempts of the id still run).
COMPLETION_OUTCOMES = ("success", "failure", "retried")
#: Longest task id (in characters) a completion record accepts.
MAX_TASK_ID_LENGTH = 200
#: Largest ``attempt`` a completion record accepts (the SQL stores' 32-bit column).
MAX_ATTEMPT = 2**31 - 1
#: Longest a completion record is kept, in seconds: 10 years (365-day), well inside what
#: every store can represent (MariaDB's DATETIME ends in year 9999, Redis's PEXPIRE at
#: 2**63 ms); past it a store fails mid-release (or, on Redis, keeps a key it cannot expire).
MAX_RETAIN = 10 * 365 * 86_400.0


@dataclass(frozen=True, slots=True)
class Completion:
    """A completion record to write with a release: run ``task_id`` (``attempt`` being its
    Celery ``retries`` count) ended with ``outcome``; kept ``retain`` seconds (store clock).

    ``LockService.release`` checks it whole before it changes anything: ``attempt`` from 0
    to :data:`MAX_ATTEMPT`, ``retain`` positive seconds (or a timedelta) up to
    :data:`MAX_RETAIN` (10 years); else InvalidArgumentError, the lease still held."""

    task_id: str
    outcome: str
    attempt: int
    retain: float


@dataclass(frozen=True, slots=True)
class Done:
    """A refused acquisition: ``record`` says this task id already finished a run on the key."""

    record: CompletionInfo


@dataclass(frozen=True, slots=True)
class RefreshRequest:
    """One lease to extend by ``ttl`` seconds, if ``token`` still owns ``key``."""

    key: str
    token: str
    ttl: float


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """One finding of a provider's ``diagnose()``: status is "ok", "warn" or "fail"."""

    check: str
    status: str
    detail: str


@runtime_checkable
class LockProvider(Protocol):
    """A lock store. All methods are thread-safe; each is one atomic operation per key."""

    #: Longest key (prefix included, in characters) this store accepts.
    max_key_length: int

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
    ) -> Grant | Held | Done:
        """Take ``key`` for ``token`` if it is free, expired, or past its hard deadline.

        With ``task_id`` (only passed to a :class:`CompletionStore`), the same call first
        looks for a live completion record of that id on ``key`` and, if there is one,
        answers :class:`Done` and takes nothing (checked in the same statement or script: no
        extra round trip). Without it, never :class:`Done`.

        Atomic: of any number of concurrent callers, at most one gets a :class:`Grant`.
        The lease expires ``min(ttl, max_lifetime)`` seconds from now on the store's clock;
        its hard deadline, stored with it, is ``max_lifetime`` seconds from now. The grant's
        fence is greater than that of every earlier acquisition of ``key`` in this store.
        If ``token`` already holds ``key`` (a retried call whose reply was lost), the
        existing lease is returned unchanged. ``holder`` is opaque JSON metadata.
        Only this key's dead row may be removed; nothing else is touched.
        """
        ...

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        """Extend every lease in ``requests`` in one round trip; one answer per request.

        An answer is the seconds the lease now has left (``min(ttl, time to its hard
        deadline)``), or ``None`` when the token does not own the key any more (released,
        expired, or taken by another): such a lease is not revived and nothing changes.
        """
        ...

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        """Delete the lease if ``token`` owns ``key``; True if it did, False if not owned.

        With ``completion`` (only passed to a :class:`CompletionStore`), the same statement
        or script also records it on ``key``
        (whether or not the lease was still owned: the run did end), replacing the record
        of the same task id unless that one is live and of a later ``attempt`` (then the
        record is not written, and the release is the same); it expires
        ``completion.retain`` seconds from now on the store's clock. Records live apart
        from leases (no lease key, no row of the shared table) and never change what any
        other method answers about leases.
        """
        ...

    def peek(self, key: str, *, timeout: float | None = None) -> LockInfo | None:
        """The live lease on ``key``, or None if the key is free (expired counts as free)."""
        ...

    def scan(self, prefix: str, *, timeout: float | None = None) -> list[LockInfo]:
        """Every live lease whose key starts with ``prefix``, ordered by key; ``timeout``
        bounds the whole call, however many round trips it takes."""
        ...

    def close(self) -> None:
        """Release connections. Leases stay in the store until released or expired."""
        ...

    def diagnose(self) -> list[Diagnosis]:
        """Health findings for ``celery-exclusive doctor``: schema, server clock vs this
        machine's, replica or pooler in the way, store settings that endanger leases."""
        ...


@runtime_checkable
class CompletionStore(LockProvider, Protocol):
    """A lock store that also keeps completion records (all five built-in stores do).

    A provider without these methods still works: the service then neither checks nor
    writes records (redelivered copies of finished tasks run again, as before records).
    """

    def completion(self, key: str, task_id: str, *, timeout: float | None = None) -> CompletionInfo | None:
        """The live completion record of ``task_id`` on ``key``, or None."""
        ...

    def completions(self, prefix: str, *, timeout: float | None = None) -> list[CompletionInfo]:
        """Every live completion record on a key starting with ``prefix``, by key and task id
        (``timeout`` bounds the whole call, as for ``scan``)."""
        ...

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        """Delete the completion record of ``task_id`` on ``key``; True if a live one existed."""
        ...


#: Most rows one sweep deletes by default (leases and completion records each).
SWEEP_LIMIT = 500


@runtime_checkable
class Sweeps(Protocol):
    """Optional: a store whose dead leases stay behind as rows (the SQL stores, memory).

    A lease whose holder died (SIGKILL, OOM) and whose key is never acquired again stays a
    row until something deletes it. The heartbeat calls :meth:`sweep` now and then (see
    ``LockService(sweep_interval=...)``), and so does ``celery-exclusive sweep``. Redis has
    no such method: its keys expire by themselves.
    """

    def sweep(self, prefix: str, limit: int = SWEEP_LIMIT, *, timeout: float | None = None) -> int:
        """Delete at most ``limit`` dead leases and at most ``limit`` expired completion
        records on keys starting with ``prefix``; the number of rows deleted.

        Only rows that are dead on the store's own clock, judged inside the deleting
        statement itself, are deleted: a lease that is live, refreshed or taken over
        meanwhile is never touched. Fences do not depend on the rows (they come from a
        counter), so a deleted key's next fence is still larger than every earlier one.
        ``timeout`` as for ``refresh``.
        """
        ...


@runtime_checkable
class GuardsTransactions(Protocol):
    """A provider whose lease can fence writes inside the caller's own transaction.

    :meth:`celery_exclusive.lease.Lease.guard` uses it on any provider that has it and
    says ``supports_guard`` (the PostgreSQL store), so the lease needs no concrete provider.
    """

    @property
    def supports_guard(self) -> bool:
        """True when :meth:`guard` works on this store."""
        ...

    def guard(self, connection: Any, key: str, token: str, fence: int) -> None:
        """Lock the live row of ``key`` for ``token``/``fence`` in ``connection``'s transaction.

        Raises :class:`~celery_exclusive.errors.LockLost` when there is no such lease.
        """
        ...


class ReleaseSubscription(Protocol):
    """Release signals for one key, from :meth:`WakesWaiters.subscribe` on (see there)."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a release of the key is signalled.

        True if one was signalled since the subscription began or since the last ``wait``
        returned True (a signal sent before ``wait`` is not lost); False on timeout. May
        return early or spuriously: the waiter retries its acquire either way. A store
        failure here may raise; the waiter then falls back to polling (its next acquire
        reports the outage).
        """
        ...

    def close(self) -> None:
        """Stop listening; idempotent."""
        ...


@runtime_checkable
class WakesWaiters(Protocol):
    """Optional: a store that can wake a waiting acquirer when the key is released.

    Used by ``LockService.lock(key, wait=...)`` (:mod:`celery_exclusive.waiting`): the
    waiter subscribes after its first refused attempt and then tries again at once, so a
    free key costs no subscription and a release between the refusal and the subscription
    is not missed. Stores without it are polled with jittered backoff, and
    so is every store between signals: a signal only shortens the wait, never lengthens it.
    """

    def subscribe(self, key: str) -> ReleaseSubscription:
        """Start listening for releases of ``key`` (already prefixed)."""
        ...


@runtime_checkable
class WakesOnAny(Protocol):
    """Optional, with :class:`WakesWaiters`: one subscription woken by the release of any of
    several keys. Used by a waiter on a full semaphore (``lock(key, limit=N, wait=...)``): a
    release of any slot frees a place. Stores with only ``subscribe`` wake such a waiter on
    slot 1's release; the other slots' releases are seen by its polling."""

    def subscribe_any(self, keys: Sequence[str]) -> ReleaseSubscription:
        """Start listening for releases of every one of ``keys`` (already prefixed): the
        subscription's ``wait`` returns True after a release of any of them."""
        ...


@runtime_checkable
class KnowsWaiters(Protocol):
    """Optional: a store that tells a releaser whether someone waited for the key it freed.

    The lock service asks right after each release of a lease; a yes makes its next
    ``lock(key, wait=)`` on that key within :data:`~celery_exclusive.waiting.YIELD_WINDOW`
    give way to those waiters (:mod:`celery_exclusive.waiting`, fairness). A hint only:
    a wrong answer costs one pause or one turn, never a lock's safety.

    A store whose answer is "``key`` is in a set, then discarded from it" may expose that
    set as ``woken_keys`` (a ``set``; Redis and PostgreSQL do): the service's release then
    tests it inline instead of calling ``had_waiters`` (the same answer, without a call).
    """

    def had_waiters(self, key: str) -> bool:
        """Whether this process's latest release of ``key`` (prefixed) freed it while
        another waiter waited for it (Redis: its release signal reached a subscriber;
        PostgreSQL: its release statement notified a registered waiter; SQLite: a waiter's
        mark). Cheap: no store round trip."""
        ...


@runtime_checkable
class MarksWaiters(KnowsWaiters, Protocol):
    """Optional, with :class:`KnowsWaiters`: a store whose waiters say they wait (SQLite:
    nobody subscribes to anything there). The waiter holds the mark from before its first
    attempt until its wait ends."""

    def mark_waiting(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Mark this process as waiting for ``key`` (prefixed) while inside."""
        ...


@runtime_checkable
class SetsUp(Protocol):
    """Optional: a store with one-time set-up on first use (the SQL stores create their
    tables). The service runs it before it starts a lease's clock, so a slow first set-up
    (a whole fleet creating one table at once) does not eat into the first lease's ttl."""

    def set_up(self, *, timeout: float | None = None) -> None:
        """Make the store ready for calls, within ``timeout`` seconds where given; returns at
        once when already done. Raises BackendError when the store cannot be set up."""
        ...


@runtime_checkable
class AcquiresAny(Protocol):
    """Optional: a store that takes the first free key of several in one atomic operation.

    Used for semaphores (``LockService.lock(key, limit=N)``, :mod:`celery_exclusive.semaphore`):
    ``keys`` are the slot keys of one semaphore, already prefixed. Stores without it are
    tried slot by slot with :meth:`LockProvider.acquire` (correct, one round trip per slot).
    """

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
        """Take the first of ``keys`` that is free (or expired), as :meth:`LockProvider.acquire`
        would take it: ``(its index, the Grant)``, or Held naming the holder of ``keys[0]``
        (None if unknown) when every key is live. If ``token`` already holds one of them (a
        retried call whose reply was lost), that one is answered unchanged. Writes nothing
        when every key is held."""
        ...


@runtime_checkable
class AcquiresUnless(Protocol):
    """Optional: a store that takes a key unless another key is held, in one atomic operation.

    Used for ``dedupe="until_done"`` queued markers (``LockService.try_mark(..., unless=)``):
    a send takes ``<key>#queued`` unless a run holds ``<key>``, in one round trip (the
    built-in stores: one Lua script, one mutex hold, one PostgreSQL statement, one SQLite or
    MariaDB/MySQL transaction). Stores without it are asked in steps
    (:func:`acquire_unless_in_steps`: two or three round trips, a run ending between them is
    seen as still running, and a concurrent sender may be refused by a marker about to be
    given back).
    """

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
        """Take ``key`` for ``token`` as ``acquire(key, token, ttl, ttl, holder)`` would, unless
        ``blocker`` (already prefixed) has a live lease: then take nothing and answer Held
        naming that lease (its ``key`` is ``blocker``). With ``blocker`` free and ``key``
        live, Held naming ``key``'s holder (None if unknown). Both keys are judged at one
        instant: no run can take ``blocker`` and release the marker it replaced between the
        look at ``blocker`` and the grant of ``key``. A refused attempt writes nothing."""
        ...


@runtime_checkable
class MarksLater(Protocol):
    """Optional: an acquire sent now whose answer is read later, so the caller works during
    the round trip (a deduplicated send builds its message meanwhile, see
    ``celery_exclusive.dedupe``). Redis has it (on the connections it keeps itself).
    """

    def acquire_later(
        self,
        key: str,
        token: str,
        ttl: float,
        holder: str,
        *,
        blocker: str | None = None,
        timeout: float | None = None,
    ) -> Callable[[], Grant | Held]:
        """Send ``acquire(key, token, ttl, ttl, holder)`` (``acquire_unless`` with ``blocker``)
        and return the call that reads its answer: call it exactly once (until then the
        request holds a connection of its own). ``timeout`` bounds both halves together,
        counted from now; a store failure may be raised by either half."""
        ...


def acquire_unless_in_steps(
    acquire: Callable[[], Grant | Held | Done],
    peek_blocker: Callable[[], LockInfo | None],
    give_back: Callable[[], object],
) -> Grant | Held:
    """:meth:`AcquiresUnless.acquire_unless` from plain calls, for a store without it (or keys
    one operation cannot reach together, as two hash slots of Redis Cluster): take the key,
    then look at the blocker, giving the key back (``give_back``) when the blocker is held.
    Not atomic: a blocker released between the two calls still refuses the key."""
    answer = acquire()
    blocking = peek_blocker()
    if blocking is not None:
        if isinstance(answer, Grant):
            give_back()
        return Held(blocking)
    if isinstance(answer, Done):  # never without a task id; a provider answering it anyway
        return Held(None)
    return answer


def accepts_timeout(method: Callable[..., object]) -> bool:
    """True if the provider ``method`` takes the ``timeout`` keyword (or ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "timeout" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def encode_holder(holder: dict[str, Any]) -> str:
    """Serialise holder metadata compactly for storage."""
    return json.dumps(holder, separators=(",", ":"), sort_keys=True, default=str)


def decode_holder(raw: str | bytes | None) -> dict[str, Any]:
    """Parse stored holder metadata; anything unreadable becomes an empty mapping."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
