"""End to end: subprocess ``celery worker`` processes (prefork) on a real Redis broker.

Two workers of two processes each per lock store (PostgreSQL and Redis), shared by every
test of the module. Task bodies record their runs in Redis (see tests/celery/app.py). The
last tests combine exclusive tasks with the Celery features users pair them with:
``autoretry_for`` with ``retry_backoff`` and ``max_retries``, ``self.retry()`` past
``max_retries``, chains and chords whose tasks lock one key, and messages that expire or
are revoked before they run.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord
from celery.exceptions import (
    MaxRetriesExceededError,
    SoftTimeLimitExceeded,
    TaskRevokedError,
    TimeLimitExceeded,
)

from celery_exclusive import LockedError, LockLost
from celery_exclusive.task import is_skipped
from tests.celery import app as tasks
from tests.celery.conftest import (
    Process,
    WorkerGroup,
    assert_no_overlap,
    failed,
    module_group,
    records,
    spawn,
    stop_all,
    uid,
    wait_for,
)

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180), pytest.mark.usefixtures("logs_on_failure")]

RESULT_TIMEOUT = 60
#: How long the beat test waits for what it counts (beat's start-up, both beats' sends, the
#: job's runs) before it calls the job stalled: a hang guard only, nothing asserted of speed.
BEAT_HANG_GUARD = 60


@pytest.fixture(scope="module", params=["redis", "postgres"])
def group(request: pytest.FixtureRequest, celery_logdir: Path) -> Iterator[WorkerGroup]:
    """Two prefork workers of two processes on one lock store, for the whole module."""
    yield from module_group(request.param, celery_logdir)


def runs(tag: str) -> list[dict[str, Any]]:
    """The completed runs recorded under ``tag``."""
    return [event for event in records(tag) if event["kind"] == "run"]


def test_worker_ready_handler_uses_the_lock_service(group: WorkerGroup) -> None:
    """A worker_ready handler runs its start-up job through get_lock_service: never two at once."""
    attempts = wait_for(
        lambda: len(records(f"startup:{group.queue}")) == 2, 10, what="both workers' attempts"
    )
    assert attempts
    startup = records(f"startup:{group.queue}")
    assert len({event["pid"] for event in startup}) == 2
    done = [event for event in startup if event["ran"]]
    assert done, "one worker must have run the start-up job"
    assert_no_overlap(done)


def test_twenty_duplicates_skip_never_overlap(group: WorkerGroup) -> None:
    """Twenty tasks for one key at once across 2x2 processes: runs never overlap, the rest skip."""
    tag = uid()
    results = [group.send(tasks.work_skip, tag, tag, 0.3) for _ in range(20)]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    skipped = [value for value in values if is_skipped(value)]
    ran = [value for value in values if not is_skipped(value)]
    assert len(skipped) + len(ran) == 20
    assert ran, "at least one task must have run"
    assert skipped, "with 4 processes and 0.3 s runs some duplicates must have been skipped"
    assert all(value["key"] == f"work:{tag}" for value in skipped)
    recorded = runs(tag)
    assert len(recorded) == len(ran)
    assert_no_overlap(recorded)


def test_twenty_duplicates_retry_all_run_in_turn(group: WorkerGroup) -> None:
    """Twenty retry-policy tasks for one key: every one runs, one at a time, after lock retries."""
    tag = uid()
    results = [group.send(tasks.work_retry, tag, tag, 0.1) for _ in range(20)]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    assert all(value["ran"] for value in values)
    assert all(value["retries"] == 0 for value in values), "lock retries must not count as retries"
    assert sum(value["lock_retries"] for value in values) > 0
    recorded = runs(tag)
    assert len(recorded) == 20
    assert len({run["task_id"] for run in recorded}) == 20
    assert_no_overlap(recorded)


def test_different_keys_run_in_parallel(group: WorkerGroup) -> None:
    """Tasks with different keys run at the same time: their recorded intervals overlap."""
    tag = uid()
    first = group.send(tasks.work_skip, f"{tag}-a", tag, 1.5)
    second = group.send(tasks.work_skip, f"{tag}-b", tag, 1.5)
    assert not is_skipped(first.get(timeout=RESULT_TIMEOUT))
    assert not is_skipped(second.get(timeout=RESULT_TIMEOUT))
    a, b = sorted(runs(tag), key=lambda run: run["start"])
    assert b["start"] < a["end"], "runs of different keys should have overlapped"


def test_skip_end_to_end(group: WorkerGroup) -> None:
    """A task whose key is held succeeds with the skip marker naming key and holder, and logs it."""
    tag = uid()
    with group.service.lock(f"work:{tag}", holder={"task_id": "external-holder"}):
        value = group.send(tasks.work_skip, tag, tag).get(timeout=RESULT_TIMEOUT)
    assert is_skipped(value)
    assert value["celery_exclusive"] == "skipped"
    assert value["key"] == f"work:{tag}"
    assert value["holder"]["task_id"] == "external-holder"
    assert runs(tag) == []
    wait_for(
        lambda: any(f"skipped: lock 'work:{tag}' is held by" in w.text() for w in group.workers),
        5,
        what="the INFO skip line in a worker log",
    )


def test_retry_end_to_end_without_consuming_max_retries(group: WorkerGroup) -> None:
    """A max_retries=0 task lock-retries until the key is free, then runs with retries still 0."""
    tag = uid()
    lease = group.service.lock(f"retry:{tag}")
    result = group.send(tasks.work_retry, tag, tag)
    time.sleep(1.0)
    lease.release()
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value["ran"]
    assert value["lock_retries"] >= 1
    assert value["retries"] == 0


def test_raise_end_to_end(group: WorkerGroup) -> None:
    """The raise policy fails the task with a LockedError whose key and holder survive the backend."""
    tag = uid()
    with group.service.lock(f"raise:{tag}", holder={"task_id": "external-holder"}):
        result = group.send(tasks.work_raise, tag, tag)
        with pytest.raises(LockedError) as caught:
            result.get(timeout=RESULT_TIMEOUT)
    assert caught.value.key == f"raise:{tag}"
    assert caught.value.holder is not None
    assert caught.value.holder.holder["task_id"] == "external-holder"
    assert "external-holder" in str(caught.value)
    assert result.state == "FAILURE"


def test_rerun_ten_requests_become_one_rerun(group: WorkerGroup) -> None:
    """Ten requests arriving during a run are coalesced into exactly one rerun after it."""
    tag = uid()
    first = group.send(tasks.work_rerun, tag, tag, 2.0)
    wait_for(lambda: records(tag), 20, what="the first run to start")
    requests = [group.send(tasks.work_rerun, tag, f"{tag}-{i}", 0.1) for i in range(10)]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in requests]
    assert all(value["celery_exclusive"] == "coalesced" for value in values)
    assert first.get(timeout=RESULT_TIMEOUT)["ran"]
    rerun_tags = {f"{tag}-{i}" for i in range(10)}
    wait_for(lambda: any(runs(t) for t in rerun_tags), 20, what="the rerun")
    time.sleep(1.5)  # any second rerun would have started by now
    reruns = [run for t in rerun_tags for run in runs(t)]
    assert len(reruns) == 1
    assert len(runs(tag)) == 1
    assert reruns[0]["start"] >= runs(tag)[0]["end"]


def test_rerun_behind_a_run_that_retries_runs_after_the_retry(group: WorkerGroup) -> None:
    """A request coalesced behind a run that then retries (4 s later, past the recorded
    rerun's 3 s marker: ``max_lifetime``) is rerun once, after the retry's run (it used to
    be lost with the marker)."""
    tag = uid()
    first = group.send(tasks.rerun_retrying, tag, tag, 1.0)
    wait_for(lambda: records(tag), 20, what="the first run to start")
    second = group.send(tasks.rerun_retrying, tag, f"{tag}-2").get(timeout=RESULT_TIMEOUT)
    assert second["celery_exclusive"] == "coalesced"
    assert first.get(timeout=RESULT_TIMEOUT)["retries"] == 1
    wait_for(lambda: runs(f"{tag}-2"), 20, what="the rerun")
    time.sleep(1.5)  # any second rerun would have started by now
    (retried,), (rerun,) = runs(tag), runs(f"{tag}-2")
    assert rerun["start"] >= retried["end"]


def test_rerun_under_a_semaphore_is_handed_on_by_the_first_holder_to_finish(group: WorkerGroup) -> None:
    """``limit=2``: a request coalesced while both slots are held is rerun as soon as either
    holder finishes, here the one on slot 2 while slot 1's still runs (only slot 1's holder
    used to hand it on: the rerun waited for that run, however long)."""
    from tests.celery.app import KEYPREFIX, records_client

    key = uid()
    tags = {name: f"{key}-{name}" for name in "abc"}
    held = {}

    def go(name: str) -> None:
        records_client().rpush(f"{KEYPREFIX}{tags[name]}:go", 1)

    try:
        for name in "ab":
            held[name] = group.send(tasks.work_rerun_limit2, key, tags[name], True)
            wait_for(lambda name=name: records(tags[name]), 20, what=f"run {name} to hold a slot")
        assert {records(tags[name])[0]["slot"] for name in "ab"} == {1, 2}
        coalesced = group.send(tasks.work_rerun_limit2, key, tags["c"]).get(timeout=RESULT_TIMEOUT)
        assert coalesced["celery_exclusive"] == "coalesced"
        on_slot_2 = next(name for name in "ab" if records(tags[name])[0]["slot"] == 2)
        go(on_slot_2)
        assert held[on_slot_2].get(timeout=RESULT_TIMEOUT)["ran"]
        wait_for(lambda: runs(tags["c"]), 20, what="the rerun, while slot 1's run still holds")
        assert not runs(tags["a" if on_slot_2 == "b" else "b"]), "slot 1's run had not finished"
    finally:
        go("a")
        go("b")
    assert all(result.get(timeout=RESULT_TIMEOUT)["ran"] for result in held.values())
    time.sleep(1.5)  # a second rerun would have started by now
    assert len(runs(tags["c"])) == 1
    assert runs(tags["c"])[0]["start"] >= runs(tags[on_slot_2])[0]["end"]


def test_sigkilled_child_lock_is_taken_only_after_ttl(group: WorkerGroup) -> None:
    """A pool child SIGKILLed mid-task keeps its lock until the ttl expires; then another run takes it."""
    tag = uid()
    victim = group.send(tasks.hold_short_ttl, tag, tag, 60)
    start = wait_for(lambda: records(tag), 20, what="the victim to start")[0]
    peeked_at = time.time()
    before = group.service.peek(f"hold:{tag}")
    assert before is not None
    assert before.holder["task_id"] == victim.id
    os.kill(start["pid"], signal.SIGKILL)
    killed_at = time.time()
    successor = group.send(tasks.hold_short_ttl, tag, f"{tag}-next", 0)
    time.sleep(1.0)
    still = group.service.peek(f"hold:{tag}")
    assert still is not None
    assert still.token == before.token, "the dead child's lock was released before its ttl"
    assert successor.get(timeout=RESULT_TIMEOUT)["ran"]
    (taken,) = runs(f"{tag}-next")
    # The store's lease ran out no earlier than the expiry seen just before the kill.
    assert taken["start"] >= peeked_at + before.expires_in - 0.2
    # ... and no later than a full 3 s ttl after the kill (plus one lock-retry backoff).
    assert taken["start"] <= killed_at + 3.0 + 2.0


def test_heartbeat_keeps_a_long_run_alive_under_prefork(group: WorkerGroup) -> None:
    """A run longer than its 3 s ttl keeps its lease under prefork: same token after 4 s."""
    tag = uid()
    group.service.peek(f"hold:{tag}")  # connected now: a cold first peek (~0.45 s) ate the 0.5 s margin
    result = group.send(tasks.hold_short_ttl, tag, tag, 4.5)
    wait_for(lambda: records(tag), 20, what="the run to start")
    first = group.service.peek(f"hold:{tag}")
    time.sleep(4.0)
    later = group.service.peek(f"hold:{tag}")
    assert first is not None
    assert later is not None
    assert later.token == first.token
    assert later.expires_in > 0
    assert result.get(timeout=RESULT_TIMEOUT)["ran"]


def released_by_main_process(group: WorkerGroup, task_id: str) -> bool:
    """Whether a worker's main process logged releasing the lock of ``task_id``."""
    return any(
        f"[{task_id}]" in line and "released its lock" in line
        for w in group.workers
        for line in w.text().splitlines()
    )


