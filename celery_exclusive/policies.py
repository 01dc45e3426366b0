"""The ``on_locked`` policies: what an exclusive run does when its key is held.

Each policy is an object with two hooks, in dramatiq's middleware style (the defaults do
nothing): :meth:`OnLocked.locked`, called when the run found its key held (after the
policy-independent redelivery check), whose return value is the task's result; and
:meth:`OnLocked.finished`, called when a run that held the key has released it. A task's
``on_locked`` setting names one of :data:`POLICIES`, or is a callable
``(task, key, holder) -> result`` that :func:`policy_for` wraps into a :class:`Custom`.

These objects are the Celery layer's internals (what a user sets is the name or the
callable); see :mod:`celery_exclusive.task` for the behaviour each name promises.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeGuard, cast

from celery.exceptions import Retry as CeleryRetry
from celery.utils.log import get_task_logger

from celery_exclusive import observe, redelivery, semaphore, signals, waiting
from celery_exclusive.errors import InvalidArgumentError, LockedError, LockRetriesExceeded
from celery_exclusive.lease import Lease
from celery_exclusive.many import LeaseSet
from celery_exclusive.providers.base import LockInfo
from celery_exclusive.validation import MAX_LIFETIME_CAP, RERUN_SUFFIX, derived_key

if TYPE_CHECKING:
    from celery_exclusive._taskview import TaskView as Task
    from celery_exclusive.heartbeat import Heartbeat
    from celery_exclusive.settings import ExclusiveSettings

logger = get_task_logger("celery_exclusive.task")

#: Key of the marker field in a skipped or coalesced task's result.
MARKER_FIELD = "celery_exclusive"
SKIPPED = "skipped"
COALESCED = "coalesced"
#: Message header counting the lock retries of one task id (not the task's own retries).
LOCK_RETRIES_HEADER = "celery_exclusive_lock_retries"
#: Holder metadata flag of runs that send a pending rerun when they finish.
HANDS_ON_RERUNS = "hands_on_reruns"
#: Holder metadata flag of rerun-policy runs that also find a rerun recorded on a marker key
#: made to fit the store (:func:`rerun_key`); earlier versions' holders lack it.
HANDS_ON_FITTED = "hands_on_fitted"
#: Message header of a rerun a holder sent: the fence of that holder's lease on the key (a
#: rerun finding the key still held by it does not coalesce behind it, see :class:`Rerun`).
RERUN_OF_HEADER = "celery_exclusive_rerun_of"
#: Message header of a rerun a holder sent: a digest of that lease's token
#: (:func:`token_digest`), which tells it from another lease of the same fence.
RERUN_OF_DIGEST_HEADER = "celery_exclusive_rerun_of_digest"
#: Message header counting how often a rerun re-sent itself to wait for the lease that sent
#: it (not lock retries: see :meth:`Retry.behind_sender`).
RERUN_WAITS_HEADER = "celery_exclusive_rerun_waits"
#: What :meth:`OnLocked.locked` returns to have the task try to acquire again at once.
AGAIN: Any = object()


def rerun_key(service: Any, key: str) -> str:
    """The key of the marker recording ``key``'s pending rerun: ``<key>#rerun``, made to fit
    the store where the suffix would take it past the store's longest key (:func:`derived_key`)."""
    return derived_key(key, RERUN_SUFFIX, prefix=service.prefix, max_length=service.provider.max_key_length)


def skip_marker(key: str, holder: LockInfo | None, *, coalesced: bool = False) -> dict[str, Any]:
    """The JSON-serialisable result of a run that did not execute its body."""
    who = None if holder is None else {**holder.holder, "fence": holder.fence}
    return {MARKER_FIELD: COALESCED if coalesced else SKIPPED, "key": key, "holder": who}


def is_skipped(value: object) -> TypeGuard[Mapping[str, Any]]:
    """True if ``value`` is the result of an exclusive task that skipped (or coalesced) its run."""
    return isinstance(value, Mapping) and value.get(MARKER_FIELD) in (SKIPPED, COALESCED)


