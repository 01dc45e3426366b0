"""``on_locked="wait"`` on real prefork workers, Redis broker, Redis and PostgreSQL stores.

The test process holds the tasks' keys through the workers' store and prefix
(``group.service``); a waiting run is a running task to Celery (its slot is blocked), so:

* a release by the holder hands the key to the waiting run, whose result is the real one;
* a wait that runs out takes ``lock_wait_fallback`` (skip marker, LockedError, lock retry);
* a warm shutdown (SIGTERM to the worker) waits for the waiting run like for any running
  task: it ends after at most about ``lock_wait``, with the fallback or, if the key came
  free meanwhile, the real run, and leaves nothing held;
* a SIGKILLed pool child held nothing while it waited; under ``acks_late`` +
  ``reject_on_worker_lost`` its message is requeued and runs once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_exclusive.errors import LockedError, LockRetriesExceeded
from celery_exclusive.task import is_skipped
from tests.celery import app as tasks
from tests.celery.conftest import (
    BROKER_URL,
    WorkerGroup,
    delete_redis_prefix,
    failed,
    module_groups,
    records,
    start_group,
    uid,
    wait_for,
)
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.celery, pytest.mark.timeout(120)]

STORES = ["redis", "postgres"]
RESULT_TIMEOUT = 30


@pytest.fixture(scope="module")
def groups(celery_logdir: Path) -> Iterator[dict[str, WorkerGroup]]:
    """One prefork worker of two processes per store, shared by the tests that do not stop it."""
    yield from module_groups(STORES, celery_logdir, workers=1, concurrency=2)


@pytest.fixture(params=STORES)
def group(request: pytest.FixtureRequest, groups: dict[str, WorkerGroup]) -> Iterator[WorkerGroup]:
    if request.param not in groups:
        pytest.skip(f"{request.param} is not reachable")
    yield groups[request.param]
    if failed(request):
        print(groups[request.param].dump())


@pytest.fixture(params=STORES)
def lone(
    request: pytest.FixtureRequest, celery_logdir: Path, groups: dict[str, WorkerGroup]
) -> Iterator[WorkerGroup]:
    """A worker of one prefork child of its own, for a test to shut down or kill."""
    if request.param not in groups:
        pytest.skip(f"{request.param} is not reachable")
    worker = start_group(request.param, celery_logdir, workers=1, concurrency=1)
    try:
        yield worker
        if failed(request):
            print(worker.dump())
    finally:
        worker.close()  # the module's groups drop the shared table at the end
        if worker.store == "redis":
            delete_redis_prefix(REDIS_URL, worker.prefix)


def runs(tag: str) -> list[dict[str, Any]]:
    return [event for event in records(tag) if event["kind"] == "run"]


def waiting(group: WorkerGroup, task_id: str) -> None:
    """Wait until the worker received ``task_id`` and passed it to its pool (it is now waiting)."""
    wait_for(
        lambda: any(f"[{task_id}] received" in w.text() for w in group.workers),
        RESULT_TIMEOUT,
        what=f"task {task_id} to be received",
    )
    time.sleep(0.5)  # into the wait: the first acquire was refused


def pool_child(group: WorkerGroup) -> int:
    """The pid of the lone worker's single pool child."""
    main = group.workers[0].popen.pid

    def child() -> int | None:
        with open(f"/proc/{main}/task/{main}/children") as listed:
            pids = [int(pid) for pid in listed.read().split()]
        return pids[0] if len(pids) == 1 else None

    pid = wait_for(child, 10, what="the pool child")
    assert isinstance(pid, int)
    return pid


def queued(group: WorkerGroup) -> int:
    """Messages in the group's broker queue plus its delivered, unacknowledged ones (kombu
    keeps those of every queue in one hash, the routing key beside each)."""
    client = redis.Redis.from_url(BROKER_URL)
    try:
        prefix = os.environ["CE_CELERY_KEYPREFIX"]
        unacked = [json.loads(raw) for raw in client.hvals(prefix + "unacked")]  # [message, exchange, queue]
        mine = [entry for entry in unacked if entry[2] == group.queue]
        return int(client.llen(prefix + group.queue)) + len(mine)
    finally:
        client.close()


def test_a_waiting_run_gets_the_key_when_the_test_releases_it(group: WorkerGroup) -> None:
    tag = uid()
    lease = group.service.lock(f"wait:{tag}")
    result = group.send(tasks.wait_skip, tag, tag)
    waiting(group, result.id)
    assert not result.ready()
    released = time.monotonic()
    lease.release()
    value = result.get(timeout=RESULT_TIMEOUT)
    elapsed = time.monotonic() - released
    assert not is_skipped(value)
    assert value["ran"]
    assert value["fence"] > lease.fence
    assert elapsed < 2.5, f"the waiter took {elapsed:.2f} s after the release (lock_wait 3 s)"
    assert len(runs(tag)) == 1


def test_a_waiting_run_gets_the_key_when_another_workers_task_ends(group: WorkerGroup) -> None:
    """The holder is a run of the same key in the worker's other child; the waiter runs after it."""
    tag = uid()
    first = group.send(tasks.wait_skip, tag, tag, 1.0)
    wait_for(lambda: records(tag), RESULT_TIMEOUT, what="the first run to start")
    second = group.send(tasks.wait_skip, tag, tag)
    a, b = first.get(timeout=RESULT_TIMEOUT), second.get(timeout=RESULT_TIMEOUT)
    assert not is_skipped(a)
    assert not is_skipped(b)
    one, two = sorted(runs(tag), key=lambda run: run["start"])
    assert one["end"] <= two["start"]
    assert one["fence"] < two["fence"]
    assert two["start"] - one["end"] < 2.0


