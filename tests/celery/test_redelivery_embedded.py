"""Redelivery decisions on Celery's embedded worker (memory broker and store), and the
bad-input and unchanged-path cases of issue #10: fast, no servers."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_exclusive import signals
from celery_exclusive.errors import ConfigurationError, InvalidArgumentError
from celery_exclusive.providers.base import MAX_RETAIN
from celery_exclusive.redelivery import ALREADY_DONE, DEFAULT_RETENTION, LOCKED, REDELIVERED, retention
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import ExclusiveTask, exclusive_task, is_skipped
from celery_exclusive.worker import get_lock_service
from tests.celery.conftest import embedded_app, embedded_worker

app = embedded_app("ce_redelivery", "ce-redelivery", result_expires=120)

_runs: dict[str, int] = {}
_mutex = threading.Lock()
_release = threading.Event()


def count(task_id: str) -> int:
    with _mutex:
        _runs[task_id] = _runs.get(task_id, 0) + 1
        return _runs[task_id]


@exclusive_task(app=app, key="once:{n}", bind=True)
def once(self: Any, n: str, wait: bool = False) -> dict[str, Any]:
    count(self.request.id)
    if wait:
        _release.wait(10)
    return {"real": True}


@exclusive_task(app=app, key="kept:{n}", done_retention=30, bind=True)
def kept_30s(self: Any, n: str) -> dict[str, Any]:
    count(self.request.id)
    return {"real": True}


@exclusive_task(app=app, key="off:{n}", done_retention=False, bind=True)
def no_records(self: Any, n: str) -> dict[str, Any]:
    count(self.request.id)
    return {"real": True}


@exclusive_task(app=app, key="slots:{n}", limit=2, bind=True)
def in_slots(self: Any, n: str, wait: bool = False) -> dict[str, Any]:
    count(self.request.id)
    if wait:
        _release.wait(10)
    return {"real": True}


@exclusive_task(app=app, key="retries:{n}", max_retries=1, bind=True)
def retries_once(self: Any, n: str) -> dict[str, Any]:
    count(self.request.id)
    if self.request.retries == 0:
        raise self.retry(countdown=1.5)
    return {"real": True, "retries": self.request.retries}


@exclusive_task(app=app, key="fails:{n}", bind=True)
def fails(self: Any, n: str) -> None:
    count(self.request.id)
    raise ValueError("the real failure")


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    yield from embedded_worker(app, 4)


@pytest.fixture
def skipped() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.task_skipped.connect(receive, weak=False)
    yield seen
    signals.task_skipped.disconnect(receive)


def test_a_second_message_of_a_finished_task_id_does_not_run(
    worker: Any, skipped: list[dict[str, Any]]
) -> None:
    """Published again after it finished: the copy ends as already_done, the result stays."""
    task_id, n = uuid.uuid4().hex, uuid.uuid4().hex
    assert once.apply_async((n,), task_id=task_id).get(timeout=10) == {"real": True}
    once.apply_async((n,), task_id=task_id)
    service = get_lock_service(app)
    record = service.completion(f"once:{n}", task_id)
    assert record is not None
    assert record.outcome == "success"
    assert 100 < record.expires_in <= 120  # result_expires
    deadline = threading.Event()
    for _ in range(200):
        if any(s["reason"] == ALREADY_DONE for s in skipped):
            break
        deadline.wait(0.02)
    (signal,) = [s for s in skipped if s["reason"] == ALREADY_DONE]
    assert signal["key"] == f"once:{n}"
    assert signal["record"].task_id == task_id
    assert signal["holder"] is None
    assert _runs[task_id] == 1
    assert once.AsyncResult(task_id).get(timeout=5) == {"real": True}


def test_a_copy_during_the_run_ends_as_redelivered(worker: Any, skipped: list[dict[str, Any]]) -> None:
    """A copy while the original holds the key: no run, no marker, signal reason redelivered."""
    task_id, n = uuid.uuid4().hex, uuid.uuid4().hex
    _release.clear()
    first = once.apply_async((n, True), task_id=task_id)
    service = get_lock_service(app)
    for _ in range(200):
        if service.peek(f"once:{n}") is not None:
            break
        threading.Event().wait(0.02)
    once.apply_async((n, True), task_id=task_id)
    for _ in range(200):
        if any(s["reason"] == REDELIVERED for s in skipped):
            break
        threading.Event().wait(0.02)
    _release.set()
    assert first.get(timeout=10) == {"real": True}
    (signal,) = [s for s in skipped if s["reason"] == REDELIVERED]
    assert signal["holder"].holder["task_id"] == task_id
    assert _runs[task_id] == 1


def _until(predicate: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        threading.Event().wait(0.02)


def test_a_copy_during_a_semaphore_run_ends_as_redelivered_and_a_later_one_as_already_done(
    worker: Any, skipped: list[dict[str, Any]]
) -> None:
    """limit=2, one slot free: the copy of the running message takes no slot and runs nothing
    (its run's task id is held on the task id's own lease); a copy after the run finds the
    record that lease's release wrote."""
    task_id, n = uuid.uuid4().hex, uuid.uuid4().hex
    _release.clear()
    first = in_slots.apply_async((n, True), task_id=task_id)
    service = get_lock_service(app)
    _until(lambda: service.peek(f"slots:{n}") is not None)
    in_slots.apply_async((n, True), task_id=task_id)
    _until(lambda: any(s["reason"] == REDELIVERED for s in skipped))
    assert service.peek(f"{{slots:{n}}}#2") is None  # the copy took no slot
    _release.set()
    assert first.get(timeout=10) == {"real": True}
    (signal,) = [s for s in skipped if s["reason"] == REDELIVERED]
    assert signal["holder"].holder["task_id"] == task_id
    in_slots.apply_async((n,), task_id=task_id)
    _until(lambda: any(s["reason"] == ALREADY_DONE for s in skipped))
    assert [s["reason"] for s in skipped] == [REDELIVERED, ALREADY_DONE]
    assert _runs[task_id] == 1
    assert in_slots.AsyncResult(task_id).get(timeout=5) == {"real": True}
    assert service.peek(f"slots:{n}") is None