def test_hard_time_limit_releases_lock_within_seconds(group: WorkerGroup) -> None:
    """A task SIGKILLed at its hard time limit (deaf to SIGTERM) has its 60 s lock released within seconds."""
    tag = uid()
    result = group.send(tasks.hold_long_ttl, tag, tag, 30, True, _options={"time_limit": 1.5})
    start = wait_for(lambda: records(tag), 20, what="the run to start")[0]
    assert group.service.peek(f"hold:{tag}") is not None
    wait_for(lambda: group.service.peek(f"hold:{tag}") is None, 10, what="the lock to be released")
    freed_after = time.time() - start["at"]
    assert freed_after < 6.0, f"released {freed_after:.1f} s after start; the ttl is 60 s"
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=RESULT_TIMEOUT)
    wait_for(lambda: released_by_main_process(group, result.id), 5, what="the main process's release log")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_releases_lock_within_seconds(group: WorkerGroup, signal_name: str) -> None:
    """A task killed by revoke(terminate=True) has its 60 s lock released within seconds."""
    tag = uid()
    result = group.send(tasks.hold_long_ttl, tag, tag, 30)
    wait_for(lambda: records(tag), 20, what="the run to start")
    assert group.service.peek(f"hold:{tag}") is not None
    revoked_at = time.time()
    result.revoke(terminate=True, signal=signal_name)
    wait_for(lambda: group.service.peek(f"hold:{tag}") is None, 10, what="the lock to be released")
    assert time.time() - revoked_at < 5.0
    wait_for(lambda: result.state == "REVOKED", 10, what="the REVOKED state")
    if signal_name == "SIGKILL":  # no finally ran in the child: the main process released it
        wait_for(lambda: released_by_main_process(group, result.id), 5, what="the main process's release log")


