"""Redelivered messages, with real workers and real brokers: one body run and the real
result per task id (issue #10).

* Redis broker, ``visibility_timeout`` (1 s) shorter than the run (3 s): kombu itself
  restores the unacknowledged message while the original runs, for every ``on_locked``.
* RabbitMQ, ``acks_late`` + ``task_reject_on_worker_lost``: the child SIGKILLed after the
  body (record written) and before the ack; the child SIGKILLed mid-body (the work runs
  again exactly once, after the dead lease's ttl); one task id published twice, 50 times.
* ``self.retry()`` still runs every attempt under one id.

Bodies count their runs per task id in Redis (tests/celery/redelivery_app.py). Short mode
takes about 40 s; ``CE_LONG=1`` publishes more duplicates.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

from celery_exclusive import redelivery
from celery_exclusive._info import LockInfo
from celery_exclusive.task import exclusive_task
from tests.celery.conftest import (
    SESSION,
    Process,
    delete_redis_prefix,
    spawn,
    wait_for,
    wait_ready,
)
from tests.conftest import POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option

LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
RABBIT_URL = os.environ.get("CE_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
BACKEND = urlunsplit(urlsplit(REDIS_URL)._replace(path="/12"))
KEYPREFIX = f"cerd-{SESSION}:"
os.environ.update({"CE_RD_BACKEND": BACKEND, "CE_RD_KEYPREFIX": KEYPREFIX, "CE_RD_BROKER": BACKEND})

from tests.celery import redelivery_app as rd  # noqa: E402 - configured by the environment above

APP = "tests.celery.redelivery_app"


class Group:
    """One worker on one broker and queue, with its lock store."""

    def __init__(self, broker: str, queue: str, worker: Process) -> None:
        self.broker = broker
        self.queue = queue
        self.worker = worker
        self._connection: Any = None

    def send(self, task: Any, *args: Any, task_id: str | None = None, **kwargs: Any) -> Any:
        """Publish ``task(*args, **kwargs)`` to this group's broker and queue (one connection)."""
        if self._connection is None:
            self._connection = rd.app.connection_for_write(self.broker)
        return task.apply_async(args, kwargs, task_id=task_id, queue=self.queue, connection=self._connection)

    def close(self) -> None:
        """Stop the worker and close the publishing connection."""
        self.worker.stop(timeout=2)
        if self._connection is not None:
            self._connection.release()

    def log(self) -> str:
        return self.worker.text()


