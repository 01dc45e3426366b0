"""``LockService.close()`` on every store: after it nothing touches the store, and a lock()
under way while it runs leaves no lease, no heartbeat and no connection behind.

Connections are counted as this process's open sockets (Linux ``/proc/self/fd``): none on
the memory and SQLite stores, so there only the answers are checked. A server store that goes
silent once connected (packets dropped, no reset) is the shared server behind a stalled
relay (``tests/faults/servers.TcpProxy``): ``tests/silent.py``'s server never answers at
all, so no lease could be taken on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from celery_exclusive import InvalidArgumentError, LockService, ReleaseOutcome, signals
from celery_exclusive._options import store_from
from celery_exclusive.providers.base import LockProvider
from celery_exclusive.service import RELEASE_TIMEOUT
from tests.conftest import Store
from tests.faults.servers import TcpProxy


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


@pytest.mark.parametrize("limit", [1, 3])
def test_callers_waiting_for_a_held_key_when_close_runs_raise_that_it_is_closed(
    store: Store, limit: int
) -> None:
    """lock(wait=), try_lock(wait=) and lock_many(wait=) waiting (each refused at least
    once) on a key another service holds when close() runs: each raises InvalidArgumentError
    saying the service is closed, long before its wait ends (bounded by a hang guard, not
    timed), none answers "not acquired", and no lease is left on the key but the holder's
    (a release signal's listener, PostgreSQL's LISTEN connection, Redis's pub/sub, SQLite's
    waiter marks, is closed with the store)."""
    holder, service = store.service(), store.service()
    held = [holder.lock("k", ttl=60, limit=limit) for _ in range(limit)]
    refused = threading.Semaphore(0)

    def contended(sender: object = None, **_: Any) -> None:
        if sender is service:
            refused.release()

    calls: list[Callable[[], object]] = [
        lambda: service.lock("k", ttl=60, limit=limit, wait=60),
        lambda: service.try_lock("k", ttl=60, limit=limit, wait=60),
        lambda: service.lock_many(["free", "k"], ttl=60, wait=60),
    ]
    answers: list[object] = []

    def call(each: Callable[[], object]) -> None:
        try:
            answers.append(each())
        except BaseException as exc:
            answers.append(exc)

    signals.lock_contended.connect(contended, weak=False)
    try:
        threads = [threading.Thread(target=call, args=(each,), daemon=True) for each in calls]
        for thread in threads:
            thread.start()
        for _ in threads:
            assert refused.acquire(timeout=10)
        service.close()
        for thread in threads:
            thread.join(10 * store.slack)  # a hang guard: each waits 60 s otherwise
    finally:
        signals.lock_contended.disconnect(contended)
    assert not any(thread.is_alive() for thread in threads)
    assert len(answers) == 3
    assert all(isinstance(answer, InvalidArgumentError) and "closed" in str(answer) for answer in answers), (
        answers
    )
    assert sorted((info.key, info.token) for info in holder.locks()) == sorted(
        (lease.store_key[len(holder.prefix) :], lease.token) for lease in held
    )


def _via(url: str, port: int) -> str:
    """``url`` with its port replaced by ``port``."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit(":", 1)[0] if parts.port is not None else parts.netloc
    return urlunsplit(parts._replace(netloc=f"{netloc}:{port}"))


def _finishes(action: Callable[[], None], guard: float) -> bool:
    """Run ``action`` in a thread; whether it ended within ``guard`` seconds (a hang guard)."""
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    thread.join(guard)
    return not thread.is_alive()


def _open_to(port: int) -> int:
    """This process's open sockets connected to ``port`` on 127.0.0.1 (``/proc/net/tcp``: a
    socket closed here has no inode there, even while its connection lingers)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
    with open("/proc/net/tcp", encoding="ascii") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(
        1 for row in rows if int(row[2].rsplit(":", 1)[1], 16) == port and f"socket:[{row[9]}]" in mine
    )


def _calls_in_flight() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "celery-exclusive-call" and t.is_alive()]


#: Leases held when the store goes silent: a close() releasing them one deadline each would
#: take 20 x 2 s; the guard is far below that and far above one deadline.
SILENT_LEASES = 20


def test_close_on_a_store_gone_silent_gives_its_releases_one_deadline_in_all(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops answering (a stalled relay: packets dropped, no reset) with leases
    held and their refresh in flight: close() still ends the service, its unanswered
    releases given RELEASE_TIMEOUT in all, not one per lease, and without waiting for the
    heartbeat's call; the leases it did not release stay in the store (until their ttl).
    The bound asserted is only a hang guard (8 deadlines x the time slack). The warnings
    say the leases end at their ttl, not that they will be retried: nothing retries them."""
    if not store.cross_process or store.name == "sqlite":
        pytest.skip("no server to go silent")
    direct = store.service()
    port = urlsplit(store.url).port
    assert port is not None
    keys = [f"silent-{i}" for i in range(SILENT_LEASES)]
    proxy = TcpProxy(port)
    service = LockService(_via(store.url, proxy.port), prefix=direct.prefix)
    try:
        for key in keys:
            service.lock(key, ttl=60, refresh_interval=0.3)
        proxy.stall()
        time.sleep(0.5)  # a refresh is sent and unanswered
        with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
            assert _finishes(lambda: service.close(release=True), 8 * RELEASE_TIMEOUT * store.slack)
        said = [r.getMessage() for r in caplog.records if "could not release" in r.getMessage()]
        assert said, "close() did not say which releases went unanswered"
        assert all("at close" in text and "ends at its ttl" in text for text in said), said
        with pytest.raises(InvalidArgumentError, match="closed"):
            service.peek("silent-0")
        assert sum(direct.peek(key) is not None for key in keys) == SILENT_LEASES
    finally:
        proxy.resume()
        service.close(release=False)
        proxy.close()
    for key in keys:
        info = direct.peek(key)
        if info is not None:
            direct.force_release(key, info.token)


