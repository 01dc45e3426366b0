"""``on_locked="rerun"`` and ``self.retry()``: a request coalesced behind a run that ends
by retrying is not lost, and its rerun runs after the run's last attempt.

Run 1 holds the key; request 2 arrives meanwhile and is coalesced (its rerun recorded on
the marker). Run 1 then retries: its work is not done, so it does not hand the rerun on
yet; its retry (the same task id, a later attempt) does when it finishes. A prefork worker
whose store is the suite's private Redis as an ACL user of its own (see
:mod:`tests.faults.test_retry_lingering_lease`), so that the test can make the store refuse
the release before the retry.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from celery_exclusive import is_skipped
from tests.faults.conftest import SLACK, shared_worker, wait_until
from tests.faults.test_retry_lingering_lease import SETTLED, Worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


worker = shared_worker(Worker)


def coalesced(worker: Worker, task: str, tag: str) -> None:
    """Request 2 of ``task``, coalesced behind the key's holder (its rerun recorded)."""
    second = getattr(worker.app, task).apply_async((tag, 2), queue=worker.queue)
    marker = worker.result(second, 30)
    assert is_skipped(marker), marker
    assert marker["celery_exclusive"] == "coalesced", marker


def wait_for_rerun(worker: Worker, first: Any, tag: str, within: float) -> list[dict[str, Any]]:
    """The runs of ``tag`` once run 2 (the rerun) ran, and no further run of run 1 (``first``)
    or of a rerun sent for its key can start (:meth:`~tests.faults.conftest.AppWorker.settled`)."""
    ran = wait_until(lambda: any(run["n"] == 2 for run in worker.runs(tag)), within)
    assert ran, f"the rerun never ran: {worker.runs(tag)}\n{worker.text()[-6000:]}"
    worker.settled(tag)
    return worker.runs(tag)


def after_the_retry(runs: list[dict[str, Any]]) -> None:
    """Run 1's attempts 0 and 1, then the rerun (run 2, once), which starts after attempt 1 ended."""
    assert [(run["n"], run["attempt"]) for run in runs] == [(1, 0), (1, 1), (2, 0)], runs
    assert runs[2]["start"] >= runs[1]["end"], "the rerun ran before the retry finished"


@pytest.mark.parametrize(
    ("task", "countdown"),
    [("rerun_retrying", 0.0), ("rerun_retrying", 2.0), ("rerun_retrying_short", 4.0)],
    ids=["at-once", "countdown", "countdown-past-the-markers-ttl"],
)
def test_a_rerun_coalesced_behind_a_run_that_retries_runs_after_the_retry(
    worker: Worker, task: str, countdown: float
) -> None:
    """The retry hands the rerun on when it finishes, also when its countdown outlasts the
    marker's ttl (``max_lifetime``, 3 s: the rerun used to be lost with the marker)."""
    tag = uuid.uuid4().hex[:8]
    first = getattr(worker.app, task).apply_async((tag, 1, countdown), queue=worker.queue)
    assert worker.admin.blpop([f"{tag}:ready"], timeout=60) is not None, worker.text()[-4000:]
    coalesced(worker, task, tag)
    worker.admin.rpush(f"{tag}:go", 1)
    assert worker.result(first, countdown + 30) == 1
    after_the_retry(wait_for_rerun(worker, first, tag, 30))


def test_a_rerun_coalesced_behind_the_unreleased_lease_of_a_run_that_retried(worker: Worker) -> None:
    """Run 1's release before its retry is refused, so its lease stays a while; request 2,
    arriving then, is coalesced behind that lease. The store answers again once the retry
    has found that lease still there. The retry runs once the lease is gone and hands the
    rerun on."""
    tag = uuid.uuid4().hex[:8]
    first = worker.app.rerun_retrying.apply_async((tag, 1), queue=worker.queue)
    assert worker.admin.blpop([f"{tag}:ready"], timeout=60) is not None, worker.text()[-4000:]
    try:
        worker.refuse_releases()
        worker.admin.rpush(f"{tag}:go", 1)
        assert wait_until(lambda: worker.runs(tag), 10), worker.text()[-4000:]
        coalesced(worker, "rerun_retrying", tag)
        worker.held_at_first_look("rerun_retrying", first.id, f"rerun:{tag}")
    finally:
        worker.answer()
    answered = time.time()
    assert worker.result(first, SETTLED + 30) == 1
    runs = wait_for_rerun(worker, first, tag, SETTLED + 30)
    after_the_retry(runs)
    assert runs[1]["start"] >= answered - SLACK, "the retry ran while its attempt's lease was held"
    assert json.loads(worker.admin.lindex(f"{tag}:runs", 0))["fence"] != runs[1]["fence"]
