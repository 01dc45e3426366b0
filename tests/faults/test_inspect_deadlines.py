"""Inspection and operator calls end by ``call_timeout`` on a silent store (issue #17).

``peek``, ``locks``, ``completion``, ``completions``, ``forget`` and ``force_release`` get
the same per-call deadline as ``lock``: a store behind a stalled relay (it accepts bytes
and answers nothing, like a network that went silent) makes each raise BackendError
within ``call_timeout``, never hang on the driver's own timeouts (tens of seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from celery_exclusive import BackendError, LockService
from tests.faults.conftest import Backend, Faults

CALL_TIMEOUT = 1.0
#: Thread start, the proxy's stall hand-shake and a loaded 2-core machine.
SLACK = 1.5

CALLS: dict[str, Callable[[LockService], object]] = {
    "peek": lambda s: s.peek("k"),
    "locks": lambda s: s.locks(),
    "completion": lambda s: s.completion("k", "task-1"),
    "completions": lambda s: s.completions(),
    "forget": lambda s: s.forget("k", "task-1"),
    "force_release": lambda s: s.force_release("k", "some-token"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_inspection_calls_end_by_call_timeout_on_a_silent_store(
    backend: Backend, faults: Faults, name: str
) -> None:
    """Each call answers on a healthy relay, then raises BackendError within call_timeout once
    the relay goes silent; the service still works after the relay resumes."""
    proxy = faults.proxy(backend.port)
    service = faults.service(backend.url(proxy.port), call_timeout=CALL_TIMEOUT)
    call = CALLS[name]
    call(service)  # connected and warm: the next call goes out on a connection that goes silent
    proxy.stall()
    try:
        started = time.monotonic()
        with pytest.raises(BackendError):
            call(service)
        took = time.monotonic() - started
        assert took <= CALL_TIMEOUT + SLACK, f"{name}() took {took:.3f} s on a silent store"
    finally:
        proxy.resume()
    proxy.cut()  # the abandoned connection is not to be reused
    deadline = time.monotonic() + 15
    while True:  # a connection broken by the cut may fail one more call
        try:
            call(service)
            break
        except BackendError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
