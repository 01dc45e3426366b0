"""``on_locked="wait"`` on Celery's embedded test worker (threads pool), memory broker and store.

The test holds the tasks' keys through the same in-memory store (``get_lock_service(app)``),
whose releases wake waiting runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_exclusive.errors import InvalidArgumentError, LockedError, LockRetriesExceeded
from celery_exclusive.service import LockService
from celery_exclusive.task import exclusive_task, is_skipped
from celery_exclusive.worker import get_lock_service
from tests.celery.conftest import embedded_app, embedded_worker, uid

app = embedded_app("ce_wait", "ce-wait")


@exclusive_task(app=app, key="wait:{n}", on_locked="wait", lock_wait=5)
def wait_task(n: str) -> str:
    return f"ran {n}"


@exclusive_task(app=app, key="wait-skip:{n}", on_locked="wait", lock_wait=0.4)
def wait_then_skip_task(n: str) -> str:
    return "ran"


@exclusive_task(app=app, key="wait-raise:{n}", on_locked="wait", lock_wait=0.3, lock_wait_fallback="raise")
def wait_then_raise_task(n: str) -> str:
    return "ran"


@exclusive_task(
    app=app,
    key="wait-retry:{n}",
    on_locked="wait",
    lock_wait=0.3,
    lock_wait_fallback="retry",
    lock_max_retries=0,
)
def wait_then_retry_task(n: str) -> str:
    return "ran"


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    yield from embedded_worker(app, 4)


@pytest.fixture
def locks(worker: Any) -> LockService:
    return get_lock_service(app)


def test_a_waiting_run_gets_the_key_when_the_holder_releases(locks: LockService) -> None:
    n = uid()
    lease = locks.lock(f"wait:{n}")
    result = wait_task.delay(n)
    time.sleep(0.5)
    assert not result.ready()  # waiting in its worker slot, not skipped
    released = time.monotonic()
    lease.release()
    assert result.get(timeout=10, interval=0.01) == f"ran {n}"
    assert time.monotonic() - released < 2.0


def test_the_wait_runs_out_into_the_default_fallback_skip(locks: LockService) -> None:
    n = uid()
    with locks.lock(f"wait-skip:{n}"):
        started = time.monotonic()
        value = wait_then_skip_task.delay(n).get(timeout=10, interval=0.01)
        elapsed = time.monotonic() - started
    assert is_skipped(value)
    assert value["key"] == f"wait-skip:{n}"
    assert 0.4 <= elapsed <= 3.0


def test_the_wait_runs_out_into_raise(locks: LockService) -> None:
    n = uid()
    with locks.lock(f"wait-raise:{n}"), pytest.raises(LockedError) as raised:
        wait_then_raise_task.delay(n).get(timeout=10, interval=0.01)
    assert raised.value.key == f"wait-raise:{n}"


def test_the_wait_runs_out_into_retry(locks: LockService) -> None:
    n = uid()
    with locks.lock(f"wait-retry:{n}"), pytest.raises(LockRetriesExceeded):
        wait_then_retry_task.delay(n).get(timeout=10, interval=0.01)


def test_a_direct_call_waits_inline(locks: LockService) -> None:
    n = uid()
    lease = locks.lock(f"wait:{n}")
    started = time.monotonic()
    threading.Timer(0.3, lease.release).start()
    assert wait_task(n) == f"ran {n}"
    assert 0.3 <= time.monotonic() - started <= 2.0


@pytest.mark.parametrize(
    "options",
    [
        {"lock_wait_fallback": "rerun"},
        {"lock_wait_fallback": "wait"},
        {"lock_wait": -1},
        {"lock_wait": float("nan")},
        {"lock_wait": 10**6},
    ],
)
def test_bad_wait_options_are_refused_when_declared(options: dict[str, Any]) -> None:
    def body() -> None:
        return None

    with pytest.raises(InvalidArgumentError):
        exclusive_task(app=app, key="bad", on_locked="wait", name=f"bad-{uid()}", **options)(body)
