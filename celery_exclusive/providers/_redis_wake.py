"""Release signals for Redis waiters (``WakesWaiters``): sharded pub/sub on the lock key.

``release.lua`` ends, when it has freed a live lease, with ``SPUBLISH <key> ''``: the
channel is the lock key itself, so on Redis Cluster it hashes to the script's own slot
(a script may publish only there) and the message goes to that shard's nodes alone,
where plain ``PUBLISH`` would be broadcast over the cluster bus to every node. Standalone
and Sentinel use the same ``SPUBLISH``/``SSUBSCRIBE`` (on one server they behave as
``PUBLISH``/``SUBSCRIBE``), so one script and one listener serve every deployment. Pub/sub
channels are not keys: nothing is written, and a release nobody waits for costs one
publish to no one. Redis < 7 has no sharded pub/sub: the script's ``pcall`` fails quietly,
``SSUBSCRIBE`` is refused, and waiters poll.

:class:`ReleaseSignals` (one per provider and process) keeps one subscriber connection per
server (per primary on Cluster: the one owning the key's slot), opened on the first
subscription, with a daemon thread reading it and waking the subscriptions of the key a
message names. A key is subscribed while someone waits for it and unsubscribed when the
last one leaves. :meth:`ReleaseSignals.subscribe` returns once the server confirmed the
subscription, so a release after it is seen (the Protocol's "subscribe before the first
try"), or after :data:`SUBSCRIBE_WAIT` seconds (the poll bound) if it did not yet: the
subscription then signals once when the confirmation comes (a release meanwhile may have
been missed), and the waiter polls meanwhile. It used to wait :data:`CONFIRM_TIMEOUT`
seconds, so a subscriber connection that had died silently (a cut link: no reset, no
error) held every waiter up to 1 s past a release and ``wait=0.3`` up to 0.7 s past its
timeout (tests/faults/test_silent_wake_loss.py).

Losing the connection (a kill, a restart, a Sentinel failover) breaks its subscriptions:
their ``wait`` raises and the waiter polls for the rest of that wait (at the poll bound of
:mod:`celery_exclusive.waiting`); the next subscription opens a new connection. So do a
server-side ``sunsubscribe`` (a slot moved on Cluster) and a subscription not confirmed
within :data:`CONFIRM_TIMEOUT` (a deadline armed on the socket per ``SSUBSCRIBE``: the
watchdog of ``_deadline`` shuts the socket down and the reader fails; then waiters poll for
:data:`STALLED_FOR` seconds before trying to subscribe again). A connection that dies
silently is so noticed by the first subscription sent on it afterwards (within
:data:`CONFIRM_TIMEOUT`) or by TCP keepalive (:data:`KEEPALIVE`, about 25 s) while no new
key is subscribed; until then its waiters miss releases and see them by polling, within
the poll bound. A child process never uses its
parent's connections: the provider makes a new ``ReleaseSignals`` when the pid changed,
leaving the inherited one untouched.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_exclusive.providers import _deadline
from celery_exclusive.providers._redis_wire import _connect_within, as_text
from celery_exclusive.providers._signals import SignalsLost, Subscription, Watch, Woken

__all__ = [
    "CONFIRM_TIMEOUT",
    "STALLED_FOR",
    "SUBSCRIBE_WAIT",
    "ReleaseSignals",
    "SignalsLost",
    "Subscription",
    "Woken",
]

#: Seconds to connect the subscriber connection, and for the server to confirm a
#: subscription; past it the connection is given up (its waiters poll).
CONFIRM_TIMEOUT = 1.0
#: Seconds ``subscribe`` waits for the server's confirmation before returning anyway (the
#: subscription then signals once when it comes, and the waiter polls meanwhile): at most
#: the poll bound, so an unanswered subscription costs a waiter no more than polling does.
SUBSCRIBE_WAIT = 0.05
#: Seconds after a subscription went unconfirmed during which waiters poll without trying
#: to subscribe (a server or proxy that swallows SSUBSCRIBE costs one wait, not every one).
STALLED_FOR = 30.0
#: TCP keepalive of a subscriber connection (seconds idle before the first probe, between
#: probes, probes unanswered): one that died silently while its subscriptions stay (nothing
#: is sent on it) fails after about 10 + 3 x 5 s, as PostgreSQL's connections do
#: (``_sql_common``), and its waiters are told (they poll) instead of missing every
#: release unheard; the next subscription opens a new connection.
KEEPALIVE = (10, 5, 3)


class _Link:
    """One subscriber connection and the daemon thread reading it."""

    def __init__(self, signals: ReleaseSignals, node: str, conn: Any) -> None:
        self.node = node
        self.conn = conn
        self.alive = True
        #: Unsubscribes sent and not yet answered, per channel: any other ``sunsubscribe``
        #: is the server's (a slot moved away).
        self.leaving: dict[str, int] = {}
        #: One armed deadline per SSUBSCRIBE sent and not yet confirmed, oldest first (the
        #: server confirms in order): past :data:`CONFIRM_TIMEOUT` the watchdog shuts the
        #: socket down, the reader fails, and the link is lost (a silently dead connection
        #: is noticed by its next subscription).
        self.pending: list[tuple[int, _deadline.Watch]] = []
        self.thread = threading.Thread(
            target=signals._listen, args=(self,), name=f"celery-exclusive-wake {node}", daemon=True
        )


class _Watch(Watch):
    """A key's watch on one link; ``confirmed`` once the server answered its SSUBSCRIBE."""

    __slots__ = ("confirmed", "early", "link")

    def __init__(self, link: _Link, changed: threading.Condition) -> None:
        super().__init__(changed)
        self.link = link
        self.confirmed = False
        #: A subscriber returned before the confirmation: signal when it comes (a release
        #: meanwhile may have been missed).
        self.early = False