def test_a_copy_of_an_attempt_that_retried_does_not_run_but_the_retry_does(
    worker: Any, skipped: list[dict[str, Any]]
) -> None:
    """Attempt 0 retried (record ``retried``, attempt 0); a copy of attempt 0 arriving before
    the retry's own message ends as already_done; the retry (retries=1) runs and returns."""
    task_id, n = uuid.uuid4().hex, uuid.uuid4().hex
    first = retries_once.apply_async((n,), task_id=task_id)
    service = get_lock_service(app)
    _until(lambda: service.completion(f"retries:{n}", task_id) is not None)
    record = service.completion(f"retries:{n}", task_id)
    assert record is not None
    assert (record.outcome, record.attempt) == ("retried", 0)
    retries_once.apply_async((n,), task_id=task_id)  # a copy of attempt 0 (retries=0)
    _until(lambda: any(s["reason"] == ALREADY_DONE for s in skipped))
    (signal,) = [s for s in skipped if s["reason"] == ALREADY_DONE]
    assert signal["record"].outcome == "retried"
    assert first.get(timeout=10) == {"real": True, "retries": 1}
    assert _runs[task_id] == 2  # attempt 0 and its retry, not the copy


def test_a_copy_after_a_final_failure_does_not_run(worker: Any, skipped: list[dict[str, Any]]) -> None:
    """A failure Celery will not retry is recorded too: the copy ends as already_done and
    the stored state stays the real FAILURE."""
    task_id, n = uuid.uuid4().hex, uuid.uuid4().hex
    with pytest.raises(ValueError, match="the real failure"):
        fails.apply_async((n,), task_id=task_id).get(timeout=10)
    fails.apply_async((n,), task_id=task_id)
    _until(lambda: any(s["reason"] == ALREADY_DONE for s in skipped))
    (signal,) = [s for s in skipped if s["reason"] == ALREADY_DONE]
    assert signal["record"].outcome == "failure"
    assert _runs[task_id] == 1
    assert fails.AsyncResult(task_id).state == "FAILURE"


