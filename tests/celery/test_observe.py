"""Visible outcomes: OpenTelemetry span attributes, Celery events, task context on log lines.

Spans: a real OpenTelemetry SDK (in-memory exporter) and opentelemetry-instrumentation-celery
around an embedded worker on the real Redis broker and a real Redis lock store, so the span
is the one the instrumentation starts for each task. Events: a subprocess worker started
with ``-E`` on a PostgreSQL lock store, and a real ``app.events.Receiver`` on the broker.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker
from opentelemetry import context as otel_context
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_exclusive import observe
from celery_exclusive.errors import LockedError, LockRetriesExceeded
from celery_exclusive.service import LockService
from celery_exclusive.task import HANDS_ON_RERUNS, exclusive_task
from tests.celery.conftest import (
    BROKER_URL,
    SESSION,
    WorkerGroup,
    cleanup_group,
    delete_redis_prefix,
    failed,
    start_group,
    wait_for,
)
from tests.conftest import REDIS_URL, require_server

# Celery's Redis result backend calls redis-py's deprecated setex in this process's worker.
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")

PREFIX = f"ceobs{SESSION}:"
QUEUE = f"ce-observe-{SESSION}"
#: The instrumentation's attribute holding the task id.
TASK_ID = "messaging.message.id"

app = Celery("ce_observe", broker=BROKER_URL, backend=BROKER_URL, set_as_current=False)
app.conf.update(
    exclusive_url=REDIS_URL,
    exclusive_prefix=PREFIX,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": f"cetest-{SESSION}:obs:"},
    result_backend_transport_options={"global_keyprefix": f"cetest-{SESSION}:obs:"},
    task_default_queue=QUEUE,
    worker_hijack_root_logger=False,
)


@exclusive_task(app=app, key="obs:{n}", bind=True)
def skipping(self: Any, n: str, duration: float = 0.0) -> int:
    time.sleep(duration)
    return int(self.lock.fence)


@exclusive_task(app=app, key="obs-raise:{n}", on_locked="raise")
def raising(n: str) -> str:
    return "ran"


# A backoff of 1 s (a countdown of 0.5-1 s): the instrumentation keys its spans by task id,
# so a lock retry starting before the first run's span ended would clobber it (see
# docs/observability.md).
@exclusive_task(app=app, key="obs-retry:{n}", on_locked="retry", lock_max_retries=1, lock_retry_backoff=1.0)
def retrying(n: str) -> str:
    return "ran"


@exclusive_task(app=app, key="obs-rerun:{n}", on_locked="rerun")
def rerunning(n: str) -> str:
    return "ran"


@exclusive_task(app=app, key="obs-lost:{n}", ttl=2)
def losing(n: str, duration: float) -> str:
    time.sleep(duration)
    return "returned"


class PublishClash:
    """Forces one interleaving of two publishes of a task id: the client's, and the worker's
    lock retry of it. opentelemetry-instrumentation-celery keeps a publish span under its
    task id on the (shared) task object, so the client's ``after_task_publish`` ends and
    forgets the retry's publish span, and the worker's then finds none: the ended publish
    span stays the worker thread's current span. ``before`` is connected ahead of the
    instrumentation's receiver, ``after`` behind it."""

    def __init__(self) -> None:
        self.task_id: str | None = None
        self.client = 0
        self.retry_sent = threading.Event()
        self.client_done = threading.Event()

    def arm(self, task_id: str) -> None:
        self.task_id, self.client = task_id, threading.get_ident()

    def before(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if self.task_id is None or (headers or {}).get("id") != self.task_id:
            return
        if threading.get_ident() == self.client:  # the client's publish waits for the retry's
            self.retry_sent.wait(15)
        else:  # the retry's publish (in the worker) waits for the client's to have ended
            self.retry_sent.set()
            self.client_done.wait(15)

    def after(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        mine = self.task_id is not None and (headers or {}).get("id") == self.task_id
        if mine and threading.get_ident() == self.client:
            self.client_done.set()


clash = PublishClash()


class LostReportGate(logging.Handler):
    """Holds the heartbeat thread's lost-lease report of one task id in its WARNING (after
    the report has claimed the run's one report, before it marks the span) until that run's
    span has ended (``task_postrun``, connected behind the instrumentation's), or for
    ``hold`` seconds: a run whose end waits for the report never ends meanwhile."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.hold = hold
        self.task_id: str | None = None
        self.reporting = threading.Event()
        self.span_ended = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.task_id is not None and getattr(record, "task_id", None) == self.task_id:
            self.reporting.set()
            self.span_ended.wait(self.hold)

    def watch(self, task_id: str) -> None:
        """Hold the report of ``task_id`` (and only it) from now on."""
        self.reporting.clear()
        self.span_ended.clear()
        self.task_id = task_id

    def ended(self, task_id: str | None = None, **_: Any) -> None:
        if self.task_id is not None and task_id == self.task_id:
            self.span_ended.set()


lost_gate = LostReportGate(hold=2.0)


@exclusive_task(app=app, key="obs-lost-gated:{n}", ttl=2, bind=True)
def losing_gated(self: Any, n: str) -> str:
    """Runs until the heartbeat's report of its lost lease has begun."""
    assert lost_gate.reporting.wait(15)
    return "returned"


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """The instrumentation on a real SDK provider, and an embedded worker on the real broker."""
    require_server(BROKER_URL)
    require_server(REDIS_URL)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    signals.after_task_publish.connect(clash.before, weak=False)
    instrumentor.instrument(tracer_provider=provider)
    signals.after_task_publish.connect(clash.after, weak=False)
    signals.task_postrun.connect(lost_gate.ended, weak=False)
    observe.logger.addHandler(lost_gate)
    level = observe.logger.level
    observe.logger.setLevel(logging.WARNING)  # the gate sees the lost-lease WARNING
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=30):
            yield exporter
    finally:
        instrumentor.uninstrument()
        signals.after_task_publish.disconnect(clash.before)
        signals.after_task_publish.disconnect(clash.after)
        signals.task_postrun.disconnect(lost_gate.ended)
        observe.logger.removeHandler(lost_gate)
        observe.logger.setLevel(level)
        delete_redis_prefix(REDIS_URL, PREFIX)
        delete_redis_prefix(BROKER_URL, f"cetest-{SESSION}:obs:")


@pytest.fixture
def locks(spans: InMemorySpanExporter) -> Iterator[LockService]:
    """A client lock service on the tasks' store and prefix."""
    service = LockService(REDIS_URL, prefix=PREFIX)
    yield service
    service.close()


def uid() -> str:
    return uuid.uuid4().hex[:8]


def run_span(exporter: InMemorySpanExporter, task_id: str) -> ReadableSpan:
    """The instrumentation's ``run/...`` span of ``task_id`` (waits for it to end)."""

    def find() -> ReadableSpan | None:
        for span in exporter.get_finished_spans():
            attrs = span.attributes or {}
            if span.name.startswith("run/") and attrs.get(TASK_ID) == task_id:
                return span
        return None

    found: ReadableSpan = wait_for(find, 15, what=f"the run span of {task_id}")
    return found


def lock_attributes(span: ReadableSpan) -> dict[str, Any]:
    return {k: v for k, v in (span.attributes or {}).items() if k.startswith("celery_exclusive.")}


def test_acquired_run_carries_key_fence_outcome_and_acquire_time(
    spans: InMemorySpanExporter, locks: LockService
) -> None:
    n = uid()
    result = skipping.delay(n)
    fence = result.get(timeout=15)
    attrs = lock_attributes(run_span(spans, result.id))
    assert attrs[observe.KEY] == f"obs:{n}"
    assert attrs[observe.OUTCOME] == "acquired"
    assert attrs[observe.FENCE] == fence
    assert 0 < attrs[observe.ACQUIRE_DURATION] < 5
    assert observe.HOLDER_TASK_ID not in attrs


def test_skipped_run_is_told_apart_from_a_real_run(spans: InMemorySpanExporter, locks: LockService) -> None:
    n = uid()
    with locks.lock(f"obs:{n}", ttl=30, holder={"task_id": "the-holder"}) as lease:
        result = skipping.delay(n)
        marker = result.get(timeout=15)
    assert marker["celery_exclusive"] == "skipped"
    span = run_span(spans, result.id)
    attrs = lock_attributes(span)
    assert attrs[observe.OUTCOME] == "skipped"
    assert attrs[observe.KEY] == f"obs:{n}"
    assert attrs[observe.HOLDER_TASK_ID] == "the-holder"
    assert attrs[observe.HOLDER_FENCE] == lease.fence
    assert attrs[observe.SKIP_REASON] == "held"
    assert observe.FENCE not in attrs
    assert attrs[observe.ACQUIRE_DURATION] > 0


def test_raise_outcome(spans: InMemorySpanExporter, locks: LockService) -> None:
    n = uid()
    with locks.lock(f"obs-raise:{n}", ttl=30):
        raised = raising.delay(n)
        with pytest.raises(LockedError):
            raised.get(timeout=15)
    assert lock_attributes(run_span(spans, raised.id))[observe.OUTCOME] == "raised"


def test_coalesced_outcome(spans: InMemorySpanExporter, locks: LockService) -> None:
    n = uid()
    with locks.lock(f"obs-rerun:{n}", ttl=30, holder={HANDS_ON_RERUNS: True}):
        coalesced = rerunning.delay(n)
        assert coalesced.get(timeout=15)["celery_exclusive"] == "coalesced"
    # (The recorded rerun's marker key goes with the prefix at the end of the module.)
    assert lock_attributes(run_span(spans, coalesced.id))[observe.OUTCOME] == "coalesced"


def test_retried_then_raised_outcomes(spans: InMemorySpanExporter, locks: LockService) -> None:
    """The same task id runs twice: first it sends its lock retry, then it gives up."""
    n = uid()
    with locks.lock(f"obs-retry:{n}", ttl=30):
        retried = retrying.delay(n)
        with pytest.raises(LockRetriesExceeded):
            retried.get(timeout=20)

    def retried_runs() -> list[ReadableSpan]:
        return [
            s
            for s in spans.get_finished_spans()
            if s.name.startswith("run/") and (s.attributes or {}).get(TASK_ID) == retried.id
        ]

    wait_for(lambda: len(retried_runs()) >= 2, 15, what="both runs of the retried task")
    assert sorted(lock_attributes(s)[observe.OUTCOME] for s in retried_runs()) == ["raised", "retried"]


def test_retried_outcome_lands_on_the_run_span_when_the_publish_spans_clash(
    spans: InMemorySpanExporter, locks: LockService
) -> None:
    """The client's publish of a task id overlaps the worker's lock retry of it (as under
    load, when the worker runs the task before the client's publish has returned): the
    retry's publish span is left current, ended, in the worker thread; the outcome is still
    set on the run's own span."""
    n, task_id = uid(), str(uuid.uuid4())
    before = otel_context.get_current()
    clash.arm(task_id)
    try:
        with locks.lock(f"obs-retry:{n}", ttl=30):
            retried = retrying.apply_async((n,), task_id=task_id)
            with pytest.raises(LockRetriesExceeded):
                retried.get(timeout=20)
    finally:
        clash.task_id = None
        # The client's ended publish span is left current here too: later tests expect none.
        otel_context.attach(before)
    assert clash.retry_sent.is_set()
    assert clash.client_done.is_set()
    first = run_span(spans, task_id)  # the first run's: the retried run ends (much) earlier
    assert (first.attributes or {}).get("celery.state") == "RETRY"
    assert lock_attributes(first)[observe.OUTCOME] == "retried"


def test_lost_lease_marks_the_span_and_logs_with_the_task_context(
    spans: InMemorySpanExporter, locks: LockService
) -> None:
    n = uid()
    result = losing.delay(n, 2.5)
    info = wait_for(lambda: locks.peek(f"obs-lost:{n}"), 10, what="the run's lease")
    assert locks.force_release(f"obs-lost:{n}", info.token)
    assert result.get(timeout=15) == "returned"
    attrs = lock_attributes(run_span(spans, result.id))
    assert attrs[observe.OUTCOME] == "lost"
    assert attrs[observe.FENCE] == info.fence
    assert "no longer lists this token" in attrs[observe.LOST_REASON]


def test_lost_outcome_reported_by_the_heartbeat_lands_before_the_span_ends(
    spans: InMemorySpanExporter, locks: LockService
) -> None:
    """The heartbeat thread claims the run's loss report, then is slow to mark the span (its
    WARNING is held) while the run ends: the run's end waits for the mark."""
    n, task_id = uid(), str(uuid.uuid4())
    lost_gate.watch(task_id)
    try:
        result = losing_gated.apply_async((n,), task_id=task_id)
        info = wait_for(lambda: locks.peek(f"obs-lost-gated:{n}"), 10, what="the run's lease")
        assert locks.force_release(f"obs-lost-gated:{n}", info.token)
        assert result.get(timeout=20) == "returned"
        attrs = lock_attributes(run_span(spans, task_id))
    finally:
        lost_gate.task_id = None
    assert lost_gate.reporting.is_set()
    assert attrs[observe.OUTCOME] == "lost"
    assert "no longer lists this token" in attrs[observe.LOST_REASON]


def test_a_loss_report_held_past_report_wait_does_not_hold_the_runs_end(
    spans: InMemorySpanExporter, locks: LockService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat thread's loss report is stuck in a logging handler (it waits for the
    run's end, far past :data:`observe.REPORT_WAIT`): the run's end waits for it only that
    long, then ends anyway (its span then misses the loss, as documented)."""
    monkeypatch.setattr(observe, "REPORT_WAIT", 0.5)
    monkeypatch.setattr(lost_gate, "hold", 60.0)
    n, task_id = uid(), str(uuid.uuid4())
    lost_gate.watch(task_id)
    try:
        result = losing_gated.apply_async((n,), task_id=task_id)
        info = wait_for(lambda: locks.peek(f"obs-lost-gated:{n}"), 10, what="the run's lease")
        assert locks.force_release(f"obs-lost-gated:{n}", info.token)
        assert lost_gate.reporting.wait(15), "the heartbeat never began its loss report"
        # Unbounded, the run's end would wait for the report, which waits for the run's end.
        assert result.get(timeout=20) == "returned"
        assert lost_gate.span_ended.wait(5), "the run's span never ended"
        run_span(spans, task_id)
    finally:
        lost_gate.task_id = None
        lost_gate.span_ended.set()  # lets a report still held go on


# -- Celery events: a real worker with -E, a real receiver ------------------------------------


@pytest.fixture(scope="module")
def events_group(celery_logdir: Path) -> Iterator[WorkerGroup]:
    """One prefork worker (2 processes) with task events on, on a PostgreSQL lock store."""
    group = start_group("postgres", celery_logdir, workers=1, concurrency=2, extra=("-E",))
    yield group
    group.close()
    cleanup_group(group)


@pytest.fixture
def received(events_group: WorkerGroup, request: pytest.FixtureRequest) -> Iterator[list[dict[str, Any]]]:
    """Every event on the broker while the test runs, from a receiver that is known to be bound."""
    from tests.celery.app import app as worker_app

    events: list[dict[str, Any]] = []
    probe = f"worker-probe-{uid()}"
    ready = threading.Event()
    with worker_app.connection_for_read() as connection:

        def collect(event: dict[str, Any]) -> None:
            if event.get("type") == probe:
                ready.set()
            events.append(event)

        receiver = worker_app.events.Receiver(connection, handlers={"*": collect})
        thread = threading.Thread(
            target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True
        )
        thread.start()
        try:
            deadline = time.monotonic() + 15
            while not ready.wait(0.2):
                assert time.monotonic() < deadline, "the event receiver never received its probe"
                with worker_app.events.default_dispatcher() as dispatcher:
                    dispatcher.send(probe)
            yield events
        finally:
            receiver.should_stop = True
            thread.join(10)
            if failed(request):
                print(events_group.dump())


def first_event(events: list[dict[str, Any]], type_: str, task_id: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: next((e for e in events if e.get("type") == type_ and e.get("uuid") == task_id), None),
        20,
        what=f"{type_} for {task_id}",
    )
    return found


def test_skip_coalesce_and_lost_send_celery_events(
    events_group: WorkerGroup, received: list[dict[str, Any]]
) -> None:
    from tests.celery.app import hold_short_ttl, work_rerun, work_skip

    group = events_group
    n = uid()
    with group.service.lock(f"work:{n}", ttl=30, holder={"task_id": "the-holder"}) as lease:
        skipped = group.send(work_skip, n, "obs")
        assert skipped.get(timeout=20)["celery_exclusive"] == "skipped"
    event = first_event(received, observe.EVENT_SKIPPED, skipped.id)
    assert event["exclusive_key"] == f"work:{n}"
    assert event["exclusive_outcome"] == "skipped"
    assert event["exclusive_holder"]["task_id"] == "the-holder"
    assert event["exclusive_holder"]["fence"] == lease.fence
    assert event["hostname"].startswith("postgres0-")

    holder = group.send(work_rerun, n, "obs", 1.5)
    wait_for(lambda: group.service.peek(f"rerun:{n}"), 15, what="the rerun holder's lease")
    coalesced = group.send(work_rerun, n, "obs")
    assert coalesced.get(timeout=20)["celery_exclusive"] == "coalesced"
    assert first_event(received, observe.EVENT_COALESCED, coalesced.id)["exclusive_key"] == f"rerun:{n}"
    holder.get(timeout=20)

    lost = group.send(hold_short_ttl, n, "obs", 3.0)
    info = wait_for(lambda: group.service.peek(f"hold:{n}"), 15, what="the long run's lease")
    assert group.service.force_release(f"hold:{n}", info.token)
    event = first_event(received, observe.EVENT_LOST, lost.id)
    assert event["exclusive_key"] == f"hold:{n}"
    assert event["exclusive_fence"] == info.fence
    # The heartbeat thread's warning is in Celery's task format: name[id], never ???[???].
    line = f"{hold_short_ttl.name}[{lost.id}]: lock 'hold:{n}' (fence {info.fence}) was lost"
    log = wait_for(lambda: line in group.workers[0].text() and group.workers[0].text(), 10, what=line)
    assert "???" not in log
    lost.get(timeout=20)
