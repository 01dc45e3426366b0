"""Tasks holding several keys (issue #13), with real prefork workers on Redis and PostgreSQL.

A key list (``key=["multi:{a}", "multi:{b}"]``) or a key callable returning several keys:
the run holds every key or none (``lock_many``), the policy sees the first refused key,
the loss of any key is a loss, and the first key in canonical order carries the
completion record. Bodies record each key's fence (tests/celery/app.py ``_multi_body``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from celery_exclusive import InvalidArgumentError, LockedError, LockLost
from celery_exclusive.task import is_skipped
from tests.celery import app as tasks
from tests.celery import test_integration as integration
from tests.celery.conftest import WorkerGroup, records, uid, wait_for

# The integration module's group fixture: a module-scoped group of workers per store (this
# module gets its own), their logs printed when a test fails.
group = integration.group
runs = integration.runs

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180), pytest.mark.usefixtures("logs_on_failure")]

RESULT_TIMEOUT = 60


def assert_no_overlap_per_key(recorded: list[dict[str, Any]]) -> set[str]:
    """Runs holding one key never overlap, and that key's fence grows; the keys seen."""
    keys = {key for run in recorded for key in run["fences"]}
    for key in keys:
        holding = sorted((run for run in recorded if key in run["fences"]), key=lambda run: run["start"])
        for before, after in itertools.pairwise(holding):
            assert before["end"] <= after["start"], f"runs overlapped on {key}: {before} and {after}"
            assert before["fences"][key] < after["fences"][key], f"fence of {key} did not grow"
    return keys


def test_overlapping_key_sets_never_run_at_once_on_the_shared_key(group: WorkerGroup) -> None:
    """Tasks asking for {x,y}, {y,z}, {z,x} in either order (2x2 processes, lock retries):
    all run, and no two runs sharing a key ever overlap."""
    tag = uid()
    x, y, z = (f"{tag}-{n}" for n in "xyz")
    pairs = [(x, y), (z, y), (z, x), (y, x), (y, z), (x, z)] * 2
    results = [group.send(tasks.multi_retry, a, b, tag, 0.2) for a, b in pairs]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    assert all(value["ran"] for value in values)
    recorded = runs(tag)
    assert len(recorded) == len(pairs)
    assert assert_no_overlap_per_key(recorded) == {f"multi:{k}" for k in (x, y, z)}
    for value in values:
        assert value["keys"] == sorted(value["keys"]), "leases are taken in canonical order"
    assert group.service.locks("multi:" + tag) == [], "every key was released"


def test_disjoint_key_sets_run_concurrently(group: WorkerGroup) -> None:
    """Two tasks whose key sets share nothing run at the same time."""
    tag = uid()
    first = group.send(tasks.multi_skip, f"{tag}-a", f"{tag}-b", tag, 1.5)
    second = group.send(tasks.multi_skip, f"{tag}-c", f"{tag}-d", tag, 1.5)
    assert not is_skipped(first.get(timeout=RESULT_TIMEOUT))
    assert not is_skipped(second.get(timeout=RESULT_TIMEOUT))
    one, two = sorted(runs(tag), key=lambda run: run["start"])
    assert two["start"] < one["end"], "runs of disjoint key sets should have overlapped"


def test_refused_run_skips_naming_the_refused_key_and_holds_nothing(group: WorkerGroup) -> None:
    """One key of the set held elsewhere: the run skips with a marker naming that key and its
    holder, and the other key is not left held (rolled back)."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    with group.service.lock(f"multi:{b}", holder={"task_id": "external-holder"}):
        value = group.send(tasks.multi_skip, a, b, tag).get(timeout=RESULT_TIMEOUT)
        assert group.service.peek(f"multi:{a}") is None
    assert is_skipped(value)
    assert value["key"] == f"multi:{b}"
    assert value["holder"]["task_id"] == "external-holder"
    assert runs(tag) == []


def test_refused_run_raises_locked_error_naming_the_refused_key(group: WorkerGroup) -> None:
    """on_locked="raise": LockedError names the refused key (the first in canonical order
    that was held) and its holder, through the result backend."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    with group.service.lock(f"multi:{a}", holder={"task_id": "external-holder"}):
        result = group.send(tasks.multi_raise, b, a, tag)
        with pytest.raises(LockedError) as caught:
            result.get(timeout=RESULT_TIMEOUT)
    assert caught.value.key == f"multi:{a}"
    assert caught.value.holder is not None
    assert caught.value.holder.holder["task_id"] == "external-holder"
    assert group.service.peek(f"multi:{b}") is None


