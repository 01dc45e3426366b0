"""Deduplication at enqueue: a send whose key is already queued publishes nothing.

With ``dedupe`` set (task option ``lock_dedupe`` / ``exclusive_task(dedupe=...)``, or
``app.conf.exclusive_dedupe``), :meth:`ExclusiveTask.apply_async` (so ``delay``, and canvas
signatures, which call it) first takes a *queued marker* for the call's lock key: a
detached lease (:meth:`LockService.mark`) on ``<key>#queued`` (made to fit the store for a
key near its longest: :func:`queued_key`) whose holder metadata names the new task id.
One store call, atomic (under ``"until_done"`` too: every built-in store checks the
execution key in the same operation): of any number of concurrent senders one takes it
and publishes; every other one publishes nothing and, by ``on_duplicate``:

* ``"return"`` (default): gets the existing task's ``AsyncResult`` (same id, same result);
* ``"raise"``: gets :class:`~celery_exclusive.errors.AlreadyQueued` naming that id;
* a callable ``(task, key, existing AsyncResult) -> result``: its return value.

The marker's token travels in the message (header ``celery_exclusive_dedupe``), so
whoever ends the message releases exactly that marker, by token:

* the worker, when the run starts (``"until_start"``, the default: as the task is called),
  or once the run holds the execution lock (``"until_done"``); and in every case when the
  task's call returns or raises, whether it ran, skipped or failed;
* the revoking process, when ``AsyncResult.revoke()`` / ``app.control.revoke(ids)``
  returns (the broadcast was sent): it looks the ids' markers up (one scan of the store's
  live leases, so a revoke costs O(leases held); no reverse record is written at send,
  which keeps a send at one store round trip) and releases them by token, so the key is
  free at once while the message still waits in its queue (see :func:`install_revoke`);
* the worker, when it discards the message as revoked or expired (``task_revoked``), or
  rejects it (``task_rejected``, ``task_unknown``): revokes from elsewhere (``celery
  control revoke``, Flower, another language) free the key only then;
* the sender, when the send raises (broker down, a router or serializer failing): no marker
  is left behind.

A release that fails on the store (an outage, a mark whose reply was lost: the server may
run it after the sender gave up) is retried in the background by the releasing process's
heartbeat, each second, until the store answers: a marker left behind would refuse every
send of its key until it expires, answering each with the id of a message that already
ran, or was never sent.

On Redis the marker's request goes out before Celery builds the message and its answer is
read once the message is built (``LockService.begin_mark``), before the result backend's
``on_task_call``, ``before_task_publish`` or the publish see it: the round trip overlaps
the message's construction instead of adding to it. A duplicate has then built its message
for nothing (and sends nothing, calls none of those hooks), so after a send that found a
duplicate the task's next send reads the answer before building its message (duplicates
come in runs, and so do new keys). A send with Celery's ``connection=`` or ``publisher=``
reads it before too, as every send does on the other stores (they answer at once).

What no one releases expires: the marker lives ``dedupe_ttl`` (default
:data:`DEFAULT_DEDUPE_TTL`) after the message is due (its ``countdown``/``eta``), and
never past the message's ``expires``. A producer killed between marker and publish (or
before its background release got through) blocks the key that long at most; so does a
message lost by the broker.

Lifetimes and the race between "marker taken" and "a run holds the execution key":

* ``"until_start"``: the marker is released as the task is called, before the run takes the
  execution lock. A send after that publishes one more message (one running plus one
  queued, as with celery-once); that message's run then finds the key held or free and
  ``on_locked`` decides, as for any producer. No send sees the execution lock.
* ``"until_done"``: the worker releases the marker only *after* the run holds the execution
  lock, and a send takes the marker only while the execution key is free, both checked in
  one atomic store operation (``LockService.try_mark(..., unless=key)``; a run found there
  is the duplicate). So at every instant the marker or the execution lease of the previous
  message exists, and a send sees one of them: the run's id, or the queued message's.
  A run that finds the key held (``on_locked="skip"``...) releases its marker when it ends.
  A key held by something that is no task's run (``service.lock(key)``) does not refuse
  the marker: the message is sent, and its run finds the key held (``on_locked`` decides).
  Every built-in store has that operation (``AcquiresUnless``: Redis one script, memory one
  mutex hold, PostgreSQL one statement, SQLite and MariaDB/MySQL one transaction; the
  interleavings, store by store, are in docs/celery.md). Third-party stores without it,
  and Redis Cluster when ``<key>#queued`` and ``<key>`` hash to different slots (a key
  without a hash tag), take the marker, then look at the execution key, giving the marker
  back if a run holds it: more round trips, and a concurrent sender may be told the id of
  a marker about to be given back.

Which producers dedupe: ``delay``, ``apply_async`` and signatures sent alone (``.s()``/
``.si()`` then ``delay``/``apply_async``: they call the task's ``apply_async``) in a process
where the task is registered, and beat entries whose task is registered in the beat process
(beat then calls the task's ``apply_async``). ``app.send_task`` by name, beat entries of
tasks beat does not import (beat then calls ``send_task``), other languages' clients and raw
publishes do not dedupe: they are still excluded at execution, like every producer. Nor do
the members of chains, groups and chords, link callbacks and chord bodies
(:data:`CANVAS_OPTIONS`): Celery waits for the ids it froze for them, which a refused send
would never complete. Eager calls (``task_always_eager``, ``apply()``) and re-sends of the
running task's own id (``self.retry()``, ``on_locked="retry"``) do not take markers.

Callbacks (``link=``, ``link_error=``, or a signature's ``.link()``) travel in the message,
so a duplicate's are never attached to anything: Celery cannot add callbacks to a message
already queued, nor to a run in progress. The send still answers as ``on_duplicate`` says
(``"return"``: the existing task's ``AsyncResult``, whose callbacks are those of the send
that queued it), and the first such drop per task and process is logged as a WARNING on
``celery_exclusive.dedupe`` naming the task, the key and the queued id (later ones at
DEBUG). ``on_duplicate="raise"`` makes the drop explicit (:class:`AlreadyQueued`, nothing
logged); a send whose callbacks must run either way should not dedupe.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals
from celery.app.control import Control

from celery_exclusive._process import new_token
from celery_exclusive._releasing import release_later
from celery_exclusive.errors import AlreadyQueued, BackendError, ExclusiveError
from celery_exclusive.providers.base import Held
from celery_exclusive.urls import store_configured
from celery_exclusive.validation import MAX_LIFETIME_CAP, QUEUED_SUFFIX, derived_key

if TYPE_CHECKING:
    from celery.result import AsyncResult

    from celery_exclusive.service import LockService

#: The ExclusiveTask calling in (Any: this module must not import the task module).
Task = Any

logger = logging.getLogger("celery_exclusive.dedupe")

#: Message header carrying the marker (``{"key": ..., "token": ..., "mode": ...}``).
HEADER = "celery_exclusive_dedupe"
#: How long a marker outlives its message's due time when ``dedupe_ttl`` is not set, in seconds.
DEFAULT_DEDUPE_TTL = 3600.0
#: Marker attempts before a send gives up deduplicating (the marker kept changing hands).
_ATTEMPTS = 3
#: Celery's ``apply_async`` parameters after ``args`` and ``kwargs``, in order.
POSITIONAL = ("task_id", "producer", "link", "link_error", "shadow")
#: Task instance attribute: whether its last send found a duplicate (see ``_refusing``).
_REFUSED = "_celery_exclusive_last_refused"
#: Request attribute set once this run's marker was released (it is released once).
_RELEASED = "_celery_exclusive_marker_released"


def queued_key(service: LockService, key: str) -> str:
    """The key of ``key``'s queued marker: ``<key>#queued``, made to fit the store where the
    suffix would take it past the store's longest key (:func:`derived_key`)."""
    marker = key + QUEUED_SUFFIX
    limit = service.provider.max_key_length
    if limit is not None and len(service.prefix) + len(marker) > limit:
        return derived_key(key, QUEUED_SUFFIX, prefix=service.prefix, max_length=limit)
    return marker


