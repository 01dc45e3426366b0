"""Fast end-to-end cases on Celery's embedded test worker (threads pool), memory broker and store.

The worker runs in this process, so the test holds keys through the same in-memory lock
store (``get_lock_service(app)``) that the tasks use.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Task, chain, group
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish

from celery_exclusive import metrics, signals
from celery_exclusive.errors import LockedError, LockLost, LockRetriesExceeded
from celery_exclusive.lease import Lease
from celery_exclusive.service import LockService
from celery_exclusive.task import (
    HANDS_ON_RERUNS,
    LOCK_RETRIES_HEADER,
    ExclusiveTask,
    exclusive_task,
    is_skipped,
)
from celery_exclusive.worker import get_lock_service
from tests.celery.conftest import embedded_app, embedded_worker, uid

app = embedded_app("ce_embedded", "ce-embedded")

executions: list[tuple[str, Any]] = []
_executions_mutex = threading.Lock()


def executed(name: str, value: Any) -> None:
    """Record that a task body ran."""
    with _executions_mutex:
        executions.append((name, value))


def ran(name: str, value: Any) -> int:
    """How many times the body ``name`` ran with ``value``."""
    with _executions_mutex:
        return executions.count((name, value))


@exclusive_task(app=app, key="skip:{n}", bind=True)
def skip_task(self: Any, n: str, hold: float = 0.0) -> dict[str, Any]:
    """Default policy (skip)."""
    executed("skip", n)
    time.sleep(hold)
    return {"n": n, "key": self.lock.key, "fence": self.lock.fence}


@exclusive_task(
    app=app,
    key="retry:{n}",
    on_locked="retry",
    lock_retry_backoff=0.02,
    lock_retry_backoff_max=0.1,
    lock_max_retries=200,
    max_retries=0,
    bind=True,
)
def retry_task(self: Any, n: str) -> dict[str, Any]:
    """Lock retries only; its own max_retries is 0."""
    executed("retry", n)
    headers = self.request.headers or {}
    return {"retries": self.request.retries, "lock_retries": headers.get(LOCK_RETRIES_HEADER, 0)}


@exclusive_task(
    app=app,
    key="few:{n}",
    on_locked="retry",
    lock_max_retries=2,
    lock_retry_backoff=0.01,
    lock_retry_backoff_max=0.02,
)
def few_retries_task(n: str) -> str:
    """Gives up after two lock retries."""
    executed("few", n)
    return n


@exclusive_task(app=app, key="raise:{n}", on_locked="raise")
def raise_task(n: str) -> str:
    """Raises LockedError when held."""
    executed("raise", n)
    return n


def custom_policy(task: Any, key: str, holder: Any) -> dict[str, Any]:
    """An on_locked callable: its return value is the task's result."""
    return {"custom": key, "task": task.name, "holder_task": holder.holder.get("task_id") if holder else None}


@exclusive_task(app=app, key="callable:{n}", on_locked=custom_policy)
def callable_task(n: str) -> str:
    """Uses a callable on_locked policy."""
    executed("callable", n)
    return n


@exclusive_task(app=app, key="rerun:{n}", on_locked="rerun")
def rerun_task(n: str, tag: str, hold: float = 0.0) -> str:
    """Coalesces requests into one rerun."""
    executed("rerun", (n, tag))
    time.sleep(hold)
    return tag


@exclusive_task(app=app, key="pair:{n}", on_locked="rerun", limit=2)
def rerun_pair_task(n: str, tag: str) -> str:
    """A semaphore of 2 under ``"rerun"``."""
    executed("pair", (n, tag))
    return tag


@exclusive_task(app=app, key="mixed:{n}", on_locked="skip")
def mixed_holder_task(n: str, hold: float) -> str:
    """A skip-policy task sharing its key with a rerun-policy one."""
    time.sleep(hold)
    return "held"


@exclusive_task(app=app, key="mixed:{n}", on_locked="rerun", lock_retry_backoff=0.05)
def mixed_webhook_task(n: str) -> str:
    """A rerun-policy task on a key that a skip-policy task may hold."""
    executed("mixed-webhook", n)
    return "ran"


