"""Task ids no completion record can hold, on a real worker and real lock stores.

Celery takes any str as a task id (``apply_async(task_id=...)``), a lone surrogate too (its
JSON messages escape it). No store can hold such an id (PostgreSQL's text, Redis's and
MariaDB's UTF-8 refuse it), so ``lock(task_id=)`` and the other record calls refuse it
with InvalidArgumentError before the store is asked, and a worker run of such an id runs
without a record, as one of an id longer than 200 characters does (docs/celery.md).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import task_postrun

from celery_exclusive import InvalidArgumentError
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import close_lock_services, get_lock_service
from tests.celery.conftest import SESSION, delete_redis_prefix, embedded_app, embedded_worker, wait_for
from tests.conftest import POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option

PREFIX = f"ceids{SESSION}:"
TABLE = f"ce_ids_{SESSION}"

#: Ids no record can hold: a lone surrogate (alone, and inside a uuid), and 201 characters.
UNRECORDABLE = {
    "lone surrogate": "\ud800",
    "surrogate in a uuid": f"{uuid.uuid4()}\udfff",
    "201 characters": "x" * 201,
}


@pytest.fixture(scope="module", params=["redis", "postgres"])
def worker_app(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, list[tuple[str, str]]]]:
    """A real (embedded) worker whose exclusive task locks on the store named by the
    parameter; yields the app, the task and its runs' (task id, state)."""
    if request.param == "redis":
        require_server(REDIS_URL)
        url = REDIS_URL
    else:
        require_server(POSTGRES_URL)
        url = with_option(POSTGRES_URL, "table", TABLE)
    app = embedded_app(f"ce-ids-{request.param}", f"ce-ids-{request.param}-{SESSION}")
    # Celery's result backends cannot key such an id (they encode it as UTF-8): no results.
    app.conf.update(exclusive_url=url, exclusive_prefix=PREFIX, task_ignore_result=True)
    ended: list[tuple[str, str]] = []
    mutex = threading.Lock()

    @exclusive_task(app=app, key="ids:{n}", name=f"ids.job.{request.param}")
    def job(n: str) -> str:
        return n

    def postrun(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == job.name:
            with mutex:
                ended.append((task_id, state))

    task_postrun.connect(postrun, weak=False)
    try:
        for worker in embedded_worker(app, concurrency=2):
            yield app, job, ended
            del worker
    finally:
        task_postrun.disconnect(postrun)
        close_lock_services()
        if request.param == "redis":
            delete_redis_prefix(REDIS_URL, PREFIX)
        else:
            drop_lock_table(POSTGRES_URL, TABLE)


@pytest.mark.parametrize("task_id", list(UNRECORDABLE.values()), ids=list(UNRECORDABLE))
def test_a_run_of_an_id_no_record_can_hold_runs_without_a_record(
    worker_app: tuple[Any, Any, list[tuple[str, str]]], task_id: str
) -> None:
    """The run succeeds, holding its key, and leaves the key free and no record; a second
    message of the id runs again (nothing recorded it), while the record calls refuse the id
    with InvalidArgumentError before the store is asked."""
    app, job, ended = worker_app
    n = uuid.uuid4().hex[:8]
    for runs in (1, 2):
        job.apply_async((n,), task_id=task_id)
        wait_for(lambda runs=runs: len([e for e in ended if e[0] == task_id]) == runs, 30, what="the run")
    assert [state for each, state in ended if each == task_id] == ["SUCCESS", "SUCCESS"]
    service = get_lock_service(app)
    assert service.peek(f"ids:{n}") is None
    with pytest.raises(InvalidArgumentError, match="task_id"):
        service.completion(f"ids:{n}", task_id)
    with pytest.raises(InvalidArgumentError, match="task_id"):
        service.lock(f"ids:{n}", task_id=task_id)
    assert service.peek(f"ids:{n}") is None
