"""Worker hooks: shutdown releases, and the exact release of a killed run's lease."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.exceptions import TimeLimitExceeded

from celery_exclusive.lease import LeaseState
from celery_exclusive.service import LockService
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import (
    HOST,
    KILL_LOOKUP_WINDOW,
    get_lock_service,
    process_gone,
    release_killed,
    release_on_hard_time_limit,
    release_on_process_shutdown,
    release_on_terminate,
    release_on_worker_shutdown,
)

HOLDER = """
import sys, time
from celery_exclusive import LockService
service = LockService(sys.argv[1], prefix=sys.argv[2])
lease = service.lock(sys.argv[3], ttl=60, holder={"task_id": sys.argv[4]})
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Iterator[tuple[Celery, Any, LockService]]:
    """An app on a SQLite lock store (shared by processes), one exclusive task, a client service."""
    app = Celery(f"ce_hooks_{uuid.uuid4().hex[:6]}", set_as_current=False)
    url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    app.conf.update(exclusive_url=url, exclusive_prefix="hooks:")

    @exclusive_task(app=app, key="job:{n}", name=f"{app.main}.job", shared=False)
    def job(n: int) -> None: ...

    service = LockService(url, prefix="hooks:")
    yield app, job, service
    service.close()


def hold_in_subprocess(url: str, key: str, task_id: str) -> subprocess.Popen[str]:
    """A process holding ``key`` with ``task_id`` in its holder metadata (a stand-in pool child)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, "hooks:", key, task_id], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    child.stdout.close()
    assert line == "held"
    return child


def test_worker_shutdown_releases_held_leases() -> None:
    """worker_shutdown's hook releases what this process still holds."""
    app = Celery("ce_hooks_shutdown", set_as_current=False)
    app.conf.exclusive_url = "memory://"
    lease = get_lock_service(app).lock("still-held")
    release_on_worker_shutdown()
    assert lease.state is LeaseState.RELEASED


def test_process_shutdown_releases_held_leases() -> None:
    """worker_process_shutdown's hook releases what the pool process still holds."""
    app = Celery("ce_hooks_process", set_as_current=False)
    app.conf.exclusive_url = "memory://"
    lease = get_lock_service(app).lock("still-held")
    release_on_process_shutdown()
    assert lease.state is LeaseState.RELEASED


def test_terminate_hook_releases_the_killed_runs_lease_once_its_process_is_gone(
    sqlite_app: tuple[Celery, Any, LockService],
) -> None:
    """task_revoked(terminated=True): the lease of that task id is released after its process exits."""
    app, job, service = sqlite_app
    url = app.conf.exclusive_url
    child = hold_in_subprocess(url, "job:1", "T1")
    try:
        request = type("Request", (), {"id": "T1", "args": [1], "kwargs": {}})()
        release_on_terminate(sender=job, request=request, terminated=True)
        time.sleep(KILL_LOOKUP_WINDOW + 0.3)
        assert service.peek("job:1") is not None, "released while its process was still alive"
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 5
        while service.peek("job:1") is not None:
            assert time.monotonic() < deadline, "not released after the process died"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()


def test_hooks_leave_other_leases_alone(sqlite_app: tuple[Celery, Any, LockService]) -> None:
    """A lease of another task id, or a non-terminating revoke or other failure, is not released."""
    app, job, service = sqlite_app
    url = app.conf.exclusive_url
    child = hold_in_subprocess(url, "job:2", "T2")
    child.send_signal(signal.SIGKILL)
    child.wait()
    request = type("Request", (), {"id": "T2", "args": [2], "kwargs": {}})()
    release_on_terminate(sender=job, request=request, terminated=False)
    release_on_hard_time_limit(sender=job, task_id="T2", exception=ValueError("x"), args=[2], kwargs={})
    release_on_hard_time_limit(
        sender=job, task_id="OTHER", exception=TimeLimitExceeded(1), args=[2], kwargs={}
    )
    time.sleep(KILL_LOOKUP_WINDOW + 0.5)
    info = service.peek("job:2")
    assert info is not None
    assert info.holder["task_id"] == "T2"
    # The exact match does release it (its process is dead already).
    release_on_hard_time_limit(sender=job, task_id="T2", exception=TimeLimitExceeded(1), args=[2], kwargs={})
    deadline = time.monotonic() + 5
    while service.peek("job:2") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_process_gone() -> None:
    """A live process is not gone; an exited one (zombie or reaped) is."""
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while not process_gone(child.pid):  # a zombie until reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child.wait()
    assert process_gone(child.pid)