@exclusive_task(app=app, key="lost-raise:{n}", ttl=1.0, on_lost="raise", bind=True)
def lost_raise_task(self: Any, n: str, call_check: bool) -> str:
    """Waits until its lease is lost; then checks it, or just returns."""
    lease: Lease = self.lock
    lease.lost.wait(10)
    if call_check:
        self.lock.check()
    return "returned"


@exclusive_task(app=app, key="lost-terminate:{n}", ttl=1.0, on_lost="terminate", bind=True)
def lost_terminate_task(self: Any, n: str) -> str:
    """Works in short steps for up to 10 s without ever checking its lease."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # The interrupt is no Exception, so even a task that suppresses them all stops.
        with contextlib.suppress(Exception):
            time.sleep(0.01)
    executed("lost-terminate", n)
    return "returned"


@exclusive_task(app=app, key="lost-log:{n}", ttl=1.0, bind=True)
def lost_log_task(self: Any, n: str) -> str:
    """Waits until its lease is lost, then returns (default on_lost: log)."""
    self.lock.lost.wait(10)
    return "returned"


@exclusive_task(app=app, key="self-retry:{n}", bind=True)
def self_retry_task(self: Any, n: str) -> dict[str, Any]:
    """Retries itself once, immediately, while holding its lock."""
    executed("self-retry", n)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return {"retries": self.request.retries}


@exclusive_task(
    app=app,
    key="reset:{n}",
    on_locked="retry",
    lock_retry_backoff=0.02,
    lock_retry_backoff_max=0.05,
    lock_max_retries=100,
    bind=True,
)
def reset_task(self: Any, n: str) -> int:
    """Waits for its lock, then retries itself once."""
    lock_retries = int((self.request.headers or {}).get(LOCK_RETRIES_HEADER, 0))
    executed("reset", (n, self.request.retries, lock_retries))
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return lock_retries


@exclusive_task(
    app=app, key="auto:{n}", bind=True, autoretry_for=(ValueError,), max_retries=1, default_retry_delay=0
)
def autoretry_task(self: Any, n: str) -> dict[str, Any]:
    """Fails its first attempt with ValueError; autoretry_for retries it."""
    executed("auto", n)
    if self.request.retries == 0:
        raise ValueError("first attempt fails")
    return {"retries": self.request.retries}


@exclusive_task(app=app, key="hb:{n}", ttl=1.0, bind=True)
def heartbeat_task(self: Any, n: str, hold: float) -> int:
    """Runs longer than its 1 s ttl."""
    time.sleep(hold)
    self.lock.check()
    return int(self.lock.fence)


@app.task
def echo(value: Any) -> Any:
    """Returns its argument (the next task of a chain)."""
    return value


class AuditedTask(Task):  # type: ignore[misc]
    """A user's custom base class with its own __call__."""

    calls: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        AuditedTask.calls.append(args[0])
        return super().__call__(*args, **kwargs)


@exclusive_task(app=app, bind=True, key="context:{n}")
def context_task(self: Task, n: str) -> dict[str, Any]:
    """What the body sees of its request: id, args, the stack depth, current_task."""
    from celery import current_task

    return {
        "id": self.request.id,
        "args": list(self.request.args or ()),
        "depth": len(self.request_stack.stack),
        "current": current_task.request.id if current_task else None,
        "nested": context_task(f"{n}-inner")["args"] if not n.endswith("-inner") else None,
    }


@exclusive_task(app=app, base=AuditedTask, key="based:{n}")
def based_task(n: str) -> str:
    """Declared with a custom base: ExclusiveTask is mixed in."""
    return n


@app.task(base=ExclusiveTask, lock_key="classic:{n}")
def classic_task(n: str) -> str:
    """Declared the app.task(base=ExclusiveTask) way."""
    executed("classic", n)
    return n