def lock_retry_countdown(attempt: int, base: float, maximum: float) -> float:
    """Seconds before lock retry ``attempt`` (0-based): ``min(maximum, base * 2**attempt)``,
    of which the upper half is random jitter so that contenders spread out."""
    ceiling = min(maximum, base * 2.0 ** min(attempt, 64))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass
class Call:
    """The contended call: its arguments, whether it runs inline (a direct or eager call:
    no message to re-send), and how many times it has waited inline so far."""

    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    inline: bool
    attempt: int = 0
    #: Under ``on_locked="wait"``: when the wait ends (monotonic), and its backoff step.
    wait_until: float | None = None
    wait_step: float = waiting.POLL_MIN
    #: Under ``on_locked="rerun"``: how many times it has waited inline for its sender's lease.
    sender_waits: int = 0


class OnLocked:
    """Base policy; subclasses implement whichever hooks they need."""

    #: Whether runs under this policy send a pending rerun when they finish (holder metadata).
    hands_on_reruns: ClassVar[bool] = False

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        """The result of a run that found ``key`` held by ``holder`` (or :data:`AGAIN`)."""
        raise NotImplementedError

    def finished(self, task: Task, lease: Lease, *, retry_in: float | None) -> None:
        """Called after a run holding ``lease`` (its first, in canonical order) released it,
        or tried to (also when the release raised); ``retry_in``: it ends in a retry, which
        runs in that many seconds (None: it does not)."""


def skipped(task: Task, key: str, holder: LockInfo | None, *, coalesced: bool) -> dict[str, Any]:
    """Log, signal and observe a run that did not run its body; its marker result."""
    who = "an unknown holder" if holder is None else holder.describe()
    if coalesced:
        logger.info("coalesced: lock %r is held by %s; a rerun is recorded to run after it", key, who)
    else:
        logger.info("skipped: lock %r is held by %s", key, who)
    signals.send(
        signals.task_skipped, task, key=key, task=task, holder=holder, reason=redelivery.LOCKED, record=None
    )
    outcome = observe.COALESCED if coalesced else observe.SKIPPED
    observe.not_acquired(task, key, holder, outcome, reason="held")
    return skip_marker(key, holder, coalesced=coalesced)


class Skip(OnLocked):
    """``"skip"``: succeed with a skip marker, without running the body."""

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        return skipped(task, key, holder, coalesced=False)


class Raise(OnLocked):
    """``"raise"``: fail with :class:`LockedError`."""

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> NoReturn:
        observe.not_acquired(task, key, holder, observe.RAISED)
        # An answer, not a failure of the contended acquire: no chained context.
        raise LockedError(key, holder) from None


