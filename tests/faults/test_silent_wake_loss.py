"""A release listener whose connection dies silently: packets vanish, no reset, no error.

The other wake-up faults (``test_redis_wake_faults.py``, the contract suite's terminated
backends) kill the listener's connection, and the client hears of it at once. Here an
nftables rule on this host drops only the listener connection's packets (its 4-tuple on
loopback, both ways), the way a cut link or a firewall loses them: its socket looks alive,
no error comes, no notification arrives, while the pool's connections (the lock
statements) keep working. The holder releases; the waiter must acquire within the poll
bound (``waiting.POLL_MAX`` plus one attempt) all the same, a ``wait=`` must not overrun
its timeout by more than 100 ms (issue 13; README: one store round trip), and the
listener must notice the dead connection on its own and wake later waits again
(docs/scaling.md, "A listener connection that dies silently", "A subscriber connection
that dies silently"). Each rule is deleted in ``finally``; only the private servers'
connections are touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_exclusive import LockedError, LockService, ReleaseOutcome
from celery_exclusive.providers import _pg_listen, _redis_wake
from celery_exclusive.waiting import POLL_MAX
from tests.faults.conftest import SLACK, holder_and_waiter, wait_until
from tests.faults.servers import PrivatePostgres, PrivateRedis

#: What a ``wait=`` may overrun its timeout by (issue 13: 100 ms), plus the machine's slack.
OVERRUN = 0.1 + SLACK


class Blackhole:
    """Drops every packet of one TCP connection on loopback (both ways), without a reset."""

    def __init__(self, local: tuple[str, int], peer: tuple[str, int]) -> None:
        if os.geteuid() != 0 or shutil.which("nft") is None:
            pytest.skip("nftables rules need root and nft")
        self.table = f"cesilent{os.getpid()}p{local[1]}"
        self.local, self.peer = local, peer

    def start(self) -> float:
        (lip, lport), (pip, pport) = self.local, self.peer
        script = (
            f"table inet {self.table} {{\n  chain out {{\n    type filter hook output priority 0;\n"
            f"    ip saddr {lip} tcp sport {lport} ip daddr {pip} tcp dport {pport} drop\n"
            f"    ip saddr {pip} tcp sport {pport} ip daddr {lip} tcp dport {lport} drop\n  }}\n}}\n"
        )
        done = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        return time.monotonic()

    def close(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True, check=False)


@contextlib.contextmanager
def blackholed(sock: socket.socket) -> Iterator[Blackhole]:
    hole = Blackhole(sock.getsockname()[:2], sock.getpeername()[:2])
    try:
        hole.start()
        yield hole
    finally:
        hole.close()


def pg_listener_socket(service: LockService) -> tuple[_pg_listen.Listener, socket.socket]:
    listener = service.provider._listening.listener  # type: ignore[attr-defined]
    assert listener is not None
    assert listener._conn is not None
    return listener, socket.socket(fileno=os.dup(listener._conn.pgconn.socket))


def redis_listener_socket(service: LockService) -> tuple[_redis_wake._Link, socket.socket]:
    signals = service.provider._signals  # type: ignore[attr-defined]
    assert signals is not None
    (link,) = signals._links.values()
    return link, link.conn._sock


def handover(holder: LockService, waiter: LockService, key: str, before_release: Any = None) -> float:
    """Hold ``key``, let ``waiter`` wait for it in a thread, release: seconds from the release
    to the waiter's lease. ``before_release()`` runs once the waiter listens."""
    lease = holder.lock(key, ttl=30)
    got: list[Any] = []

    def run() -> None:
        try:
            got.append((waiter.lock(key, ttl=30, wait=20), time.monotonic()))
        except Exception as exc:  # pragma: no cover - reported below
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)  # the waiter is refused and subscribed
    if before_release is not None:
        before_release()
    released = time.monotonic()
    assert lease.release() is ReleaseOutcome.RELEASED
    thread.join(25)
    ((won, acquired),) = got
    won.release()
    return float(acquired - released)


def timed_out_wait(holder: LockService, waiter: LockService, key: str, wait: float) -> float:
    """Seconds a ``waiter.lock(key, wait=wait)`` on a held key overran its timeout."""
    lease = holder.lock(key, ttl=30)
    try:
        start = time.monotonic()
        with pytest.raises(LockedError):
            waiter.lock(key, ttl=30, wait=wait)
        return time.monotonic() - start - wait
    finally:
        lease.release()