def test_revoke_terminate_frees_a_semaphore_runs_slot_within_seconds(group: WorkerGroup) -> None:
    """limit=2 on 60 s leases: SIGKILL of the run on slot 2 (``{key}#2``) by
    revoke(terminate=True) frees that slot, and the lease on its own task id, within seconds;
    the hook looks at every slot of the key, not only at the key itself (slot 1)."""
    tag = uid()
    key, slot2 = f"hold2:{tag}", f"{{hold2:{tag}}}#2"
    results = [group.send(tasks.hold_long_ttl_limit2, tag, tag, 30) for _ in range(2)]
    try:
        wait_for(lambda: len(records(tag)) == 2, 20, what="both runs to start")
        on_slot2 = group.service.peek(slot2)
        assert on_slot2 is not None
        (victim,) = [r for r in results if r.id == on_slot2.holder["task_id"]]
        revoked_at = time.time()
        victim.revoke(terminate=True, signal="SIGKILL")
        wait_for(
            lambda: group.service.peek(slot2) is None and group.service.peek(f"{key}#id:{victim.id}") is None,
            10,
            what="the killed run's slot and task-id lease to be released",
        )
        assert time.time() - revoked_at < 5.0, "left to the 60 s ttl"
        assert group.service.peek(key) is not None  # the other run's slot 1 is untouched
    finally:
        for result in results:
            result.revoke(terminate=True, signal="SIGKILL")


