"""``on_locked="rerun"``: a request coalesced behind a lease whose release was not confirmed.

The run has finished and handed on (nothing recorded yet), but the store refused its
release, so its lease stays until the heartbeat's background release gets through or its
ttl. A request arriving meanwhile finds that lease (a rerun-policy holder), records a rerun
and is coalesced behind it; the finished run must still send that rerun once the lease is
gone. A prefork worker (two processes) whose lock store is the suite's private Redis as an
ACL user of its own; the test takes ``HDEL`` and ``DEL`` away from it on lock keys (the
release script's, ``RELEASE_COMMANDS``; acquire, refresh, peek and the markers' own release
keep working), and gives them back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from celery_exclusive import is_skipped
from celery_exclusive.policies import COALESCED, MARKER_FIELD
from tests.faults.conftest import SLACK, AclWorker, refuse_redis_releases, shared_worker, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The ttl of ``rerun_hand_on``'s lease, in seconds (tests/faults/_celery_app.py).
TTL = 3.0


@dataclass
class Worker(AclWorker):
    """The worker (:class:`AclWorker`); the tasks record their runs in ``admin``'s db."""

    def refuse_releases(self) -> None:
        """The store refuses the release of every lock from now on, but a rerun marker's."""
        refuse_redis_releases(self.admin, self.user, except_keys="*#rerun")

    def runs(self, tag: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.admin.lrange(f"{tag}:runs", 0, -1)]

    def send(self, *args: Any) -> Any:
        return self.app.rerun_hand_on.apply_async(args, queue=self.queue)

    def coalesced_behind_a_stale_lease(self, tag: str) -> dict[str, Any]:
        """Run 1 of ``tag`` finishes while the store refuses its release (it hands on with
        nothing recorded); run 2, sent then, is coalesced behind its lease, still in the
        store. Run 1's record of its run."""
        first = self.send(tag, 1, True)
        raw = self.admin.blpop([f"{tag}:ready"], timeout=60)
        assert raw is not None, self.text()[-4000:]
        self.refuse_releases()
        self.admin.rpush(f"{tag}:go", 1)
        assert first.get(timeout=30) == 1
        held = self.store.peek(f"rerun:{tag}")
        assert held is not None, "run 1's release was refused: its lease is still in the store"
        second = self.send(tag, 2).get(timeout=30)
        assert is_skipped(second), second
        assert second[MARKER_FIELD] == COALESCED, second
        assert second["holder"]["fence"] == held.fence, "coalesced behind run 1's lease"
        (run,) = self.runs(tag)
        return run


worker = shared_worker(Worker)


def _ran_once_after(worker: Worker, tag: str, first: dict[str, Any], within: float) -> None:
    """Run 2 (the rerun) runs within ``within`` seconds, after run 1, once."""
    assert wait_until(lambda: len(worker.runs(tag)) > 1, within), worker.text()[-6000:]
    worker.settled(tag)  # a second rerun has run by now, if any was sent
    runs = worker.runs(tag)
    assert [run["n"] for run in runs] == [1, 2], runs
    assert runs[1]["fence"] > first["fence"]
    assert runs[1]["start"] >= first["end"]


def test_a_request_coalesced_behind_a_stale_lease_runs_once_the_release_gets_through(worker: Worker) -> None:
    """The store answers again right after run 2 was coalesced: the finished run's
    background release gets through, and it hands on once more, sending run 2's rerun,
    which runs once (it used to wait for some later run of the key: lost until then)."""
    tag = uuid.uuid4().hex[:8]
    try:
        first = worker.coalesced_behind_a_stale_lease(tag)
    finally:
        worker.answer()
    _ran_once_after(worker, tag, first, 2 * TTL + 4 * SLACK)


def test_a_request_coalesced_behind_a_stale_lease_runs_once_that_lease_has_expired(worker: Worker) -> None:
    """The store refuses run 1's release all along: the heartbeat's retry finds its lease
    gone once the store expired it (its ttl), and the finished run hands on once more then:
    run 2's rerun runs once, while releases are still refused (it used to be lost)."""
    tag = uuid.uuid4().hex[:8]
    try:
        first = worker.coalesced_behind_a_stale_lease(tag)
        _ran_once_after(worker, tag, first, 2 * TTL + 4 * SLACK)
    finally:
        worker.answer()
