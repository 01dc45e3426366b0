"""What each exclusive run did, made visible where Celery users look.

* **OpenTelemetry**: when ``opentelemetry-api`` is importable (it is never required), the
  task's own span (the current span while the worker runs the task, e.g. the one
  ``opentelemetry-instrumentation-celery`` starts) gets the attributes below. Nothing is
  set on direct calls of the task function (they have no span of their own) or when no SDK
  records the span.
* **Celery events**: a skipped, coalesced or lost run sends a task event (``task.send_event``)
  when the worker sends task events (``-E`` / ``worker_send_task_events``) and the task's
  ``send_events`` is true, so ``celery events`` and Flower show it next to the task.
* **Logs**: the lost-lease WARNING is logged from the heartbeat thread with the task's name
  and id on the record, so Celery's task log format prints ``name[id]`` rather than ``???[???]``.

===================================== ====== ================================================
span attribute                        type   value
===================================== ====== ================================================
``celery_exclusive.lock.key``         str    the lock key (without the service prefix)
``celery_exclusive.lock.outcome``     str    ``acquired``, ``skipped``, ``coalesced``,
                                             ``retried``, ``raised`` or ``lost`` (the last word)
``celery_exclusive.lock.fence``       int    this run's fence (runs that acquired)
``celery_exclusive.lock.acquire.duration`` double seconds spent in lock-store calls to acquire
``celery_exclusive.lock.holder.task_id``   str    the holder's task id (runs that did not acquire)
``celery_exclusive.lock.holder.fence``     int    the holder's fence (runs that did not acquire)
``celery_exclusive.lock.skip_reason``      str    why the body was skipped (``held``)
``celery_exclusive.lock.lost_reason``      str    why the lease was lost
===================================== ====== ================================================

Events: ``task-exclusive-skipped``, ``task-exclusive-coalesced``, ``task-exclusive-lost``,
each with ``uuid`` (the task id) and the fields ``exclusive_key``, ``exclusive_outcome``,
``exclusive_reason``, and ``exclusive_holder`` (holder metadata with its fence; skip and
coalesce) or ``exclusive_fence`` (lost). The ``exclusive_`` prefix keeps them apart from
the task fields Celery's event state merges them into.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from celery.utils.log import get_task_logger

if TYPE_CHECKING:
    from celery_exclusive.lease import Lease
    from celery_exclusive.providers.base import LockInfo


# The task module's logger: in a worker, Celery's task format prints "name[id]: " before each line.
logger = get_task_logger("celery_exclusive.task")

KEY = "celery_exclusive.lock.key"
OUTCOME = "celery_exclusive.lock.outcome"
FENCE = "celery_exclusive.lock.fence"
ACQUIRE_DURATION = "celery_exclusive.lock.acquire.duration"
HOLDER_TASK_ID = "celery_exclusive.lock.holder.task_id"
HOLDER_FENCE = "celery_exclusive.lock.holder.fence"
SKIP_REASON = "celery_exclusive.lock.skip_reason"
LOST_REASON = "celery_exclusive.lock.lost_reason"

ACQUIRED = "acquired"
SKIPPED = "skipped"
COALESCED = "coalesced"
RETRIED = "retried"
RAISED = "raised"
LOST = "lost"
OUTCOMES = (ACQUIRED, SKIPPED, COALESCED, RETRIED, RAISED, LOST)

EVENT_SKIPPED = "task-exclusive-skipped"
EVENT_COALESCED = "task-exclusive-coalesced"
EVENT_LOST = "task-exclusive-lost"
#: Longest a run's end waits for a loss report under way on another thread (its log line,
#: span mark and event, which a broker that does not answer can hold up), in seconds; past
#: it the run ends and its span may miss the loss.
REPORT_WAIT = 5.0


class _Events:
    """Whether this worker sends task events; set by the worker hook before pool processes fork."""

    enabled = False


events = _Events()


class _Local(threading.local):
    def __init__(self) -> None:
        self.acquiring = 0.0


_local = _Local()


def begin() -> None:
    """A task call starts in this thread: its acquisition time starts from zero."""
    _local.acquiring = 0.0


def spent_acquiring(seconds: float) -> None:
    """Add ``seconds`` spent in a lock-store call to acquire, for this thread's current call."""
    _local.acquiring += seconds