def test_a_replacement_of_the_same_key_runs_at_once(group: WorkerGroup) -> None:
    """``self.replace(same_task.si(...))`` hands the task id to a run of the same key; the run
    releases its lease before the replacement is sent, so the replacement (which another
    process may start while the base's on_replace still goes on) is not taken for a copy."""
    tag = uid()
    result = group.send(tasks.replacing, tag, tag, 1)
    assert result.get(timeout=RESULT_TIMEOUT / 6) == {"pages": 2}
    assert [r["page"] for r in records(tag)] == [1, 2]


def test_a_replacement_sent_by_a_retry_runs(group: WorkerGroup) -> None:
    """Attempt 0 retries (its record: ``retried``, attempt 0) and the retry replaces itself:
    the replacement, ``retries`` 0 again under the same task id, runs once; it used to be
    ended as a copy of attempt 0 (``already_done``), its result never stored."""
    tag = uid()
    result = group.send(tasks.replacing_retried, tag, tag, 1)
    assert result.get(timeout=RESULT_TIMEOUT / 6) == {"pages": 2}
    assert [(r["page"], r["attempt"]) for r in records(tag)] == [(1, 0), (1, 1), (2, 0)]


def test_soft_time_limit_fails_the_task_and_frees_the_lock(group: WorkerGroup) -> None:
    """A soft time limit raises in the body; the task fails with it and its lock is free at once."""
    tag = uid()
    result = group.send(tasks.soft_limited, tag, tag, 5)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=RESULT_TIMEOUT)
    assert group.service.peek(f"soft:{tag}") is None


