"""Redelivered messages: one body run, and the real result, per task id.

A broker delivers a message again when it cannot know it was handled: the Redis transport
restores an unacknowledged message after ``visibility_timeout``; RabbitMQ redelivers when
the consumer's connection or channel closes; ``acks_late`` with
``task_reject_on_worker_lost`` requeues the message of a child that died; a producer may
publish the same task id twice. Such a copy carries the same task id, so an exclusive task
recognises it in the one store call it makes anyway:

* **a copy during the run** finds the key held by a lease whose holder metadata names its
  own task id (``redelivered``);
* **a copy after the run** finds the completion record that the run's release wrote on the
  key, in the same statement or script (``already_done``). Records are kept for
  ``done_retention`` (default: Celery's ``result_expires``, or 24 h).

Either way the copy ends with :class:`celery.exceptions.Ignore`: the worker acknowledges
the message and writes no state or result under the shared id (no skip marker, no
``LockedError``, no lock retry, no coalesced rerun), and ``task_skipped`` is sent with
``reason``. ``Reject`` was not chosen: ``Reject(requeue=False)`` stores a FAILURE under the
id (Celery 5.7, issue #4222) and ``requeue=True`` spins the message between broker and
worker for as long as the original runs.

A copy during the run cannot tell a live original from a dead one (a SIGKILLed child's
lease stays live until its ttl runs out). So before it ends it re-publishes itself,
silently: the same id, arguments, ``retries`` and headers, with a countdown of the holder's
remaining lease time (at most half the Redis transport's ``visibility_timeout``, so the
deferred message is not restored as yet another copy). When it arrives, the original has
either finished (its record ends the copy: ``already_done``), is still running (deferred
again), or died and its lease expired (the copy takes the key and runs the work, once).
With records turned off there is nothing that would end the deferred copy, so the copy is
only dropped.

A semaphore's run (``limit > 1``) takes any free slot, so its slot cannot tell a copy: such
a run also holds a lease on its own task id's key, ``<key>#id:<task id>`` (:func:`guard_key`;
for a key near the store's longest, made to fit as a marker's key is:
:func:`~celery_exclusive.validation.derived_key`), taken before the slot and released after
it, and that lease plays the single lock's part (the copy finds it held; its release writes
the record). One acquire and one release more per semaphore run; an id too long for the
store's keys gets no such lease (nor records).

``self.retry()`` is told from a redelivery by the attempt: every record names the
request's ``retries`` (the release before a retry records ``retried``); a message of a
later attempt (the retry's own) runs, a copy of that attempt or an earlier one does not.
So a retry sent by ``self.retry(throw=False)`` runs even if its attempt then ends otherwise
(killed at its hard time limit, recorded as failed). Eager runs and direct calls neither
check nor write records.

A retry can find its previous attempt's lease still in the store, held by its own task id
yet no copy: under a ``cooldown`` (the release before the retry shortened the lease, it did
not delete it), or when the store did not confirm that release (an outage: the heartbeat
retries it in the background until the store answers or the lease expires). The retry's
message names the fences of those leases (header ``celery_exclusive_cooling``,
:func:`is_predecessor`), so the retry re-publishes itself to look again
(:func:`after_cooldown`), with or without records, instead of ending as a copy (without
records, that lost the retry): at the cooldown's end, or for a release not confirmed after
0.5 s, doubled at each look, at most until the lease expires. A copy of the retry's own
message finds the retry's own lease, whose fence no message names: a copy. An eager retry
waits inline.

``self.replace(sig)`` hands the task id on too: the signature that takes it (``sig``, a
chain's task, or a chord's body: for a group, Celery's ``accumulate``) names those fences
as a retry's message does, and so does every other task of ``sig`` (of a chain, a group or
a chord, at any depth: new ids), whose message also names the replaced run's task id
(header ``celery_exclusive_replaced``), so it waits for them too. The
replacement's ``retries`` start from 0 again, so a replacement of a run of attempt N
carries N (header ``celery_exclusive_attempts``): its attempts, and the records they
write, count on from N (:func:`attempt`), and the ``retried`` record of attempt N - 1 does
not end it as a copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_task_logger

from celery_exclusive import signals
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    MAX_ATTEMPT,
    MAX_RETAIN,
    MAX_TASK_ID_LENGTH,
    Completion,
    CompletionInfo,
    LockInfo,
)
from celery_exclusive.semaphore import slot_keys
from celery_exclusive.validation import GUARD_INFIX, check_key, derived_key

if TYPE_CHECKING:
    from celery_exclusive._taskview import TaskView

logger = get_task_logger("celery_exclusive.task")

#: ``task_skipped`` reasons: the key was held by another run (the ``on_locked`` policy
#: applied), a copy of this task id's own running message, or a task id already done.
LOCKED = "locked"
REDELIVERED = "redelivered"
ALREADY_DONE = "already_done"
#: Records are kept this long when neither the task nor Celery's ``result_expires`` says.
DEFAULT_RETENTION = 24 * 60 * 60.0
#: Message header counting how often a copy during the run deferred itself.
DEFERRED_HEADER = "celery_exclusive_deferred"
#: Message header of a retry (or replacement) whose previous attempt may have left leases in
#: the store (cooling, or their release not confirmed): their fences.
COOLING_HEADER = "celery_exclusive_cooling"
#: Message header of the tasks of a replacement (``self.replace()``) whose message names
#: fences (:data:`COOLING_HEADER`): the task id of the run that replaced itself, which holds
#: those leases (a task of the replacement other than the one taking that id runs under an
#: id of its own).
REPLACED_HEADER = "celery_exclusive_replaced"
#: Message header of the replacement of a run (``self.replace()``) of a later attempt than
#: 0: that run's attempt, which the replacement's own attempts count on from (:func:`attempt`).
ATTEMPTS_HEADER = "celery_exclusive_attempts"
#: A retry behind its previous attempt's lease whose release the store did not confirm looks
#: again after this many seconds, doubled at each look (:func:`look_again`).
LINGER_STEP = 0.5


#: Task attribute: the task tracks STARTED itself, not Celery's tracer (:func:`hold_back_started`).
TRACKS_STARTED = "_celery_exclusive_tracks_started"
#: Request attribute: this run's STARTED is stored (:func:`started`).
_STARTED_STORED = "_celery_exclusive_started_stored"


def hold_back_started(app: Any) -> list[str]:
    """At worker start: exclusive tasks of ``app`` with ``track_started`` store STARTED
    themselves (:func:`started`), no longer Celery's tracer; their names.

    The tracer stores STARTED for every message it is about to run, before the task is
    called, so a copy of a finished run (a redelivery, a duplicate publish) would replace
    the run's state with STARTED and then end without a trace (``Ignore``): a FAILURE (on
    every result backend) or a SUCCESS (on those that overwrite one) lost, and ``get()``
    waiting forever. The task's ``track_started`` is set False on the instance the worker
    runs, and the run stores STARTED once it knows it is no copy: when it holds its lease,
    or before its ``on_locked`` policy answers. Workers started otherwise (Celery's embedded
    test worker sends no ``celeryd_after_setup``) keep the tracer's STARTED."""
    names = []
    for task in list(app.tasks.values()):
        if not callable(getattr(task, "lock_key_for", None)):  # not an exclusive task
            continue
        if task.__dict__.get(TRACKS_STARTED) or task.track_started:
            task.__dict__[TRACKS_STARTED] = True
            task.track_started = False  # the tracer's view; started() acts on TRACKS_STARTED
            names.append(task.name)
    return names