def _start(name: str, broker: str, lock_url: str, logdir: Path, *, pool: str, concurrency: int) -> Group:
    queue = f"cerd-{SESSION}-{name}-{uuid.uuid4().hex[:6]}"
    env = {
        "CE_RD_BROKER": broker,
        "CE_RD_BACKEND": BACKEND,
        "CE_RD_KEYPREFIX": KEYPREFIX,
        "CE_RD_QUEUE": queue,
        "CE_RD_VISIBILITY": "1",
        "CELERY_EXCLUSIVE_URL": lock_url,
        "CELERY_EXCLUSIVE_PREFIX": f"cerd{SESSION}{name}:",
    }
    args = ["worker", "-P", pool, "-c", str(concurrency), "-n", f"rd-{name}-{SESSION}@%h", "-Q", queue]
    args += ["-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    worker = spawn(f"rd-{name}", args, env, logdir, app=APP)
    try:
        wait_ready([worker])
    except BaseException:
        worker.stop()
        raise
    return Group(broker, queue, worker)


@pytest.fixture(scope="module")
def redis_vt(celery_logdir: Path) -> Iterator[Group]:
    """A worker on a Redis broker whose visibility_timeout (1 s) is shorter than the runs;
    locks in Redis."""
    require_server(REDIS_URL)
    group = _start("vt", BACKEND, REDIS_URL, celery_logdir, pool="threads", concurrency=12)
    yield group
    group.close()
    delete_redis_prefix(REDIS_URL, f"cerd{SESSION}vt:")
    delete_redis_prefix(BACKEND, KEYPREFIX)


@pytest.fixture(scope="module")
def rabbit(celery_logdir: Path) -> Iterator[Group]:
    """A prefork worker of 4 processes on RabbitMQ (acks_late, reject_on_worker_lost);
    locks in PostgreSQL (the libpq fast path)."""
    require_server(RABBIT_URL)
    require_server(POSTGRES_URL)
    require_server(REDIS_URL)
    table = f"ce_rd_{SESSION}"
    group = _start(
        "amqp",
        RABBIT_URL,
        with_option(POSTGRES_URL, "table", table),
        celery_logdir,
        pool="prefork",
        concurrency=4,
    )
    yield group
    group.close()
    with contextlib.suppress(Exception), rd.app.connection_for_write(RABBIT_URL) as conn:
        conn.default_channel.queue_delete(group.queue)
    drop_lock_table(POSTGRES_URL, table)
    delete_redis_prefix(BACKEND, KEYPREFIX)


@pytest.fixture
def dump(request: pytest.FixtureRequest) -> Iterator[list[Group]]:
    """Groups whose worker log is printed if the test fails."""
    groups: list[Group] = []
    yield groups
    if getattr(getattr(request.node, "rep_call", None), "failed", False):
        for group in groups:
            print(f"===== {group.worker.name} =====\n{group.log()[-30000:]}")


@pytest.mark.parametrize("failover", ["list", "semicolons"])
def test_a_deferred_copy_is_capped_by_a_failover_redis_brokers_visibility_timeout(failover: str) -> None:
    """A copy deferred behind a 60 s lease is re-published to Redis (a failover list of
    URLs, or one string of ``;``-separated URLs) with at most half the transport's
    ``visibility_timeout`` (4 s) as its countdown, else the worker holding it for its eta
    would see it restored as yet another copy; only a single Redis URL was capped."""
    require_server(REDIS_URL)
    prefix = f"{KEYPREFIX}defer-{uuid.uuid4().hex[:6]}:"
    app = Celery("defer", broker=[BACKEND, BACKEND] if failover == "list" else f"{BACKEND};{BACKEND}")
    app.conf.update(
        broker_transport_options={"visibility_timeout": 4, "global_keyprefix": prefix},
        task_default_queue="q",
    )

    @exclusive_task(app=app, key="k", shared=False, bind=True)
    def job(self: Any) -> None: ...

    held = LockInfo("k", "token", 1, 0.0, 60.0, 60.0, {"task_id": "tid"})
    client = redis.Redis.from_url(BACKEND)
    job.push_request(id="tid", headers={}, retries=0, delivery_info={"routing_key": "q"})
    try:
        sent = datetime.now(UTC)
        assert redelivery._defer(job, held, (), {}) == 2.0
        (raw,) = client.lrange(prefix + "q", 0, -1)
        eta = datetime.fromisoformat(json.loads(raw)["headers"]["eta"])
        assert eta - sent < timedelta(seconds=3)
    finally:
        job.pop_request()
        client.delete(prefix + "q")
        client.close()


def _lines(group: Group, reason: str, task_id: str) -> int:
    return len(re.findall(rf"{reason}: \S+\[{re.escape(task_id)}\]", group.log()))


def test_visibility_timeout_copies_never_run_again_under_any_policy(
    redis_vt: Group, dump: list[Group]
) -> None:
    """kombu restores each 3 s run's message after 1 s; for every policy the copy ends
    without a trace: one body run per id, and the stored result is the body's own."""
    dump.append(redis_vt)
    _copies_end_without_a_trace(redis_vt, rd.ONCE)


def test_visibility_timeout_copies_with_wait_slots_and_dedupe(redis_vt: Group, dump: list[Group]) -> None:
    """The same under on_locked="wait", a limit=2 semaphore (a free slot must not take the
    copy), both together, and dedupe markers (until_done, until_start): one body run per
    id, the real result, the copy redelivered and then already_done."""
    dump.append(redis_vt)
    conf = rd.app.conf
    conf.update(exclusive_url=REDIS_URL, exclusive_prefix=f"cerd{SESSION}vt:")  # the markers' store
    _copies_end_without_a_trace(redis_vt, rd.VARIANTS)


def _copies_end_without_a_trace(redis_vt: Group, tasks: dict[str, Any]) -> None:
    sent = {
        name: redis_vt.send(task, f"vt-{name}-{uuid.uuid4().hex[:6]}", 3.0) for name, task in tasks.items()
    }
    for name, result in sent.items():
        assert result.get(timeout=30)["real"] is True, name
    for name, result in sent.items():
        assert _lines(redis_vt, "redelivered", result.id) >= 1, f"{name}: no copy was redelivered"
    time.sleep(1.5)  # the deferred copies come back and find the record
    for name, result in sent.items():
        assert rd.runs(result.id) == 1, name
        assert result.get(timeout=5)["real"] is True, name
        assert _lines(redis_vt, "already_done", result.id) >= 1, f"{name}: no copy found the record"


def test_retry_still_runs_every_attempt_under_one_id(redis_vt: Group, dump: list[Group]) -> None:
    """max_retries=3: four attempts (retries 0..3) of one task id each run their body once."""
    dump.append(redis_vt)
    result = redis_vt.send(rd.retrying, f"retry-{uuid.uuid4().hex[:6]}")
    assert result.get(timeout=30)["real"] is True
    attempts = [e["retries"] for e in rd.events() if e["task_id"] == result.id]
    assert attempts == [0, 1, 2, 3]
    assert rd.runs(result.id) == 4


def test_child_killed_after_the_body_does_not_run_it_again(rabbit: Group, dump: list[Group]) -> None:
    """SIGKILL after the release wrote the record and before the ack: RabbitMQ redelivers
    (reject_on_worker_lost) and the copy ends as already_done, without a second body run."""
    dump.append(rabbit)
    result = rabbit.send(rd.ONCE["skip"], f"after-{uuid.uuid4().hex[:6]}", 0.1, "after")
    wait_for(lambda: _lines(rabbit, "already_done", result.id), 30, what="the redelivered copy")
    assert "WorkerLostError" in rabbit.log() or "exited prematurely" in rabbit.log()
    time.sleep(1.0)
    assert rd.runs(result.id) == 1


def test_child_killed_mid_body_runs_again_once_after_the_ttl(rabbit: Group, dump: list[Group]) -> None:
    """SIGKILL mid-body: the redelivered copy finds the dead run's lease and defers itself;
    once the lease expired it runs the work, exactly once, and its result is stored."""
    dump.append(rabbit)
    result = rabbit.send(rd.once_long, f"mid-{uuid.uuid4().hex[:6]}", 0.1, "mid")
    assert result.get(timeout=60)["real"] is True
    runs = [e for e in rd.events() if e["task_id"] == result.id]
    assert len(runs) == 2
    assert runs[1]["at"] - runs[0]["at"] >= rd.LONG_TTL * 0.9, (
        "the work ran again before the dead lease expired"
    )
    assert _lines(rabbit, "redelivered", result.id) >= 1
    time.sleep(2)
    assert rd.runs(result.id) == 2


def test_same_task_id_published_twice_runs_once(rabbit: Group, dump: list[Group]) -> None:
    """Each of 50 task ids (200 with CE_LONG=1) published twice: 50 body runs, 50 real
    results, and every second copy accounted for by an already_done line."""
    dump.append(rabbit)
    count = 200 if LONG else 50
    ids = [uuid.uuid4().hex for _ in range(count)]
    results = []
    for index, task_id in enumerate(ids):
        for _ in range(2):
            sent = rabbit.send(rd.ONCE["skip"], f"dup-{index}-{task_id[:6]}", 0.05, task_id=task_id)
        results.append(sent)
    for result in results:
        assert result.get(timeout=120)["real"] is True
    wait_for(
        lambda: all(_lines(rabbit, "already_done", task_id) for task_id in ids),
        30,
        interval=0.5,
        what="every duplicate to end as already_done",
    )
    assert [rd.runs(task_id) for task_id in ids] == [1] * count
    assert all(result.get(timeout=5)["real"] is True for result in results)


@pytest.mark.parametrize("attempt", [0, 2])
def test_a_copy_after_a_hard_time_limit_does_not_run(rabbit: Group, dump: list[Group], attempt: int) -> None:
    """A run killed at its hard time limit is a final FAILURE (the message is acknowledged,
    task_acks_on_failure_or_timeout): a copy of its id published afterwards finds the record
    the worker's main process wrote with the kill release, and neither runs the body again
    nor replaces the stored failure with a result. The record names the killed run's
    attempt (``retries``), which a copy of a later attempt (a retry) would pass."""
    from billiard.exceptions import TimeLimitExceeded

    dump.append(rabbit)
    key_id = f"hard-{uuid.uuid4().hex[:6]}"
    rabbit.send(rd.ONCE["skip"], "warm", 0.0).get(timeout=30)  # the connection, for the option below
    options = {"queue": rabbit.queue, "connection": rabbit._connection, "retries": attempt}
    result = rd.ONCE["skip"].apply_async((key_id, 6.0), time_limit=1, **options)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30, propagate=True)
    rabbit.send(rd.ONCE["skip"], key_id, 0.0, task_id=result.id)
    rd.ONCE["skip"].apply_async((key_id, 0.0), task_id=result.id, **options)
    wait_for(
        lambda: _lines(rabbit, "already_done", result.id) >= 2 or rd.runs(result.id) > 1,
        30,
        what="the copies to end or to run",
    )
    time.sleep(0.5)
    assert rd.runs(result.id) == 1
    assert result.state == "FAILURE"


