"""Exclusive Celery tasks: at most one run per lock key at a time, decided at execution.

Two spellings, same behaviour::

    @app.task(base=ExclusiveTask, lock_key="community-pr:{work_id}")
    def sync_pr(work_id): ...

    @exclusive_task(key="community-pr:{work_id}", on_locked="retry")   # shared_task style
    def sync_pr(work_id): ...

The lock is taken when the worker *starts* the task (also under ``task_always_eager`` and
for direct calls), so every producer (``delay``, ``send_task``, beat, canvas) is covered.
When the key is held, ``on_locked`` decides (see :data:`ON_LOCKED_POLICIES`):

* ``"skip"``: the body does not run; the task SUCCEEDS with a marker result,
  ``{"celery_exclusive": "skipped", "key": ..., "holder": {...}}`` (test with
  :func:`is_skipped`), logs one INFO line and sends ``task_skipped``. In a chain the next
  task receives the marker as its argument; in a group/chord it is that task's result.
* ``"retry"``: re-sent with exponential backoff and jitter (``lock_retry_backoff``,
  ``lock_retry_backoff_max``), counted in the ``celery_exclusive_lock_retries`` message
  header, *not* in the task's own ``retries``/``max_retries``; after ``lock_max_retries``
  it fails with :class:`LockRetriesExceeded`. Eager and direct calls wait inline instead.
* ``"raise"``: fails with :class:`LockedError` (key and holder survive the result backend).
* ``"rerun"``: the request is recorded on the held lock and the body runs exactly once
  more after the current holder finishes, however many requests arrived meanwhile; the
  rerun uses the arguments recorded by the *first* coalesced request (``rerun_args="latest"``:
  by the *last* one, a debounce). Requests that were
  coalesced succeed with a ``"coalesced"`` marker (``is_skipped`` is true for it too).
  The holder hands the rerun on even if its release fails (see :class:`policies.Rerun`).
* ``"wait"``: the run waits up to ``lock_wait`` seconds for the key (woken by the holder's
  release where the store signals it, else polling), **blocking its worker slot** meanwhile;
  then ``lock_wait_fallback`` (``"skip"``, ``"retry"`` or ``"raise"``) decides.
* a callable ``(task, key, holder) -> result``: its return value is the task's result.

Several keys (``key=["tenant:{a}", "resource:{b}"]``, or a key callable returning several):
the run holds all of them (``LockService.lock_many``: all or none, canonical order), the
policy sees the first refused key, the loss of any key is a loss, and the first key in
canonical order carries the completion record; ``self.locks`` is the :class:`LeaseSet`.

Inside the body, ``self.lock`` (``bind=True``) is the current :class:`Lease`: read
``self.lock.fence``, call ``self.lock.check()``. If the lease is lost while the body runs,
``lock_on_lost="log"`` logs a WARNING; ``"raise"`` makes ``check()`` raise and fails the
run with :class:`LockLost` instead of returning its result; ``"terminate"`` interrupts the
running body as soon as the loss is known (at its next Python bytecode; a blocking C call
finishes first) and fails the run with :class:`LockLost`. Under both, ``autoretry_for``
covering LockLost retries the run (its record says ``retried``). ``self.retry()`` releases
the lock before the retry is sent. Every run (including an ``acks_late`` redelivery with the
same task id) acquires with a fresh token: a dead run's lock never lets a new run in.

A message delivered again with the same task id (visibility timeout, ``acks_late``
redelivery, a duplicate publish) never runs the body twice and never touches the real
result: see :mod:`celery_exclusive.redelivery` (``done_retention`` sets how long a
finished id is remembered; ``False`` turns that off).
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial as _partial
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Concatenate,
    Generic,
    Literal,
    NoReturn,
    ParamSpec,
    TypeVar,
    cast,
    overload,
)

from celery import Signature, Task, shared_task
from celery.exceptions import Retry, TaskPredicate
from celery.utils.imports import symbol_by_name
from celery.utils.log import get_task_logger
from celery.utils.threads import Local as _Local
from celery.utils.threads import _LocalStack
from celery.utils.time import get_exponential_backoff_interval

from celery_exclusive import _interrupt, _runs, dedupe, observe, policies, redelivery
from celery_exclusive import worker as _worker
from celery_exclusive._process import HolderTemplate
from celery_exclusive._records import _SETTERS, checked_completion
from celery_exclusive.dedupe import install_revoke
from celery_exclusive.errors import AlreadyDone, ExclusiveError, InvalidArgumentError, LockedError, LockLost
from celery_exclusive.keys import KeyBuilder, KeySpec
from celery_exclusive.lease import Lease
from celery_exclusive.many import LeaseSet
from celery_exclusive.policies import (
    COALESCED,
    HANDS_ON_RERUNS,
    LOCK_RETRIES_HEADER,
    MARKER_FIELD,
    SKIPPED,
    is_skipped,
    lock_retry_countdown,
    skip_marker,
)
from celery_exclusive.providers.base import MAX_ATTEMPT, MAX_RETAIN, MAX_TASK_ID_LENGTH, Completion
from celery_exclusive.service import LockService
from celery_exclusive.settings import (
    TASK_OPTIONS,
    ExclusiveSettings,
    check_lock_attributes,
    check_policy_options,
    check_task_options,
    keyword_attributes,
)
from celery_exclusive.validation import RERUN_SUFFIX, check_key, lease_durations
from celery_exclusive.worker import app_settings, lock_service_of

if TYPE_CHECKING:
    from celery.canvas import Signature
    from celery.result import AsyncResult

    from celery_exclusive.providers.base import Held

logger = get_task_logger("celery_exclusive.task")

__all__ = [
    "COALESCED",
    "HANDS_ON_RERUNS",
    "LOCK_RETRIES_HEADER",
    "MARKER_FIELD",
    "RERUN_SUFFIX",
    "SKIPPED",
    "ExclusiveTask",
    "exclusive_base",
    "exclusive_task",
    "is_skipped",
    "lock_retry_countdown",
    "skip_marker",
]


def _raw_attribute(task: object, name: str) -> Any:
    """``task.<name>`` without binding: a function given as an option is not a method."""
    value = inspect.getattr_static(task, name)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _key_builder_for(cls: Any) -> KeyBuilder:
    """Compile ``cls.lock_key`` against the signature of ``cls.run`` (without ``self``)."""
    spec = _raw_attribute(cls, "lock_key")
    run = inspect.getattr_static(cls, "run")
    if isinstance(run, staticmethod):
        return KeyBuilder.for_function(spec, run.__func__, bound=False)
    if inspect.isfunction(run):
        return KeyBuilder.for_function(spec, run, bound=True)
    return KeyBuilder.for_function(spec, cls.run, bound=False)


def _key_builder_of(task: Any) -> KeyBuilder:
    """The task's key builder: its class's, unless ``lock_key`` changed after the class was made."""
    builder: KeyBuilder | None = type(task)._lock_keys
    # The class's own spec, read without getattr_static (a classmethod key takes the long way).
    seen = task.__dict__.get("lock_key", _UNSET)
    if builder is not None and builder.spec is (type(task).lock_key if seen is _UNSET else seen):
        return builder
    spec = _raw_attribute(task, "lock_key")
    if builder is None or builder.spec is not spec:
        # Bind the new lock_key to the run method, once.
        builder = task.__dict__.get("_lock_keys_own")
        if builder is None or builder.spec is not spec:
            builder = KeyBuilder.for_function(spec, task.run, bound=False)
            task.__dict__["_lock_keys_own"] = builder
    return builder


_UNSET: Any = object()
_P = ParamSpec("_P")
_R = TypeVar("_R")

if not hasattr(Task, "__class_getitem__"):  # pragma: no cover - Celery releases before 5.4
    # What celery-types asks projects to add, so that ``Task[P, R]`` also runs.
    Task.__class_getitem__ = classmethod(lambda cls, _params: cls)  # type: ignore[attr-defined, unused-ignore]


# Without celery-types Task is Any, which --strict forbids subclassing; with them it is fine.
class ExclusiveTask(Task[_P, _R], Generic[_P, _R]):  # type: ignore[misc, unused-ignore]
    """A Celery task whose runs hold a lock on their key; see the module docs for policies.

    Generic like ``celery-types``' ``Task[P, R]``: ``ExclusiveTask[[int], str]`` is a task
    whose body takes an int and returns a str (a skip/coalesce marker is typed as ``R``
    too: tell it apart with :func:`is_skipped`).

    Lock options are class attributes (``app.task(base=ExclusiveTask, lock_key=...)``),
    None meaning "the app's setting": ``lock_key``, ``lock_on_locked``, ``lock_ttl``,
    ``lock_max_lifetime``, ``lock_refresh_interval``, ``lock_on_lost``,
    ``lock_max_retries``, ``lock_retry_backoff``, ``lock_retry_backoff_max``,
    ``lock_done_retention`` (see :mod:`celery_exclusive.redelivery`), ``lock_wait``,
    ``lock_wait_fallback`` (``on_locked="wait"``), ``lock_dedupe``,
    ``lock_on_duplicate``, ``lock_dedupe_ttl`` (see :mod:`celery_exclusive.dedupe`),
    ``lock_cooldown`` (the key stays held that long after a run started), ``lock_rerun_args``,
    ``lock_limit`` (at most that many runs hold the key at once: a leased semaphore, see
    :mod:`celery_exclusive.semaphore`).
    """

    lock_key: KeySpec = None
    lock_on_locked: str | Callable[..., Any] | None = None
    lock_ttl: float | timedelta | None = None
    lock_max_lifetime: float | timedelta | None = None
    lock_refresh_interval: float | timedelta | None = None
    lock_on_lost: str | None = None
    lock_max_retries: int | None = None
    lock_retry_backoff: float | timedelta | None = None
    lock_retry_backoff_max: float | timedelta | None = None
    lock_done_retention: float | timedelta | bool | None = None
    lock_wait: float | timedelta | None = None
    lock_wait_fallback: str | None = None
    lock_dedupe: str | bool | None = None
    lock_on_duplicate: str | Callable[..., Any] | None = None
    lock_dedupe_ttl: float | timedelta | None = None
    lock_cooldown: float | timedelta | None = None
    lock_rerun_args: str | None = None
    lock_limit: int | None = None

    _lock_keys: ClassVar[KeyBuilder | None] = None
    _own_throws: tuple[type[Exception], ...] = ()

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery's hook on binding: a revoke through ``app.control`` then frees queued markers."""
        super().on_bound(app)
        install_revoke(app)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery builds a task class per decorated function: reject bad options right here.
        super().__init_subclass__(**kwargs)
        _declared(cls)

    @property
    def throws(self) -> tuple[type[Exception], ...]:
        """The task's own expected errors (Celery's ``Task.throws``), and under
        ``on_locked="raise"`` LockedError: contention is then an expected outcome, which
        Celery logs at INFO without a traceback (the state is still FAILURE)."""
        return _throws(self)

    @throws.setter
    def throws(self, value: tuple[type[Exception], ...]) -> None:
        self._own_throws = tuple(value)

    # -- public helpers -------------------------------------------------------------------

    @property
    def lock(self) -> Lease | None:
        """The lease held by this task's run in progress in this thread, or None.

        A run holding several keys: the lease of its first key in canonical order (the one
        carrying the completion record); :attr:`locks` has them all."""
        lease = _runs.current(self)
        return lease.leases[0] if isinstance(lease, LeaseSet) else lease

    @property
    def locks(self) -> LeaseSet | None:
        """Every lease held by this task's run in progress in this thread (one for a
        single key), in canonical order, or None: ``self.locks.check()`` checks them all."""
        lease = _runs.current(self)
        return LeaseSet([lease]) if isinstance(lease, Lease) else lease

    @property
    def lock_settings(self) -> ExclusiveSettings:
        """The app's settings with this task's own lock options applied (read once)."""
        cached: ExclusiveSettings | None = self.__dict__.get("_lock_settings_cache")
        if cached is None:
            options = {name: _raw_attribute(self, attr) for name, attr in TASK_OPTIONS.items()}
            cached = app_settings(self.app).with_overrides(**options)
            if options["on_locked"] is None:  # its own was checked with them when declared
                try:
                    check_policy_options(cached.on_locked, options, " (the app's)")
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"{self.name}: {exc}") from None
            self.__dict__["_lock_settings_cache"] = cached
        return cached

    def check_lock_settings(self) -> None:
        """Raise the error every run would: the task's own lock options at odds with the
        app's settings (a ``ttl`` above the app's ``max_lifetime``, an app-wide
        ``on_locked="rerun"`` for a task of several keys...). The worker calls it at start."""
        settings = self.lock_settings
        if _key_builder_of(self).several:
            _check_several(self.name, settings.on_locked, settings.cooldown, None, settings.limit)

    @property
    def lock_service(self) -> LockService:
        """This process's lock service for this task's app."""
        return lock_service_of(self)

    def lock_key_for(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The lock key of a call with ``args`` and ``kwargs`` (without the service prefix).

        InvalidArgumentError if the call has several keys (see :meth:`lock_keys_for`)."""
        key = _key_builder_of(self).build(self.name, args, kwargs or {})
        if not isinstance(key, str):
            raise InvalidArgumentError(
                f"{self.name}: this call has several lock keys {key!r}; lock_key_for names one "
                "key (use lock_keys_for), and dedupe, which marks one key, does not support "
                "several keys: set dedupe=False on this task"
            )
        return key

    def lock_keys_for(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> list[str]:
        """Every lock key of a call (without the service prefix) in canonical order: one for
        a single-key task, several for a key list or a callable returning several."""
        key = _key_builder_of(self).build(self.name, args, kwargs or {})
        return [key] if isinstance(key, str) else key

    if not TYPE_CHECKING:  # typed as Celery's own (celery-types), which it forwards to

        def apply_async(self, args=None, kwargs=None, *more, **options):
            """Celery's ``apply_async``; with ``dedupe`` set, through the queued marker
            (:mod:`celery_exclusive.dedupe`): a duplicate publishes nothing."""
            options.update(zip(dedupe.POSITIONAL, more, strict=False))  # task_id, producer... by position
            return dedupe.apply_async(self, args, kwargs, options, super().apply_async)

    # -- execution ------------------------------------------------------------------------

    if TYPE_CHECKING:
        # Celery's own methods, typed by the body's parameters and result as celery-types
        # types them (the same signatures, so they also stand where celery-types is absent).
        def run(self, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...
        def delay(self, *args: _P.args, **kwargs: _P.kwargs) -> AsyncResult[_R]: ...
        def si(self, *args: _P.args, **kwargs: _P.kwargs) -> Signature[_R]: ...

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        # Task.request without its property's call: the request the tracer (or apply) pushed.
        # Celery's own thread-local stack read as its ``top`` reads it, without that property
        # and Local.__getattr__ (whose way in is a failed attribute lookup: an AttributeError
        # made and dropped, ~2k instructions); any other stack through ``top``.
        stack = self.request_stack
        local = stack._local if type(stack) is _LocalStack else None  # type: ignore[attr-defined]
        if type(local) is _Local:
            own = local.__storage__.get(local.__ident_func__())
            pushed = None if own is None else own.get("stack")
            request: Any = pushed[-1] if pushed else None
        else:
            request = stack.top
        if request is None:
            request = self.request
        headers = getattr(request, "headers", None)  # _may_carry_marker inline
        if not headers or dedupe.HEADER not in headers or dedupe.marker_of(request) is None:  # most
            return _run(self, args, kwargs, request, False)  # type: ignore[no-any-return]
        dedupe.run_started(self, request)
        try:
            return cast("_R", _run(self, args, kwargs, request, True))
        finally:
            dedupe.release_for(self, "run ended", request)

    def retry(  # noqa: PLR0917 - Celery's own signature
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, but the lock is released first so the retry cannot find it held.

        Code after ``retry(throw=False)`` runs without the lock. The lock-retry counter
        starts again from zero for the retried run. A retry Celery will not send (past
        ``max_retries``, or a direct call: it raises the failure instead) keeps the lock
        until the run ends, whose release records the ``failure``, not ``retried``.
        """
        if _will_retry(self, max_retries):
            _before_retry(self, options)
        args, kwargs = None if args is None else tuple(args), None if kwargs is None else dict(kwargs)
        # celery-types says exc is an Exception; Celery takes any.
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)  # type: ignore[arg-type]

    def on_replace(self, sig: Any) -> Any:
        """Celery's hook as ``self.replace(sig)`` hands this task id to ``sig``: the run's
        lease is released first, without a completion record (the id's work goes on in
        ``sig``), so ``sig``, which may lock the same key under the same id, is not taken
        for a copy of this run. Its tasks (``sig``, or a chain's, a group's or a chord's, at
        any depth) name, as a retry does, the fences of the leases that may still be in the
        store (cooling, or their release not confirmed), and this run's task id, which
        holds them: each of them, the one that takes the id and those under ids of their
        own, runs once those leases are gone (:func:`redelivery.is_predecessor`). The one
        that takes the id also names, for a run of a later attempt than 0, that attempt,
        which its own count on from (a ``retried`` record of an earlier attempt does not
        end it as a copy)."""
        request = self.request
        cooling = _hand_on(self, None)
        attempt = redelivery.attempt_of(request)
        named = (
            {redelivery.COOLING_HEADER: cooling, redelivery.REPLACED_HEADER: request.id} if cooling else {}
        )
        for each in _tasks_of(sig):
            own: dict[str, Any] = dict(named)
            if attempt and each.options.get("task_id") == request.id:
                own[redelivery.ATTEMPTS_HEADER] = attempt
            if own:
                each.options["headers"] = {**(each.options.get("headers") or {}), **own}
        return super().on_replace(sig)

    # -- internals ------------------------------------------------------------------------

    def _acquire(self, key: str | list[str], once: str | None, request: Any) -> Lease | LeaseSet:
        """The run's lease(s) on ``key`` (LockedError if held; AlreadyDone if ``once`` is done)."""
        return _acquire(self, _plan_of(self), key, once, request)

    def _run_holding(
        self,
        lease: Lease | LeaseSet,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        request: Any,
        record: str | None,
    ) -> Any:
        """Run the body holding ``lease``, then release it, writing the completion record of
        ``record`` (:func:`redelivery.once_id` of ``request``, the current request)."""
        return _hold(self, _plan_of(self), lease, args, kwargs, request=request, record=record, marked=True)


