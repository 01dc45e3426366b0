"""A redelivered copy under ``task_track_started``: it must not replace the real result.

Celery's tracer stores STARTED for every message it is about to run, before the task is
called, so a copy of a finished run (a duplicate publish of its id, a broker's
redelivery) would overwrite the run's state with STARTED, and then end without a trace
(``Ignore``): ``AsyncResult.get()`` would wait forever. On Redis results Celery keeps a
SUCCESS (its key-value backends never overwrite one) but not a FAILURE; on the database
backend (SQLAlchemy, django-celery-results) not even a SUCCESS.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from tests.celery.conftest import BROKER_URL, Process, delete_redis_prefix, spawn, stop_all, wait_ready
from tests.conftest import REDIS_URL, require_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["redis", "database"])
def worker(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Process, str]]:
    """A prefork worker of tests/celery/started_app.py with results in Redis or an SQLite
    database (SQLAlchemy); yields it and its result backend's URL."""
    require_server(REDIS_URL)
    tag = uuid.uuid4().hex[:8]
    backend = BROKER_URL if request.param == "redis" else f"db+sqlite:///{tmp_path / 'results.db'}"
    env = {
        "CE_ST_BROKER": BROKER_URL,
        "CE_ST_BACKEND": backend,
        "CE_ST_KEYPREFIX": f"cest-{tag}:",
        "CE_ST_QUEUE": f"cest-{tag}",
        "CELERY_EXCLUSIVE_URL": REDIS_URL,
        "CELERY_EXCLUSIVE_PREFIX": f"cest-{tag}:",
    }
    # The sending side (this process) reads them too; restored after the test, or every
    # later app in this process would take CELERY_EXCLUSIVE_PREFIX and URL from them.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    process = spawn(
        f"started-{tag}",
        ["worker", "-P", "prefork", "-c", "1", "-l", "INFO", "--without-gossip", "--without-mingle"],
        env,
        tmp_path,
        app="tests.celery.started_app",
    )
    try:
        wait_ready([process])
        yield process, backend
    finally:
        stop_all([process])
        delete_redis_prefix(BROKER_URL, f"cest-{tag}:")
        delete_redis_prefix(REDIS_URL, f"cest-{tag}:")


def _sender(backend: str) -> Celery:
    """A fresh app of this test's broker and result backend (sends by name; a new app, so
    no connection pool or backend of an earlier test's configuration is reused)."""
    app = Celery("cest-sender", broker=os.environ["CE_ST_BROKER"], backend=backend, set_as_current=False)
    options = {"global_keyprefix": os.environ["CE_ST_KEYPREFIX"]}
    app.conf.update(
        task_default_queue=os.environ["CE_ST_QUEUE"],
        broker_transport_options=options,
        result_backend_transport_options=options,
    )
    return app


NAME = "tests.celery.started_app.tracked"


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_a_copy_of_a_finished_run_leaves_its_state_alone(worker: tuple[Process, str], fail: bool) -> None:
    """The run's SUCCESS or FAILURE, its result or exception, stay what they were after a
    copy of its message (the same id published again) ended as ``already_done``."""
    process, backend = worker
    app = _sender(backend)
    tag = uuid.uuid4().hex[:8]
    first = app.send_task(NAME, (tag, fail))
    state = "FAILURE" if fail else "SUCCESS"
    deadline = time.monotonic() + 60
    while first.state != state and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.state == state, process.text()[-3000:]
    app.send_task(NAME, (tag, fail), task_id=first.id)  # a copy: the same id published again
    done = f"already_done: {NAME}[{first.id}]"
    deadline = time.monotonic() + 60
    while done not in process.text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done in process.text(), process.text()[-3000:]
    time.sleep(0.5)  # anything the copy would store after its log line
    again = app.AsyncResult(first.id)
    assert again.state == state, process.text()[-3000:]
    if fail:
        assert isinstance(again.result, ValueError)
    else:
        assert again.result == f"ran {tag}"


def test_a_run_is_still_started_while_its_body_runs(worker: tuple[Process, str]) -> None:
    """The run stores STARTED itself once it holds its lease (the tracer no longer does):
    STARTED while the body runs, with the worker's pid and hostname, then SUCCESS."""
    process, backend = worker
    app = _sender(backend)
    result = app.send_task(NAME, (uuid.uuid4().hex[:8], False, 3.0))
    deadline = time.monotonic() + 60
    while result.state != "STARTED" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result.state == "STARTED", process.text()[-3000:]
    assert result.info["hostname"].startswith("celery@")
    assert result.get(timeout=60).startswith("ran ")