class Retry(OnLocked):
    """``"retry"``: re-send with backoff, counted in a message header; inline calls wait here."""

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        if call.inline:  # no message to re-send (direct call, eager): wait here instead
            self._check(task, key, holder, call.attempt)
            time.sleep(self._countdown(task, key, holder, call.attempt))
            call.attempt += 1
            return AGAIN
        return self._send_again(task, key, holder, call)

    def behind_sender(self, task: Task, key: str, holder: LockInfo, call: Call) -> Any:
        """Wait like :meth:`locked` for ``holder``, the lease whose run sent this rerun, but
        without counting the waits against ``lock_max_retries`` (they are counted in
        :data:`RERUN_WAITS_HEADER` instead, for the backoff), each at most until that lease
        expires. They are bounded all the same: that run has finished and handed the rerun
        on, so nothing refreshes its lease any more, which the store expires within its ttl
        (``holder.expires_in``, never past its hard deadline) if its release does not get
        through first. Counted, a lease left to a ttl longer than the lock retries made the
        rerun fail with LockRetriesExceeded: the rerun was lost."""
        if call.inline:
            time.sleep(self._countdown(task, key, holder, call.sender_waits, sender=True))
            call.sender_waits += 1
            return AGAIN
        return self._send_again(task, key, holder, call, sender=True)

    def _send_again(
        self, task: Task, key: str, holder: LockInfo | None, call: Call, *, sender: bool = False
    ) -> NoReturn:
        """Re-send the message after the backoff; ``sender``: see :meth:`behind_sender`."""
        request = task.request
        headers = dict(request.headers or {})
        header = RERUN_WAITS_HEADER if sender else LOCK_RETRIES_HEADER
        try:
            attempt = int(headers.get(header) or 0)
        except (TypeError, ValueError):
            attempt = 0
        if not sender:
            self._check(task, key, holder, attempt)
        countdown = self._countdown(task, key, holder, attempt, sender=sender)
        headers[header] = attempt + 1
        # Like Task.retry, but ``retries`` stays as it is: max_retries is the task's own budget.
        signature = task.signature_from_request(
            request,
            tuple(call.args),
            dict(call.kwargs),
            countdown=countdown,
            retries=request.retries,
            headers=headers,
        )
        span = observe._task_span(task)  # the run's, looked up before the publish
        signature.apply_async()
        observe.not_acquired(task, key, holder, observe.RETRIED, span=span)
        # celery-types wants numbers.Real, which mypy cannot match a float against.
        raise CeleryRetry(exc=LockedError(key, holder), when=cast(Any, countdown), sig=signature)

    @staticmethod
    def _check(task: Task, key: str, holder: LockInfo | None, attempt: int) -> None:
        limit = task.lock_settings.lock_max_retries
        if attempt >= limit:
            observe.not_acquired(task, key, holder, observe.RAISED)
            who = f" by {holder.describe()}" if holder is not None else ""
            raise LockRetriesExceeded(
                key,
                holder,
                f"{task.name}: lock {key!r} is still held{who} after {attempt} lock retries "
                f"(lock_max_retries={limit})",
            )

    @staticmethod
    def _countdown(
        task: Task, key: str, holder: LockInfo | None, attempt: int, *, sender: bool = False
    ) -> float:
        settings = task.lock_settings
        backoff, backoff_max = settings.lock_retry_backoff, settings.lock_retry_backoff_max
        countdown = lock_retry_countdown(attempt, backoff, backoff_max)
        if sender and holder is not None:
            # No later than just after the lease expires: nothing extends it any more.
            countdown = min(countdown, max(holder.expires_in, 0.0) + waiting.POLL_MIN)
            logger.info(
                "lock %r is held by %s, the lease that sent this rerun; trying again in %.2f s "
                "(wait %d, not a lock retry)",
                key,
                holder.describe(),
                countdown,
                attempt + 1,
            )
            return countdown
        logger.info(
            "lock %r is held by %s; lock retry %d/%d in %.2f s",
            key,
            "an unknown holder" if holder is None else holder.describe(),
            attempt + 1,
            settings.lock_max_retries,
            countdown,
        )
        return countdown


