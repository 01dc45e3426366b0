"""``on_locked="rerun"``: the holder's hand-on survives a release that fails.

A request coalesced behind a run is sent by that run when it finishes (the hand-on); nobody
else will send it. These tests make the run's release fail in a prefork worker whose lock
store is the suite's private Redis behind a stall/resume proxy (the broker is the same
server, reached directly), and check that the rerun still runs exactly once, after the key
is free: a release interrupted by the soft time limit, a release that leaves the lease in
the store, and a store that answers neither the release nor the hand-on for a while.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_exclusive import LockLost, LockService, is_skipped
from tests.faults.conftest import AppWorker, app_worker, broker_client, wait_until
from tests.faults.servers import PrivateRedis, TcpProxy

pytestmark = pytest.mark.slow

#: The soft time limit of the run whose release it interrupts, in seconds.
SOFT_LIMIT = 6.0


@dataclass
class Worker(AppWorker):
    """One prefork worker (two processes) on the private Redis, its store through ``proxy``;
    ``events``: the broker's db, where the tasks record their runs."""

    proxy: TcpProxy
    events: redis.Redis

    def runs(self, tag: str) -> list[dict[str, Any]]:
        """The runs the task recorded under ``tag``, in order."""
        return [json.loads(raw) for raw in self.events.lrange(f"{tag}:runs", 0, -1)]

    def send(self, *args: Any, task: str = "rerun_hand_on", **options: Any) -> Any:
        return getattr(self.app, task).apply_async(args, queue=self.queue, **options)

    def hold_with_rerun_recorded(
        self, tag: str, *args: Any, task: str = "rerun_hand_on", **options: Any
    ) -> tuple[Any, dict[str, Any]]:
        """Run 1 of ``tag`` holding the key (``wait=True``, then ``args``: see the tasks), and
        run 2 coalesced behind it (its rerun recorded); run 1's result and what it said
        when it started."""
        first = self.send(tag, 1, True, *args, task=task, **options)
        raw = self.events.blpop([f"{tag}:ready"], timeout=60)
        assert raw is not None, self.text()[-4000:]
        assert is_skipped(self.send(tag, 2, task=task).get(timeout=30)), "run 2 was coalesced"
        return first, json.loads(raw[1])

    def go(self, tag: str) -> None:
        self.events.rpush(f"{tag}:go", 1)

    def wait_for_rerun(self, tag: str) -> list[dict[str, Any]]:
        """The runs of ``tag`` once the rerun (run 2) ran, and no second rerun sent for its
        key can start any more (:meth:`~tests.faults.conftest.AppWorker.settled`)."""
        assert wait_until(lambda: any(run["n"] == 2 for run in self.runs(tag)), 30), self.text()[-6000:]
        self.settled(tag)
        return self.runs(tag)