def test_refused_run_retries_until_every_key_is_free(group: WorkerGroup) -> None:
    """on_locked="retry": lock-retried while one key is held, then runs holding both."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    lease = group.service.lock(f"multi:{b}")
    result = group.send(tasks.multi_retry, a, b, tag)
    wait_for(lambda: _retried(group, f"multi:{b}"), 20, what="a lock retry")
    # Each retry takes the free key and gives it back when the held one refuses the run, so
    # one peek may land inside an attempt; kept between attempts, it would never be free.
    wait_for(
        lambda: group.service.peek(f"multi:{a}") is None, 5, what="the free key given back between retries"
    )
    lease.release()
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value["ran"]
    assert value["keys"] == [f"multi:{a}", f"multi:{b}"]
    assert value["fences"][f"multi:{b}"] > lease.fence


def _retried(workers: WorkerGroup, key: str) -> bool:
    return any(f"lock {key!r} is held" in worker.text() for worker in workers.workers)


def test_an_interrupted_release_still_releases_every_key(group: WorkerGroup) -> None:
    """SoftTimeLimitExceeded raised inside the release of one key of a finished run: the
    run fails with it, and the other key is released too (it used to stay held, kept alive
    by the heartbeat until its max lifetime, 24 h by default); the heartbeat finishes the
    interrupted release."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    result = group.send(tasks.multi_release_interrupted, a, b, tag)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=RESULT_TIMEOUT)
    assert len(runs(tag)) == 1
    wait_for(lambda: group.service.locks("multi:" + tag) == [], 5, what="every key to be released")


@pytest.mark.parametrize("task", ["multi_lost_raise", "multi_lost_terminate"])
def test_losing_one_key_follows_lock_on_lost(group: WorkerGroup, task: str) -> None:
    """The second key of a running two-key task is taken away: its heartbeat finds it gone,
    and the run fails with LockLost naming that key ("raise" at the end, "terminate" at once)."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    duration = 8.0
    result = group.send(getattr(tasks, task), a, b, tag, duration)
    wait_for(lambda: [e for e in records(tag) if e["kind"] == "start"], 20, what="the run to start")
    taken = f"multi:{b}"
    info = group.service.peek(taken)
    assert info is not None
    started = time.monotonic()
    assert group.service.force_release(taken, info.token)
    with pytest.raises(LockLost) as caught:
        result.get(timeout=RESULT_TIMEOUT)
    assert caught.value.key == taken
    if task == "multi_lost_terminate":
        assert time.monotonic() - started < duration - 2, "terminate interrupts the body early"
        assert runs(tag) == []
    else:
        assert len(runs(tag)) == 1, "'raise' lets the body finish, then discards its result"
    assert group.service.locks("multi:" + tag) == [], "the other key was released too"


def test_callable_returning_several_keys(group: WorkerGroup) -> None:
    """A key callable returning three keys: the run holds all three; a run whose set
    overlaps it skips on the shared key; a disjoint one runs alongside."""
    tag = uid()
    ids = [f"{tag}-3", f"{tag}-1", f"{tag}-2"]
    first = group.send(tasks.multi_callable, ids, tag, 2.0)
    wait_for(lambda: [e for e in records(tag) if e["kind"] == "start"], 20, what="the run to start")
    held = {info.key for info in group.service.locks("multi:" + tag)}
    assert held == {f"multi:{i}" for i in ids}
    overlapping = group.send(tasks.multi_callable, [f"{tag}-9", f"{tag}-2"], tag).get(timeout=RESULT_TIMEOUT)
    disjoint = group.send(tasks.multi_callable, [f"{tag}-7", f"{tag}-8"], tag).get(timeout=RESULT_TIMEOUT)
    value = first.get(timeout=RESULT_TIMEOUT)
    assert value["keys"] == sorted(f"multi:{i}" for i in ids)
    assert is_skipped(overlapping)
    assert overlapping["key"] == f"multi:{tag}-2"
    assert disjoint["ran"]


@pytest.mark.parametrize(
    ("ids", "reason"),
    [([], "must not be empty"), (["x", "y", "x"], "repeated"), ([str(n) for n in range(65)], "at most 64")],
)
def test_bad_key_lists_fail_the_run_before_the_store_is_touched(
    group: WorkerGroup, ids: list[str], reason: str
) -> None:
    """A callable giving no key, a repeated key or more than 64 keys: the run fails with
    InvalidArgumentError naming the task, and nothing is taken on the store."""
    tag = uid()
    ids = [f"{tag}-{i}" for i in ids]
    result = group.send(tasks.multi_callable, ids, tag)
    with pytest.raises(InvalidArgumentError) as caught:
        result.get(timeout=RESULT_TIMEOUT)
    assert reason in str(caught.value)
    assert tasks.multi_callable.name in str(caught.value)
    assert group.service.locks("multi:" + tag) == []
    assert runs(tag) == []


def test_completion_record_is_on_the_first_key_and_a_second_delivery_does_not_run(
    group: WorkerGroup,
) -> None:
    """The run's release records its task id on its first key (canonical order) only; the same
    task id delivered again ends as already_done without running the body."""
    tag = uid()
    a, b = f"{tag}-a", f"{tag}-b"
    task_id = f"multi-{tag}"
    result = group.send(tasks.multi_skip, b, a, tag, _options={"task_id": task_id})
    assert result.get(timeout=RESULT_TIMEOUT)["ran"]
    assert group.service.completion(f"multi:{a}", task_id) is not None
    assert group.service.completion(f"multi:{b}", task_id) is None
    group.send(tasks.multi_skip, b, a, tag, _options={"task_id": task_id})
    wait_for(
        lambda: any(f"already_done: {tasks.multi_skip.name}[{task_id}]" in w.text() for w in group.workers),
        20,
        what="the second delivery to end as already_done",
    )
    assert len(runs(tag)) == 1
    assert group.service.locks("multi:" + tag) == []