def test_holder_metadata_names_host_pid_and_task() -> None:
    """A task's lease records host, pid, task name and id: what the kill hooks match on."""
    app = Celery("ce_hooks_meta", set_as_current=False)
    app.conf.exclusive_url = "memory://"
    seen: dict[str, Any] = {}

    @exclusive_task(app=app, key="meta", bind=True, name="ce_hooks_meta.t", shared=False)
    def meta_task(self: Any) -> None:
        info = get_lock_service(app).peek("meta")
        assert info is not None
        seen.update(info.holder)

    meta_task.apply(task_id="the-id")
    assert seen["host"] == HOST
    assert seen["pid"] == os.getpid()
    assert seen["task_name"] == "ce_hooks_meta.t"
    assert seen["task_id"] == "the-id"


def test_hard_time_limit_hook_records_the_run_before_billiard_kills_it(
    sqlite_app: tuple[Celery, Any, LockService],
) -> None:
    """task_failure(TimeLimitExceeded) fires before billiard kills the child, which may
    release its lease on its way out without a record: the hook has written the run's
    failure record by the time it returns, the lease still held; the release comes after
    the process is gone. A copy of that task id then ends as already_done."""
    app, job, service = sqlite_app
    child = hold_in_subprocess(app.conf.exclusive_url, "job:3", "T3")
    try:
        release_on_hard_time_limit(
            sender=job, task_id="T3", exception=TimeLimitExceeded(1), args=[3], kwargs={}
        )
        record = service.completion("job:3", "T3")
        assert record is not None
        assert record.outcome == "failure"
        assert service.peek("job:3") is not None, "released while its process was still alive"
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 5
        while service.peek("job:3") is not None:
            assert time.monotonic() < deadline, "not released after the process died"
            time.sleep(0.05)
        assert service.completion("job:3", "T3") is not None
    finally:
        child.kill()
        child.wait()


def test_hard_time_limit_hook_names_the_attempt_of_the_request_celery_fails(
    sqlite_app: tuple[Celery, Any, LockService],
) -> None:
    """billiard ends a job killed at its hard time limit first through Celery's
    ``Request.on_failure`` (its traceback as text; the failing request's context pushed on
    the task's request stack), and only then through ``on_timeout``: that first
    task_failure names the run's attempt too. The highest attempt would stay (a record
    never goes back to an earlier attempt) and refuse the retry the run had sent."""
    _, job, service = sqlite_app
    job.request_stack.push(Context(id="T5", retries=2))
    try:
        release_on_hard_time_limit(
            sender=job,
            task_id="T5",
            exception=TimeLimitExceeded(1),
            args=[5],
            kwargs={},
            traceback="Traceback (most recent call last): ...",
        )
    finally:
        job.request_stack.pop()
    record = service.completion("job:5", "T5")
    assert record is not None
    assert (record.outcome, record.attempt) == ("failure", 2)


def test_hard_time_limit_hook_records_nothing_for_a_message_celery_requeues(
    sqlite_app: tuple[Celery, Any, LockService],
) -> None:
    """acks_late without acks on timeout requeues the killed run's message, to run again: no
    record (it would end that run); nor with records turned off."""
    app, _, service = sqlite_app

    @exclusive_task(app=app, key="late:{n}", name=f"{app.main}.late", shared=False, acks_late=True)
    def late(n: int) -> None: ...

    @exclusive_task(app=app, key="off:{n}", name=f"{app.main}.off", shared=False, done_retention=False)
    def off(n: int) -> None: ...

    late.acks_on_timeout = late.acks_on_failure_or_timeout = False
    for task, key in ((late, "late:4"), (off, "off:4")):
        release_on_hard_time_limit(
            sender=task, task_id="T4", exception=TimeLimitExceeded(1), args=[4], kwargs={}
        )
        assert service.completion(key, "T4") is None, task.name


def _on_timeout_traceback(request: Any) -> Any:
    """The traceback Celery's ``Request.on_timeout`` passes: of the TimeLimitExceeded it
    raises and catches in a frame whose ``self`` is the request."""

    def on_timeout(self: Any) -> Any:
        try:
            raise TimeLimitExceeded(1)
        except TimeLimitExceeded as exc:
            return exc.__traceback__

    return on_timeout(request)