def apply_async(
    task: Task, args: Any, kwargs: Any, options: dict[str, Any], send: Callable[..., AsyncResult[Any]]
) -> Any:
    """``task.apply_async(args, kwargs, **options)`` through the queued marker; ``send`` publishes.

    The marker's request goes out first; where the store can answer later (Redis), Celery
    builds the message during its round trip and the answer is read just before anything
    is done with the message (:class:`_MarkingProducer`), else it is read now."""
    settings = task.lock_settings
    ttl = _ttl_if_deduped(task, settings, options)
    if ttl is None:
        return send(args, kwargs, **options)
    key = task.lock_key_for(args or (), kwargs or {})
    task_id = options.get("task_id") or str(uuid.uuid4())
    marking = _Marking(task, key, settings.dedupe, ttl, {"task_id": task_id, "task_name": task.name})
    headers = dict(options.get("headers") or {})
    headers[HEADER] = {"key": key, "token": marking.token, "mode": settings.dedupe}
    marked = {**options, "task_id": task_id, "headers": headers}
    if marking.pending.ready or options.get("connection") or options.get("publisher") or _refusing(task):
        # Answered already, Celery would publish with a producer of its own making, or the
        # task's last send found a duplicate: the next one then builds no message for one.
        try:
            found = marking.settle()
        except BaseException:
            marking.give_back()  # the answer was lost: the store may hold the marker
            raise
        refused = found is not None and found is not _KEPT_CHANGING
        task.__dict__[_REFUSED] = refused
        if found is not None and refused:
            return _duplicate(task, key, found.task_id, settings.on_duplicate, options)
        return marking.publish(send, args, kwargs, options, marked)
    try:
        return marking.send_reading(send, args, kwargs, marked)
    except _Refused as refused:
        if refused.found is None:
            return marking.publish(send, args, kwargs, options, marked)
        task.__dict__[_REFUSED] = True
        return _duplicate(task, key, refused.found.task_id, settings.on_duplicate, options)
    except BaseException:
        marking.give_back()
        raise