def test_the_wait_runs_out_into_skip(group: WorkerGroup) -> None:
    tag = uid()
    with group.service.lock(f"wait:{tag}", holder={"task_id": "external"}):
        started = time.monotonic()
        value = group.send(tasks.wait_skip, tag, tag).get(timeout=RESULT_TIMEOUT)
        elapsed = time.monotonic() - started
    assert is_skipped(value)
    assert value["key"] == f"wait:{tag}"
    assert value["holder"]["task_id"] == "external"
    assert elapsed >= 3.0, "skipped before lock_wait ran out"
    assert runs(tag) == []


def test_the_wait_runs_out_into_raise(group: WorkerGroup) -> None:
    tag = uid()
    with group.service.lock(f"wait:{tag}"):
        result = group.send(tasks.wait_raise, tag, tag)
        with pytest.raises(LockedError) as raised:
            result.get(timeout=RESULT_TIMEOUT)
        assert raised.value.key == f"wait:{tag}"
        assert result.state == "FAILURE"
    assert runs(tag) == []


def test_the_wait_runs_out_into_retry(group: WorkerGroup) -> None:
    tag = uid()
    with group.service.lock(f"wait:{tag}"):
        result = group.send(tasks.wait_retry, tag, tag)
        with pytest.raises(LockRetriesExceeded):
            result.get(timeout=RESULT_TIMEOUT)
        assert result.state == "FAILURE"
    assert runs(tag) == []


def test_warm_shutdown_mid_wait_ends_with_the_fallback_and_holds_nothing(lone: WorkerGroup) -> None:
    """SIGTERM while a run waits: the worker waits for it like any running task (about
    ``lock_wait``), the run skips, no lease of the worker is left, the message is acked."""
    tag = uid()
    lease = lone.service.lock(f"wait:{tag}")
    result = lone.send(tasks.wait_late, tag, tag)
    waiting(lone, result.id)
    assert queued(lone) == 1  # delivered, not acknowledged while it waits (acks_late)
    stopping = time.monotonic()
    lone.workers[0].terminate()
    lone.workers[0].popen.wait(20)
    took = time.monotonic() - stopping
    value = result.get(timeout=5)
    assert is_skipped(value)
    # the rest of the 4 s wait, then an idle worker's own shutdown (~2.5 s, more under load)
    assert took <= 4 + 5.0, f"warm shutdown took {took:.1f} s (lock_wait 4 s)"
    assert "still held after waiting 4.0 s" in lone.dump()
    held = lone.service.peek(f"wait:{tag}")
    assert held is not None
    assert held.token == lease.token
    lease.release()
    assert lone.service.peek(f"wait:{tag}") is None
    assert queued(lone) == 0, "the acks_late message was not acknowledged"
    assert runs(tag) == []


def test_warm_shutdown_mid_wait_runs_when_the_key_comes_free(lone: WorkerGroup) -> None:
    """SIGTERM while a run waits, then the holder releases: the run takes the key, runs its
    body to the real result, releases, and the shutdown completes holding nothing."""
    tag = uid()
    lease = lone.service.lock(f"wait:{tag}")
    result = lone.send(tasks.wait_late, tag, tag, 0.3)
    waiting(lone, result.id)
    lone.workers[0].terminate()
    time.sleep(0.5)
    assert lone.workers[0].popen.poll() is None, "the worker did not wait for its waiting run"
    lease.release()
    lone.workers[0].popen.wait(20)
    value = result.get(timeout=5)
    assert not is_skipped(value)
    assert value["ran"]
    assert lone.service.peek(f"wait:{tag}") is None
    assert queued(lone) == 0
    assert len(runs(tag)) == 1


def test_sigkill_of_the_pool_child_mid_wait_holds_nothing_and_redelivers(lone: WorkerGroup) -> None:
    """The waiting child is SIGKILLed: it held nothing (the key is still only ours); under
    ``acks_late`` + ``reject_on_worker_lost`` the message is requeued, waits again in the
    new child, gets the key when released, and the body runs once."""
    tag = uid()
    lease = lone.service.lock(f"wait:{tag}")
    result = lone.send(tasks.wait_late, tag, tag)
    waiting(lone, result.id)
    child = pool_child(lone)
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: "WorkerLostError" in lone.dump() or "Restoring" in lone.dump(), 10, what="the loss")
    held = lone.service.peek(f"wait:{tag}")
    assert held is not None
    assert held.token == lease.token
    wait_for(lambda: pool_child(lone) != child, 10, what="a new pool child")
    time.sleep(1.0)  # the requeued message reaches the new child and waits there
    assert not result.ready()
    lease.release()
    value = result.get(timeout=RESULT_TIMEOUT)
    assert not is_skipped(value)
    assert value["ran"]
    assert len(runs(tag)) == 1
    wait_for(lambda: lone.service.peek(f"wait:{tag}") is None, 5, what="the run's release")