def _task_span(task: Any, request: Any = None) -> Any:
    """The task's own recording span in this thread, or None. Only until the run publishes
    a message: opentelemetry-instrumentation-celery can leave its (ended) publish span current
    after that, when another thread publishes the same task id at the same time (the
    client's send of the message whose lock retry this is)."""
    # Never imported here: a span can only be recording if an SDK, which imports this
    # module, is set up; so the package costs nothing where OpenTelemetry is not used.
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or (task.request if request is None else request).called_directly:
        return None
    # The current span is read from the current context: an empty one (no instrumentation
    # set anything in it) holds none, which get_current_span would answer with its invalid,
    # never recording span, in two calls more.
    context = sys.modules.get("opentelemetry.context")  # imported by opentelemetry.trace
    if context is not None and not context.get_current():
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def _wants_events(task: Any, hostname: str | None = None) -> bool:
    if not events.enabled:
        return False
    return bool(getattr(task, "send_events", True)) and bool(
        task.request.hostname if hostname is None else hostname
    )


def _send_event(task: Any, type_: str, **fields: Any) -> None:
    """``task.send_event`` that never fails the task: a broker hiccup is logged, not raised."""
    try:
        task.send_event(type_, **fields)
    except Exception:
        logger.warning("could not send the %s event of this run", type_, exc_info=True)


#: ``span=``'s default: look the span up (a caller that has looked passes what it found).
_ASK: Any = object()


def not_acquired(
    task: Any,
    key: str,
    holder: LockInfo | None,
    outcome: str,
    *,
    reason: str | None = None,
    span: Any = _ASK,
) -> None:
    """The run did not get ``key``: ``outcome`` is skipped, coalesced, retried or raised.
    ``span``: the run's :func:`_task_span`, if the caller looked it up (it must, before
    publishing anything: see :func:`_task_span`)."""
    span = _task_span(task) if span is _ASK else span
    if span is not None:
        span.set_attribute(KEY, key)
        span.set_attribute(OUTCOME, outcome)
        span.set_attribute(ACQUIRE_DURATION, _local.acquiring)
        if holder is not None:
            span.set_attribute(HOLDER_FENCE, holder.fence)
            holder_id = holder.holder.get("task_id")
            if isinstance(holder_id, str):
                span.set_attribute(HOLDER_TASK_ID, holder_id)
        if reason is not None:
            span.set_attribute(SKIP_REASON, reason)
    if outcome in (SKIPPED, COALESCED) and _wants_events(task):
        who = None if holder is None else {**holder.holder, "fence": holder.fence}
        _send_event(
            task,
            EVENT_COALESCED if outcome == COALESCED else EVENT_SKIPPED,
            exclusive_key=key,
            exclusive_outcome=outcome,
            exclusive_reason=reason or "held",
            exclusive_holder=who,
        )