def _run(  # noqa: PLR0912, PLR0915 - the usual run inline: its calls cost each run
    task: ExclusiveTask[..., Any], args: Any, kwargs: Any, request: Any, marked: bool
) -> Any:
    """The run of the current ``request`` (``marked``: its message may carry a queued marker)."""
    # _plan_of's check of the cached plan inline (the usual run makes no call for it).
    own = task.__dict__
    plan: _Plan | None = own.get("_lock_plan_cache")
    if (
        plan is None
        or plan.settings is not own.get("_lock_settings_cache")
        or plan.process is not _worker._state
        or plan.app is not task.app
        or plan.service._closed
    ):
        plan = _plan_of(task)
    # The task's recording span, looked up once for the run: OpenTelemetry's API is often
    # imported without an SDK recording anything (redis-py imports it, so every worker
    # with a Redis broker has it), and only a recording span reads the acquire's duration.
    # observe._task_span's first tests inline: no OpenTelemetry, or an empty context (no
    # instrumentation set a span in it), has no span, without its call.
    modules = sys.modules
    if _SPANS not in modules:
        span = None
    else:
        context = modules.get(_CONTEXT)
        span = (
            None if context is not None and not context.get_current() else observe._task_span(task, request)
        )
    spans = span is not None
    if spans:
        observe.begin()
    # _key_builder_of's first test inline: the class's builder while lock_key is its spec.
    cls = type(task)
    builder: KeyBuilder | None = cls._lock_keys
    seen = own.get("lock_key", _UNSET)
    if builder is None or builder.spec is not (cls.lock_key if seen is _UNSET else seen):
        builder = _key_builder_of(task)
    # KeyBuilder.build's first path without its frame: every argument by position.
    fill = builder.positional
    found = fill(args) if fill is not None and not kwargs else None
    key = builder.build(task.name, args, kwargs) if found is None else found
    if not isinstance(key, str):
        settings = plan.settings
        _check_several(task.name, settings.on_locked, settings.cooldown, None, settings.limit)
    inline = bool(request.called_directly or request.is_eager)
    # redelivery.once_id() with the plan's retention: one call instead of three.
    # usable_id()'s tests inline for an exact ASCII str (any other value takes the call).
    task_id = request.id
    if inline or plan.retention is None:
        record = None
    elif (
        type(task_id) is str
        and 0 < len(task_id) <= MAX_TASK_ID_LENGTH
        and task_id.isascii()
        and "\x00" not in task_id
    ):
        record = task_id
    else:
        record = redelivery.usable_id(task_id)
    once, asked_again = record, inline
    call: policies.Call | None = None  # made once the key is found held (its waits' state)
    lease: Lease | LeaseSet
    while True:
        watched = False  # whether the lease came with _hold's loss report (quiet_run's)
        try:
            if spans:
                lease = _acquire(task, plan, key, once, request)  # timed, for the span
            elif plan.lock_one and isinstance(key, str):
                # _lock inline for the usual run (one key, limit 1), and plan.holder's lookup.
                template = plan._templates.get(request.hostname)
                if observe.events.enabled:
                    lost = None
                else:  # _hold's quiet report, given at the grant: no lease.on_lost call after it
                    lost = _partial(
                        _lost_once, [True], task.name, request.id
                    )  # quiet_run's, without its frame
                    watched = True
                if plan.direct and (once is None or once.isascii()):
                    # service.lock's hot path without its frame: the id is one it passes
                    # unchanged (a str of 1-200 ASCII characters without NUL, or None), the
                    # durations are the plan's, and a store without records gets no id.
                    ttl, interval, lifetime = plan.ttls
                    # The holder as its stored JSON only: the mapping holder() would attach it
                    # to is never read on this path.
                    text = (plan.template(task, request) if template is None else template).text(task_id)
                    # A holder mapping only where the template has no text for it.
                    mapping = None if text is not None else plan.holder(task, request)
                    # By position (name_holder, task_id, limit, on_lost, holder_text): no keyword matching.
                    taken = plan.take(
                        key,
                        ttl,
                        interval,
                        lifetime,
                        mapping,
                        True,
                        once if plan.records else None,
                        1,
                        lost,
                        text,
                    )
                    if type(taken) is not Lease:
                        raise LockedError(key, cast("Held", taken).holder)
                    lease = taken
                else:
                    holder = plan.holder(task, request) if template is None else template.holder(task_id)
                    lease = plan.service.lock(key, task_id=once, holder=holder, on_lost=lost, **plan.options)
            else:
                lease = _lock(task, plan, key, once, request)
        except InvalidArgumentError as refused:
            raise _unusable_key(task, plan.service, key) or refused from None
        except AlreadyDone as done:
            redelivery.settle(task, done.key, done.record, args, kwargs)  # ends a copy of a finished run
            once, plan = None, _plan_of(task)  # a retry's own attempt: take the key as usual
            continue
        except LockedError as locked:
            if locked.holder is None and not asked_again:
                # The holder was committing its grant as we asked: ask once more to
                # learn who it is (it may be this very message's original).
                asked_again = True
                continue
            if call is None:
                call = policies.Call(args, kwargs, inline=inline)
            try:
                result = policies.held(task, locked.key, locked.holder, call)
            except Exception as refused:  # LockedError, LockRetriesExceeded: autoretry_for's too
                _autoretry(task, refused)
                raise
            if result is policies.AGAIN:
                plan = _plan_of(task)  # after an inline wait: the service may have been replaced
                continue
            return result
        except Exception as failed:  # the acquire's (a BackendError): autoretry_for's too
            _autoretry(task, failed)
            raise
        return _hold(
            task, plan, lease, args, kwargs, request, record, marked, span, watched
        )  # by position: no keyword matching


