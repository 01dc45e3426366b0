"""Exclusive tasks combined with the Celery features users pair them with, end to end.

Subprocess ``celery worker`` processes (prefork) on a real Redis broker and result backend,
one module-scoped group per lock store (Redis, PostgreSQL): ``autoretry_for`` with
``retry_backoff`` and ``max_retries``, ``self.retry()`` past ``max_retries``, chains and
chords whose tasks lock one key, and messages that expire or are revoked before they run.
Task bodies record their attempts in Redis (see tests/celery/app.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord
from celery.exceptions import MaxRetriesExceededError, TaskRevokedError

from celery_exclusive.task import is_skipped
from tests.celery import app as tasks
from tests.celery.conftest import WorkerGroup, assert_no_overlap, module_group, records, uid, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.timeout(120), pytest.mark.usefixtures("logs_on_failure")]

#: A hang guard for a result (nothing here is timed).
RESULT_TIMEOUT = 30


@pytest.fixture(scope="module", params=["redis", "postgres"])
def group(request: pytest.FixtureRequest, celery_logdir: Path) -> Iterator[WorkerGroup]:
    """Two prefork workers of two processes on one lock store, for the whole module."""
    yield from module_group(request.param, celery_logdir)


def attempts(tag: str) -> list[dict[str, Any]]:
    """The attempts recorded under ``tag`` (``tasks._attempt``), in order."""
    return [event for event in records(tag) if event["kind"] == "attempt"]


def on_queue(group: WorkerGroup, signature: Any) -> Any:
    """``signature`` routed to the group's queue."""
    return signature.set(queue=group.queue)


def test_autoretry_for_past_max_retries_records_the_final_failure(group: WorkerGroup) -> None:
    """``autoretry_for`` with ``retry_backoff`` and ``max_retries=2``: each attempt holds the
    key (a new fence), the last one fails, the key ends free, and the completion record of
    the id says ``failure`` of attempt 2; a copy's outcome (and ``list --done``) used to say
    ``retried``: the lease was released with that record before Celery raised the failure."""
    tag = uid()
    result = group.send(tasks.autoretrying, tag, tag)
    with pytest.raises(KeyError):
        result.get(timeout=RESULT_TIMEOUT)
    seen = attempts(tag)
    assert [each["attempt"] for each in seen] == [0, 1, 2]
    assert seen[0]["fence"] < seen[1]["fence"] < seen[2]["fence"]
    key = f"autoretry:{tag}"
    assert group.service.peek(key) is None
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("failure", 2)


def test_self_retry_past_max_retries_records_the_final_failure(group: WorkerGroup) -> None:
    """``self.retry()`` past ``max_retries`` (Celery raises MaxRetriesExceededError instead of
    retrying) records ``failure`` of the last attempt, not ``retried``."""
    tag = uid()
    result = group.send(tasks.self_retrying, tag, tag)
    with pytest.raises(MaxRetriesExceededError):
        result.get(timeout=RESULT_TIMEOUT)
    assert [each["attempt"] for each in attempts(tag)] == [0, 1]
    key = f"selfretry:{tag}"
    assert group.service.peek(key) is None
    done = group.service.completion(key, result.id)
    assert done is not None
    assert (done.outcome, done.attempt) == ("failure", 1)


def test_code_after_a_retry_refused_past_max_retries_still_holds_the_lock(group: WorkerGroup) -> None:
    """A body that catches the MaxRetriesExceededError of ``self.retry()`` and goes on (a
    fallback) still holds its lease, in the store too, and its success is recorded; the
    lease used to be released (``retried`` recorded) before Celery refused the retry, so
    the fallback ran unprotected (``self.lock.check()`` raised LockLost)."""
    tag = uid()
    result = group.send(tasks.self_retrying, tag, tag, fallback=True)
    assert result.get(timeout=RESULT_TIMEOUT) == {"fallback": True}
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
    value = result.get(timeout=RESULT_TIMEOUT)
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
    value = result.get(timeout=RESULT_TIMEOUT)
    assert value["attempt"] >= 1
    assert value["fence"] > lease.fence
    assert [each["attempt"] for each in attempts(tag)] == [value["attempt"]]


def test_a_chain_of_one_key_runs_every_link(group: WorkerGroup) -> None:
    """A chain whose links lock the same key (``on_locked="skip"``): each link releases its
    key before Celery sends the next, so no link is skipped by the one before it."""
    tag = uid()
    links = [on_queue(group, tasks.work_skip.si(tag, tag, 0.1)) for _ in range(3)]
    value = chain(*links).apply_async().get(timeout=RESULT_TIMEOUT)
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
    values = chord(header)(on_queue(group, tasks.collect.s())).get(timeout=RESULT_TIMEOUT)
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
        result.get(timeout=RESULT_TIMEOUT)
    key = f"work:{tag}"
    assert records(tag) == []
    assert group.service.completion(key, result.id) is None
    assert group.service.peek(key) is None
