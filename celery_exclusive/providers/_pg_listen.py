"""Release signals for PostgreSQL waiters (``WakesWaiters``): ``LISTEN``/``NOTIFY``.

The release statements end, when they freed a live lease, with ``pg_notify(channel, '')``
in the same statement (no extra round trip for the releaser; see ``postgres.py``). NOTIFY
is transactional: it is delivered when the release commits (a release rolled back sends
nothing), so a woken waiter sees the row gone. The channel is :func:`channel`: ``ce_`` and
24 hex digits of the SHA-256 of the table and the store key (a channel is an identifier of
at most 63 bytes; a collision only wakes a waiter spuriously).

:class:`Listener` (one per provider and process, made on the first wait) keeps one
dedicated psycopg connection in autocommit, out of the pool, read by a daemon thread that
waits on its socket (and on a pipe that tells it about new subscriptions). A channel is
``LISTEN``\\ ed while someone in the process waits for its key and ``UNLISTEN``\\ ed
:data:`LINGER` seconds after the last one left. While someone waits, the connection also
holds the channel's waiter registration (a shared advisory lock, :func:`waiter_lock`): a
release notifies only while someone is registered, and tells its releaser so
(``KnowsWaiters``, the fairness of ``waiting.py``). The registration is dropped as soon as
the last waiter leaves, lingering or not: a process that waited for a key and took it is
no waiter of that key when it releases it (nor is it counted while that unlock is in
flight: :meth:`Listener.releasing`), and its own release's notification, which comes back
to its lingering channel, is not signalled to a wait it starts after that release.
:meth:`Listener.subscribe` returns once the ``LISTEN`` and the registration are in effect,
or after :data:`SUBSCRIBE_WAIT` seconds if they are not yet (the first connection, a
server away): the subscription then starts signalling when they are, and meanwhile the
waiter polls. On a lingering channel that is one round trip on the listener connection
(the registration), where it used to be none: returning before it (and polling for a
release it missed) made handovers on a loaded machine miss their wake-up.

Losing the connection (a restart, a terminated backend, a failover) loses the notifications
sent meanwhile: every subscription is then signalled spuriously (its waiter retries at
once), and the thread reconnects with backoff and ``LISTEN``\\ s again, signalling once more
when it did. A lost signal only costs latency: waiters poll at the poll bound anyway. A
connection that dies silently (no reset, no error: a cut link) is noticed by the next
command sent on it, which every wait on a key nobody else here waits for sends (its
registration, and its removal when it leaves), within :data:`COMMAND_TIMEOUT`; until then
its waiters poll (tests/faults/test_silent_wake_loss.py). A
child process never uses its parent's listener (the provider makes a new one when the pid
changed and leaves the inherited one untouched).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_exclusive.providers import _deadline
from celery_exclusive.providers._signals import SignalsLost, Subscription, Watch

__all__ = ["Listener", "SignalsLost", "Subscription", "channel", "waiter_lock"]

#: Seconds a channel stays LISTENed after its last subscriber left: back-to-back waits on one
#: key skip an UNLISTEN and a LISTEN. Its waiter registration is not kept meanwhile (that
#: would make this process a waiter of the key it holds next: see the module docstring).
LINGER = 1.0
#: Seconds ``subscribe`` waits for its LISTEN to be in effect before returning anyway.
SUBSCRIBE_WAIT = 0.05
#: How many keys' channel names :func:`channel` remembers.
CHANNELS = 4096
#: Seconds a LISTEN/UNLISTEN on the listener connection may take before it is dropped.
COMMAND_TIMEOUT = 2.0
#: Seconds a listener connection may take to open.
CONNECT_TIMEOUT = 5.0
#: First and longest pause between reconnection attempts, in seconds.
RETRY_MIN, RETRY_MAX = 0.1, 5.0


def waiter_lock(function: str, channel_sql: str) -> str:
    """SQL calling ``pg_<function>`` on the advisory lock of the channel ``channel_sql`` (an
    SQL expression): waiters hold it shared, a release tries it exclusively (see postgres.py).
    The bigint lock space, apart from the (int, int) key locks of the acquire statements."""
    return f"pg_{function}(hashtextextended({channel_sql}, 0))"


@functools.lru_cache(maxsize=CHANNELS)
def channel(table: str, key: str) -> str:
    """The notification channel of ``key`` (already prefixed) in lock table ``table``.

    Cached (the last :data:`CHANNELS` keys): every release sends its key's channel, and a
    key is usually released again and again; a hit is a dictionary lookup instead of a
    SHA-256 (BENCHMARKS.md, "The PostgreSQL client path"). Keys never seen again cost the
    cache an entry each until they are evicted."""
    return "ce_" + hashlib.sha256(f"{table}\0{key}".encode()).hexdigest()[:24]


class _Watch(Watch):
    """A channel's watch, with the LISTEN state of the channel on the current connection."""

    __slots__ = ("echoes", "idle_since", "listening", "lost")

    def __init__(self, changed: threading.Condition) -> None:
        super().__init__(changed)
        #: When the last subscriber left (monotonic; None while it has subscribers).
        self.idle_since: float | None = None
        #: Whether its releases reach this process: the channel is LISTENed and its waiter
        #: registration held on the current connection.
        self.listening = False
        #: Whether releases may have gone unheard (a lost connection, a subscriber that did
        #: not wait for the LISTEN): signal once the channel is LISTENed.
        self.lost = False
        #: Notifications still to come of this process's own releases, sent while nobody
        #: here waited: not signalled (see :meth:`Listener.releasing`).
        self.echoes = 0