class Rerun(OnLocked):
    """``"rerun"``: record one rerun on a marker lock; the holder sends it when it finishes.

    Whoever deletes the marker owns the rerun: the holder when it finishes (and then sends
    it), or the contender that recorded it when the key turned free meanwhile (and then runs).

    The holder hands the rerun on whatever its release did: also when the release raised
    (an exception that is not the store's, such as ``SoftTimeLimitExceeded``, interrupted
    it; that exception still ends the run) or could not tell whether the store deleted the
    lease (an outage: the heartbeat retries the release in the background). Its lease may
    then still hold the key for a while (until that retry gets through, at most until its
    ttl). So the rerun it sends names that lease's fence (:data:`RERUN_OF_HEADER`), and a
    rerun that finds the key held by the very lease that sent it does not coalesce behind
    it (that holder has handed on already and never will again): it waits its turn like
    ``"retry"`` (with its backoff), but these waits are not lock retries
    (:meth:`Retry.behind_sender`): nothing refreshes that lease any more, so they end with
    it, and ``lock_max_retries`` would otherwise lose the rerun behind a lease left to a
    long ttl. Behind any other holder it coalesces as usual.
    A hand-on that cannot reach the store (the marker cannot be read or deleted) is retried
    in the background by this process (:func:`hand_on_later`) until it gets an answer or
    the marker's ttl has passed; if the process ends first, the marker stays in the store
    and the next run of the key to finish sends it.
    While such a lease lingers, a request finding it (a rerun-policy holder) records a
    rerun and is coalesced behind it, though that run has handed on already: so the run
    hands on once more when its lease is surely gone (:func:`hand_on_when_gone`), with the
    same caveat if the process ends first.
    """

    hands_on_reruns = True

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        # Only rerun-policy holders send the recorded rerun when they finish; behind any
        # other holder (a "skip" or "retry" task on the same key), or behind the lease that
        # sent this very rerun (it has handed on already: its release has not got through
        # yet), a coalesced request would wait for some later rerun-policy run, or forever.
        # So wait like "retry" (behind the sender, for as long as its lease lasts).
        service, request = task.lock_service, task.request
        marker_key = rerun_key(service, key)
        if holder is not None:
            if _sent_by(task, holder):
                return RETRY.behind_sender(task, key, holder, call)
            if not holder.holder.get(HANDS_ON_RERUNS) or (
                # An earlier version's holder looks for ``<key>#rerun`` only, which the store
                # does not take here: a rerun recorded on the fitted marker would never be sent.
                not holder.holder.get(HANDS_ON_FITTED) and marker_key != key + RERUN_SUFFIX
            ):
                return RETRY.locked(task, key, holder, call)
        meta = {**holder_of(task), "rerun": _recorded_call(task, call)}
        token = service.mark(marker_key, ttl=task.lock_settings.max_lifetime, holder=meta)
        if token is None and task.lock_settings.rerun_args == "latest":
            token = _replace_marker(service, marker_key, meta, task.lock_settings.max_lifetime)
        if token is None:
            return skipped(task, key, holder, coalesced=True)
        try:
            lease = task._acquire(key, None, request)
        except LockedError as locked:
            return skipped(task, key, locked.holder, coalesced=True)
        if service.force_release(marker_key, token):
            return task._run_holding(
                lease, call.args, call.kwargs, request, redelivery.once_id(task, request)
            )
        # The previous holder took our marker and has sent the rerun already. A request that
        # found the key held by us meanwhile recorded a new rerun: hand it on like a holder.
        first = lease.leases[0] if isinstance(lease, LeaseSet) else lease
        try:
            lease.release()
        finally:
            self.finished(task, first, retry_in=None)
        return skipped(task, key, holder, coalesced=True)

    def finished(self, task: Task, lease: Lease, *, retry_in: float | None) -> None:
        """Send the rerun recorded on ``lease.key`` if this process is the one that deletes
        its marker; not before a retry (``retry_in``): the run's work is not done, and its
        retry hands the rerun on when it finishes, so the marker is kept until then
        (:func:`keep_for_retry`). Never raises: a store that does not answer leaves it to
        :func:`hand_on_later`. ``lease.key`` is a semaphore's own for every slot (its store
        key names the slot): the first holder of any slot to finish hands the rerun on.

        If the store has not confirmed the release (the heartbeat retries it in the
        background), the lease may hold the key a while longer, and a request arriving
        meanwhile records a rerun behind it, trusting it to hand on: so this process hands
        on once more when that lease is surely gone (:func:`hand_on_when_gone`)."""
        if retry_in is not None:
            keep_for_retry(task, lease, retry_in)
            return
        key, sender = lease.key, Sender.of(lease)
        try:
            hand_on(task, key, sender)
        except Exception as exc:
            logger.warning(
                "%s: could not look for a rerun recorded on lock %r: %s; trying again in the background",
                task.name,
                key,
                exc,
            )
            hand_on_later(task, key, sender)
        heartbeat = task.lock_service.heartbeat
        if heartbeat.releasing(lease.store_key, lease.token):
            hand_on_when_gone(task, lease, heartbeat)


@dataclass(frozen=True)
class Sender:
    """The lease that sends a rerun, as the rerun names it: its ``fence``
    (:data:`RERUN_OF_HEADER`) and a digest of its token (:data:`RERUN_OF_DIGEST_HEADER`),
    since a fence alone can repeat for a key (see :func:`_sent_by`)."""

    fence: int
    digest: str

    @classmethod
    def of(cls, lease: Lease) -> Sender:
        return cls(lease.fence, token_digest(lease.token))


