"""The worker's kill hooks across a store failure: the release of a killed run's lease (and
its completion record) is retried in the background until the store answers.

A prefork worker whose lock store is the suite's private Redis, logged into as an ACL user
of its own whose commands the test takes away (``-@all``) and gives back (``+@all``); the
broker is the same server as its default user. The runs hold 30 s leases: a lease the hook
did not release stays that long.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.faults.conftest import SLACK, AclWorker, acl_app_worker, wait_until
from tests.faults.servers import PrivateRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: How long the worker may take to report the store's refusals it will retry (a hang guard).
REPORTED = 30.0
#: How soon after the store answers again the killed run's lease must be gone: the
#: heartbeat retries a release each second (without the retry it stays its 30 s ttl).
SETTLED = 5.0 + 4 * SLACK


@dataclass
class Worker(AclWorker):
    """One prefork worker on the private Redis, its store as ACL user ``user`` (:class:`AclWorker`)."""

    def refuse(self) -> None:
        """The store refuses every command of the worker's user from now on."""
        self.admin.execute_command("ACL", "SETUSER", self.user, "-@all")

    def outlast(self, tag: str, fence: int, *refused: str) -> None:
        """With the store refusing the worker (``refuse()`` called), wait until its log shows
        each of ``refused`` (the failures it retries, ``{key}`` standing for the lock's key)
        and check the killed run's lease (``fence``) is still held; then let the store answer
        and check the lease is released within :data:`SETTLED`."""
        key = f"killed:{tag}"
        try:
            lines = [line.format(key=repr(key)) for line in refused]
            assert wait_until(lambda: all(line in self.text() for line in lines), REPORTED, interval=0.05), (
                f"the worker did not report all of {lines}:\n{self.text()[-4000:]}"
            )
            held = self.store.peek(key)
            assert held is not None, "the lease was released while the store refused the worker"
            assert held.fence == fence
        finally:
            self.answer()
        assert wait_until(lambda: self.store.peek(f"killed:{tag}") is None, SETTLED), self.text()[-4000:]

    def ready(self, tag: str) -> dict[str, Any]:
        raw = self.admin.blpop([f"{tag}:ready"], timeout=60)
        assert raw is not None, self.text()[-4000:]
        return dict(json.loads(raw[1]))


@pytest.fixture(scope="module")
def worker(redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The worker, its ACL user and the test's app; stopped and deleted afterwards."""
    with acl_app_worker(redis_server, "kill", tmp_path_factory.mktemp("celery-kill"), Worker) as worker:
        yield worker


def test_a_hard_time_limit_kill_the_store_refuses_is_released_with_its_record_later(worker: Worker) -> None:
    """The store refuses the worker as the run meets its hard time limit: the main process
    can neither write the run's record nor find its lease then. Once the store answers
    again, the lease is released and the record written within seconds (they used to be
    given up at once: the lease held the key for its 30 s ttl and no record was written,
    so a copy of the message would have run the body again)."""
    from billiard.exceptions import TimeLimitExceeded

    tag = uuid.uuid4().hex[:8]
    result = worker.app.hard_killed.apply_async((tag,), queue=worker.queue)
    fence = worker.ready(tag)["fence"]
    worker.refuse()
    try:
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=30)
    except BaseException:
        worker.answer()
        raise
    worker.outlast(
        tag, fence, "could not look for its lock {key}", "could not record it as failed on lock {key} yet"
    )
    record = worker.store.completion(f"killed:{tag}", result.id)
    assert record is not None, worker.text()[-4000:]
    assert record.outcome == "failure"


def test_a_terminated_runs_release_the_store_refuses_is_retried(worker: Worker) -> None:
    """``revoke(terminate=True)``: the main process finds the run's lease at once, and the
    store refuses the worker while the run's process takes 2 s to exit, so the release
    after its exit fails. Once the store answers again, the release is retried and gets
    through within seconds (it used to be given up: the key stayed held for the 30 s ttl)."""
    tag = uuid.uuid4().hex[:8]
    result = worker.app.slow_to_die.apply_async((tag,), queue=worker.queue)
    fence = worker.ready(tag)["fence"]
    worker.app.app.control.revoke(result.id, terminate=True)
    assert worker.admin.blpop([f"{tag}:dying"], timeout=30) is not None, worker.text()[-4000:]
    worker.refuse()
    # The release after the process's exit failed, and was retried (not the lookup).
    worker.outlast(tag, fence, f"could not release its lock {{key}} (fence {fence})")