def test_a_hard_time_limit_reported_twice_is_handled_once(
    sqlite_app: tuple[Celery, Any, LockService],
) -> None:
    """Celery reports one hard time limit twice: through ``Request.on_failure`` (the request's
    context pushed on the task's request stack), then ``Request.on_timeout`` (a traceback of a
    frame whose ``self`` is the request). The second report of the run touches nothing (it
    used to write the record again and look for the lease for a second); a report of another
    run of the same task id (its retry, another request) is handled again."""
    from celery.contrib.testing.mocks import TaskMessage
    from celery.worker.request import Request

    app, job, service = sqlite_app
    store = get_lock_service(app)
    calls: list[str] = []

    def counting(name: str) -> Any:
        """The store's method ``name``, each call counted on its way to the real store."""
        call = getattr(store, name)

        @functools.wraps(call)
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return call(*args, **kwargs)

        return counted

    for name in ("peek", "force_release"):
        setattr(store, name, counting(name))
    report = {"sender": job, "task_id": "T6", "exception": TimeLimitExceeded(1), "args": [6], "kwargs": {}}
    request = Request(TaskMessage(job.name, id="T6", args=[6]), app=app, task=job)
    child = hold_in_subprocess(app.conf.exclusive_url, "job:6", "T6")
    try:
        job.request_stack.push(request._context)
        try:
            first = release_on_hard_time_limit(**report, traceback="Traceback (most recent call last): ...")
        finally:
            job.request_stack.pop()
        assert first is not None
        assert calls, "the first report writes the record and looks for the lease"
        handled = len(calls)
        second = release_on_hard_time_limit(**report, traceback=_on_timeout_traceback(request))
        time.sleep(KILL_LOOKUP_WINDOW)
        assert len(calls) == handled, f"the second report made store calls: {calls[handled:]}"
        assert second is None
        child.send_signal(signal.SIGKILL)
        child.wait()
        first.join(10)
        assert service.peek("job:6") is None, "the first report's thread released the lease"
        retry = Request(TaskMessage(job.name, id="T6", args=[6], retries=1), app=app, task=job)
        again = release_on_hard_time_limit(**report, traceback=_on_timeout_traceback(retry))
        assert again is not None, "another run of the same id is handled"
        again.join(10)
        record = service.completion("job:6", "T6")
        assert record is not None
        assert (record.outcome, record.attempt) == ("failure", 1)
    finally:
        child.kill()
        child.wait()


def _hook_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name.startswith("celery_exclusive")]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (None, "no lock store configured"),
        ("postgresql+nodriver://u:hunter2@127.0.0.1/test", "the 'nodriver' package is required"),
    ],
)
def test_a_kill_hook_on_a_misconfigured_store_logs_one_line(
    url: str | None, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A configuration problem (no URL, a missing driver) met by the kill hook is one ERROR
    line naming the run and the problem: no traceback (it used to log one, with the
    driver's chained error), no credentials."""
    app = Celery(f"ce_hooks_{uuid.uuid4().hex[:6]}", set_as_current=False)
    if url is not None:
        app.conf.exclusive_url = url

    @exclusive_task(app=app, key="job:{n}", name=f"{app.main}.job", shared=False)
    def job(n: int) -> None: ...

    request = type("Request", (), {"id": "T-conf", "args": [1], "kwargs": {}})()
    with caplog.at_level(logging.DEBUG, logger="celery_exclusive"):
        release_on_terminate(sender=job, request=request, terminated=True)
    records = _hook_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    record = records[0]
    assert record.levelno == logging.ERROR
    assert record.exc_info is None
    assert record.exc_text is None
    message = record.getMessage()
    assert f"{job.name}[T-conf]" in message
    assert "terminated (revoked)" in message
    assert reason in message
    assert "hunter2" not in caplog.text


def test_a_kill_hooks_lookup_on_a_store_down_past_the_ttl_ends_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The release thread that looked for the killed run's lease while the store was down
    gives up once the lease's ttl has passed: a WARNING line saying so, no traceback (an
    outage is expected there), no credentials."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = Celery(f"ce_hooks_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.exclusive_url = f"redis://:hunter2@127.0.0.1:{port}/0"

    @exclusive_task(app=app, key="job:{n}", name=f"{app.main}.job", shared=False, ttl=1)
    def job(n: int) -> None: ...

    request = type("Request", (), {"id": "T-down", "args": [1], "kwargs": {}})()
    try:
        with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
            thread = release_killed(job, request.id, request.args, request.kwargs, "terminated (revoked)")
            assert thread is not None
            thread.join(30)
            assert not thread.is_alive()
    finally:
        get_lock_service(app).close(release=False)
    records = _hook_records(caplog)
    assert records, "nothing logged"
    assert all(record.exc_info is None for record in records), caplog.text
    assert "it expires with its ttl" in records[-1].getMessage()
    assert "hunter2" not in caplog.text