def _unusable_key(
    task: ExclusiveTask[..., Any], service: LockService, key: str | list[str]
) -> Exception | None:
    """The error naming the task and its key's source if the store refused ``key`` (too
    long for it, a NUL or lone surrogate from an argument), else None (another refusal)."""
    try:
        _check_keys(service, [key] if isinstance(key, str) else key)
    except InvalidArgumentError as refused:
        return InvalidArgumentError(
            f"the lock key of {task.name} (from its {_key_builder_of(task).source}): {refused}"
        )
    return None


def _check_keys(service: LockService, keys: list[str]) -> None:
    """InvalidArgumentError for the first of ``keys`` the service's store would refuse."""
    for each in keys:
        check_key(each, prefix=service.prefix, max_length=service.provider.max_key_length)


def _acquire(
    task: ExclusiveTask[..., Any], plan: _Plan, key: str | list[str], once: str | None, request: Any
) -> Lease | LeaseSet:
    """``task._acquire`` with the task's plan."""
    if _SPANS not in sys.modules:  # no span to report the duration on: not timed
        return _lock(task, plan, key, once, request)
    started = time.perf_counter()
    try:
        return _lock(task, plan, key, once, request)
    finally:
        observe.spent_acquiring(time.perf_counter() - started)


def _hold(  # noqa: PLR0912, PLR0915, PLR0917 - the usual run's release inline, its arguments by position
    task: ExclusiveTask[..., Any],
    plan: _Plan,
    lease: Lease | LeaseSet,
    args: Any,
    kwargs: Any,
    request: Any,
    record: str | None,
    marked: bool,
    span: Any = observe._ASK,
    watched: bool = False,
) -> Any:
    """``task._run_holding`` with the task's plan (``marked``: as for :func:`_run`; ``span``:
    the run's recording span or None, if :func:`_run` looked it up; ``watched``: the lease
    has its :func:`observe.quiet_run` loss report already, given to ``lock`` by :func:`_run`)."""
    if marked and _may_carry_marker(request) and dedupe.marker_of(request) is not None:
        dedupe.acquired(task, request)
    if plan.tracks_started:  # the run holds its lease: no copy (redelivery.hold_back_started)
        redelivery.started(task, request)
    report: observe.Run | None
    # A Lease on its exact type first: an isinstance() that fails looks up __class__ too.
    if type(lease) is not Lease and isinstance(lease, LeaseSet):
        leases: Sequence[Lease] = lease.leases
        report = observe.holding(task, leases, request, span)
    elif watched:  # quiet_run's report given to lock() by _run: most runs
        leases = (lease,)
        report = None
    elif span is None and not observe.events.enabled:  # no span or event to report on
        leases = (lease,)
        report = None
        lease.on_lost(observe.quiet_run(task.name, request.id))
    else:  # observe.holding of one lease, without its frame and loop
        leases = (lease,)
        report = observe.Run(task, lease, request, span)
        lease.on_lost(report.lost)
    interrupter = _interrupt.arm(*leases) if plan.terminate else None
    # Whether the body may be called without Task.__call__: the worker's tracer (and
    # apply()) pushed this task and its request before calling us, and Task.__call__
    # would push a copy of both (10 us a run). Only when it is the next __call__ in line
    # (plan.traceable), and not for a call from inside this task's own body.
    # _runs.enter inline: whether no run of this task was in progress in this thread.
    stack = _runs._running.stack
    outermost = not stack or all(running is not task for running, _ in stack)
    stack.append((task, lease))
    traced = outermost and plan.traceable and not request.called_directly
    try:
        try:
            try:
                result = (
                    task.run(*args, **kwargs)
                    if traced
                    else super(ExclusiveTask, task).__call__(*args, **kwargs)
                )
            finally:
                if interrupter is not None:
                    interrupter.disarm()
        except _interrupt.LeaseLostInterrupt:
            # autoretry_for covering LockLost: its retry (the lease released before it is
            # sent, recording ``retried``), or past max_retries the LockLost, ends the run
            # as the body's own would (below); else the interrupted run's own end.
            which = _runs.first_lost(leases)
            _autoretry(task, LockLost(which.key, which.fence, _INTERRUPTED))
            raise
    except _interrupt.LeaseLostInterrupt as exc:
        done = redelivery.completion(task, exc, interrupted=True, task_id=record, request=request)
        lost = _finish(task, plan, lease, retry_in=None, done=done)
        which = lost or _runs.first_lost(leases)
        raise LockLost(which.key, which.fence, _INTERRUPTED) from None
    except BaseException as exc:
        done = redelivery.completion(task, exc, task_id=record, request=request)
        lost = _finish(task, plan, lease, retry_in=_retry_in(exc), done=done)
        if report is not None:
            report.finished(lost or leases[0], lost is not None)
        raise
    # redelivery.completion() of a body that returned, without its two calls.
    keep = plan.retention
    attempt = request.retries or 0
    headers = request.headers
    if headers and redelivery.ATTEMPTS_HEADER in headers:  # a replacement's (attempt_of)
        attempt = redelivery.attempt_of(request)
    direct = plan.direct and type(lease) is Lease and lease._service is plan.service
    if record is None or keep is None:
        done = None
    elif (
        direct
        and plan.keep is not None
        and type(attempt) is int
        and 0 <= attempt <= MAX_ATTEMPT
        and record.isascii()
    ):
        # checked_completion's record, made as it makes it: each of its checks holds (the
        # id was checked by _run, the retention by the plan), and for a store without
        # records service.release would drop it.
        if plan.records:
            done = _new(Completion)
            _set_task_id(done, record)
            _set_outcome(done, "success")
            _set_attempt(done, attempt)
            _set_retain(done, keep)
        else:
            done = None
    else:
        done = checked_completion(record, "success", int(attempt), keep)
        direct = False
    if plan.finishes:  # the rerun hand-on, whatever the release did
        lost = _finish(task, plan, lease, retry_in=None, done=done)
    elif direct:
        # Released through the service's own release (what lease.release and service.release
        # call), the record already checked.
        lost = _runs.finish(lease, done, plan.release)
    else:
        lost = _runs.finish(lease, done)  # _finish without a hand-on, inline
    if lost is not None:
        if report is not None:
            report.finished(lost, True)
        if plan.settings.on_lost == "raise":
            _discard(
                task, plan, lease, LockLost(lost.key, lost.fence, _DISCARDED), done=done, request=request
            )
    return result