def test_positional_and_keyword_calls_share_a_key(group: WorkerGroup) -> None:
    """positional(7) and positional(work_id=7) compute the same key, so both skip while it is held."""
    tag = uid()
    work_id = int(tag, 16) % 10**9
    with group.service.lock(f"pos:{work_id}"):
        by_position = group.send(tasks.positional, work_id, tag).get(timeout=RESULT_TIMEOUT)
        by_keyword = group.send(tasks.positional, work_id=work_id, tag=tag).get(timeout=RESULT_TIMEOUT)
    assert is_skipped(by_position)
    assert is_skipped(by_keyword)
    assert by_position["key"] == by_keyword["key"] == f"pos:{work_id}"


def test_beat_job_longer_than_its_interval_never_overlaps(
    group: WorkerGroup, celery_logdir: Path, request: pytest.FixtureRequest
) -> None:
    """Two beat processes send a 2.5 s job every second until it has started twice and a send
    has skipped: every send runs or skips, the runs never overlap, and each skip names one of
    the job's runs as the holder.

    Counted in sends and runs, never in wall-clock time: a loaded machine takes seconds longer
    to start beat (4.4 s against 1.4 s here at load 7), which says nothing about the lock."""
    tag = uid()
    env = {
        **group.env,
        "CE_BEAT_INTERVAL": "1",
        "CE_BEAT_DURATION": "2.5",
        "CE_BEAT_TAG": tag,
    }
    beats = [
        spawn(
            f"beat{i}-{tag}",
            ["beat", "-s", str(celery_logdir / f"schedule-{tag}-{i}"), "-l", "INFO", "--max-interval", "1"],
            env,
            celery_logdir,
        )
        for i in range(2)
    ]
    request.addfinalizer(lambda: _print_beat_failure(request, tag, beats))

    def kinds(kind: str) -> list[dict[str, Any]]:
        return [event for event in records(tag) if event["kind"] == kind]

    def exercised() -> bool:
        events = records(tag)
        count = Counter(event["kind"] for event in events)
        both_send = len({event["pid"] for event in events if event["kind"] == "sent"}) == 2
        overlapping = count["start"] - count["run"] >= 2  # no use waiting: the asserts fail
        return both_send and (overlapping or (count["start"] >= 2 and count["skip"] >= 1))

    try:
        wait_for(
            exercised, BEAT_HANG_GUARD, what="both beats to send, a send to skip and a second run to start"
        )
    finally:
        stop_all(beats)
    # A send is recorded once published, so each ends in a run or a skip; one that the stop cut
    # short may have been published unrecorded, so the runs and skips may be more than these.
    sent = {event["task_id"] for event in kinds("sent")}

    def settled() -> bool:
        events = records(tag)
        done = {e["task_id"] for e in events if e["kind"] in ("run", "skip")}
        starts = sum(e["kind"] == "start" for e in events)
        return sent <= done and starts == sum(e["kind"] == "run" for e in events)

    wait_for(settled, BEAT_HANG_GUARD, what="every send to run or skip")
    recorded, skips = kinds("run"), kinds("skip")
    assert_no_overlap(recorded)
    handled = [event["task_id"] for event in recorded + skips]
    assert len(handled) == len(set(handled)), "a send ran or skipped twice"
    assert len(recorded) >= 2
    assert skips, "sends that found the job running must have been skipped"
    fences = {run["fence"] for run in recorded}
    strangers = [skip for skip in skips if skip["holder_fence"] not in fences]
    assert not strangers, f"skips that named no run of the job as holder: {strangers}"