def test_a_retry_sent_before_a_hard_time_limit_still_runs(rabbit: Group, dump: list[Group]) -> None:
    """``self.retry(throw=False)``, then the hard time limit: the main process records the
    killed attempt as failed, and the retry it had sent (the next attempt of the same id)
    still runs, and its result replaces the failure. The killed attempt's record used to
    end the retry as already_done."""
    dump.append(rabbit)
    key_id = f"hang-{uuid.uuid4().hex[:6]}"
    rabbit.send(rd.ONCE["skip"], "warm", 0.0).get(timeout=30)  # the connection, for the option below
    result = rd.retry_then_hang.apply_async(
        (key_id, 2.0), queue=rabbit.queue, connection=rabbit._connection, time_limit=1
    )
    wait_for(
        lambda: _lines(rabbit, "already_done", result.id) or rd.runs(result.id) > 1,
        30,
        what="the retry to end or to run",
    )
    assert rd.runs(result.id) == 2
    # runs() counts the retry's body at its start: its result is stored when it returns. A
    # fresh AsyncResult each look (one caches the first final state it reads: the failure).
    wait_for(
        lambda: result.app.AsyncResult(result.id).state == "SUCCESS",
        10,
        what="the retry's result to replace the killed attempt's failure",
    )
    assert result.app.AsyncResult(result.id).get(timeout=10)["real"] is True