def _discard(
    task: ExclusiveTask[..., Any],
    plan: _Plan,
    lease: Lease | LeaseSet,
    failure: LockLost,
    *,
    done: Completion | None,
    request: Any,
) -> NoReturn:
    """End a run whose release found its lease lost (``on_lost="raise"``) with ``failure``,
    or with what ``autoretry_for`` covering it makes of it: the retry it sends, or past
    ``max_retries`` ``failure`` all the same. The release recorded ``done`` (``success``)
    already; that record is then written again for the same attempt, which replaces it:
    ``failure``, or before the retry is sent ``retried``, as the run's end would have
    recorded (:func:`redelivery.completion`). Only when a loss is found at the release."""
    options = _autoretry_options(task, failure)
    retrying = options is not None and _will_retry(task, options.get("max_retries"))
    if done is not None and plan.records:
        again = redelivery.completion(
            task, Retry() if retrying else failure, task_id=done.task_id, request=request
        )
        carrier = _runs.carrier(lease)
        try:
            plan.service.force_release(carrier.key, carrier.token, completion=again)
        except ExclusiveError as exc:  # the record stays ``success`` (a retry runs all the same)
            logger.warning(
                "%s[%s]: its completion record could not be written again: %s", task.name, request.id, exc
            )
    if options is None:
        raise failure
    raise task.retry(exc=failure, **options)