def _refusing(task: Task) -> bool:
    """Whether the last send of ``task`` in this process found a duplicate (duplicates come in
    runs, and so do new keys): the next send then reads the answer before building a message."""
    return bool(task.__dict__.get(_REFUSED, False))


class _Refused(Exception):
    """Raised out of Celery's ``send_task`` when the marker was refused: nothing is published."""

    def __init__(self, found: _Found | None) -> None:
        super().__init__()
        self.found = found


class _MarkingProducer:
    """The producer Celery sends with: the marker's answer is read before the producer is
    used (``send_task`` takes ``.connection`` after building the message and before the
    result backend's ``on_task_call``, the ``before_task_publish`` signal and ``publish``);
    a refusal raises :class:`_Refused` there, so a duplicate sends nothing and calls no hook."""

    __slots__ = ("_marking", "_producer")

    def __init__(self, producer: Any, marking: _Marking) -> None:
        self._producer, self._marking = producer, marking

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    @property
    def connection(self) -> Any:
        self._marking.require()
        return self._producer.connection

    def publish(self, *args: Any, **kwargs: Any) -> Any:
        self._marking.require()
        return self._producer.publish(*args, **kwargs)


class _Marking:
    """One send's marker: asked for at once, its answer read once (:meth:`settle`)."""

    __slots__ = (
        "_outcome",
        "_read",
        "_unknown",
        "holder",
        "key",
        "marker",
        "mode",
        "pending",
        "service",
        "task",
        "token",
        "ttl",
    )

    def __init__(self, task: Task, key: str, mode: str, ttl: float, holder: dict[str, Any]) -> None:
        self.task, self.key, self.mode, self.ttl, self.holder = task, key, mode, ttl, holder
        self.service: LockService = task.lock_service
        self.marker = queued_key(self.service, key)
        self.token = new_token()
        self._read = False
        #: Whether reading the answer raised: the store may hold (or still take) the marker.
        self._unknown = False
        self._outcome: str | _Found | None = None
        unless = key if self.mode == "until_done" else None
        self.pending = self.service.begin_mark(
            self.marker, ttl=ttl, holder=holder, unless=unless, token=self.token
        )

    def settle(self) -> _Found | None:
        """None once the marker is taken (``self.token``), else the duplicate found
        (``_Found(None)`` when it kept changing hands: the caller sends without dedupe)."""
        if not self._read:
            self._read = self._unknown = True  # read once, even if the read raises
            self._outcome = _take(self, self.pending.answer())
            self._unknown = False
        outcome = self._outcome
        if isinstance(outcome, str):
            return None
        return outcome if outcome is not None else _KEPT_CHANGING

    def require(self) -> None:
        """Return once the marker is taken; raise :class:`_Refused` otherwise."""
        found = self.settle()
        if found is not None:
            raise _Refused(None if found is _KEPT_CHANGING else found)

    def send_reading(self, send: Callable[..., Any], args: Any, kwargs: Any, marked: Any) -> Any:
        """``send`` with a producer that reads the marker's answer before it is used."""
        given = marked.get("producer")
        if given is not None:  # not through producer_or_acquire: it reads two settings
            return send(args, kwargs, **{**marked, "producer": _MarkingProducer(given, self)})
        with self.task.app.producer_or_acquire(None) as producer:
            return send(args, kwargs, **{**marked, "producer": _MarkingProducer(producer, self)})

    def publish(
        self,
        send: Callable[..., Any],
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        marked: dict[str, Any],
    ) -> Any:
        """Send with the marker taken (``marked``), or without one if it kept changing hands;
        a send that raises gives the marker back."""
        if not isinstance(self._outcome, str):
            logger.warning(
                "%s: the queued marker of %r kept changing hands; sending without dedupe",
                self.task.name,
                self.key,
            )
            return send(args, kwargs, **options)
        try:
            return send(args, kwargs, **marked)
        except BaseException:
            self.give_back()
            raise

    def give_back(self) -> None:
        """The send failed: release the marker if it was taken (its answer read first if not
        yet). If the store failed during the mark (its answer unknown: the server may have
        run it, or may still run it once it answers again) or during this release, the
        release is retried in the background (:func:`.release_later`) until the store
        answers: a marker left behind would refuse every send of the key for its ttl,
        answering each with this never-sent task id."""
        with contextlib.suppress(BackendError):  # then the answer is unknown
            self.settle()
        if self._unknown:
            release_later(self.service, self.marker, self.token, self.ttl)
        elif isinstance(self._outcome, str):
            try:
                self.service.force_release(self.marker, self._outcome)
            except BackendError:
                release_later(self.service, self.marker, self._outcome, self.ttl)


