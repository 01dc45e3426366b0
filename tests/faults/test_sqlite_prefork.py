"""SQLite under a real prefork worker: ``revoke(terminate=True)`` kills a pool child while its
lease is held; the main process's kill hook releases that lease from a thread, and the pool
forks a replacement child meanwhile. Every later task must still run (before the at-fork
gate in ``providers/_sqlite.py``, a child forked while the hook was mid-call failed every task).

Short mode: 3 kills. ``CE_LONG=1``: 10 (the code before the gate failed at the 4th kill).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.celery.conftest import WorkerGroup, records, spawn, wait_for, wait_ready
from tests.faults.conftest import LONG

pytestmark = [pytest.mark.slow, pytest.mark.celery, pytest.mark.timeout(300)]

KILLS = 10 if LONG else 3
RESULT_TIMEOUT = 60


@pytest.fixture
def sqlite_group(tmp_path: Path) -> Iterator[WorkerGroup]:
    """One prefork worker of two processes on a SQLite lock store in a temp file."""
    from tests.celery.app import BROKER
    from tests.conftest import require_server

    require_server(BROKER)
    tag = uuid.uuid4().hex[:8]
    group = WorkerGroup(
        store="sqlite",
        url=f"sqlite:///{tmp_path / 'locks.sqlite3'}",
        prefix=f"cesqlite{tag}:",
        queue=f"cetest-sqlite-{tag}",
        logdir=tmp_path,
        env={},
    )
    group.env = {
        "CELERY_EXCLUSIVE_URL": group.url,
        "CELERY_EXCLUSIVE_PREFIX": group.prefix,
        "CE_CELERY_QUEUE": group.queue,
    }
    args = ["worker", "-P", "prefork", "-c", "2", "-n", f"sqlite-{tag}@%h", "-Q", group.queue, "-l", "INFO"]
    args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    group.workers.append(spawn(f"sqlite-{tag}", args, group.env, tmp_path))
    try:
        wait_ready(group.workers)
        yield group
    finally:
        group.close()


def test_sqlite_tasks_keep_running_after_revoke_terminate(sqlite_group: WorkerGroup) -> None:
    """After each SIGKILL by ``revoke(terminate=True)`` the lease is released by the main
    process and the next tasks (on the replacement child too) run."""
    from tests.celery import app as tasks

    group = sqlite_group
    for kill in range(KILLS):
        tag = uuid.uuid4().hex[:8]
        held = group.send(tasks.hold_long_ttl, tag, tag, 30)
        wait_for(lambda tag=tag: records(tag), 30, what="the run to start")
        held.revoke(terminate=True, signal="SIGKILL")
        wait_for(
            lambda tag=tag: group.service.peek(f"hold:{tag}") is None, 30, what="the lock to be released"
        )
        # Four quick tasks on two processes: the replacement child runs some of them.
        after = [group.send(tasks.work_skip, f"{tag}-{i}", tag) for i in range(4)]
        outcomes = []
        for result in after:
            try:
                outcomes.append(result.get(timeout=RESULT_TIMEOUT))
            except Exception as exc:
                outcomes.append(repr(exc))
        assert all(isinstance(o, dict) and o.get("ran") for o in outcomes), (
            f"kill {kill + 1}: tasks after the kill did not run: {outcomes}\n{group.dump()}"
        )