def _finish(
    task: ExclusiveTask[..., Any],
    plan: _Plan,
    lease: Lease | LeaseSet,
    *,
    retry_in: float | None,
    done: Completion | None,
) -> Lease | None:
    """Pop and release the run's lease(s) (see :func:`_runs.finish`), then the policy's
    ``finished`` hook (the rerun hand-on), even if the release raised (which it then raises
    again: a rerun recorded meanwhile is handed on all the same). ``retry_in``: the run
    ends in a retry, which runs in that many seconds (:func:`_retry_in`). The lease that
    had been lost, or None."""
    if not plan.finishes:
        return _runs.finish(lease, done)
    try:
        return _runs.finish(lease, done)
    finally:
        first = _runs.first(lease)
        plan.policy.finished(task, first, retry_in=retry_in)


def _autoretry(task: ExclusiveTask[..., Any], exc: Exception) -> None:
    """Retry as Celery's ``autoretry_for`` would (raising what ``task.retry`` raises) if it
    covers ``exc``, raised outside the body: by the acquire (a BackendError), by the
    ``on_locked`` policy (LockedError, LockRetriesExceeded), or for a lost lease under
    ``on_lost="terminate"`` or ``"raise"`` (LockLost). Celery's autoretry wraps ``run``,
    the body, which the lock is taken and released outside of; its options are the task's."""
    options = _autoretry_options(task, exc)
    if options is not None:
        raise task.retry(exc=exc, **options)


