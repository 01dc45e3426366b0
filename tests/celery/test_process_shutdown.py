"""A prefork child that exits still holding a lease releases it (worker_process_shutdown).

Billiard children leave through ``os._exit``: no ``atexit`` handler runs, so without the
hook such a lease would stay until its ttl (60 s here).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.celery import app as tasks
from tests.celery.conftest import WorkerGroup, failed, module_group, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def recycling(celery_logdir: Path) -> Iterator[WorkerGroup]:
    """One prefork worker whose single child exits after every task (--max-tasks-per-child 1)."""
    yield from module_group(
        "redis", celery_logdir, workers=1, concurrency=1, extra=("--max-tasks-per-child", "1")
    )


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, recycling: WorkerGroup) -> Iterator[None]:
    """Print the worker's log when a test fails."""
    yield
    if failed(request):
        print(recycling.dump())


def test_child_exit_releases_leases_it_still_holds(recycling: WorkerGroup) -> None:
    """A lease left held by a task is released when its pool child exits, long before its 60 s ttl."""
    key = f"leaked:{uuid.uuid4().hex[:8]}"
    assert recycling.send(tasks.leak_lease, key, key).get(timeout=30) >= 1
    wait_for(lambda: recycling.service.peek(key) is None, 10, what="the leaked lease to be released")