class ReleaseSignals:
    """Subscriptions to lock keys' release channels, for one provider in one process.

    ``route(key)`` names the server owning ``key`` and gives a factory of unconnected
    redis-py connections to it.
    """

    def __init__(self, route: Callable[[str], tuple[str, Callable[[], Any]]]) -> None:
        self.pid = os.getpid()
        self._route = route
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._connecting = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._watches: dict[str, _Watch] = {}
        #: Why this server cannot signal (no SSUBSCRIBE before Redis 7), once seen.
        self._unsupported: str | None = None
        #: Monotonic time until which subscribing is not tried (see :data:`STALLED_FOR`).
        self._stalled_until = 0.0

    def subscribe(self, key: str) -> Subscription:
        """Subscribe to ``key``'s releases; returns once the server confirmed it, or after
        :data:`SUBSCRIBE_WAIT` seconds (then it signals when it is). Raises a driver error or
        :class:`SignalsLost` when it cannot (the waiter then polls)."""
        return self.subscribe_any([key])

    def subscribe_any(self, keys: Sequence[str]) -> Subscription:
        """Subscribe to the releases of every one of ``keys`` (one subscription, signalled
        by any); the SSUBSCRIBEs are sent together, then their confirmations awaited. Raises
        as :meth:`subscribe` if any one cannot be made."""
        if self._unsupported is not None:
            raise SignalsLost(self._unsupported)
        if time.monotonic() < self._stalled_until:
            raise SignalsLost("a recent subscription went unconfirmed; polling for now")
        links = {key: self._link(*self._route(key)) for key in keys}
        with self._lock:
            watches: dict[str, _Watch] = {}
            try:
                for key, link in links.items():
                    if not link.alive:  # lost since: never send on it (redis-py would reconnect it)
                        raise SignalsLost(f"no subscription to releases of {key!r}")
                    found = self._watches.get(key)
                    if found is None or found.broken or found.link is not link:
                        watch = self._watches[key] = _Watch(link, self._changed)
                        self._send(link, "SSUBSCRIBE", key)
                        link.pending.append(
                            _deadline.arm(link.conn._sock.fileno(), time.monotonic() + CONFIRM_TIMEOUT)
                        )
                    else:
                        watch = found
                    watch.subscribers += 1
                    watches[key] = watch
            except BaseException:
                for taken, watch in watches.items():
                    self._leave(taken, watch)
                raise
            subscription = Subscription(self._changed, watches, self._leave)
            self._changed.wait_for(
                lambda: all(w.confirmed for w in watches.values()) or subscription.broken(), SUBSCRIBE_WAIT
            )
            if not subscription.broken():
                for watch in watches.values():
                    if not watch.confirmed:
                        watch.early = True
                return subscription
            subscription.close_locked()
        raise SignalsLost(self._unsupported or f"no subscription to releases of {', '.join(map(repr, keys))}")

    def _link(self, node: str, make: Callable[[], Any]) -> _Link:
        link = self._links.get(node)
        if link is not None and link.alive:
            return link
        with self._connecting:
            link = self._links.get(node)
            if link is not None and link.alive:
                return link
            conn = make()
            _connect_within(conn, CONFIRM_TIMEOUT)
            conn._sock.settimeout(None)  # a subscriber waits for messages as long as it takes
            _keep_alive(conn._sock)
            link = _Link(self, node, conn)
            with self._lock:  # started with it: close() joins every link it finds
                self._links[node] = link
                link.thread.start()
            return link

    def _send(self, link: _Link, *command: str) -> None:
        """Send on ``link`` (holding the lock, so commands go out in the order recorded)."""
        try:
            link.conn.send_command(*command, check_health=False)
        except Exception:
            self._lost(link)
            raise

    def _leave(self, key: str, watch: _Watch) -> None:
        """One subscriber of ``watch`` left (holding the lock); the last one unsubscribes."""
        watch.subscribers -= 1
        if watch.subscribers > 0 or self._watches.get(key) is not watch:
            return
        del self._watches[key]
        link = watch.link
        if watch.broken or not link.alive:
            return
        link.leaving[key] = link.leaving.get(key, 0) + 1
        try:
            self._send(link, "SUNSUBSCRIBE", key)
        except Exception:  # the link is marked lost; nothing is left to unsubscribe
            return

    def _listen(self, link: _Link) -> None:
        """The reader thread of ``link``: dispatch messages until the connection fails."""
        try:
            while True:
                reply = link.conn.read_response(push_request=True)
                if isinstance(reply, list) and len(reply) == 3:
                    self._dispatch(link, as_text(reply[0]), as_text(reply[1]))
        except Exception as exc:
            if "unknown command" in str(exc).lower():
                self._unsupported = "this Redis has no sharded pub/sub (SSUBSCRIBE, Redis >= 7)"
        with self._lock:
            if any(armed.fired for _, armed in link.pending):
                # A connection that stopped answering: a new one, but not at once.
                self._stalled_until = time.monotonic() + STALLED_FOR
            self._lost(link)

    def _dispatch(self, link: _Link, kind: str, key: str) -> None:
        with self._lock:
            if kind == "ssubscribe" and link.pending:
                _deadline.disarm(link.pending.pop(0)[0])
            if kind == "sunsubscribe" and link.leaving.get(key):
                link.leaving[key] -= 1
                if not link.leaving[key]:
                    del link.leaving[key]
                return
            watch = self._watches.get(key)
            if watch is None or watch.link is not link:
                return
            if kind == "smessage":
                watch.signal()
            elif kind == "ssubscribe":
                watch.confirmed = True
                if watch.early:
                    watch.signal()
                else:
                    watch.changed.notify_all()
            elif kind == "sunsubscribe":  # the server's: the slot moved; its waiters poll
                del self._watches[key]
                watch.break_off()

    def _lost(self, link: _Link) -> None:
        """``link`` is gone (holding the lock): its subscriptions break, its waiters poll."""
        for ticket, _ in link.pending:  # before the socket closes (its number may be reused)
            _deadline.disarm(ticket)
        if link.alive:
            link.alive = False
            if self._links.get(link.node) is link:
                del self._links[link.node]
            for key, watch in list(self._watches.items()):
                if watch.link is link:
                    del self._watches[key]
                    watch.break_off()
        link.conn.disconnect()

    def close(self) -> None:
        """Close every subscriber connection (their readers end; open subscriptions break)."""
        with self._lock:
            links = list(self._links.values())
            for link in links:
                self._lost(link)
        for link in links:
            if link.thread is not threading.current_thread():
                link.thread.join(CONFIRM_TIMEOUT)


def _keep_alive(sock: socket.socket) -> None:
    """Turn on :data:`KEEPALIVE` probes on ``sock`` (where the platform has them)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):  # a Unix socket: no peer to lose
        return
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