@exclusive_task(key="shared:{n}")
def shared_style_task(n: str) -> str:
    """Declared shared_task style (no app)."""
    executed("shared", n)
    return n


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    """One embedded threads-pool worker for the module."""
    yield from embedded_worker(app, 6)


@pytest.fixture
def locks(worker: Any) -> LockService:
    """The lock service the worker's tasks use (same process, same memory store)."""
    return get_lock_service(app)


@pytest.fixture
def task_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the integration's Celery task logger, at INFO."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("celery_exclusive.task")
    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def later(seconds: float, action: Callable[[], object]) -> threading.Timer:
    """Run ``action`` in ``seconds`` from a timer thread."""
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_unlocked_run_returns_its_result(locks: LockService) -> None:
    """A free key: the body runs, gets a lease (self.lock), and its result is not a skip marker."""
    n = uid()
    first = skip_task.delay(n).get(timeout=10, interval=0.01)
    second = skip_task.delay(n).get(timeout=10, interval=0.01)
    assert not is_skipped(first)
    assert first["key"] == f"skip:{n}"
    assert second["fence"] > first["fence"]
    assert locks.peek(f"skip:{n}") is None


def test_skip_marker_log_and_signal(locks: LockService, task_log: list[logging.LogRecord]) -> None:
    """A held key: the body never runs; SUCCESS with the marker, one INFO line, task_skipped sent."""
    n = uid()
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    signals.task_skipped.connect(receiver)
    try:
        with locks.lock(f"skip:{n}", holder={"task_id": "external"}):
            result = skip_task.delay(n)
            value = result.get(timeout=10, interval=0.01)
    finally:
        signals.task_skipped.disconnect(receiver)
    assert result.state == "SUCCESS"
    assert is_skipped(value)
    assert value == {"celery_exclusive": "skipped", "key": f"skip:{n}", "holder": value["holder"]}
    assert value["holder"]["task_id"] == "external"
    assert ran("skip", n) == 0
    lines = [r.getMessage() for r in task_log if r.levelno == logging.INFO and f"skip:{n}" in r.getMessage()]
    assert len(lines) == 1
    assert "task_id=external" in lines[0]
    (event,) = [e for e in seen if e["key"] == f"skip:{n}"]
    assert event["sender"] is event["task"]
    assert event["holder"].holder["task_id"] == "external"


def test_metrics_count_real_task_runs(locks: LockService) -> None:
    """With metrics installed, a worker's task runs move acquisitions, skips, releases and hold time."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics.install(registry)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(f"celery_exclusive_{name}", labels) or 0.0

    try:
        n = uid()
        assert skip_task.delay(n).get(timeout=10, interval=0.01)["n"] == n
        with locks.lock(f"skip:{n}"):
            assert is_skipped(skip_task.delay(n).get(timeout=10, interval=0.01))
    finally:
        metrics.uninstall()
    assert value("acquisitions_total", outcome="acquired") == 2
    assert value("acquisitions_total", outcome="contended") == 1
    assert value("task_skips_total", task=skip_task.name) == 1
    assert value("releases_total", outcome="released") == 2
    assert value("hold_seconds_count") == 2


def test_retry_waits_for_the_lock_without_consuming_max_retries(locks: LockService) -> None:
    """A max_retries=0 task lock-retries while the key is held and then runs with retries 0."""
    n = uid()
    lease = locks.lock(f"retry:{n}")
    result = retry_task.delay(n)
    later(0.4, lease.release)
    value = result.get(timeout=10, interval=0.01)
    assert value["retries"] == 0
    assert value["lock_retries"] >= 1
    assert ran("retry", n) == 1


def test_retry_exhaustion_fails_with_lock_retries_exceeded(locks: LockService) -> None:
    """After lock_max_retries lock retries the task fails with LockRetriesExceeded naming the key."""
    n = uid()
    with locks.lock(f"few:{n}"):
        result = few_retries_task.delay(n)
        with pytest.raises(LockRetriesExceeded, match=rf"few:{n}.*after 2 lock retries"):
            result.get(timeout=10, interval=0.01)
    assert ran("few", n) == 0


def test_raise_policy_round_trips_locked_error(locks: LockService) -> None:
    """The raise policy's LockedError comes back from the result backend with key and holder."""
    n = uid()
    with locks.lock(f"raise:{n}", holder={"task_id": "external"}):
        result = raise_task.delay(n)
        with pytest.raises(LockedError) as caught:
            result.get(timeout=10, interval=0.01)
    assert type(caught.value) is LockedError
    assert caught.value.key == f"raise:{n}"
    assert caught.value.holder is not None
    assert caught.value.holder.holder["task_id"] == "external"
    assert result.state == "FAILURE"