def _print_beat_failure(request: pytest.FixtureRequest, tag: str, beats: list[Process]) -> None:
    """On failure, print the beats' logs and the job's events in time order."""
    if not failed(request):
        return
    print("\n".join(f"===== {beat.name} =====\n{beat.text()}" for beat in beats))
    for event in sorted(records(tag), key=lambda e: e.get("at", e.get("end", 0))):
        print(event)


def test_a_limit_two_task_runs_at_most_two_at_once(group: WorkerGroup) -> None:
    """Twelve limit=2 tasks on one key across 2x2 processes: every one runs, never more than two
    at once, and two at once at some point."""
    tag = uid()
    results = [group.send(tasks.work_limit2, tag, tag, 0.3) for _ in range(12)]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    assert all(value["ran"] for value in values)
    recorded = runs(tag)
    assert len(recorded) == 12
    edges = sorted([(run["start"], 1) for run in recorded] + [(run["end"], -1) for run in recorded])
    running = most = 0
    for _, step in edges:  # an end at the same instant as a start sorts first (-1 < 1)
        running += step
        most = max(most, running)
    assert most == 2, f"most runs at once: {most}"


def attempts(tag: str) -> list[dict[str, Any]]:
    """The attempts recorded under ``tag`` (``tasks._attempt``), in order."""
    return [event for event in records(tag) if event["kind"] == "attempt"]


def on_queue(group: WorkerGroup, signature: Any) -> Any:
    """``signature`` routed to the group's queue."""
    return signature.set(queue=group.queue)


@pytest.mark.parametrize(
    ("task", "failure", "last"),
    [(tasks.autoretrying, KeyError, 2), (tasks.self_retrying, MaxRetriesExceededError, 1)],
    ids=["autoretry_for", "self.retry"],
)
def test_a_retry_past_max_retries_records_the_final_failure(
    group: WorkerGroup, task: Any, failure: type[Exception], last: int
) -> None:
    """``autoretry_for`` with ``retry_backoff`` (``max_retries=2``), or ``self.retry()``
    (``max_retries=1``): each attempt holds the key (a new fence), the last one fails (Celery
    raises the exception, or MaxRetriesExceededError, instead of retrying), the key ends free
    and the id's completion record says ``failure`` of the last attempt; it used to say
    ``retried`` (``list --done``, a copy's record): the lease was released with that record
    before Celery refused the retry."""
    tag = uid()
    result = group.send(task, tag, tag)
    with pytest.raises(failure):
        result.get(timeout=RESULT_TIMEOUT / 2)
    seen = attempts(tag)
    assert [each["attempt"] for each in seen] == list(range(last + 1))
    assert all(before["fence"] < after["fence"] for before, after in itertools.pairwise(seen))
    key = task.lock_key_for((tag, tag))
    assert group.service.peek(key) is None
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("failure", last)