@pytest.fixture
def pg_services(pg_server: PrivatePostgres) -> Iterator[tuple[LockService, LockService]]:
    yield from holder_and_waiter(pg_server.url, "sl")


@pytest.fixture
def redis_services(redis_server: PrivateRedis) -> Iterator[tuple[LockService, LockService]]:
    yield from holder_and_waiter(redis_server.url, "sl")


def test_pg_silently_dead_listener_costs_only_latency_and_recovers(
    pg_services: tuple[LockService, LockService],
) -> None:
    holder, waiter = pg_services
    assert handover(holder, waiter, "a") <= 0.05 + SLACK  # woken: the listener is up
    listener, sock = pg_listener_socket(waiter)
    # An idle listener (a long wait: nothing sent) is noticed by libpq's keepalives, the
    # URL defaults of _sql_common (10 s idle, 3 probes 5 s apart): not waited for here.
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
    dead_pid = listener.backend_pid
    with sock, blackholed(sock):
        # Cut while the waiter listens: its release notification is lost; it polls.
        latency = handover(holder, waiter, "a")
        assert latency <= POLL_MAX + SLACK, latency
        # Later waits while the listener is still on the dead connection: bounded too.
        assert timed_out_wait(holder, waiter, "b", 0.3) <= OVERRUN
        assert handover(holder, waiter, "c") <= POLL_MAX + SLACK
        # The listener notices: its next command on the connection (the waits above sent a
        # LISTEN or a waiter registration each) times out after COMMAND_TIMEOUT.
        limit = _pg_listen.COMMAND_TIMEOUT + 2 * SLACK
        # (None: dropped, and not reopened while nobody in the process waits)
        assert wait_until(lambda: listener.backend_pid != dead_pid, timeout=limit)
    # Woken again by notifications on the new connection.
    assert min(handover(holder, waiter, "d") for _ in range(3)) <= 0.05 + SLACK


def test_redis_silently_dead_subscriber_costs_only_latency_and_recovers(
    redis_services: tuple[LockService, LockService], monkeypatch: pytest.MonkeyPatch
) -> None:
    holder, waiter = redis_services
    monkeypatch.setattr(_redis_wake, "STALLED_FOR", 2.0)  # the test's recovery window, not 30 s
    assert handover(holder, waiter, "a") <= 0.05 + SLACK
    link, sock = redis_listener_socket(waiter)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == _redis_wake.KEEPALIVE[0]
    with blackholed(sock):
        latency = handover(holder, waiter, "a")
        assert latency <= POLL_MAX + SLACK, latency
        # A new subscription goes unconfirmed on the dead connection: the wait must still end
        # on time (the confirmation wait is bounded by the wait's own timeout).
        assert timed_out_wait(holder, waiter, "b", 0.3) <= OVERRUN
        assert handover(holder, waiter, "c") <= POLL_MAX + SLACK
        # The dead link is dropped (an unconfirmed subscription) within CONFIRM_TIMEOUT.
        assert wait_until(lambda: not link.alive, timeout=_redis_wake.CONFIRM_TIMEOUT + 2 * SLACK)
    # After STALLED_FOR a new connection is made and waits are woken again.
    time.sleep(2.0)
    assert min(handover(holder, waiter, "d") for _ in range(3)) <= 0.05 + SLACK


def test_redis_silently_dead_idle_subscriber_is_noticed_by_keepalive(
    redis_services: tuple[LockService, LockService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long wait subscribed before the cut sends nothing on the dead connection: TCP
    keepalive (``KEEPALIVE``, lowered here to 1 + 2 x 1 s) fails it, its subscription breaks
    (the waiter polls, and still acquires within the poll bound), and the next wait is woken
    on a new connection. Without keepalive the connection stayed alive-looking forever."""
    holder, waiter = redis_services
    monkeypatch.setattr(_redis_wake, "KEEPALIVE", (1, 1, 2))
    assert handover(holder, waiter, "a") <= 0.05 + SLACK  # the link, made with the lowered keepalive
    link, sock = redis_listener_socket(waiter)
    with contextlib.ExitStack() as cut:

        def cut_then_until_lost() -> None:  # the waiter is subscribed already: nothing more is sent
            cut.enter_context(blackholed(sock))
            assert wait_until(lambda: not link.alive, timeout=3.0 + 3 * SLACK)

        assert handover(holder, waiter, "a", before_release=cut_then_until_lost) <= POLL_MAX + SLACK
    assert min(handover(holder, waiter, "d") for _ in range(3)) <= 0.05 + SLACK
