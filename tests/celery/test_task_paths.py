"""The exclusive run's short paths (issue #16) against the full ones, on real lock stores.

A worker run of the usual exclusive task (one key, limit 1, no cooldown) takes its lease
through the service's acquire and releases it through the service's release directly,
its completion record made without ``checked_completion``'s frame; a task id those
checks do not vouch for (non-ASCII) takes ``LockService.lock`` and ``checked_completion``.
Both must leave the same record and refuse the same copy. Runs go through Celery's own
tracer (``build_tracer``, what a pool process runs), without a broker, on real Redis and
PostgreSQL stores. The span lookup skips an empty OpenTelemetry context: a span set in
the context (here by a private SDK provider, as the Celery instrumentation sets its own)
must still get the lock's attributes.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_exclusive import _process
from celery_exclusive.errors import LockedError
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import close_lock_services, get_lock_service
from tests.celery.conftest import SESSION, delete_redis_prefix
from tests.conftest import POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option

PREFIX = f"cepaths{SESSION}:"
TABLE = f"ce_paths_{SESSION}"


@pytest.fixture(params=["redis", "postgres"])
def app(request: pytest.FixtureRequest) -> Iterator[Celery]:
    """An app whose exclusive tasks lock on the real store named by the parameter."""
    if request.param == "redis":
        require_server(REDIS_URL)
        url = REDIS_URL
    else:
        require_server(POSTGRES_URL)
        url = with_option(POSTGRES_URL, "table", TABLE)
    made = Celery(f"ce-paths-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    made.conf.update(exclusive_url=url, exclusive_prefix=PREFIX, task_ignore_result=True)
    try:
        yield made
    finally:
        close_lock_services()
        if request.param == "redis":
            delete_redis_prefix(REDIS_URL, PREFIX)
        else:
            drop_lock_table(POSTGRES_URL, TABLE)


def traced(app: Celery, task: Any) -> Any:
    """Run ``task`` as a pool process does: ``trace(task_id, args, retries)``."""
    app.finalize()
    tracer = build_tracer(task.name, app.tasks[task.name], eager=False, hostname="paths@test", app=app)

    def trace(task_id: str, args: tuple[Any, ...], retries: int = 0) -> tuple[str, Any]:
        request = {"id": task_id, "args": args, "kwargs": {}, "hostname": "paths@test", "retries": retries}
        done = tracer(task_id, args, {}, request)
        if done.info is None:  # trace_ok_t of a success: no TraceInfo
            return "SUCCESS", done.retval
        return done.info.state, done.info.retval

    return trace


@pytest.mark.parametrize("task_id", ["ascii-{}", "tâche-{}"], ids=["ascii id", "non-ASCII id"])
def test_a_run_records_its_completion_and_a_copy_of_it_does_not_run(app: Celery, task_id: str) -> None:
    """Both paths: the body runs once, its record names the id and its retries count, and a
    second message of the id (a redelivery) does not run the body; another id does."""
    ran: list[str] = []

    @exclusive_task(app=app, key="rec:{n}", bind=True, name=f"paths.rec.{uuid.uuid4().hex[:6]}")
    def rec(self: Any, n: str) -> int:
        ran.append(self.request.id)
        assert self.lock is not None
        assert self.lock.key == f"rec:{n}"
        return int(self.lock.fence)

    trace = traced(app, rec)
    tid, n = task_id.format(uuid.uuid4().hex[:8]), uuid.uuid4().hex[:8]
    state, fence = trace(tid, (n,), retries=3)
    assert state == "SUCCESS"
    assert isinstance(fence, int)
    assert ran == [tid]
    service = get_lock_service(app)
    record = service.completion(f"rec:{n}", tid)
    assert record is not None
    assert (record.task_id, record.outcome, record.attempt) == (tid, "success", 3)
    assert service.peek(f"rec:{n}") is None  # released
    assert trace(tid, (n,), retries=3)[0] == "IGNORED"  # the real result is left alone
    assert ran == [tid]  # the copy did not run the body
    assert trace(f"{tid}-other", (n,))[0] == "SUCCESS"
    assert ran == [tid, f"{tid}-other"]


def test_a_held_key_is_refused_on_the_short_path(app: Celery) -> None:
    """on_locked="raise": a key held elsewhere fails the run with LockedError naming its holder."""

    @exclusive_task(app=app, key="held:{n}", on_locked="raise", name=f"paths.held.{uuid.uuid4().hex[:6]}")
    def held(n: str) -> str:
        return "ran"

    trace = traced(app, held)
    n = uuid.uuid4().hex[:8]
    with get_lock_service(app).lock(f"held:{n}", holder={"who": "the other"}):
        state, error = trace(f"held-{n}", (n,))
    assert state == "FAILURE"
    assert isinstance(error, LockedError)
    assert error.key == f"held:{n}"
    assert error.holder is not None
    assert error.holder.holder["who"] == "the other"
    assert trace(f"held-{n}-2", (n,)) == ("SUCCESS", "ran")


def test_the_short_path_stores_the_holder_holder_json_makes(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual run sends its holder as the template's JSON text alone: what the store keeps
    is holder_json's text of the run's holder, in this process and after a fork (a new
    process identity: the template's text made again, not the parent's pid)."""
    seen: list[dict[str, Any]] = []

    @exclusive_task(app=app, key="who:{n}", bind=True, name=f"paths.who.{uuid.uuid4().hex[:6]}")
    def who(self: Any, n: str) -> None:
        info = get_lock_service(app).peek(f"who:{n}")
        assert info is not None
        seen.append(info.holder)

    trace = traced(app, who)
    expected = {"task_name": who.name, "worker": "paths@test"}
    for i in range(2):  # the first run makes the template, the second takes the inline text
        assert trace(f"who-{i}", (f"{uuid.uuid4().hex[:8]}",))[0] == "SUCCESS"
        assert seen[-1] == {**_process.this.meta, **expected, "task_id": f"who-{i}"}
    close_lock_services()  # the parent's connections closed here: the "child" makes its own
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    _process.this.reset()  # what a forked child runs
    try:
        assert trace("who-child", (f"{uuid.uuid4().hex[:8]}",))[0] == "SUCCESS"
        assert seen[-1] == {"host": _process.HOST, "pid": 424242, **expected, "task_id": "who-child"}
    finally:
        monkeypatch.undo()
        _process.this.reset()


def test_a_span_in_the_context_gets_the_lock_attributes(app: Celery) -> None:
    """An empty context skips the span lookup; a recording span set in it is still found."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    @exclusive_task(app=app, key="span:{n}", name=f"paths.span.{uuid.uuid4().hex[:6]}")
    def spanned(n: str) -> str:
        return "ran"

    trace = traced(app, spanned)
    n = uuid.uuid4().hex[:8]
    assert not otel_context.get_current()  # the empty context of a worker without instrumentation
    assert trace(f"span-{n}-bare", (n,)) == ("SUCCESS", "ran")
    with provider.get_tracer("paths").start_as_current_span("run/paths") as span:
        assert trace(f"span-{n}", (n,)) == ("SUCCESS", "ran")
    assert span.attributes is not None
    assert span.attributes.get("celery_exclusive.lock.key") == f"span:{n}"
    assert span.attributes.get("celery_exclusive.lock.outcome") == "acquired"