def _autoretry_options(task: ExclusiveTask[..., Any], exc: Exception) -> dict[str, Any] | None:
    """The options of the ``task.retry`` that Celery's ``autoretry_for`` makes for ``exc``
    (its ``retry_kwargs``, ``retry_backoff``, ``max_retries``), or None if it does not cover it."""
    if not hasattr(task, "_orig_run") or isinstance(exc, TaskPredicate):  # Retry, Ignore, Reject
        return None
    covered = tuple(getattr(task, "autoretry_for", ()) or ())
    if not covered or not isinstance(exc, covered):
        return None
    excluded = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if excluded and isinstance(exc, excluded):
        return None
    options = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False))
    if backoff:
        options["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=task.request.retries,
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    if hasattr(task, "override_max_retries"):
        options["max_retries"] = getattr(task, "override_max_retries", task.max_retries)
    return options


def _retry_in(exc: BaseException) -> float | None:
    """Seconds until the retry that ``exc`` sent runs (a Celery ``Retry``), else None."""
    if not isinstance(exc, Retry):
        return None
    when = exc.when
    if isinstance(when, datetime):  # an eta
        return max(0.0, when.timestamp() - time.time())
    return max(0.0, float(when)) if isinstance(when, (int, float)) else 0.0


def _lock(
    task: ExclusiveTask[..., Any], plan: _Plan, key: str | list[str], once: str | None, request: Any
) -> Lease | LeaseSet:
    """The lease on ``key``; several keys all or none, in canonical order (``key`` is sorted):
    the first through ``lock(task_id=once)``, which checks (and at release records) the
    completion record of the task id on it, the rest through ``lock_many``. A semaphore
    (``limit > 1``) of several keys is refused (:func:`_check_several` did, before; again here);
    one of a single key holds its :func:`redelivery.guard_key` first (:func:`_lock_slot`)."""
    service, settings = plan.service, plan.settings
    holder = plan.holder(task, request)
    if isinstance(key, str):
        if settings.limit == 1:  # the usual run: one call, its options made once (the plan's)
            return service.lock(key, task_id=once, holder=holder, **plan.options)
        guard = redelivery.guard_key(task, key, request)
        if guard is not None:
            return _lock_slot(service, settings, (key, guard), holder, once, durations=plan.durations)
        return service.lock(key, task_id=once, holder=holder, **plan.options)
    options: dict[str, Any] = {**plan.durations, "holder": holder}
    if settings.limit > 1:
        raise InvalidArgumentError(f"several lock keys do not support limit={settings.limit} (a semaphore)")
    keys = key
    _check_keys(service, keys)  # all before the first is taken (lock_many checks only the rest)
    first = service.lock(keys[0], task_id=once, **options)
    try:
        rest = service.lock_many(keys[1:], **options)
    except BaseException:
        first.release()
        raise
    return LeaseSet([first, *rest])


def _lock_slot(
    service: LockService,
    settings: ExclusiveSettings,
    keys: tuple[str, str],
    holder: Mapping[str, Any],
    once: str | None,
    *,
    durations: Mapping[str, float | None],
) -> _runs.Guarded:
    """A semaphore run's slot of ``key``, behind the lease on its task id's ``guard`` key
    (``keys``), which checks (and at release records) the completion record of ``once``."""
    key, guard = keys
    options: dict[str, Any] = {**durations, "holder": holder}
    first = service.lock(guard, task_id=once, **options)
    try:
        slot = service.lock(key, hold_at_least=settings.cooldown, limit=settings.limit, **options)
    except BaseException:
        first.release()
        raise
    return _runs.Guarded([slot, first])


def _check_several(name: str, on_locked: object, cooldown: object, dedupe: object, limit: object) -> None:
    """Refuse the options a task holding several keys cannot have (InvalidArgumentError)."""
    refused = [
        what
        for what, on in (
            ("on_locked='rerun' (its marker records one key)", on_locked == "rerun"),
            ("cooldown (lock_many has no hold_at_least)", cooldown is not None),
            ("dedupe (its queued marker names one key)", bool(dedupe)),
            (f"limit={limit!r} (a semaphore is of one key)", limit not in (None, 1)),
        )
        if on
    ]
    if refused:
        raise InvalidArgumentError(
            f"{name} has several lock keys, which do not support {' or '.join(refused)}"
        )


#: LockLost's messages: lock_on_lost="terminate" interrupted the body, "raise" dropped its result.
_INTERRUPTED = "the lease was lost while the task ran, so it was interrupted (lock_on_lost='terminate')"
_DISCARDED = (
    "the lease was lost while the task ran, so the run may have overlapped another; "
    "its result was discarded (lock_on_lost='raise')"
)


class _Plan:
    """What every run of a task reads the same way: made once per settings and service
    object (a new service after a fork or close is another), see :func:`_plan_of`."""

    __slots__ = (
        "_templates",
        "app",
        "direct",
        "durations",
        "finishes",
        "keep",
        "lock_one",
        "options",
        "policy",
        "process",
        "records",
        "release",
        "retention",
        "service",
        "settings",
        "take",
        "terminate",
        "traceable",
        "tracks_started",
        "ttls",
    )

    def __init__(
        self, task: ExclusiveTask[..., Any], settings: ExclusiveSettings, service: LockService
    ) -> None:
        self.settings = settings
        self.service = service
        #: What the service was looked up for: valid while these are the task's (see _plan_of).
        self.app, self.process = task.app, _worker._current()
        self.durations = _durations(settings, service)
        #: ``service.lock``'s options for a single key, but the holder and task id: only those
        #: that differ from its defaults (every keyword passed costs the call its matching).
        self.options: dict[str, Any] = dict(self.durations)
        if settings.cooldown is not None:
            self.options["hold_at_least"] = settings.cooldown
        if type(settings.limit) is not int or settings.limit != 1:  # True is refused there, not here
            self.options["limit"] = settings.limit
        #: Whether a run of one key is one ``service.lock`` call (no semaphore guard key).
        self.lock_one = settings.limit == 1
        #: How long completion records are kept (None: none are): :func:`redelivery.retention`.
        self.retention = redelivery.retention(task)
        #: Whether ``super().__call__`` is Celery's own (see ``_run_holding``).
        self.traceable = _celerys_call_is_next(type(task))
        self.policy = policies.of(task)
        #: Whether the policy has a ``finished`` hook (the rerun hand-on); the others' is a no-op.
        self.finishes = type(self.policy).finished is not policies.OnLocked.finished
        self.terminate = settings.on_lost == "terminate"
        #: Whether the run stores STARTED itself (:func:`redelivery.hold_back_started`).
        self.tracks_started = bool(task.__dict__.get(redelivery.TRACKS_STARTED))
        self._templates: dict[str | None, HolderTemplate] = {}  # per worker hostname
        #: Whether the usual run (one key, limit 1, no cooldown) may take its lease through
        #: the service's acquire (``take``) and give it back through its release
        #: (``release``) without ``service.lock``'s, ``lease.release``'s and
        #: ``service.release``'s frames: what those add is their option and argument checks,
        #: which the plan and :func:`_run` make once (the task id is checked as ``lock``
        #: checks it before it is passed, and the record as ``checked_completion`` checks it).
        self.direct = self.lock_one and settings.cooldown is None and type(service) is LockService
        self.take = service._acquiring.take
        self.release = service._releasing.release
        #: ``service.lock``'s durations by position (None: the service's own).
        self.ttls = tuple(self.durations.get(name) for name in ("ttl", "refresh_interval", "max_lifetime"))
        #: Whether the store keeps completion records (else the task id is not passed, as
        #: ``service.lock`` and ``service.release`` drop it).
        self.records = service.keeps_records
        #: The retention when a record of it needs no check (a float within MAX_RETAIN), else None.
        keep = self.retention
        self.keep = keep if type(keep) is float and 0.0 < keep <= MAX_RETAIN else None

    def holder(self, task: ExclusiveTask[..., Any], request: Any) -> Mapping[str, Any]:
        """:func:`policies.holder_of` ``request``, its JSON encoded around the task id."""
        return self.template(task, request).holder(request.id)

    def template(self, task: ExclusiveTask[..., Any], request: Any) -> HolderTemplate:
        """The holder template of ``request``'s worker (made on its first run there)."""
        hostname = request.hostname
        template = self._templates.get(hostname)
        if template is None:
            template = HolderTemplate(policies.holder_fields(task, hostname), "task_id")
            self._templates = {**self._templates, hostname: template}
        return template


def _plan_of(task: ExclusiveTask[..., Any]) -> _Plan:
    """The task's :class:`_Plan` for its current settings and service: the cached one while
    it has the same settings object, app and process and its service is not closed (what
    :func:`~celery_exclusive.worker.lock_service_of` checks, without its calls)."""
    own = task.__dict__
    plan: _Plan | None = own.get("_lock_plan_cache")
    if (
        plan is None
        or plan.settings is not own.get("_lock_settings_cache")
        or plan.process is not _worker._state
        or plan.app is not task.app
        or plan.service._closed
    ):
        settings, service = task.lock_settings, task.lock_service
        plan = own["_lock_plan_cache"] = _Plan(task, settings, service)
    return plan


#: Completion(...) as checked_completion makes it: the object, then its slots set directly.
_new = object.__new__
_set_task_id, _set_outcome, _set_attempt, _set_retain = _SETTERS
_lost_once = observe._lost_once

#: The module whose presence means a span may record (see observe._task_span).
_SPANS = "opentelemetry.trace"
#: OpenTelemetry's context API (imported by the former): an empty current context has no span.
_CONTEXT = "opentelemetry.context"


def _may_carry_marker(request: Any) -> bool:
    """False when ``request``'s message has no dedupe header (most): no marker to look at."""
    headers = getattr(request, "headers", None)
    return bool(headers) and dedupe.HEADER in headers  # type: ignore[operator]  # a mapping


def _durations(settings: ExclusiveSettings, service: LockService) -> dict[str, float | None]:
    """The durations ``service.lock`` is given for a task's runs: none when the settings'
    resolve to the service's own (which it then takes unchecked), else the settings'."""
    own = (settings.lease_ttl, settings.refresh_interval, settings.max_lifetime)
    try:
        same = lease_durations(*own, ttl_explicit=True) == (
            service.ttl,
            service.refresh_interval,
            service.max_lifetime,
        )
    except InvalidArgumentError:  # the call itself then says so
        same = False
    return {} if same else dict(zip(("ttl", "refresh_interval", "max_lifetime"), own, strict=True))


def _throws(task: ExclusiveTask[..., Any]) -> tuple[type[Exception], ...]:
    """``task.throws``: its own, and LockedError under ``on_locked="raise"``."""
    own = task._own_throws
    try:
        raising = task.lock_settings.on_locked == "raise"
    except ExclusiveError:  # a misconfigured app fails elsewhere, loudly; not while logging
        raising = False
    return (*own, LockedError) if raising and LockedError not in own else own


def _will_retry(task: ExclusiveTask[..., Any], max_retries: int | None) -> bool:
    """Whether Celery's ``Task.retry`` sends (or, eager, runs) a retry of the current request:
    not for a direct call, nor past ``max_retries`` (its own tests, in its order: it raises
    the exception, or MaxRetriesExceededError, and the run ends in that failure)."""
    request = task.request
    if request.called_directly:
        return False
    limit = task.max_retries if max_retries is None else max_retries
    return limit is None or (request.retries or 0) + 1 <= limit


def _before_retry(task: ExclusiveTask[..., Any], options: dict[str, Any]) -> None:
    """Release the run's lease before its retry is sent, and restart the lock-retry count.

    Under a ``cooldown`` the release leaves the key cooling, held by this very task id, and
    a release the store did not confirm leaves the lease there until the heartbeat's retry
    gets through: the retry's message names the fences of those leases, so it tells them
    from a copy of its own run (:func:`redelivery.is_predecessor`). The headers this
    attempt's message had for itself (lock retries, deferrals, fences) are not passed on."""
    cooling = _hand_on(task, redelivery.retried(task))
    headers = task.request.headers
    if "headers" not in options and (cooling or (headers and any(name in headers for name in _OWN_HEADERS))):
        options["headers"] = {k: v for k, v in (headers or {}).items() if k not in _OWN_HEADERS}
    if cooling:
        options["headers"] = {**(options["headers"] or {}), redelivery.COOLING_HEADER: cooling}


def _hand_on(task: ExclusiveTask[..., Any], done: Completion | None) -> list[int]:
    """Release the run's lease(s) before its task id is handed on (a retry, a replacement),
    recording ``done``; the fences of the leases that may still be in the store (all of
    them under a ``cooldown``, else those whose release the store did not confirm), which
    the next message of the id names (:data:`redelivery.COOLING_HEADER`), else []."""
    lease = _runs.current(task)
    if lease is None:
        return []
    unconfirmed = _runs.release_all(lease, done)
    if task.lock_settings.cooldown is None:
        return [each.fence for each in unconfirmed]
    return [each.fence for each in (lease.leases if isinstance(lease, LeaseSet) else (lease,))]


def _tasks_of(sig: Any) -> list[Any]:
    """The single tasks' signatures of the replacement ``sig``: ``sig`` itself, or those of
    a chain's, a group's or a chord's tasks (a chord's header and its body, which takes the
    task id of the replaced run: for a group, Celery's own ``accumulate``). A group's and a
    chord header's tasks run under ids of their own, their parent the replaced run."""
    kind = sig.subtask_type
    if kind is None:
        return [sig]
    if kind == "chord":
        header = sig.tasks
        parts = [*(header if isinstance(header, (list, tuple)) else [header]), sig.body]
    elif kind in ("chain", "group"):
        parts = list(sig.tasks)
    else:
        return []
    return [each for part in parts if isinstance(part, Signature) for each in _tasks_of(part)]


#: Headers of an attempt's message that are its own, not its retry's (:func:`_before_retry`).
_OWN_HEADERS = (
    LOCK_RETRIES_HEADER,
    redelivery.DEFERRED_HEADER,
    redelivery.COOLING_HEADER,
    redelivery.REPLACED_HEADER,
)


def _declared(cls: type[ExclusiveTask[..., Any]]) -> None:
    """Check and compile a new task class: its own ``throws``, its key, its lock options."""
    own = vars(cls).get("throws")
    if own is not None and not isinstance(own, property):  # app.task(throws=...) or a class attribute
        cls._own_throws = tuple(own)
        delattr(cls, "throws")
    cls._lock_keys = builder = _key_builder_for(cls)
    if builder.several:
        raw = {
            attr: _raw_attribute(cls, attr)
            for attr in ("lock_on_locked", "lock_cooldown", "lock_dedupe", "lock_limit")
        }
        _check_several(str(vars(cls).get("name") or cls.__qualname__), *raw.values())
    # Methods a subclass defines are its own business; data attributes are options.
    options = [n for n, v in vars(cls).items() if not isinstance(v, _CLASS_MEMBERS)]
    check_lock_attributes(options, _LOCK_ATTRIBUTES)
    check_task_options(**{name: _raw_attribute(cls, attr) for name, attr in TASK_OPTIONS.items()})


_mixins: dict[type, type] = {}
_mixins_mutex = threading.Lock()


_celerys_call_next: dict[type, bool] = {}


def _celerys_call_is_next(cls: type) -> bool:
    """Whether ``super().__call__`` in ExclusiveTask is Celery's own for tasks of ``cls``."""
    known = _celerys_call_next.get(cls)
    if known is None:
        mro = cls.__mro__
        following = [k for k in mro[mro.index(ExclusiveTask) + 1 :] if "__call__" in vars(k)]
        known = _celerys_call_next[cls] = bool(following) and vars(following[0])["__call__"] is Task.__call__
    return known


_CLASS_MEMBERS = (types.FunctionType, property, classmethod, staticmethod)
#: Every ``lock_*`` option a task may carry: ExclusiveTask's ``lock_*`` data attributes, not
#: its helpers (``lock_key_for``, the ``lock_settings`` property...), which an option of
#: that name would replace.
_LOCK_ATTRIBUTES = frozenset(
    n for n, v in vars(ExclusiveTask).items() if n.startswith("lock_") and not isinstance(v, _CLASS_MEMBERS)
)


def exclusive_base(base: type | str | None = None) -> type:
    """``base`` with :class:`ExclusiveTask` mixed in (ExclusiveTask itself for None)."""
    if base is None:
        return ExclusiveTask
    if isinstance(base, str):
        base = symbol_by_name(base)
    if not (isinstance(base, type) and issubclass(base, Task)):
        raise InvalidArgumentError(f"base must be a celery Task subclass, got {base!r}")
    if issubclass(base, ExclusiveTask):
        return base
    with _mixins_mutex:
        mixed = _mixins.get(base)
        if mixed is None:
            mixed = type(f"Exclusive{base.__name__}", (ExclusiveTask, base), {"__module__": base.__module__})
            _mixins[base] = mixed
        return mixed


@overload
def exclusive_task(fun: Callable[_P, _R], /) -> ExclusiveTask[_P, _R]: ...
@overload
def exclusive_task(
    *,
    bind: Literal[True],
    key: KeySpec = None,
    on_locked: str | Callable[..., Any] | None = None,
    ttl: float | timedelta | None = None,
    max_lifetime: float | timedelta | None = None,
    refresh_interval: float | timedelta | None = None,
    on_lost: str | None = None,
    lock_max_retries: int | None = None,
    lock_retry_backoff: float | timedelta | None = None,
    lock_retry_backoff_max: float | timedelta | None = None,
    lock_wait: float | timedelta | None = None,
    lock_wait_fallback: str | None = None,
    limit: int | None = None,
    app: Any = None,
    base: type | str | None = None,
    **options: Any,
) -> Callable[[Callable[Concatenate[ExclusiveTask[Any, Any], _P], _R]], ExclusiveTask[_P, _R]]: ...
@overload
def exclusive_task(
    *,
    bind: Literal[False] = False,
    key: KeySpec = None,
    on_locked: str | Callable[..., Any] | None = None,
    ttl: float | timedelta | None = None,
    max_lifetime: float | timedelta | None = None,
    refresh_interval: float | timedelta | None = None,
    on_lost: str | None = None,
    lock_max_retries: int | None = None,
    lock_retry_backoff: float | timedelta | None = None,
    lock_retry_backoff_max: float | timedelta | None = None,
    lock_wait: float | timedelta | None = None,
    lock_wait_fallback: str | None = None,
    limit: int | None = None,
    app: Any = None,
    base: type | str | None = None,
    **options: Any,
) -> Callable[[Callable[_P, _R]], ExclusiveTask[_P, _R]]: ...
def exclusive_task(
    fun: Callable[..., Any] | None = None,
    *,
    key: KeySpec = None,
    on_locked: str | Callable[..., Any] | None = None,
    ttl: float | timedelta | None = None,
    max_lifetime: float | timedelta | None = None,
    refresh_interval: float | timedelta | None = None,
    on_lost: str | None = None,
    lock_max_retries: int | None = None,
    lock_retry_backoff: float | timedelta | None = None,
    lock_retry_backoff_max: float | timedelta | None = None,
    done_retention: float | timedelta | bool | None = None,
    lock_wait: float | timedelta | None = None,
    lock_wait_fallback: str | None = None,
    dedupe: str | bool | None = None,
    on_duplicate: str | Callable[..., Any] | None = None,
    dedupe_ttl: float | timedelta | None = None,
    cooldown: float | timedelta | None = None,
    rerun_args: str | None = None,
    limit: int | None = None,
    app: Any = None,
    base: type | str | None = None,
    **options: Any,
) -> Any:
    """Declare an exclusive task: ``app.task`` (or ``shared_task`` without ``app``) plus a lock.

    ``key`` is a template over the task's parameters, a callable, or None (the task name:
    one global lock); a list of templates, or a callable returning several keys, makes the
    run hold every key or none (see docs/celery.md, "Several keys"). Other options are
    Celery's (``bind``, ``autoretry_for``, ``max_retries``, ``acks_late``, time limits,
    ``name``...). ``base`` may be any Task subclass: ExclusiveTask is mixed in. A bad key
    or option raises InvalidArgumentError here.

    Typed: the task is an ``ExclusiveTask[P, R]`` of the function's parameters ``P`` (less
    the bound ``self`` under ``bind=True``) and result ``R``, so a type checker checks
    ``task(...)``, ``.delay(...)`` and ``.si(...)`` arguments and what ``.delay(...).get()`` returns.
    """
    options.update(keyword_attributes(locals(), options))
    check_lock_attributes(options, _LOCK_ATTRIBUTES)
    check_task_options(**{name: options.get(attr) for name, attr in TASK_OPTIONS.items()})
    options["base"] = exclusive_base(base)

    def decorate(function: Callable[..., Any]) -> Any:
        builder = KeyBuilder.for_function(options.get("lock_key"), function, bound=bool(options.get("bind")))
        if builder.several:
            name = options.get("name") or f"{function.__module__}.{function.__qualname__}"
            _check_several(
                name,
                *(options.get(a) for a in ("lock_on_locked", "lock_cooldown", "lock_dedupe", "lock_limit")),
            )
        if app is not None:
            install_revoke(app)  # before the app is finalized (its control may be built first)
            return app.task(**options)(function)
        return shared_task(**options)(function)

    return decorate(fun) if fun is not None else decorate