def test_a_kill_recorded_after_its_retry_finished_does_not_rerun_the_retry(
    rabbit: Group, dump: list[Group]
) -> None:
    """``self.retry(countdown=0, throw=False)``, the retry runs and records its success,
    and only then the first attempt meets its hard time limit: the main process's record
    of the killed attempt 0 must not replace the retry's record of attempt 1, so a copy of
    the retry's message (attempt 1) ends as already_done. It used to run the body again."""
    dump.append(rabbit)
    key_id = f"late-{uuid.uuid4().hex[:6]}"
    rabbit.send(rd.ONCE["skip"], "warm", 0.0).get(timeout=30)  # the connection, for the option below
    result = rd.retry_then_hang.apply_async(
        (key_id, 0.0, True), queue=rabbit.queue, connection=rabbit._connection, time_limit=4
    )
    first = wait_for(
        lambda: next((e for e in rd.events() if e["task_id"] == result.id and e["retries"] == 0), None),
        30,
        what="the first attempt to start",
    )

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    # The main process records the kill before billiard signals the child.
    wait_for(lambda: gone(first["pid"]), 30, what="the first attempt's child to be killed")
    assert rd.client().get(f"{rd.KEYPREFIX}saw:{result.id}"), "the retry did not finish before the kill"
    assert rd.runs(result.id) == 2
    rd.retry_then_hang.apply_async(
        (key_id, 0.0, True), task_id=result.id, retries=1, queue=rabbit.queue, connection=rabbit._connection
    )
    wait_for(
        lambda: _lines(rabbit, "already_done", result.id) or rd.runs(result.id) > 2,
        30,
        what="the copy to end or to run",
    )
    assert rd.runs(result.id) == 2