class Listener:
    """The LISTEN connection of one provider in one process; ``connect()`` returns a new
    psycopg 3 connection that is this listener's alone."""

    def __init__(self, connect: Callable[[], Any], name: str = "postgres") -> None:
        self.pid = os.getpid()
        self.closed = False
        #: The server process of the current connection (None while disconnected).
        self.backend_pid: int | None = None
        self._connect = connect
        self._name = name
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watches: dict[str, _Watch] = {}
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        #: The channels LISTENed on the current connection (the thread changes it, holding
        #: the lock; a channel leaves it before its UNLISTEN, joins it after its LISTEN).
        self._listened: set[str] = set()
        #: The channels whose waiter registration the current connection holds (the same
        #: rules: a channel leaves it before its unlock, joins it after its lock).
        self._registered: set[str] = set()
        #: The channels whose registration is being dropped (its unlock sent, not answered).
        self._dropping: set[str] = set()
        # Owned by the thread:
        self._conn: Any = None

    def subscribe(self, name: str) -> Subscription:
        """Subscribe to channel ``name``; returns once it is LISTENed and registered, or
        after :data:`SUBSCRIBE_WAIT` seconds (the subscription signals from when it is)."""
        return self.subscribe_any([name])

    def subscribe_any(self, names: Sequence[str]) -> Subscription:
        """Subscribe to every channel of ``names`` at once (one subscription, signalled by
        any of them); returns once all are LISTENed (one batch on the listener connection),
        or after :data:`SUBSCRIBE_WAIT` seconds, as :meth:`subscribe`."""
        with self._lock:
            if self.closed:
                raise SignalsLost("the listener is closed")
            watches: dict[str, _Watch] = {}
            for name in names:
                watch = self._watches.get(name)
                if watch is None:
                    watch = self._watches[name] = _Watch(self._changed)
                    # Still registered after its last subscriber left: in effect (if the thread
                    # drops it after all, it registers again and signals, see _sync).
                    watch.listening = name in self._registered
                if name not in watches:
                    watch.subscribers += 1
                    watch.idle_since = None
                    watches[name] = watch
            subscription = Subscription(self._changed, watches, self._leave)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"celery-exclusive-listen {self._name}", daemon=True
                )
                self._thread.start()
            pending = [watch for watch in watches.values() if not watch.listening]
            if pending:
                self._poke()
                listening = self._changed.wait_for(
                    lambda: all(watch.listening for watch in pending) or self.closed, SUBSCRIBE_WAIT
                )
                if not listening:
                    for watch in pending:  # a release before the LISTEN is missed: signal once it is on
                        if not watch.listening:
                            watch.lost = True
        return subscription

    def releasing(self, name: str) -> tuple[bool, int | None]:
        """Called just before this process sends a release of the key of channel ``name``:
        ``(ours, mark)``. ``ours``: our registration may still be held while nobody here
        waits (the last waiter left, its unlock not yet done or answered), so the release
        may be told of a waiter that is only us. ``mark``: while the channel lingers here
        with nobody subscribed, its signal count (pass it to :meth:`released`), else None."""
        with self._lock:
            watch = self._watches.get(name)
            idle = watch is None or watch.subscribers <= 0
            ours = idle and (name in self._registered or name in self._dropping)
            mark = watch.released if watch is not None and idle and name in self._listened else None
            return ours, mark

    def released(self, name: str, mark: int | None, notified: bool) -> None:
        """The release :meth:`releasing` was told of returned; ``notified``: it notified.
        Its notification comes back to this lingering channel too: unless it already did
        (the signal count moved), it is not signalled when it does, so a wait this process
        starts right after its release (giving way) is not woken by that release itself."""
        if mark is None or not notified:
            return
        with self._lock:
            watch = self._watches.get(name)
            if watch is not None and watch.released == mark:
                watch.echoes += 1

    def _leave(self, name: str, watch: _Watch) -> None:
        """A subscriber of ``watch`` left (holding the lock); after the last one, the
        channel's registration is dropped at once and the channel UNLISTENed :data:`LINGER`
        seconds later (unless someone subscribes)."""
        watch.subscribers -= 1
        if watch.subscribers <= 0 and self._watches.get(name) is watch:
            watch.idle_since = time.monotonic()
            self._poke()  # the thread times the linger out

    def _wanted(self) -> tuple[set[str], float | None]:
        """(holding the lock) The channels to LISTEN, dropping watches that lingered long
        enough; and seconds until the next one expires (None: none lingers)."""
        now, soonest = time.monotonic(), None
        for name, watch in list(self._watches.items()):
            if watch.idle_since is None:
                continue
            left = watch.idle_since + LINGER - now
            if left <= 0:
                del self._watches[name]
            elif soonest is None or left < soonest:
                soonest = left
        return set(self._watches), soonest

    def _poke(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        retry = RETRY_MIN
        while True:
            with self._lock:
                if self.closed:
                    break
                wanted, linger = self._wanted()
            if self._conn is None and not wanted:
                self._idle(None)
                continue
            try:
                if self._conn is None:
                    self._open()
                self._sync(wanted)
                self._read(linger)
                retry = RETRY_MIN
            except Exception:  # a connection that fails at once again is retried ever slower
                self._lost()
                self._idle(retry)
                retry = min(retry * 2, RETRY_MAX)
        self._drop()

    def _idle(self, timeout: float | None) -> None:
        """Wait for a poke (or ``timeout`` seconds), then drain the pipe."""
        select.select([self._wake_r], [], [], timeout)
        self._drain()

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 512):
                pass

    def _open(self) -> None:
        with _deadline.connect_budget(CONNECT_TIMEOUT):
            conn = self._connect()
        try:
            if not conn.autocommit:
                conn.rollback()
                conn.autocommit = True
            # A waiter registration blocked past this (a foreign bigint advisory lock)
            # fails: the connection is dropped and made again, and waiters poll meanwhile.
            conn.execute(f"SET lock_timeout = {int(COMMAND_TIMEOUT * 1000)}")
            conn.add_notify_handler(lambda notify: self._dispatch(notify.channel))
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.backend_pid = int(conn.info.backend_pid)

    def _sync(self, wanted: set[str]) -> None:
        """LISTEN the channels wanted and not yet listened to, UNLISTEN those left; hold the
        waiter registration of the channels someone subscribes to, and of no other."""
        with self._lock:
            waited = {
                name for name, watch in self._watches.items() if watch.subscribers > 0 and name in wanted
            }
            start, stop = sorted(wanted - self._listened), sorted(self._listened - wanted)
            register, unregister = sorted(waited - self._registered), sorted(self._registered - waited)
            self._listened -= set(stop)
            self._registered -= set(unregister)
            self._dropping = set(unregister)
            for name in unregister:  # from now on its releases may not reach us
                if (watch := self._watches.get(name)) is not None:
                    watch.listening = False
        if not (start or stop or register or unregister):
            return
        # LISTEN, then register as a waiter (releases notify only while someone is); a
        # release committing meanwhile holds the lock exclusively and this waits for it.
        # Unregister before UNLISTEN, the same order backwards.
        commands = [f"LISTEN {c}" for c in start]
        commands += [f"SELECT {waiter_lock('advisory_lock_shared', repr(c))}" for c in register]
        commands += [f"SELECT {waiter_lock('advisory_unlock_shared', repr(c))}" for c in unregister]
        commands += [f"UNLISTEN {c}" for c in stop]
        conn = self._conn
        with _deadline.watch(conn.pgconn.socket, COMMAND_TIMEOUT):
            conn.execute("; ".join(commands))
        with self._lock:
            self._listened |= set(start)
            self._registered |= set(register)
            self._dropping = set()
            for name in register:
                watch = self._watches.get(name)
                if watch is None:
                    continue
                # A subscriber that returned before this registration (it timed out waiting,
                # or took the channel for registered while it was being dropped) may have
                # missed a release: signal it, so its waiter looks again.
                missed = watch.lost or watch.listening
                watch.listening, watch.lost = True, False
                if missed:
                    watch.signal()
                else:
                    watch.changed.notify_all()

    def _read(self, timeout: float | None) -> None:
        """Wait for notifications or a poke (or ``timeout`` seconds); dispatch what arrived."""
        pgconn = self._conn.pgconn
        ready, _, _ = select.select([pgconn.socket, self._wake_r], [], [], timeout)
        if self._wake_r in ready:
            self._drain()
        if pgconn.socket in ready:
            pgconn.consume_input()  # raises when the connection is gone
            while (notify := pgconn.notifies()) is not None:
                self._dispatch(notify.relname.decode())
            if pgconn.status != 0:  # psycopg.pq.ConnStatus.OK
                raise SignalsLost("the listener connection is gone")

    def _dispatch(self, name: str) -> None:
        with self._lock:
            watch = self._watches.get(name)
            if watch is not None and watch.echoes > 0:
                watch.echoes -= 1  # our own release's, sent before anyone here waited
            elif watch is not None:
                watch.signal()

    def _lost(self) -> None:
        """The connection failed: drop it, and signal every subscription (their waiters
        retry at once: a release may have been missed)."""
        self._drop()
        with self._lock:
            for watch in self._watches.values():
                if watch.listening:
                    watch.listening, watch.lost = False, True
                watch.echoes = 0
                watch.signal()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        with self._lock:
            self._listened, self._registered, self._dropping = set(), set(), set()
        self.backend_pid = None
        if conn is not None:
            with contextlib.suppress(Exception):  # a dead connection still closes locally
                conn.close()

    def close(self) -> None:
        """Close the connection and end the thread; open subscriptions stop signalling."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for watch in self._watches.values():
                watch.break_off()
            thread = self._thread
            self._poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(COMMAND_TIMEOUT + 1)
        if thread is None or not thread.is_alive():
            self._drop()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


class PerProcess:
    """The :class:`Listener` of one provider (lock table ``name``) in the current process,
    made on the first subscription (a child never uses its parent's, see
    :meth:`after_fork`). None at all behind PgBouncer in transaction mode (no session to
    LISTEN on) or with a driver other than psycopg 3: subscriptions are refused there, and
    waiters poll."""

    def __init__(self, connect: Callable[[], Any], name: str, *, pgbouncer: bool, driver: str) -> None:
        self.listener: Listener | None = None
        self._connect = connect
        self._name = name
        self._no_wake: str | None = None
        if pgbouncer:
            self._no_wake = "behind PgBouncer (ce_pgbouncer=true) there is no session to LISTEN on"
        elif driver != "psycopg":
            self._no_wake = f"the {driver} driver is not psycopg 3"
        self._lock = threading.Lock()
        self._closed = False

    def subscribe_any(self, keys: Sequence[str]) -> Subscription:
        """Subscribe to the channels of ``keys`` (see :meth:`Listener.subscribe_any`); raises
        SignalsLost when this provider cannot listen, or is closed."""
        if self._no_wake is not None:
            raise SignalsLost(f"no release signals: {self._no_wake}; waiters poll")
        listener = self.listener
        if listener is None or listener.pid != os.getpid():  # a child never uses its parent's
            with self._lock:
                listener = self.listener
                if listener is None or listener.pid != os.getpid():
                    if self._closed:
                        raise SignalsLost("the provider is closed")
                    listener = self.listener = Listener(self._connect, self._name)
        return listener.subscribe_any([channel(self._name, key) for key in keys])

    def releasing(self, name: str) -> tuple[bool, int | None]:
        """:meth:`Listener.releasing` of this process's listener (``(False, None)`` if none)."""
        listener = self.listener
        if listener is None or listener.pid != os.getpid():
            return False, None
        return listener.releasing(name)

    def released(self, name: str, mark: int | None, notified: bool) -> None:
        """:meth:`Listener.released` of this process's listener."""
        listener = self.listener
        if mark is not None and listener is not None and listener.pid == os.getpid():
            listener.released(name, mark, notified)

    def close(self) -> None:
        """Close this process's listener; later subscriptions are refused."""
        self._closed = True
        with self._lock:
            listener, self.listener = self.listener, None
        if listener is not None and listener.pid == os.getpid():
            listener.close()

    def after_fork(self, inherited: list[Any]) -> None:
        """In a forked child: the parent's listener (its connection and thread are not ours)
        goes to ``inherited``, untouched."""
        listener, self.listener = self.listener, None
        if listener is not None:
            inherited.append(listener)
        self._lock = threading.Lock()