def test_code_after_a_retry_refused_past_max_retries_still_holds_the_lock(group: WorkerGroup) -> None:
    """A body that catches the MaxRetriesExceededError of ``self.retry()`` and goes on (a
    fallback) still holds its lease, in the store too, and its success is recorded; the
    lease used to be released (``retried`` recorded) before Celery refused the retry, so
    the fallback ran unprotected (``self.lock.check()`` raised LockLost)."""
    tag = uid()
    result = group.send(tasks.self_retrying, tag, tag, fallback=True)
    assert result.get(timeout=RESULT_TIMEOUT / 2) == {"fallback": True}
    assert [each["attempt"] for each in attempts(tag)] == [0, 1]
    [fallback] = [event for event in records(tag) if event["kind"] == "fallback"]
    assert (fallback["held"], fallback["stored"]) == (True, True)
    done = group.service.completion(f"selfretry:{tag}", result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("success", 1)


def test_an_autoretry_that_finds_its_key_held_lock_retries_then_runs(group: WorkerGroup) -> None:
    """The retry ``autoretry_for`` sends meets ``on_locked`` like any run: attempt 0 fails
    and releases its key, the test takes the key before the retry is due (2 s later) and
    holds it a while; the retry lock-retries, then runs and succeeds, recorded ``success``."""
    tag = uid()
    key = f"autoretry:{tag}"
    result = group.send(tasks.autoretrying, tag, tag, 1)
    wait_for(lambda: attempts(tag), RESULT_TIMEOUT, what="attempt 0")
    lease = wait_for(lambda: group.service.try_lock(key, ttl=30), RESULT_TIMEOUT, what="attempt 0's release")
    try:
        # Held until the retry has been refused at least once (its lock retries are logged).
        wait_for(
            lambda: any(f"lock {key!r} is held" in worker.text() for worker in group.workers),
            RESULT_TIMEOUT,
            what="the retry's lock retry",
        )
    finally:
        lease.release()
    value = result.get(timeout=RESULT_TIMEOUT / 2)
    assert value["attempt"] == 1
    assert value["lock_retries"] >= 1
    assert value["fence"] > lease.fence
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("success", 1)


def test_autoretry_for_retries_a_locked_error_of_the_raise_policy(group: WorkerGroup) -> None:
    """``on_locked="raise"`` with ``autoretry_for=(LockedError,)``: a run that finds its key
    held is retried by Celery (``retry_backoff``, counted in ``retries``), and runs once the
    key is free. The LockedError is raised before the body, outside the ``run`` that
    Celery's autoretry wraps, so it used to fail the task at once."""
    tag = uid()
    key = f"autolocked:{tag}"
    lease = group.service.lock(key, ttl=30)
    try:
        result = group.send(tasks.autoretry_locked, tag, tag)
        wait_for(
            lambda: (
                result.ready()
                or any(f"{result.id}] retry: Retry in" in worker.text() for worker in group.workers)
            ),
            RESULT_TIMEOUT,
            what="the locked run's end or retry",
        )
    finally:
        lease.release()
    value = result.get(timeout=RESULT_TIMEOUT / 2)
    assert value["attempt"] >= 1
    assert value["fence"] > lease.fence
    assert [each["attempt"] for each in attempts(tag)] == [value["attempt"]]


def _take_away(group: WorkerGroup, key: str, tag: str, attempt: int) -> None:
    """Once attempt ``attempt`` of ``tag`` runs, delete its lease from the store (as an
    operator's ``force_release`` would): its heartbeat, or its release, finds it lost."""
    [seen] = wait_for(
        lambda: [each for each in attempts(tag) if each["attempt"] == attempt],
        RESULT_TIMEOUT,
        what=f"attempt {attempt}",
    )
    held = group.service.peek(key)
    assert held is not None
    assert held.fence == seen["fence"]
    assert group.service.force_release(key, held.token)


@pytest.mark.parametrize(
    "task", [tasks.lost_terminate_retrying, tasks.lost_raise_retrying], ids=["terminate", "raise"]
)
def test_autoretry_for_lock_lost_retries_a_run_that_lost_its_lock(group: WorkerGroup, task: Any) -> None:
    """``autoretry_for=(LockLost,)`` under ``on_lost="terminate"`` (the body interrupted) or
    ``"raise"`` (the body returns, its release finds the lease gone): attempt 0, whose lease
    is taken away, is retried, the retry finds attempt 0's record saying ``retried`` and
    runs to success, recorded ``success`` of attempt 1. LockLost is raised after the body,
    outside the ``run`` that Celery's autoretry wraps, so the run used to fail at once."""
    tag = uid()
    key = task.lock_key_for((tag, tag))
    result = group.send(task, tag, tag, 1)
    _take_away(group, key, tag, 0)
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value["attempt"] == 1
    assert value["before"] == ["retried", 0]
    assert [each["attempt"] for each in attempts(tag)] == [0, 1]
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("success", 1)


@pytest.mark.parametrize(
    "task", [tasks.lost_terminate_retrying, tasks.lost_raise_retrying], ids=["terminate", "raise"]
)
def test_autoretry_for_lock_lost_past_max_retries_fails_with_lock_lost(group: WorkerGroup, task: Any) -> None:
    """``autoretry_for=(LockLost,)`` with ``max_retries=1``, each attempt's lease taken away:
    attempt 1, past ``max_retries``, fails the task with LockLost and its record says
    ``failure`` of attempt 1 (under ``"raise"`` the release had written ``success``)."""
    tag = uid()
    key = task.lock_key_for((tag, tag))
    result = group.send(task, tag, tag)
    _take_away(group, key, tag, 0)
    _take_away(group, key, tag, 1)
    with pytest.raises(LockLost):
        result.get(timeout=RESULT_TIMEOUT)
    assert [each["attempt"] for each in attempts(tag)] == [0, 1]
    assert group.service.peek(key) is None
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("failure", 1)


@pytest.mark.parametrize("task", [tasks.lost_terminate, tasks.lost_raise], ids=["terminate", "raise"])
def test_a_run_failed_by_its_lost_lock_is_recorded_as_a_failure(group: WorkerGroup, task: Any) -> None:
    """Without ``autoretry_for``, a run whose lease is taken away fails with LockLost under
    ``on_lost="terminate"`` and ``"raise"``, and its completion record says ``failure``, as
    the task's state does: under ``"raise"`` the body returned and its release (which finds
    the lease gone) had written ``success``."""
    tag = uid()
    key = task.lock_key_for((tag, tag))
    result = group.send(task, tag, tag)
    _take_away(group, key, tag, 0)
    with pytest.raises(LockLost):
        result.get(timeout=RESULT_TIMEOUT)
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("failure", 0)


def test_a_chain_of_one_key_runs_every_link(group: WorkerGroup) -> None:
    """A chain whose links lock the same key (``on_locked="skip"``): each link releases its
    key before Celery sends the next, so no link is skipped by the one before it."""
    tag = uid()
    links = [on_queue(group, tasks.work_skip.si(tag, tag, 0.1)) for _ in range(3)]
    value = chain(*links).apply_async().get(timeout=RESULT_TIMEOUT / 2)
    assert not is_skipped(value)
    recorded = [event for event in records(tag) if event["kind"] == "run"]
    assert len(recorded) == 3
    assert_no_overlap(recorded)


def test_a_chord_of_one_key_retries_its_header_in_turn_and_fires_its_body(group: WorkerGroup) -> None:
    """A chord whose header tasks lock one key under ``on_locked="retry"``: they run one at a
    time (the others lock-retry, their chord membership kept), and the body gets every
    header result, none a marker."""
    tag = uid()
    header = [on_queue(group, tasks.work_retry.si(tag, tag, 0.2)) for _ in range(3)]
    values = chord(header)(on_queue(group, tasks.collect.s())).get(timeout=RESULT_TIMEOUT / 2)
    assert len(values) == 3
    assert all(value["ran"] and not is_skipped(value) for value in values)
    recorded = [event for event in records(tag) if event["kind"] == "run"]
    assert len(recorded) == 3
    assert_no_overlap(recorded)


@pytest.mark.parametrize("how", ["expires", "revoke"])
def test_an_expired_or_revoked_message_takes_no_lock(group: WorkerGroup, how: str) -> None:
    """A message that expires before it is due, or whose id is revoked before it runs, is
    discarded by the worker: its body does not run and its task id takes no lease (no
    completion record), so the key stays free."""
    tag = uid()
    options: dict[str, Any] = {"countdown": 2}
    if how == "expires":
        options["expires"] = 1
    result = group.send(tasks.work_skip, tag, tag, _options=options)
    if how == "revoke":
        tasks.app.control.revoke(result.id)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=RESULT_TIMEOUT / 2)
    key = f"work:{tag}"
    assert records(tag) == []
    assert group.service.completion(key, result.id) is None
    assert group.service.peek(key) is None