def test_callable_policy_result_is_the_task_result(locks: LockService) -> None:
    """A callable on_locked gets (task, key, holder) and its return value is the result."""
    n = uid()
    with locks.lock(f"callable:{n}", holder={"task_id": "external"}):
        value = callable_task.delay(n).get(timeout=10, interval=0.01)
    assert value == {"custom": f"callable:{n}", "task": callable_task.name, "holder_task": "external"}
    assert ran("callable", n) == 0


def test_rerun_coalesces_ten_requests_into_one(locks: LockService) -> None:
    """Ten requests during a run are coalesced; exactly one rerun follows, with recorded arguments."""
    n = uid()
    first = rerun_task.delay(n, "first", 1.0)
    while ran("rerun", (n, "first")) == 0:
        time.sleep(0.01)
    values = [rerun_task.delay(n, f"req{i}").get(timeout=10, interval=0.01) for i in range(10)]
    assert [value["celery_exclusive"] for value in values] == ["coalesced"] * 10
    assert first.get(timeout=10, interval=0.01) == "first"
    deadline = time.monotonic() + 5
    while sum(ran("rerun", (n, f"req{i}")) for i in range(10)) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    assert ran("rerun", (n, "req0")) == 1, "the rerun uses the first coalesced request's arguments"
    assert sum(ran("rerun", (n, f"req{i}")) for i in range(10)) == 1
    assert locks.peek(f"rerun:{n}#rerun") is None