def _ttl_if_deduped(task: Task, settings: Any, options: Mapping[str, Any]) -> float | None:
    """The new marker's ttl, or None when this send takes none (no dedupe, eager, a re-send
    of the running task, a member of a canvas (:data:`CANVAS_OPTIONS`), or a message expired
    already: it will never run nor block anything)."""
    if not settings.dedupe or task.app.conf.task_always_eager or _resending(task, options):
        return None
    for name in CANVAS_OPTIONS:  # a loop, not any(genexpr): 2.3 K instructions, not 5.5 K
        if options.get(name):
            return None
    return marker_ttl(task, settings.dedupe_ttl, options)


#: ``apply_async`` options with which Celery's canvas sends a member whose id it froze and
#: waits for: a chain's head and later steps (``chain``; a step the worker sends, and a
#: link callback, with ``parent_id``/``root_id``), a group's or chord header's members
#: (``group_id``, ``chord``), a chord body (``root_id``). Celery ignores what such a send
#: returns (the chain, group or chord result holds the frozen ids, a chord counts them), so
#: a refused member's id would never complete, a refused chain head would drop the rest of
#: the chain and a chord would never fire: these sends take no marker (they are excluded at
#: execution, like every producer). A signature sent alone (``sig.delay()``) dedupes.
CANVAS_OPTIONS = ("chain", "group_id", "chord", "parent_id", "root_id")