def test_an_other_task_id_on_a_held_key_is_skipped_with_reason_locked(
    worker: Any, skipped: list[dict[str, Any]]
) -> None:
    n = uuid.uuid4().hex
    with get_lock_service(app).lock(f"once:{n}"):
        assert is_skipped(once.apply_async((n,)).get(timeout=10))
    assert [s["reason"] for s in skipped] == [LOCKED]


def test_per_task_retention_and_turning_records_off(worker: Any) -> None:
    n = uuid.uuid4().hex
    kept = kept_30s.apply_async((n,))
    kept.get(timeout=10)
    record = get_lock_service(app).completion(f"kept:{n}", kept.id)
    assert record is not None
    assert 20 < record.expires_in <= 30
    task_id = uuid.uuid4().hex
    no_records.apply_async((n,), task_id=task_id).get(timeout=10)
    no_records.apply_async((n,), task_id=task_id)
    for _ in range(250):
        if _runs[task_id] == 2:
            break
        threading.Event().wait(0.02)
    assert _runs[task_id] == 2  # records off: the second message runs as before
    assert get_lock_service(app).completions(f"off:{n}") == []


def test_eager_and_direct_calls_are_unchanged() -> None:
    """No record is checked or written inline: the same task id runs every time."""
    n = uuid.uuid4().hex
    app.conf.task_always_eager = True
    try:
        for _ in range(2):
            assert once.apply_async((n,), task_id="eager-id").get() == {"real": True}
        assert once.apply((n,), task_id="eager-id").get() == {"real": True}
    finally:
        app.conf.task_always_eager = False
    assert once(n) == {"real": True}
    assert _runs["eager-id"] == 3
    assert get_lock_service(app).completions(f"once:{n}") == []


@pytest.mark.parametrize(
    ("expires", "kept"),
    [
        ("unset", 86400.0),
        (timedelta(hours=2), 7200.0),
        (600, 600.0),
        (None, DEFAULT_RETENTION),
        (0, DEFAULT_RETENTION),
        (timedelta(days=365 * 20), MAX_RETAIN),  # the longest a record is kept
    ],
)
def test_retention_defaults_to_result_expires_else_24_hours(expires: object, kept: float) -> None:
    """done_retention unset: Celery's result_expires (its own default is 1 day), or 24 h when
    that is off (None, 0); a task's own done_retention wins."""
    other = Celery(f"ce-retention-{uuid.uuid4().hex[:6]}", set_as_current=False)
    if expires != "unset":
        other.conf.result_expires = expires

    def body() -> None:
        return None

    task = exclusive_task(app=other, name="ret", shared=False)(body)
    own = exclusive_task(app=other, name="ret30", done_retention=30, shared=False)(body)
    other.finalize()
    assert retention(other.tasks[task.name]) == kept
    assert retention(other.tasks[own.name]) == 30.0


@pytest.mark.parametrize(
    "bad", [0, -1, float("nan"), float("inf"), "1h", True, timedelta(0), None.__class__, MAX_RETAIN * 2]
)
def test_bad_retention_is_rejected_when_the_task_is_defined(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="done_retention"):
        exclusive_task(app=app, name=f"bad-{uuid.uuid4().hex}", done_retention=bad, shared=False)(
            lambda: None
        )


def test_bad_retention_as_a_class_attribute_or_setting_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="done_retention"):

        class Bad(ExclusiveTask):  # type: ignore[misc]
            lock_done_retention = -5

    with pytest.raises(ConfigurationError, match="exclusive_done_retention"):
        ExclusiveSettings.from_conf({"exclusive_done_retention": 0}, environ={})
    with pytest.raises(ConfigurationError, match="CELERY_EXCLUSIVE_DONE_RETENTION"):
        ExclusiveSettings.from_conf({}, environ={"CELERY_EXCLUSIVE_DONE_RETENTION": "soon"})
    assert (
        ExclusiveSettings.from_conf({}, environ={"CELERY_EXCLUSIVE_DONE_RETENTION": "off"}).done_retention
        is False
    )
    assert (
        ExclusiveSettings.from_conf({"exclusive_done_retention": timedelta(hours=2)}).done_retention == 7200.0
    )
