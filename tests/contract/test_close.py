"""``LockService.close()`` on every store: after it nothing touches the store, and a lock()
under way while it runs leaves no lease, no heartbeat and no connection behind.

Connections are counted as this process's open sockets (Linux ``/proc/self/fd``): none on
the memory and SQLite stores, so there only the answers are checked.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import pytest

from celery_exclusive import InvalidArgumentError, LockService, ReleaseOutcome
from celery_exclusive._options import store_from
from celery_exclusive.providers.base import LockProvider
from tests.conftest import Store


def _sockets() -> int:
    """This process's open sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own fd, closed since
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_a_closed_service_touches_the_store_no_more(store: Store) -> None:
    """After close(release=False) the lease it left held stays held (a release answers
    UNKNOWN without a store call) and every call on the service raises
    InvalidArgumentError, none opening a connection."""
    service, other = store.service(), store.service()
    lease = service.lock("k", ttl=30)
    other.peek("k")  # its connection made before the count
    service.close(release=False)
    before = _sockets()
    assert lease.release() is ReleaseOutcome.UNKNOWN
    for call in (
        lambda: service.peek("k"),
        service.locks,
        lambda: service.force_release("k", lease.token),
        lambda: service.mark("m"),
        lambda: service.lock("k2"),
        lambda: service.try_lock("k2"),
    ):
        with pytest.raises(InvalidArgumentError, match="closed"):
            call()
    assert _sockets() <= before
    info = other.peek("k")
    assert info is not None
    assert info.token == lease.token
    assert other.force_release("k", lease.token)


class _Paused:
    """A store whose next acquire waits for ``go`` once it has set ``entered``."""

    def __init__(self, inner: LockProvider) -> None:
        self._inner = inner
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def acquire(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.go.wait(10)
        return self._inner.acquire(*args, timeout=timeout, **kwargs)


@pytest.mark.parametrize("release", [True, False])
def test_a_lock_under_way_when_close_runs_gets_no_lease(store: Store, release: bool) -> None:
    """A lock() past the closed check when close() runs, its acquire answered after close()
    returned: it raises InvalidArgumentError, the key is free, no heartbeat runs and no
    connection is left open."""
    other = store.service()
    other.peek("k")  # its connection made before the count
    before = _sockets()
    inner = other.provider if store.name == "memory" else store_from(store.url)[1]
    paused = _Paused(inner)
    service = LockService(paused, prefix=other.prefix)  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def lock() -> None:
        try:
            service.lock("k", ttl=30)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=lock)
    thread.start()
    assert paused.entered.wait(10)
    service.close(release=release)
    paused.go.set()
    thread.join(10)
    assert len(raised) == 1
    assert isinstance(raised[0], InvalidArgumentError), raised
    assert not service.heartbeat.running
    assert service.held() == []
    assert other.peek("k") is None
    assert _sockets() <= before
