"""Exceptions a signal handler raises into a thread waiting on the store (issue #17, item 5).

Celery's soft time limit raises ``SoftTimeLimitExceeded`` (an ``Exception``) from a SIGUSR1
handler in whatever the task is doing, an acquire included. It must reach the task
unchanged: not be taken for a store outage (BackendError), not be retried away. Only the
driver's and the network's errors are the store's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from types import FrameType

import pytest

from celery_exclusive import BackendError
from tests.faults.conftest import ROOT, SLACK, Backend, Faults, start_worker, wait_until

pytestmark = pytest.mark.slow

CALL_TIMEOUT = 2.0


class SoftLimit(Exception):
    """Stands for SoftTimeLimitExceeded: an Exception, not a BaseException."""


@contextlib.contextmanager
def alarm(after: float, raising: type[BaseException]) -> Iterator[None]:
    """Raise ``raising`` from a SIGALRM handler ``after`` seconds into the block."""

    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise raising("raised by a signal handler")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, after)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("raising", [SoftLimit, KeyboardInterrupt])
def test_signal_during_a_stalled_acquire_propagates_unchanged(
    backend: Backend, faults: Faults, raising: type[BaseException]
) -> None:
    """The handler's exception leaves ``lock()`` as it is, once (no retry), by the call's deadline;
    the token the interrupted acquire may have recorded is released in the background."""
    proxy = faults.proxy(backend.port)
    service = faults.service(
        backend.url(proxy.port, application_name="ce-signal"), ttl=60, call_timeout=CALL_TIMEOUT
    )
    service.lock("warm").release()  # connected, and the schema exists
    rival = faults.service(backend.url(application_name="ce-signal-rival"))
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(raising) as raised, alarm(0.3, raising):
        service.lock("blocked")
    elapsed = time.monotonic() - started
    assert type(raised.value) is raising
    assert not isinstance(raised.value, BackendError)
    # The socket wait is interrupted at once: Redis's read, and PostgreSQL's (the libpq
    # runner waits for the reply in Python, not inside libpq, so the handler runs at once).
    assert elapsed <= 0.3 + SLACK, elapsed
    proxy.resume()
    assert wait_until(lambda: rival.peek("blocked") is None, 10), "the interrupted acquire left a 60 s lease"
    assert wait_until(lambda: not service.heartbeat._pending_release, 10)
    faults.record(store=backend.name, raised=raising.__name__, interrupt_to_raise_s=round(elapsed - 0.3, 3))


@pytest.mark.parametrize("raising", [SoftLimit, KeyboardInterrupt])
def test_signal_during_a_stalled_release_propagates_and_the_release_is_finished(
    backend: Backend, faults: Faults, raising: type[BaseException]
) -> None:
    """The handler's exception leaves ``release()`` as it is, and the heartbeat finishes the
    release once the store answers: the interrupted release used to leave the key held,
    kept and released by no one, until its ttl (60 s here)."""
    proxy = faults.proxy(backend.port)
    service = faults.service(
        backend.url(proxy.port, application_name="ce-signal"), ttl=60, call_timeout=CALL_TIMEOUT
    )
    lease = service.lock("held")
    rival = faults.service(backend.url(application_name="ce-signal-rival"))
    proxy.stall()
    with pytest.raises(raising), alarm(0.3, raising):
        lease.release()
    proxy.cut()  # the interrupted request dies with its connection
    proxy.resume()
    assert wait_until(lambda: rival.peek("held") is None, 10), "the interrupted release left a 60 s lease"
    assert wait_until(lambda: not service.heartbeat._pending_release, 10)


def test_celery_soft_time_limit_during_acquire_fails_the_task(
    redis_backend: Backend, faults: Faults, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prefork worker whose acquire stalls past the task's soft_time_limit (1 s): the task fails
    with SoftTimeLimitExceeded, and its body never runs (on main it ran once the store answered)."""
    from celery.exceptions import SoftTimeLimitExceeded

    proxy = faults.proxy(redis_backend.port)
    broker = f"redis://127.0.0.1:{redis_backend.port}/3"
    queue = f"cefaults-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CE_FAULT_BROKER": broker,
        "CE_FAULT_QUEUE": queue,
        "CELERY_EXCLUSIVE_URL": redis_backend.url(proxy.port),
        "CELERY_EXCLUSIVE_PREFIX": faults.prefix,
    }
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    worker = start_worker("tests.faults._celery_app", queue, env, log)
    try:
        assert wait_until(lambda: " ready." in log.read_text(errors="replace"), 60), log.read_text()
        os.environ["CE_FAULT_BROKER"], os.environ["CE_FAULT_QUEUE"] = broker, queue
        from tests.faults import _celery_app

        _celery_app.app.conf.broker_url = _celery_app.app.conf.result_backend = broker
        # A first task with the store healthy: the pool child has opened the store (the
        # worker hooks do at process start) and holds a connection that will go silent.
        warm = _celery_app.soft_limited.apply_async(("warm",), queue=queue)
        assert warm.get(timeout=60) == "ran warm"
        proxy.stall()  # before the task starts: its acquire waits on a silent store
        sent = time.monotonic()
        result = _celery_app.soft_limited.apply_async(("t1",), queue=queue)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=30, propagate=True)
        failed_after = time.monotonic() - sent
        proxy.resume()
        assert result.state == "FAILURE"
        assert "ran t1" not in log.read_text(errors="replace")
        assert "ran warm" in log.read_text(errors="replace")  # the log does show a body's result
        assert failed_after < 1.0 + 5.0, failed_after
    finally:
        proxy.resume()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)  # its own process group: the pool child too
        worker.wait(10)
    faults.record(store="redis", soft_time_limit_s=1.0, send_to_failure_s=round(failed_after, 3))