def token_digest(token: str) -> str:
    """The first 16 hex digits of the SHA-256 of a lease's ``token``: what a rerun's message
    names of its sender's token (never the token, which may release the lease)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def keep_for_retry(task: Task, lease: Lease, retry_in: float) -> None:
    """Keep the rerun recorded on ``lease.key`` until the retry of ``lease``'s run, sent to
    run in ``retry_in`` seconds, can have finished and handed it on: a marker lives
    ``max_lifetime`` from when it was recorded, which the retry's countdown may outlast
    (the rerun was lost). Its ttl is made ``retry_in`` plus ``max_lifetime`` (at most 24 h)
    where it would end sooner: deleted (so owned) and recorded again; if another request
    records a rerun in between, that one stands. If recording it again fails, the rerun is
    sent now rather than lost. Never raises: a store that does not answer leaves the marker."""
    service = task.lock_service
    marker_key = rerun_key(service, lease.key)
    ttl = min(MAX_LIFETIME_CAP, retry_in + task.lock_settings.max_lifetime)
    try:
        info = service.peek(marker_key)
        if info is None or info.expires_in >= ttl or not service.force_release(marker_key, info.token):
            return
    except Exception as exc:
        logger.warning(
            "%s: could not keep the rerun recorded on lock %r for its retry: %s", task.name, lease.key, exc
        )
        return
    try:
        service.mark(marker_key, ttl=ttl, holder=info.holder)
    except Exception as exc:
        logger.warning(
            "%s: could not keep the rerun recorded on lock %r for its retry: %s; sending it now",
            task.name,
            lease.key,
            exc,
        )
        try:
            _send_rerun(task, lease.key, info.holder.get("rerun") or {}, Sender.of(lease))
        except Exception:
            logger.exception("%s: could not send the rerun recorded on lock %r", task.name, lease.key)


def hand_on(task: Task, key: str, sender: Sender) -> None:
    """Send the rerun recorded on ``key`` if this call deletes its marker; ``sender``: the
    lease of the holder sending it, named by the rerun (:data:`RERUN_OF_HEADER`).

    Raises what the store calls raise: the marker is then still there for a later hand-on
    (unless the store deleted it and the answer was lost: the window of one round trip the
    docs describe). A rerun the broker refuses once the marker is deleted is logged and
    lost, as before: sending it again could send it twice (a publish may fail after the
    broker took the message)."""
    service = task.lock_service
    marker_key = rerun_key(service, key)
    info = service.peek(marker_key)
    if info is None or not service.force_release(marker_key, info.token):
        return
    try:
        _send_rerun(task, key, info.holder.get("rerun") or {}, sender)
    except Exception:
        logger.exception("%s: could not send the rerun recorded on lock %r", task.name, key)


#: Seconds before the first background attempt of a hand-on the store did not answer; each
#: later one waits twice as long, at most :data:`HAND_ON_RETRY_MAX`.
HAND_ON_RETRY_FIRST = 1.0
HAND_ON_RETRY_MAX = 30.0
#: How often a hand-on waiting for a lease to be gone looks whether its release got through
#: (in this process's heartbeat: no store call), in seconds.
GONE_POLL = 0.25


@dataclass(frozen=True)
class _Gone:
    """A lease whose release the store has not confirmed: gone once ``heartbeat`` no longer
    retries it, or by ``at`` (monotonic) in any case."""

    heartbeat: Heartbeat
    store_key: str
    token: str
    at: float

    def gone(self, now: float) -> bool:
        return now >= self.at or not self.heartbeat.releasing(self.store_key, self.token)


@dataclass
class _Pending:
    """A hand-on of one key to do in the background: as ``sender`` (the latest lease's),
    at ``due`` (monotonic) once every lease of ``behind`` is gone, retried with ``step``
    until ``until`` (the marker's ttl, at most)."""

    task: Task
    sender: Sender
    until: float
    due: float
    behind: tuple[_Gone, ...] = ()
    step: float = HAND_ON_RETRY_FIRST

    def merged(self, other: _Pending) -> _Pending:
        later = self.sender if self.sender.fence >= other.sender.fence else other.sender
        return _Pending(
            other.task,
            later,
            max(self.until, other.until),
            min(self.due, other.due),
            self.behind + other.behind,
            min(self.step, other.step),
        )


class _HandOns:
    """This process's hand-ons to do in the background: one daemon thread for them all,
    started when the first is added and ending when none is left."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        #: (app id, key) -> what to hand on, replaced (never changed) by add().
        self.pending: dict[tuple[int, str], _Pending] = {}
        self.running = False
        self.wake = threading.Event()

    def add(self, task: Task, key: str, pending: _Pending) -> None:
        with self.mutex:
            known = self.pending.get((id(task.app), key))
            self.pending[(id(task.app), key)] = pending if known is None else known.merged(pending)
            self.wake.set()
            if self.running:
                return
            self.running = True
        try:
            threading.Thread(target=self._run, name="celery-exclusive-hand-on", daemon=True).start()
        except RuntimeError as exc:  # no new thread (the interpreter is shutting down)
            with self.mutex:
                self.running = False
                self.pending.pop((id(task.app), key), None)
            logger.error("%s: cannot hand on the rerun recorded on lock %r later: %s", task.name, key, exc)

    def _run(self) -> None:
        while True:
            with self.mutex:
                self.wake.clear()
                pending = list(self.pending.items())
                if not pending:
                    self.running = False
                    return
            now = time.monotonic()
            wake = now + HAND_ON_RETRY_MAX
            for (app_id, key), each in pending:
                if each.behind and not all(gone.gone(now) for gone in each.behind):
                    wake = min(wake, now + GONE_POLL)
                    continue
                if now < each.due:
                    wake = min(wake, each.due)
                    continue
                if not self._hand_on(key, each):
                    with self.mutex:
                        if self.pending.get((app_id, key)) is each:
                            self.pending[(app_id, key)] = _Pending(
                                each.task,
                                each.sender,
                                each.until,
                                now + each.step,
                                step=min(each.step * 2, HAND_ON_RETRY_MAX),
                            )
                    wake = min(wake, now + each.step)
                    continue
                with self.mutex:
                    if self.pending.get((app_id, key)) is each:  # nothing added for the key since
                        del self.pending[(app_id, key)]
            self.wake.wait(max(0.0, wake - time.monotonic()))

    @staticmethod
    def _hand_on(key: str, each: _Pending) -> bool:
        """:func:`hand_on`; False to try again later."""
        task = each.task
        try:
            hand_on(task, key, each.sender)
        except Exception as exc:
            if time.monotonic() < each.until:
                return False
            logger.error("%s: gave up handing on the rerun recorded on lock %r: %s", task.name, key, exc)
        return True

    def after_fork_in_child(self) -> None:
        """A forked child neither has the parent's thread nor owns its hand-ons."""
        self.mutex = threading.Lock()
        self.pending = {}
        self.running = False
        self.wake = threading.Event()


_hand_ons = _HandOns()
os.register_at_fork(after_in_child=_hand_ons.after_fork_in_child)


def hand_on_later(task: Task, key: str, sender: Sender) -> None:
    """:func:`hand_on` in a background thread of this process, every 1, 2, 4... up to 30 s,
    until the store answers or ``task``'s ``max_lifetime`` (the marker's ttl) has passed."""
    now = time.monotonic()
    until = now + task.lock_settings.max_lifetime  # the marker's ttl, at most
    _hand_ons.add(task, key, _Pending(task, sender, until, now + HAND_ON_RETRY_FIRST))


def hand_on_when_gone(task: Task, lease: Lease, heartbeat: Heartbeat) -> None:
    """:func:`hand_on` of ``lease.key`` in a background thread of this process once
    ``lease`` is surely gone from the store: when ``heartbeat``'s retry of its release
    got through (or ended), or at the lease's local deadline plus its ttl, whichever comes
    first (then retried as by :func:`hand_on_later` if the store does not answer).

    A request that found the key held by ``lease`` after this run had handed on recorded
    a rerun behind it, trusting it to hand on when it finishes: this is that hand-on.
    Should this process end first, the marker waits for the next run of the key to finish
    (at most its ttl, ``max_lifetime``), as a hand-on retried by :func:`hand_on_later` does."""
    now = time.monotonic()
    gone = _Gone(heartbeat, lease.store_key, lease.token, now + max(lease.expires_in, 0.0) + lease.ttl)
    until = gone.at + task.lock_settings.max_lifetime
    _hand_ons.add(task, lease.key, _Pending(task, Sender.of(lease), until, now, (gone,)))


def _sent_by(task: Task, holder: LockInfo) -> bool:
    """Whether ``holder`` is the lease whose holder sent this run as its rerun: its fence
    (:data:`RERUN_OF_HEADER`) and, where the message names it, its token's digest
    (:data:`RERUN_OF_DIGEST_HEADER`). Fences alone can repeat for a key: a memory store's
    count from 1 per key and process (and per semaphore slot), and an SQL store's counter
    starts over with a new database file or table; a rerun would then wait behind an
    unrelated holder instead of coalescing. Messages sent before the digest was added name
    the fence only, and are judged by it, as before."""
    headers = task.request.headers
    if not headers or headers.get(RERUN_OF_HEADER) != holder.fence:
        return False
    digest = headers.get(RERUN_OF_DIGEST_HEADER)
    return digest is None or not holder.token or digest == token_digest(holder.token)


def _replace_marker(service: Any, marker_key: str, meta: dict[str, Any], ttl: float) -> str | None:
    """``rerun_args="latest"``: delete the recorded rerun and record this call's instead.

    Deleting the marker by its token makes this request the rerun's owner (as the holder is
    when it finishes), so it records the rerun again and goes on as the first request did:
    the holder sends it, or this request runs it if the key turned free. None when other
    requests keep replacing it (one of theirs, as recent as ours, stays recorded)."""
    for _ in range(3):
        recorded = service.peek(marker_key)
        if recorded is not None and not service.force_release(marker_key, recorded.token):
            continue  # someone else took it over meanwhile: look again
        token: str | None = service.mark(marker_key, ttl=ttl, holder=meta)
        if token is not None:
            return token
    return None


def _send_rerun(task: Task, key: str, recorded: Mapping[str, Any], sender: Sender) -> None:
    """Send the rerun a marker recorded (see :func:`_recorded_call`), naming the sending
    holder's lease in its :data:`RERUN_OF_HEADER` and :data:`RERUN_OF_DIGEST_HEADER`."""
    name = recorded.get("task_name") or task.name
    headers = {RERUN_OF_HEADER: sender.fence, RERUN_OF_DIGEST_HEADER: sender.digest}
    options = {**(recorded.get("options") or {}), "headers": headers}
    args, kwargs = recorded.get("args") or [], recorded.get("kwargs") or {}
    if name in task.app.tasks:
        sent = task.app.tasks[name].apply_async(args=tuple(args), kwargs=kwargs, **options)
    else:
        sent = task.app.send_task(name, args=args, kwargs=kwargs, **options)
    logger.info("requests arrived while it held lock %r; rerun sent as %s[%s]", key, name, sent.id)


def _recorded_call(task: Task, call: Call) -> dict[str, Any]:
    """What a rerun marker records: task name, arguments and the delivery's routing."""
    recorded = {"task_name": task.name, "args": list(call.args), "kwargs": dict(call.kwargs)}
    delivery = task.request.delivery_info or {}
    # Keep an empty exchange: "" is AMQP's default exchange, which routes by queue name
    # (send_task(queue=...)); dropping it would send the rerun to the default queue.
    options = {k: delivery[k] for k in ("exchange", "routing_key", "priority") if delivery.get(k) is not None}
    if not options.get("routing_key"):
        options.pop("exchange", None)
    if options:
        recorded["options"] = options
    try:
        json.dumps(recorded)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{task.name}: on_locked='rerun' records the call's arguments as JSON, and these "
            f"are not JSON-serialisable: {exc}"
        ) from None
    return recorded


class Custom(OnLocked):
    """A user's callable ``(task, key, holder) -> result``: its return value is the result."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        observe.not_acquired(task, key, holder, observe.SKIPPED, reason="held")
        return self.function(task, key, holder)


class Wait(OnLocked):
    """``"wait"``: wait up to ``lock_wait`` seconds for the key, in the worker (its slot is
    blocked meanwhile), then fall back to ``lock_wait_fallback`` (skip, retry or raise).

    Each refusal pauses (woken by the holder's release where the store signals it, else
    the jittered backoff of :mod:`celery_exclusive.waiting`) and asks to acquire again
    (:data:`AGAIN`), so every attempt goes through the redelivery check as usual."""

    def locked(self, task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
        settings = task.lock_settings
        now = time.monotonic()
        if call.wait_until is None:
            call.wait_until = now + settings.lock_wait
        remaining = call.wait_until - now
        if remaining <= 0:
            logger.info("lock %r still held after waiting %.1f s", key, settings.lock_wait)
            return POLICIES[settings.lock_wait_fallback].locked(task, key, holder, call)
        service = task.lock_service
        waiter = waiting.Waiter(service.provider, remaining, step=call.wait_step)
        try:
            slots = semaphore.store_slot_keys(
                service.prefix, key, settings.limit, service.provider.max_key_length
            )
            waiter.watch(slots[0], slots[1:])
            waiter.pause()
        finally:
            waiter.close()
        call.wait_step = waiter.step
        return AGAIN


RETRY = Retry()
#: The named policies.
POLICIES: dict[str, OnLocked] = {
    "skip": Skip(),
    "raise": Raise(),
    "retry": RETRY,
    "rerun": Rerun(),
    "wait": Wait(),
}


def policy_for(on_locked: str | Callable[..., Any]) -> OnLocked:
    """The policy object for an ``on_locked`` setting (already validated)."""
    if callable(on_locked):
        return Custom(on_locked)
    return POLICIES[on_locked]


def of(task: Task) -> OnLocked:
    """The policy object of ``task``'s settings (made once per settings object)."""
    settings = task.lock_settings
    cached: tuple[ExclusiveSettings, OnLocked] | None = task.__dict__.get("_lock_policy_cache")
    if cached is None or cached[0] is not settings:
        cached = (settings, policy_for(settings.on_locked))
        task.__dict__["_lock_policy_cache"] = cached
    return cached[1]


def held(task: Task, key: str, holder: LockInfo | None, call: Call) -> Any:
    """The answer to a held key: the redelivery check (policy-independent, and first: a copy
    of this very message's run never reaches a policy, nor does a retry that finds its previous
    attempt's lease still in the store: cooling, or its release not confirmed), then the
    policy's ``locked`` hook."""
    # A lease outlives its run under a cooldown (its holder says "cooldown"), or when its
    # release was not confirmed (the retry's message then names it): no lookup else.
    cools = (
        task.lock_settings.cooldown
        or (holder is not None and "cooldown" in holder.holder)
        or redelivery.COOLING_HEADER in (task.request.headers or {})
    )
    cooling = redelivery.predecessor(task, key, holder) if cools else None
    if cooling is not None:
        if call.inline:  # an eager retry: no message to re-publish, so it waits here
            time.sleep(redelivery.look_again(task, cooling) + waiting.POLL_MIN)
            return AGAIN
        redelivery.after_cooldown(task, key, cooling, call.args, call.kwargs)
    if not call.inline and (redelivery.is_copy(task, holder) or redelivery.is_guard(task, key)):
        redelivery.end(task, key, redelivery.REDELIVERED, call.args, call.kwargs, holder=holder)
    if not call.inline:
        redelivery.started(task, task.request)  # no copy: STARTED, if the task tracks it
    return of(task).locked(task, key, holder, call)


def holder_of(task: Task, request: Any = None) -> dict[str, Any]:
    """The holder metadata of ``task``'s run (``request``: its current request, if the
    caller has it): who runs it, and what its policy and cooldown need others to know (a
    rerun-policy holder hands on reruns; ``list`` shows "cooling"). The service adds this
    process's ``host`` and ``pid`` in front (the store's JSON is the same as with them here)."""
    request = task.request if request is None else request
    return {**holder_fields(task, request.hostname), "task_id": request.id}


def holder_fields(task: Task, hostname: str | None) -> dict[str, Any]:
    """:func:`holder_of` but the task id: the same for every run of ``task`` on ``hostname``."""
    holder: dict[str, Any] = {"task_name": task.name}
    if hostname:
        holder["worker"] = hostname
    if of(task).hands_on_reruns:
        holder[HANDS_ON_RERUNS] = True
        holder[HANDS_ON_FITTED] = True
    if task.lock_settings.cooldown:
        holder["cooldown"] = task.lock_settings.cooldown
    return holder