def test_a_rerun_coalesces_behind_another_lease_of_its_senders_fence(locks: LockService) -> None:
    """The memory store counts fences per slot, so the two slots' holders both have fence 1.
    A rerun handed on by slot 2's lease, finding the semaphore full again and slot 1's
    holder named, coalesces behind that holder, which is not its sender (a different token)
    though its fence is the same: it used to wait for it as for its own sender, re-sent
    without coalescing. It runs once, when a holder hands it on."""
    from celery_exclusive.policies import COALESCED, MARKER_FIELD, Sender, hand_on

    n = uid()
    key, meta = f"pair:{n}", {HANDS_ON_RERUNS: True}
    first, second = locks.lock(key, limit=2, holder=meta), locks.lock(key, limit=2, holder=meta)
    assert first.fence == second.fence, "one fence, two leases"
    value = rerun_pair_task.delay(n, "request").get(timeout=10, interval=0.01)
    assert value[MARKER_FIELD] == COALESCED, value
    second.release()
    third = locks.lock(key, limit=2, holder=meta)
    sent: list[str] = []

    def receiver(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("task") == rerun_pair_task.name:
            sent.append(headers["id"])

    before_task_publish.connect(receiver)
    try:
        hand_on(rerun_pair_task, key, Sender.of(second))  # as slot 2's run did when it finished
    finally:
        before_task_publish.disconnect(receiver)
    (rerun,) = sent
    value = rerun_pair_task.AsyncResult(rerun).get(timeout=10, interval=0.01)
    assert value[MARKER_FIELD] == COALESCED, value
    assert value["holder"]["fence"] == first.fence
    assert ran("pair", (n, "request")) == 0
    first.release()
    hand_on(rerun_pair_task, key, Sender.of(first))  # as slot 1's run does when it finishes
    third.release()
    deadline = time.monotonic() + 10
    while ran("pair", (n, "request")) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    assert ran("pair", (n, "request")) == 1


def wait_held(locks: LockService, key: str) -> Any:
    """Wait until ``key`` is held and return its LockInfo."""
    deadline = time.monotonic() + 10
    while (info := locks.peek(key)) is None:
        assert time.monotonic() < deadline, f"{key} was never taken"
        time.sleep(0.01)
    return info


@pytest.mark.parametrize("call_check", [True, False])
def test_on_lost_raise_fails_the_run_with_lock_lost(locks: LockService, call_check: bool) -> None:
    """lock_on_lost='raise': check() raises LockLost, and a run that returns anyway fails with it."""
    n = uid()
    result = lost_raise_task.delay(n, call_check)
    info = wait_held(locks, f"lost-raise:{n}")
    assert locks.force_release(f"lost-raise:{n}", info.token)
    with pytest.raises(LockLost, match=f"lost-raise:{n}"):
        result.get(timeout=10, interval=0.01)


def test_on_lost_terminate_interrupts_the_running_body(locks: LockService) -> None:
    """lock_on_lost='terminate': losing the lease stops the body at once; the run fails with LockLost."""
    n = uid()
    result = lost_terminate_task.delay(n)
    info = wait_held(locks, f"lost-terminate:{n}")
    lost_at = time.monotonic()
    assert locks.force_release(f"lost-terminate:{n}", info.token)
    with pytest.raises(LockLost, match="interrupted"):
        result.get(timeout=10, interval=0.01)
    assert time.monotonic() - lost_at < 3.0
    assert ran("lost-terminate", n) == 0


def test_rerun_behind_a_holder_of_another_policy_waits_and_runs(locks: LockService) -> None:
    """A rerun request behind a holder that sends no reruns waits its turn instead of being lost."""
    n = uid()
    holder = mixed_holder_task.delay(n, 1.0)
    info = wait_held(locks, f"mixed:{n}")
    assert HANDS_ON_RERUNS not in info.holder
    assert mixed_webhook_task.delay(n).get(timeout=15, interval=0.01) == "ran"
    assert holder.get(timeout=10, interval=0.01) == "held"
    assert ran("mixed-webhook", n) == 1


def test_on_lost_log_warns_and_keeps_the_result(
    locks: LockService, task_log: list[logging.LogRecord]
) -> None:
    """lock_on_lost='log' (default): a WARNING names the key, and carries the task's name and
    id for Celery's task format (it is logged from the heartbeat thread); the result is kept."""
    n = uid()
    result = lost_log_task.delay(n)
    info = wait_held(locks, f"lost-log:{n}")
    assert locks.force_release(f"lost-log:{n}", info.token)
    assert result.get(timeout=10, interval=0.01) == "returned"
    warnings = [r for r in task_log if r.levelno == logging.WARNING and f"lost-log:{n}" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in task_log]  # one report per run
    assert all(
        getattr(r, "task_id", None) == result.id and getattr(r, "task_name", None) == lost_log_task.name
        for r in warnings
    )


def test_self_retry_releases_the_lock_before_the_retry_is_sent(locks: LockService) -> None:
    """self.retry() releases the lock before publishing, so the retried run is never skipped."""
    n = uid()
    held_at_publish: list[bool] = []

    def receiver(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("task") == self_retry_task.name and headers.get("retries") == 1:
            held_at_publish.append(locks.peek(f"self-retry:{n}") is not None)

    before_task_publish.connect(receiver)
    try:
        value = self_retry_task.delay(n).get(timeout=10, interval=0.01)
    finally:
        before_task_publish.disconnect(receiver)
    assert value == {"retries": 1}
    assert held_at_publish == [False]
    assert ran("self-retry", n) == 2


def test_own_retry_starts_the_lock_retry_count_again(locks: LockService) -> None:
    """A run that waited for its lock and then retries itself sends the retry with zero lock retries."""
    n = uid()
    lease = locks.lock(f"reset:{n}")
    result = reset_task.delay(n)
    later(0.3, lease.release)
    assert result.get(timeout=10, interval=0.01) == 0
    with _executions_mutex:
        attempts = [value for name, value in executions if name == "reset" and value[0] == n]
    assert len(attempts) == 2
    assert attempts[0][1] == 0
    assert attempts[0][2] >= 1, "the first attempt ran after at least one lock retry"
    assert attempts[1][1:] == (1, 0)


def test_autoretry_for_composes(locks: LockService) -> None:
    """autoretry_for retries through the lock: the second attempt runs instead of being skipped."""
    n = uid()
    assert autoretry_task.delay(n).get(timeout=10, interval=0.01) == {"retries": 1}
    assert ran("auto", n) == 2


def test_heartbeat_keeps_the_lease_under_the_threads_pool(locks: LockService) -> None:
    """A run three times longer than its 1 s ttl keeps its lease (same token) under threads."""
    n = uid()
    result = heartbeat_task.delay(n, 2.5)
    first = wait_held(locks, f"hb:{n}")
    time.sleep(2.0)
    assert locks.try_lock(f"hb:{n}") is None
    later_info = locks.peek(f"hb:{n}")
    assert later_info is not None
    assert later_info.token == first.token
    assert result.get(timeout=10, interval=0.01) == first.fence


def test_chain_and_group_receive_the_skip_marker(locks: LockService) -> None:
    """In a chain the next task receives the marker; in a group it is that member's result."""
    n, m = uid(), uid()
    with locks.lock(f"skip:{n}"):
        chained = chain(skip_task.s(n), echo.s()).delay().get(timeout=10, interval=0.01)
        grouped = group(skip_task.s(n), skip_task.s(m)).delay().get(timeout=10, interval=0.01)
    assert is_skipped(chained)
    assert chained["key"] == f"skip:{n}"
    assert is_skipped(grouped[0])
    assert not is_skipped(grouped[1])


def test_countdown_lock_is_taken_at_execution(locks: LockService) -> None:
    """A key held when a countdown task is sent but free when it runs does not make it skip."""
    n = uid()
    lease = locks.lock(f"skip:{n}")
    result = skip_task.apply_async((n,), countdown=0.5)
    lease.release()
    assert not is_skipped(result.get(timeout=10, interval=0.01))


def test_same_task_id_does_not_enter_a_dead_runs_lock(locks: LockService) -> None:
    """A redelivered message (same task id) finds the dead run's lease held: it does not get
    in, stores nothing under the id, and runs once the dead lease is gone (issue #10)."""
    n = uid()
    task_id = str(uuid.uuid4())
    seen: list[str] = []

    def skipped(sender: Any = None, reason: str = "", **_: Any) -> None:
        seen.append(reason)

    signals.task_skipped.connect(skipped, weak=False)
    try:
        with locks.lock(f"skip:{n}", holder={"task_id": task_id}, ttl=1.0):
            result = skip_task.apply_async((n,), task_id=task_id)
            deadline = time.monotonic() + 10
            while "redelivered" not in seen:
                assert time.monotonic() < deadline, "the copy was never handled"
                time.sleep(0.01)
        assert ran("skip", n) == 0
        assert result.state == "PENDING"  # ended with Ignore: no skip marker under the id
        deadline = time.monotonic() + 10  # its deferred copy comes back after the lease's ttl
        while ran("skip", n) == 0:
            assert time.monotonic() < deadline, "the run with a free key never happened"
            time.sleep(0.01)
        assert result.get(timeout=10, interval=0.01)["n"] == n
    finally:
        signals.task_skipped.disconnect(skipped)


def test_custom_base_still_locks(locks: LockService) -> None:
    """exclusive_task(base=MyTask) mixes ExclusiveTask in: it locks, and MyTask.__call__ still runs."""
    n = uid()
    assert isinstance(based_task, ExclusiveTask)
    assert isinstance(based_task, AuditedTask)
    with locks.lock(f"based:{n}"):
        assert is_skipped(based_task.delay(n).get(timeout=10, interval=0.01))
    assert n not in AuditedTask.calls
    assert based_task.delay(n).get(timeout=10, interval=0.01) == n
    assert AuditedTask.calls.count(n) == 1


def test_app_task_base_form_locks(locks: LockService) -> None:
    """@app.task(base=ExclusiveTask, lock_key=...) locks like the decorator."""
    n = uid()
    with locks.lock(f"classic:{n}"):
        assert is_skipped(classic_task.delay(n).get(timeout=10, interval=0.01))
    assert classic_task.delay(n).get(timeout=10, interval=0.01) == n
    assert ran("classic", n) == 1


def test_shared_task_style_locks(locks: LockService) -> None:
    """@exclusive_task without app= registers on the app like shared_task, and locks."""
    n = uid()
    task = app.tasks[shared_style_task.name]
    with locks.lock(f"shared:{n}"):
        assert is_skipped(task.delay(n).get(timeout=10, interval=0.01))
    assert task.delay(n).get(timeout=10, interval=0.01) == n
    assert ran("shared", n) == 1


def test_direct_call_is_locked_too(locks: LockService) -> None:
    """Calling the task directly in-process applies the lock like a worker run."""
    n = uid()
    with locks.lock(f"skip:{n}"):
        assert is_skipped(skip_task(n))
    assert skip_task(n)["key"] == f"skip:{n}"


def test_body_sees_its_own_request_under_the_worker(locks: LockService) -> None:
    """Under the worker the body runs in the request the worker pushed (no second copy),
    with its id, args and current_task; a direct call from inside its own body still gets
    a request of its own."""
    n = uid()
    result = context_task.delay(n)
    seen = result.get(timeout=10, interval=0.01)
    assert seen["id"] == result.id
    assert seen["current"] == result.id
    assert seen["args"] == [n]
    assert seen["depth"] == 1
    assert seen["nested"] == [f"{n}-inner"]
    assert locks.peek(f"context:{n}") is None


@pytest.fixture
def eager() -> Iterator[None]:
    """task_always_eager on for one test."""
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def test_always_eager_still_locks(locks: LockService, eager: None) -> None:
    """Under task_always_eager the lock is applied: a held key skips; retry waits inline."""
    n = uid()
    with locks.lock(f"skip:{n}"):
        assert is_skipped(skip_task.delay(n).get())
    lease = locks.lock(f"retry:{n}")
    later(0.3, lease.release)
    started = time.monotonic()
    assert retry_task.delay(n).get()["retries"] == 0
    assert time.monotonic() - started >= 0.25
    with locks.lock(f"raise:{n}"), pytest.raises(LockedError):
        raise_task.delay(n).get()


@exclusive_task(app=app, key="coolretry:{n}", cooldown=0.5, bind=True)
def cooled_retrying(self: Any, n: str) -> dict[str, Any]:
    if not self.request.retries:
        raise self.retry(countdown=0)
    return {"retries": self.request.retries}


def test_an_eager_retry_within_the_cooldown_waits_for_its_end(eager: None) -> None:
    """Eager, as on a worker: a retry that finds its previous attempt's key cooling runs once
    the cooldown is over (inline, as an eager lock retry waits), not skipped by it."""
    started = time.monotonic()
    assert cooled_retrying.delay(uid()).get() == {"retries": 1}
    assert time.monotonic() - started >= 0.45


def test_heartbeat_keeps_the_lease_under_the_solo_pool(locks: LockService) -> None:
    """Under the solo pool (the worker's own thread runs the task) the lease outlives its 1 s ttl."""
    n = uid()
    with start_worker(
        app, pool="solo", perform_ping_check=False, queues=["ce-embedded-solo"], shutdown_timeout=30
    ):
        result = heartbeat_task.apply_async((n, 2.5), queue="ce-embedded-solo")
        first = wait_held(locks, f"hb:{n}")
        time.sleep(2.0)
        later_info = locks.peek(f"hb:{n}")
        assert later_info is not None
        assert later_info.token == first.token
        assert result.get(timeout=10, interval=0.01) == first.fence