@dataclass(frozen=True, slots=True)
class _Found:
    """A failed mark: the id of the task queued (or, under until_done, running) for the key."""

    task_id: str | None


#: The outcome of a marker that kept changing hands (settle's answer: send without dedupe).
_KEPT_CHANGING = _Found("")


def _take(marking: _Marking, answer: str | Held) -> str | _Found | None:
    """The new marker's token, the duplicate found, or None when the marker kept changing hands.

    ``answer`` is the first attempt's (one store call: under until_done the store checks the
    execution key in the same operation, ``LockService.try_mark(unless=)``); a marker that
    changed hands within the call is asked for again, with the same token."""
    key = marking.key
    unless = key if marking.mode == "until_done" else None
    for attempt in range(_ATTEMPTS):
        if attempt:
            answer = marking.service.begin_mark(
                marking.marker,
                ttl=marking.ttl,
                holder=marking.holder,
                unless=unless,
                token=marking.token,
            ).answer()
        if isinstance(answer, str):
            return answer
        if answer.holder is None:
            continue  # changed hands within the call: take it again
        task_id = answer.holder.holder.get("task_id")
        known = task_id if isinstance(task_id, str) and task_id else None
        if answer.holder.key == key and known is None:
            unless = None  # the key is held, but by no task's run: only the marker decides
            continue
        return _Found(known)
    return None


def marker_ttl(task: Task, dedupe_ttl: float | None, options: Mapping[str, Any]) -> float | None:
    """Seconds a new marker lives: ``dedupe_ttl`` past the due time, never past ``expires``
    (None when the message has expired already), at most 24 h."""
    now = time.time()
    due = 0.0
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        due = max(0.0, float(countdown))
    elif eta is not None:
        due = max(0.0, _timestamp(eta) - now)
    ttl = due + (DEFAULT_DEDUPE_TTL if dedupe_ttl is None else dedupe_ttl)
    expires = options.get("expires", getattr(task, "expires", None))
    if expires is not None:
        left = float(expires) if isinstance(expires, (int, float)) else _timestamp(expires) - now
        if left <= 0:
            return None
        ttl = min(ttl, left)
    return min(ttl, MAX_LIFETIME_CAP)


def _timestamp(when: datetime | str) -> float:
    moment = datetime.fromisoformat(when) if isinstance(when, str) else when
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _resending(task: Task, options: Mapping[str, Any]) -> bool:
    """A re-send of the run in progress (a retry, a lock retry): its id is queued already."""
    task_id = options.get("task_id")
    if not task_id:
        return False
    stack = task.request_stack  # None until the app binds the task: then nothing runs either
    running = None if stack is None else stack.top
    return running is not None and running.id == task_id


def _duplicate(
    task: Task, key: str, task_id: str | None, on_duplicate: Any, options: Mapping[str, Any]
) -> Any:
    logger.debug("%s: %r is queued already as %s; nothing sent", task.name, key, task_id)
    if on_duplicate == "raise" or task_id is None:
        raise AlreadyQueued(key, task_id)
    if options.get("link") or options.get("link_error"):
        _callbacks_dropped(task, key, task_id, options)
    existing = task.AsyncResult(task_id)
    if on_duplicate == "return":
        return existing
    return on_duplicate(task, key, existing)