def started(task: Any, request: Any) -> None:
    """Store STARTED for this worker run of ``task`` (``request``) as Celery's tracer would
    have (see :func:`hold_back_started`), once per run; nothing for a task that does not
    track STARTED, an eager or direct call, or a run whose result is ignored."""
    if not task.__dict__.get(TRACKS_STARTED) or request.is_eager or request.called_directly:
        return
    if getattr(request, _STARTED_STORED, False):
        return
    setattr(request, _STARTED_STORED, True)
    ignore = getattr(request, "ignore_result", None)
    if task.ignore_result if ignore is None else ignore:
        return
    task.backend.store_result(
        request.id, {"pid": os.getpid(), "hostname": request.hostname}, "STARTED", request=request
    )


def retention(task: TaskView) -> float | None:
    """Seconds a completion record of ``task`` is kept, or None when it keeps none (cached)."""
    cached = task.__dict__.get("_lock_retention_cache", False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    value = task.lock_settings.done_retention
    result: float | None
    if value is False:
        result = None
    elif isinstance(value, float):
        result = value
    else:
        expires = task.app.conf.result_expires
        if isinstance(expires, timedelta):
            expires = expires.total_seconds()
        ok = isinstance(expires, (int, float)) and not isinstance(expires, bool) and expires > 0
        # Celery's own setting, not ours to refuse: a longer one is kept the longest a record can.
        result = min(float(expires), MAX_RETAIN) if ok else DEFAULT_RETENTION
    task.__dict__["_lock_retention_cache"] = result
    return result


def once_id(task: TaskView, request: Any = None) -> str | None:
    """The task id this worker run checks and records, or None (inline run, records off,
    or an id a record cannot hold: more than 200 characters, NUL). ``request``: the task's
    current request, when the caller has it (one thread-local lookup fewer)."""
    request = task.request if request is None else request
    if request.called_directly or request.is_eager or retention(task) is None:
        return None
    return usable_id(request.id)


def usable_id(task_id: object) -> str | None:
    """``task_id`` if a completion record can hold it (what ``check_task_id`` accepts: a str
    of 1-200 characters without NUL, valid Unicode), else None: a run of such an id keeps
    no record, where ``lock(task_id=)`` would refuse it."""
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_TASK_ID_LENGTH or "\x00" in task_id:
        return None
    if not task_id.isascii():
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (Celery's JSON carries one): no store holds it
            return None
    return task_id


def guard_key(task: TaskView, key: str, request: Any) -> str | None:
    """The key of the lease a semaphore's worker run (``limit > 1``) holds on its own task
    id besides its slot (see the module docs); None for a single lock (its key does that),
    an inline run, or an id that no key of the store can hold."""
    if request.called_directly or request.is_eager:
        return None
    return guard_of(task, key, request.id)


def guard_of(task: TaskView, key: str, task_id: object) -> str | None:
    """The key of the lease a worker run of ``task_id`` of the semaphore ``task`` holds on its
    own task id (:func:`guard_key`); None for a single lock or an id no key of the store can hold."""
    if task.lock_settings.limit == 1:
        return None
    task_id = usable_id(task_id)
    if task_id is None:
        return None
    service = task.lock_service
    prefix, longest = service.prefix, service.provider.max_key_length
    try:
        # Made to fit the store for a key near its longest, as markers' keys are.
        guard = derived_key(key, f"{GUARD_INFIX}{task_id}", prefix=prefix, max_length=longest)
        check_key(guard, prefix=prefix, max_length=longest)
    except InvalidArgumentError:
        return None
    return guard


def completion(
    task: TaskView,
    exc: BaseException | None,
    *,
    interrupted: bool = False,
    task_id: Any = False,
    request: Any = None,
) -> Completion | None:
    """The record a run that ended with ``exc`` (None: returned) writes with its release.

    None when nothing may be recorded: a run whose message will be delivered again and
    must run then (``Reject``, a worker shutting down), a body that raised ``Ignore``
    (``self.replace()`` among others), or no :func:`once_id` (``task_id``, when the caller
    has it already for ``request``, the current request).
    """
    request = task.request if request is None else request
    task_id = once_id(task, request) if task_id is False else task_id
    if task_id is None:
        return None
    if exc is None:
        outcome = "success"
    elif isinstance(exc, Retry):
        outcome = "retried"
    elif isinstance(exc, (Reject, Ignore)) or not (interrupted or isinstance(exc, Exception)):
        # Reject(requeue=True) wants the message run again; Ignore is also how
        # ``self.replace()`` hands the same task id to another signature.
        return None
    else:
        outcome = "failure"
    keep = retention(task)
    assert keep is not None  # once_id() said records are on
    return Completion(task_id, outcome, attempt_of(request), keep)


def attempt_of(request: Any) -> int:
    """The attempt the records of ``request``'s task id name for it: :func:`attempt` of its
    ``retries`` and headers."""
    return attempt(request.retries or 0, request.headers) or 0


def attempt(retries: object, headers: Mapping[str, Any] | None) -> int | None:
    """The attempt of a message with ``retries`` and ``headers`` that records name: its
    ``retries``, counted on from the attempt of the run it replaced (:data:`ATTEMPTS_HEADER`),
    so that a replacement (``retries`` 0 again) is no copy of the attempts before it; None
    if ``retries`` is not a count."""
    if type(retries) is not int or retries < 0:
        return None
    before = headers.get(ATTEMPTS_HEADER) if headers else None
    return retries + before if type(before) is int and before > 0 else retries


def retried(task: TaskView) -> Completion | None:
    """The record written by the release before ``self.retry()`` sends the next attempt."""
    return completion(task, Retry())


def killed(
    task: TaskView, keys: Sequence[str], task_id: object, attempt: int | None
) -> tuple[str, Completion] | None:
    """The record of a run of ``task_id`` killed at its hard time limit, and the key it goes
    on (the carrier's: the first key, a semaphore's :func:`guard_key`), which the worker's
    main process writes with the kill release; None when none may be written.

    Celery acknowledges such a message (a final FAILURE) unless ``acks_late`` without
    ``acks_on_timeout`` (``task_acks_on_failure_or_timeout``) requeues it, to run again: no
    record then. ``attempt`` is the killed run's (:func:`attempt`); None (not known) records
    :data:`MAX_ATTEMPT`, which ends a message of any attempt of the id."""
    task_id = usable_id(task_id)
    keep = retention(task)
    if task_id is None or keep is None or not keys:
        return None
    if getattr(task, "acks_late", False):
        acks = getattr(task, "acks_on_timeout", None)  # Celery >= 5.6; before: the joint setting
        if acks is None:
            acks = getattr(task, "acks_on_failure_or_timeout", True)
        if not acks:
            return None
    key = keys[0] if task.lock_settings.limit == 1 else guard_of(task, keys[0], task_id)
    attempt = MAX_ATTEMPT if attempt is None else attempt
    return None if key is None else (key, Completion(task_id, "failure", attempt, keep))


def is_copy(task: TaskView, holder: LockInfo | None) -> bool:
    """Whether the key is held by a run of this very task id: this message is its copy."""
    request = task.request
    if request.called_directly or request.is_eager or holder is None or not request.id:
        return False
    return bool(holder.holder.get("task_id") == request.id)


def is_predecessor(task: TaskView, holder: LockInfo | None) -> bool:
    """Whether ``holder`` is a lease an earlier attempt of this task id left in the store
    (cooling, or its release not confirmed): its fence is one the retry's message names
    (see the module docs), not a run in progress. Or one the run that replaced itself by
    this message's task (a replacement's task under an id of its own) left: its task id is
    the one the message names (:data:`REPLACED_HEADER`)."""
    request = task.request
    headers = request.headers or {}
    fences = headers.get(COOLING_HEADER)
    if holder is None or not isinstance(fences, list) or holder.fence not in fences:
        return False
    owner = holder.holder.get("task_id")
    return owner is not None and owner in (request.id, headers.get(REPLACED_HEADER))


def predecessor(task: TaskView, key: str, holder: LockInfo | None) -> LockInfo | None:
    """The lease this retry's previous attempt left (:func:`is_predecessor`) among
    the holders of ``key``: ``holder``, which the store named, or for a semaphore whose
    every slot is full, whichever slot's holder it is (the store names slot 1's only), or
    None. Slots are looked up only by a retry whose message names fences, refused a slot."""
    if is_predecessor(task, holder):
        return holder
    limit = task.lock_settings.limit
    if limit == 1 or not (task.request.headers or {}).get(COOLING_HEADER) or is_guard(task, key):
        return None
    service = task.lock_service
    for slot in slot_keys(key, limit, prefix=service.prefix, max_length=service.provider.max_key_length)[1:]:
        info = service.peek(slot)
        if is_predecessor(task, info):
            return info
    return None


def after_cooldown(
    task: TaskView, key: str, holder: LockInfo, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> NoReturn:
    """End this retry's delivery, re-published to look again (:func:`look_again`) once its
    previous attempt's lease on ``key`` (``holder``) may be gone."""
    request = task.request
    deferred = _defer(task, holder, args, kwargs, after=look_again(task, holder))
    replaced = (request.headers or {}).get(REPLACED_HEADER)
    logger.info(
        "%s: %s[%s] is %s, and lock %r is still held by %s (%s, %s); it looks again in %.1f s",
        "cooling" if "cooldown" in holder.holder else "releasing",
        task.name,
        request.id,
        "a retry" if replaced is None else f"part of the replacement of run {replaced}",
        key,
        "its previous attempt" if replaced is None else "that run",
        holder.describe(),
        "cooling down" if "cooldown" in holder.holder else "its release not confirmed yet",
        deferred,
    )
    raise Ignore()


def look_again(task: TaskView, holder: LockInfo) -> float:
    """Seconds until a retry behind ``holder``, its previous attempt's lease
    (:func:`is_predecessor`), looks again: the lease's expiry under a cooldown (it stays
    until then); else (its release not confirmed: the heartbeat retries it each second)
    :data:`LINGER_STEP` doubled at each look of this retry, at most the expiry."""
    if "cooldown" in holder.holder:
        return holder.expires_in
    looks = int((task.request.headers or {}).get(DEFERRED_HEADER) or 0)
    return min(holder.expires_in, LINGER_STEP * 2.0 ** min(looks, 20))


def is_guard(task: TaskView, key: str) -> bool:
    """Whether ``key`` is the :func:`guard_key` of ``task``'s current run: whoever holds it
    (even one not yet known) is a run of this very task id."""
    request = task.request
    return bool(request.id) and task.lock_settings.limit > 1 and key.endswith(f"{GUARD_INFIX}{request.id}")


def settle(
    task: TaskView,
    key: str,
    record: CompletionInfo,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """End this delivery if ``record`` covers it; return if it is a later attempt (a retry
    its attempt sent, whatever the attempt's own outcome)."""
    if attempt_of(task.request) > record.attempt:
        return
    end(task, key, ALREADY_DONE, args, kwargs, record=record)


def end(
    task: TaskView,
    key: str,
    reason: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    holder: LockInfo | None = None,
    record: CompletionInfo | None = None,
) -> NoReturn:
    """Log, signal and end this delivery without a trace (``Ignore``); a copy during the
    run first defers itself (see the module docs)."""
    request = task.request
    if reason == REDELIVERED:
        who = "an unknown holder" if holder is None else holder.describe()
        deferred = _defer(task, holder, args, kwargs) if retention(task) is not None else None
        logger.info(
            "redelivered: %s[%s] is already running under lock %r (%s); this copy does not run%s",
            task.name,
            request.id,
            key,
            who,
            "" if deferred is None else f" (checks again in {deferred:.1f} s, in case that run died)",
        )
    else:
        assert record is not None
        logger.info(
            "already_done: %s[%s] already finished on lock %r (%s, attempt %d, %.0f s ago); "
            "this copy does not run",
            task.name,
            request.id,
            key,
            record.outcome,
            record.attempt,
            record.age,
        )
    signals.send(signals.task_skipped, task, key=key, task=task, holder=holder, reason=reason, record=record)
    raise Ignore()


def visibility_cap(app: Any) -> float | None:
    """Half the ``visibility_timeout`` of ``app``'s broker if it is Redis (a URL, a failover
    list or ``;``-separated URLs, Sentinel), else None: a message deferred longer than the
    timeout would be restored as yet another copy while the worker holds it for its eta."""
    with app.connection_for_read() as connection:  # kombu's parsing; nothing is connected
        if not str(connection.transport_cls).startswith(("redis", "sentinel")):  # rediss too
            return None
        options = connection.transport_options or {}
    return float(options.get("visibility_timeout", 3600)) / 2


def _defer(
    task: TaskView,
    holder: LockInfo | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    after: float | None = None,
) -> float:
    """Re-publish this delivery to look again once the holder's lease could have expired
    (``after``: that many seconds from now instead)."""
    request = task.request
    if after is None:
        after = holder.expires_in if holder is not None else task.lock_settings.lease_ttl
    countdown = max(0.5, after + 0.25)
    cap = visibility_cap(task.app)
    countdown = countdown if cap is None else min(countdown, cap)
    headers = dict(request.headers or {})
    headers[DEFERRED_HEADER] = int(headers.get(DEFERRED_HEADER) or 0) + 1
    signature = task.signature_from_request(
        request, tuple(args), dict(kwargs), countdown=countdown, retries=request.retries, headers=headers
    )
    signature.apply_async(add_to_parent=False)
    return countdown