@pytest.fixture(scope="module")
def worker(redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The worker, its proxy and the test's app, stopped afterwards."""
    proxy = TcpProxy(redis_server.port)
    events = broker_client(redis_server)
    log = tmp_path_factory.mktemp("celery-rerun") / "worker.log"
    try:
        with app_worker(
            redis_server, f"redis://127.0.0.1:{proxy.port}/0", "rerun", log, concurrency=2
        ) as base:
            yield Worker(base.queue, base.log, base.app, base.store, proxy, events)
    finally:
        proxy.resume()
        proxy.close()
        events.close()


def _at(when: float) -> None:
    """Sleep until wall-clock ``when`` (the worker's clock: the same machine)."""
    time.sleep(max(0.0, when - time.time()))


def test_a_release_interrupted_by_the_soft_time_limit_still_hands_on_the_rerun(worker: Worker) -> None:
    """The run's body returns into a silent store, and its soft time limit strikes while
    the release waits: the run fails with SoftTimeLimitExceeded, as before, and the rerun
    recorded during it still runs, once (the hand-on used to be skipped: no rerun ever)."""
    from celery.exceptions import SoftTimeLimitExceeded

    tag = uuid.uuid4().hex[:8]
    first, started = worker.hold_with_rerun_recorded(tag, soft_time_limit=SOFT_LIMIT)
    # The release waits up to 2 s for the store; the soft limit falls in the middle of it.
    _at(started["start"] + SOFT_LIMIT - 1.0)
    worker.proxy.stall()
    worker.go(tag)
    _at(started["start"] + SOFT_LIMIT + 0.5)
    worker.proxy.resume()
    with pytest.raises(SoftTimeLimitExceeded):
        first.get(timeout=30)
    runs = worker.wait_for_rerun(tag)
    assert [run["n"] for run in runs] == [1, 2], runs  # the body had returned: the release was cut
    assert runs[1]["fence"] > runs[0]["fence"]
    assert runs[1]["start"] >= runs[0]["end"]


def test_a_rerun_does_not_coalesce_behind_the_lease_that_sent_it(worker: Worker) -> None:
    """The run's release does not reach the store (its lease stays until its ttl, 3 s): the
    rerun it hands on finds the key held by that very lease, and waits for it with lock
    retries instead of coalescing behind it (it used to, and that lease never hands on
    again: the rerun was lost). It runs once the lease has expired."""
    tag = uuid.uuid4().hex[:8]
    first, _ = worker.hold_with_rerun_recorded(tag, True)  # drop: its lease stays
    worker.go(tag)
    assert first.get(timeout=30) == 1
    runs = worker.wait_for_rerun(tag)
    assert [run["n"] for run in runs] == [1, 2], runs
    assert runs[1]["fence"] > runs[0]["fence"]
    assert runs[1]["start"] >= runs[0]["end"]
    assert f"lock 'rerun:{tag}' is held by" in worker.text(), "the rerun waited with lock retries"


def test_a_rerun_waits_out_its_senders_lease_past_lock_max_retries(worker: Worker) -> None:
    """The run's release does not reach the store and its lease (ttl 8 s) outlasts the
    rerun's lock retries (``lock_max_retries=2``, 0.1-0.5 s apart): waiting behind the very
    lease that sent it does not count against them, so the rerun runs once that lease has
    expired (it used to fail with LockRetriesExceeded after about a second: lost)."""
    from tests.faults._celery_app import LONG_LEASE

    tag = uuid.uuid4().hex[:8]
    first, _ = worker.hold_with_rerun_recorded(tag, True, task="rerun_long_lease")
    worker.go(tag)
    assert first.get(timeout=30) == 1
    assert wait_until(lambda: any(run["n"] == 2 for run in worker.runs(tag)), 30 + LONG_LEASE), worker.text()[
        -6000:
    ]
    runs = worker.runs(tag)
    assert [run["n"] for run in runs] == [1, 2], runs
    assert runs[1]["fence"] > runs[0]["fence"]
    assert runs[1]["start"] >= runs[0]["end"]
    assert "LockRetriesExceeded" not in worker.text()
    assert f"lock 'rerun:{tag}' is held by" in worker.text(), "the rerun waited for its sender's lease"


def test_a_hand_on_the_store_does_not_answer_is_retried_in_the_background(worker: Worker) -> None:
    """The store goes silent as the run ends, for longer than the release (2 s) and the
    hand-on's look at the recorded rerun (10 s) wait: the run still succeeds, and once the
    store answers again the rerun runs, once (it used to be lost with the failed look)."""
    tag = uuid.uuid4().hex[:8]
    first, _ = worker.hold_with_rerun_recorded(tag)
    worker.proxy.stall()
    worker.go(tag)
    time.sleep(14.0)
    worker.proxy.resume()
    assert first.get(timeout=30) == 1
    runs = worker.wait_for_rerun(tag)
    assert [run["n"] for run in runs] == [1, 2], runs
    assert runs[1]["fence"] > runs[0]["fence"]
    assert runs[1]["start"] >= runs[0]["end"]


def test_a_run_interrupted_by_the_loss_of_its_lease_hands_on_the_rerun(worker: Worker) -> None:
    """``lock_on_lost="terminate"``: the lease of a run with a rerun recorded is taken away;
    the run is interrupted and fails with LockLost, and still hands the rerun on, once."""
    tag = uuid.uuid4().hex[:8]
    first, started = worker.hold_with_rerun_recorded(tag, task="rerun_terminated")
    held = worker.store.peek(f"rerun:{tag}")
    assert held is not None
    assert held.fence == started["fence"]
    assert worker.store.force_release(f"rerun:{tag}", held.token)
    with pytest.raises(LockLost):
        first.get(timeout=30)
    runs = worker.wait_for_rerun(tag)
    assert [run["n"] for run in runs] == [2], runs  # run 1 was interrupted: it recorded no run
    assert runs[0]["fence"] > started["fence"]


def test_an_inline_rerun_waits_out_its_senders_lease(tmp_path: Path) -> None:
    """An eager run (no message to re-send) sent as the rerun of a lease that nothing
    refreshes any more (a marker of 2 s stands in for it) waits inline until that lease
    has expired, past ``lock_max_retries=1``, and runs (it used to fail with
    LockRetriesExceeded after one wait of at most 0.2 s)."""
    from celery import Celery

    from celery_exclusive.policies import HANDS_ON_RERUNS, RERUN_OF_HEADER
    from celery_exclusive.task import exclusive_task

    url = f"sqlite:///{tmp_path / 'locks.db'}"
    app = Celery("rerun_inline", broker="memory://", set_as_current=False)
    app.conf.exclusive_url = url
    app.conf.exclusive_prefix = "inline:"

    @exclusive_task(
        app=app,
        key="k",
        on_locked="rerun",
        lock_max_retries=1,
        lock_retry_backoff=0.1,
        lock_retry_backoff_max=0.2,
        shared=False,
    )
    def job() -> str:
        return "ran"

    with LockService(url, prefix="inline:") as service:
        assert service.mark("k", ttl=2.0, holder={HANDS_ON_RERUNS: True}) is not None
        sender = service.peek("k")
        assert sender is not None
        result = job.apply(headers={RERUN_OF_HEADER: sender.fence})
        assert result.get() == "ran"
        assert service.peek("k") is None