@contextlib.contextmanager
def _refresh_in_flight(
    store: Store, *keys: str
) -> Iterator[tuple[LockService, TcpProxy, list[threading.Thread]]]:
    """A service reaching the store through a relay, holding ``keys`` (refreshed every 0.3 s),
    the relay stalled until a refresh is sent and unanswered: (the service, the relay, the
    refresh's call threads). At the end the relay resumes, the service is closed and the
    leases released."""
    if not store.cross_process or store.name == "sqlite":
        pytest.skip("no server to go silent")
    direct = store.service()
    port = urlsplit(store.url).port
    assert port is not None
    proxy = TcpProxy(port)
    service = LockService(_via(store.url, proxy.port), prefix=direct.prefix)
    try:
        leases = [service.lock(key, ttl=60, refresh_interval=0.3) for key in keys]
        earlier = set(_calls_in_flight())
        proxy.stall()
        time.sleep(0.5)  # a refresh is sent and unanswered
        calls = [call for call in _calls_in_flight() if call not in earlier]
        assert calls
        yield service, proxy, calls
    finally:
        proxy.resume()
        service.close(release=False)
        proxy.close()
    for lease in leases:
        direct.force_release(lease.key, lease.token)


def test_a_refresh_answered_after_close_leaves_no_connection_open(store: Store) -> None:
    """close(release=False) while the heartbeat's refresh waits on a silent server (a stalled
    relay) returns without waiting for it; once the server answers again the refresh's call
    ends, and the connection it used or opened is closed with the store (the call closes it
    again), none left open to the server."""
    with _refresh_in_flight(store, "answered-late") as (service, proxy, calls):
        assert _finishes(lambda: service.close(release=False), 10 * store.slack)
        proxy.resume()
        for call in calls:
            call.join(30)
            assert not call.is_alive()
        assert _open_to(proxy.port) == 0


def test_a_refresh_failing_after_close_says_its_lease_ends_at_its_ttl(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """close(release=False) while the heartbeat's refresh waits on a silent server, then the
    connection is reset: the refresh fails after close() returned, and its warning says the
    lease ends at its ttl (the heartbeat has stopped), not that it will be retried."""
    with _refresh_in_flight(store, "failed-late") as (service, proxy, calls):
        with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
            service.close(release=False)
            proxy.cut()
            for call in calls:
                call.join(30)
                assert not call.is_alive()
        said = [r.getMessage() for r in caplog.records if "could not refresh" in r.getMessage()]
        assert said, "the refresh did not fail"
        wanted = ("after close", "end at their ttl")
        assert all("will retry" not in text and all(w in text for w in wanted) for text in said), said


def test_a_refresh_failing_while_close_releases_says_its_leases_end_at_their_ttl(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """close(release=True) on a silent server (a stalled relay) with two leases held: the
    first release waits its deadline (RELEASE_TIMEOUT) while the heartbeat, not stopped yet,
    gives up the refreshes of the other lease. Those warnings say it ends at its ttl unless
    close() releases it, not that it will be retried: the heartbeat stops when the releases
    end, and nothing refreshes it after close()."""
    with _refresh_in_flight(store, "closing-a", "closing-b") as (service, _, _):
        with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
            closing = threading.Thread(target=lambda: service.close(release=True), daemon=True)
            closing.start()
            time.sleep(0.05)  # close() has begun
            began = time.time()
            closing.join(8 * RELEASE_TIMEOUT * store.slack)
            assert not closing.is_alive()
        late = [r.getMessage() for r in caplog.records if r.created > began]
        said = [text for text in late if "could not refresh" in text]
        assert said, "no refresh was given up while close() released"
        wanted = ("while close() releases", "end at their ttl")
        assert all("will retry" not in text and all(w in text for w in wanted) for text in said), said