def _callbacks_dropped(task: Task, key: str, task_id: str, options: Mapping[str, Any]) -> None:
    """A duplicate send carried ``link``/``link_error``: nothing was sent, so they never run
    (Celery cannot add callbacks to a message already queued, nor to a run in progress).
    Said once per task and process, as a warning (at DEBUG after that)."""
    given = " and ".join(f"{name}=" for name in ("link", "link_error") if options.get(name))
    mine = object()
    if task.__dict__.setdefault(_DROPPED_SAID, mine) is not mine:  # atomic: one thread says it
        logger.debug("%s: %s of a duplicate send dropped (%r queued as %s)", task.name, given, key, task_id)
        return
    logger.warning(
        "%s: a send with %s found %r queued already as %s, so nothing was sent and its "
        "callbacks will not run (the AsyncResult returned is that task's, whose callbacks are "
        "those of the send that queued it); use on_duplicate='raise' to be told, or attach "
        "callbacks to sends that do not dedupe. Said once per task and process.",
        task.name,
        given,
        key,
        task_id,
    )


#: Task instance attribute: the dropped-callbacks warning was given (see _callbacks_dropped).
_DROPPED_SAID = "_celery_exclusive_dropped_callbacks_said"


# -- the worker's side: releasing a message's marker --------------------------------------