class Run:
    """Reporting for one run that holds its lease: made in the task's thread by :func:`holding`."""

    __slots__ = ("_reporting", "_unreported", "app", "events", "hostname", "span", "task_id", "task_name")

    def __init__(self, task: Any, lease: Lease, request: Any = None, span: Any = _ASK) -> None:
        request = task.request if request is None else request
        self.task_name, self.task_id, self.hostname = task.name, request.id, request.hostname
        self.app = task.app
        self.events = events.enabled and _wants_events(task, self.hostname)
        if span is _ASK:  # the caller has not looked: _task_span, its first test inline
            span = None if "opentelemetry.trace" not in sys.modules else _task_span(task, request)
        #: The task's recording span (None: none), as :func:`_task_span` found it for this run.
        self.span = span
        #: Popped by the first report of a loss (list.pop is atomic): one report per run.
        self._unreported = [True]
        #: Held while a loss is reported: the run's end waits for a report under way.
        self._reporting = threading.Lock()
        if self.span is not None:
            self.span.set_attribute(KEY, lease.key)
            self.span.set_attribute(FENCE, lease.fence)
            self.span.set_attribute(OUTCOME, ACQUIRED)
            self.span.set_attribute(ACQUIRE_DURATION, _local.acquiring)

    def _first_report(self) -> bool:
        try:
            return self._unreported.pop()
        except IndexError:
            return False

    def lost(self, lease: Lease, reason: str) -> None:
        """The ``lease.on_lost`` callback (usually on the heartbeat thread): log, span, event."""
        with self._reporting:
            if not self._first_report():
                return
            _log_lost(self.task_name, self.task_id, lease, reason)
            self._mark_lost(lease, reason)

    def finished(self, lease: Lease, lost: bool) -> None:
        """The run ended; ``lost`` if the release found the lease gone (already logged there).
        Returns once a loss report under way on another thread has marked the span (at
        most :data:`REPORT_WAIT` later): the span ends after this, and an ended span drops
        attributes."""
        waited = self._reporting.acquire(timeout=REPORT_WAIT)
        try:
            if lost and self._first_report():
                self._mark_lost(lease, "the lease was no longer held at release")
        finally:
            if waited:
                self._reporting.release()

    def _mark_lost(self, lease: Lease, reason: str) -> None:
        if self.span is not None:
            # An SDK span takes attributes from any thread until it ends.
            self.span.set_attribute(OUTCOME, LOST)
            self.span.set_attribute(LOST_REASON, reason)
        if self.events:
            # Off the heartbeat thread: a slow broker must not delay the refresh of other leases.
            fields = {
                "exclusive_key": lease.key,
                "exclusive_outcome": LOST,
                "exclusive_reason": reason,
                "exclusive_fence": lease.fence,
            }
            threading.Thread(
                target=self._send_lost, args=(fields,), name="celery-exclusive-event", daemon=True
            ).start()

    def _send_lost(self, fields: dict[str, Any]) -> None:
        try:
            policy = self.app.conf.task_publish_retry_policy
            with self.app.events.default_dispatcher(hostname=self.hostname) as dispatcher:
                dispatcher.send(EVENT_LOST, uuid=self.task_id, retry=True, retry_policy=policy, **fields)
        except Exception:
            context = {"task_name": self.task_name, "task_id": self.task_id}
            logger.warning("could not send the %s event", EVENT_LOST, exc_info=True, extra=context)


def _log_lost(task_name: str, task_id: object, lease: Lease, reason: str) -> None:
    """The lost-lease WARNING, with the task's name and id on the record (see the module docs)."""
    logger.warning(
        "lock %r (fence %d) was lost while the task ran (%s); another run may now hold it",
        lease.key,
        lease.fence,
        reason,
        extra={"task_name": task_name, "task_id": task_id},
    )


def quiet_run(task_name: str, task_id: object) -> Callable[[Lease, str], None]:
    """The ``lease.on_lost`` callback of a run with no recording span and no task events
    (``events.enabled`` false: the usual run), which :class:`Run` would make at more cost:
    the same WARNING, once per run. Such a run's :meth:`Run.finished` has nothing to mark
    (no span, no event), so the caller makes no report at the release."""
    # A partial, not a closure: made in C, without a frame or cells. The list is popped by
    # the first report (list.pop is atomic), as Run's.
    return partial(_lost_once, [True], task_name, task_id)


def _lost_once(unreported: list[bool], task_name: str, task_id: object, lease: Lease, reason: str) -> None:
    """:func:`quiet_run`'s callback: the lost-lease WARNING, the first time only."""
    try:
        unreported.pop()
    except IndexError:
        return
    _log_lost(task_name, task_id, lease, reason)


def holding(task: Any, leases: Sequence[Lease], request: Any = None, span: Any = _ASK) -> Run:
    """The run acquired ``leases`` and is about to run its body: annotate its span (with the
    first lease), and report the loss of any of them (``lease.on_lost``). ``request``: the
    task's current request, if the caller has it; ``span``: its :func:`_task_span`, if the
    caller has looked it up for this run."""
    report = Run(task, leases[0], request, span)
    for lease in leases:
        lease.on_lost(report.lost)
    return report