def _marker(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    found = (headers or {}).get(HEADER)
    return found if isinstance(found, Mapping) and found.get("key") and found.get("token") else None


def _release(app: Any, marker: Mapping[str, Any], why: str) -> None:
    """Release ``marker`` by its token; a failure is logged (in one line when it is the
    store's or the settings'), and a store failure's release retried in the background
    until the store answers (:func:`.release_later`): a marker left behind would refuse
    every send of its key until its ttl (an hour by default), answering each with the
    AsyncResult of this message, which has run."""
    from celery_exclusive.worker import get_lock_service

    service = None
    try:
        service = get_lock_service(app)
        service.force_release(queued_key(service, str(marker["key"])), str(marker["token"]))
    except Exception as exc:
        retried = isinstance(exc, BackendError) and service is not None
        logger.warning(
            "could not release the queued marker of %r (%s): %s%s",
            marker.get("key"),
            why,
            exc,
            "; retrying in the background" if retried else "",
            # The store's or the settings' error says it all; anything else is a defect.
            exc_info=not isinstance(exc, ExclusiveError),
        )
        if retried:
            assert service is not None
            # The marker's expiry is not in the message: retry for as long as any marker lives.
            release_later(
                service, queued_key(service, str(marker["key"])), str(marker["token"]), MAX_LIFETIME_CAP
            )


def marker_of(request: Any) -> Mapping[str, Any] | None:
    """The queued marker ``request``'s message carries, or None (most messages)."""
    return _marker(getattr(request, "headers", None))


def release_for(task: Any, why: str, request: Any = None) -> None:
    """Release the marker of ``task``'s current message (``request``, if the caller has
    it), once (no-op without one)."""
    request = task.request if request is None else request
    marker = _marker(getattr(request, "headers", None))
    if marker is None or getattr(request, _RELEASED, False):
        return
    setattr(request, _RELEASED, True)
    _release(task.app, marker, why)


def acquired(task: Any, request: Any = None) -> None:
    """The run holds its execution lock: an ``"until_done"`` marker ends now."""
    request = task.request if request is None else request
    marker = _marker(getattr(request, "headers", None))
    if marker is not None and marker.get("mode") == "until_done":
        release_for(task, "run started", request)


def run_started(task: Any, request: Any = None) -> None:
    """The worker starts running ``task``'s message: an ``"until_start"`` marker ends now.

    Called by the task itself (and :func:`release_for` when its run ends), not from
    ``task_prerun``/``task_postrun`` receivers: only exclusive tasks' messages carry a
    marker, and a receiver on those signals makes Celery send both for every task of the
    worker (22.5 against 15.2 us per plain task measured). The task skips all three for a
    message without a marker (:func:`marker_of`)."""
    request = task.request if request is None else request
    marker = _marker(getattr(request, "headers", None))
    if marker is not None and marker.get("mode") != "until_done":
        release_for(task, "run started", request)


@celery_signals.task_revoked.connect(weak=False)
def _on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    marker = _marker(getattr(request, "headers", None))
    if marker is not None and sender is not None:
        _release(sender.app, marker, "expired" if expired else "revoked")


@celery_signals.task_rejected.connect(weak=False)
@celery_signals.task_unknown.connect(weak=False)
def _on_rejected(sender: Any = None, message: Any = None, **_: Any) -> None:
    marker = _marker(getattr(message, "headers", None))
    app = getattr(sender, "app", None)
    if marker is not None and app is not None:
        _release(app, marker, "rejected")


# -- the revoking process's side: a revoke frees the ids' markers at once ------------------


def install_revoke(app: Any) -> None:
    """Make ``app.control.revoke`` (and so ``AsyncResult.revoke``, ``GroupResult.revoke``)
    also release the revoked ids' queued markers (called when an ExclusiveTask is bound).

    The app's control is built from ``app.control_cls`` on first use: before that, the
    default class is swapped for :class:`RevokingControl` (importable by name, so the app
    still pickles); a custom or already built control gets its instance's ``revoke`` wrapped.
    """
    if getattr(app, _REVOKE_INSTALLED, False):
        return
    setattr(app, _REVOKE_INSTALLED, True)
    if "control" not in app.__dict__ and app.control_cls in (_DEFAULT_CONTROL, Control):
        app.control_cls = "celery_exclusive.dedupe:RevokingControl"
        return
    control = app.control
    if isinstance(control, RevokingControl):
        return
    original = control.revoke

    def revoke(task_id: Any, *args: Any, **kwargs: Any) -> Any:
        answer = original(task_id, *args, **kwargs)
        release_revoked(app, task_id)
        return answer

    control.revoke = revoke


class RevokingControl(Control):
    """Celery's ``Control`` whose ``revoke`` also releases the ids' queued markers."""

    def revoke(self, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        answer = super().revoke(task_id, *args, **kwargs)
        release_revoked(self.app, task_id)
        return answer


def release_revoked(app: Any, task_ids: Any) -> int:
    """Release the queued markers naming ``task_ids`` (an id or ids); how many it released.

    Only after the revoke broadcast went out (a revoke that raised frees nothing). A process
    with no lock store configured (a client that only sends and revokes) has taken no
    marker and looks for none. A failure here (a store outage, settings that do not
    resolve) is logged in one line, not raised: the revoke itself took effect, and the
    worker that meets the message releases its marker then (``task_revoked``), the
    marker's ttl at the latest.
    """
    ids = {task_ids} if isinstance(task_ids, str) else {str(one) for one in task_ids or ()}
    from celery_exclusive.worker import app_settings, get_lock_service

    released = 0
    try:
        if not ids or not _dedupes(app) or not store_configured(app_settings(app).url, app.conf):
            return 0
        service = get_lock_service(app)
        for info in service.locks():
            if info.key.endswith(QUEUED_SUFFIX) and info.holder.get("task_id") in ids:
                released += service.force_release(info.key, info.token)
    except ExclusiveError as exc:  # the revoke went out: its caller must not see it fail (see above)
        logger.warning(
            "could not release the queued markers of revoked %s: %s; the worker that meets "
            "their messages releases them (their dedupe_ttl at the latest)",
            sorted(ids),
            exc,
        )
    except Exception:  # not the store's nor the settings': a defect, with its traceback
        logger.warning("could not release the queued markers of revoked %s", sorted(ids), exc_info=True)
    return released


def _dedupes(app: Any) -> bool:
    """Whether a task registered on ``app`` may deduplicate (else a revoke has no marker to free)."""
    if not app.finalized:
        # Its tasks are not built (a process that revokes without having sent): building them
        # here would finalize the app as a side effect of a revoke. Scan; it finds what is there.
        return True
    for task in list(app.tasks.values()):
        settings = getattr(type(task), "lock_settings", None) and task.lock_settings
        if settings and settings.dedupe:
            return True
    return False


_REVOKE_INSTALLED = "_celery_exclusive_revoke_installed"
_DEFAULT_CONTROL = "celery.app.control:Control"
