"""Per-call deadlines on sockets a driver blocks on without a read timeout (libpq).

libpq waits for a reply with no timeout of its own: on a network that went silent a
statement waits until TCP gives up (``tcp_user_timeout``, keepalives), tens of seconds
after the lease it was refreshing stopped mattering. :func:`watch` arms a deadline on the
connection's socket for the length of one call; if the call is still blocked when it
passes, one watchdog thread per process shuts the socket down (``shutdown(SHUT_RDWR)``
on a duplicate of its descriptor), which wakes the blocked call at once with an error:
the connection is then broken and is never reused. Arming and disarming cost a lock and a
dict operation; the thread wakes only when the earliest deadline passes (at most once a
second while calls are armed) and exits after a while without any.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

#: Seconds without any armed deadline after which the watchdog thread exits.
IDLE_EXIT = 10.0
#: The thread wakes at least this often while deadlines are armed, in seconds.
POLL = 1.0


class Watch:
    """One armed call: ``fired`` is True once its socket was shut down for its deadline."""

    __slots__ = ("deadline", "fd", "fired", "timeout")

    def __init__(self, fd: int, timeout: float) -> None:
        self.fd = fd
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.fired = False


class _Watchdog:
    def __init__(self) -> None:
        #: arm and disarm take the mutex itself (a C-level ``with``, not the Condition's
        #: Python one: two per statement); the thread waits on the Condition over it.
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._armed: dict[int, Watch] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._wake_at = math.inf

    def arm(self, fd: int, timeout: float) -> tuple[int, Watch]:
        watch = Watch(fd, timeout)
        ticket = next(self._ids)
        with self._mutex:
            if self._pid != os.getpid():  # forked: the parent's thread and calls are not ours
                self._armed, self._thread, self._pid = {}, None, os.getpid()
                self._wake_at = math.inf
            self._armed[ticket] = watch
            if self._thread is None:  # none yet, or it exited (it clears this as it does)
                self._thread = threading.Thread(
                    target=self._run, name="celery-exclusive-watchdog", daemon=True
                )
                self._wake_at = -math.inf
                self._thread.start()
            elif watch.deadline < self._wake_at:
                self._lock.notify()
        return ticket, watch

    def disarm(self, ticket: int) -> None:
        with self._mutex:
            self._armed.pop(ticket, None)

    def _run(self) -> None:
        try:
            self._watch()
        finally:  # ended by an error too: the next arm starts a new thread
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _watch(self) -> None:
        idle_since = time.monotonic()
        with self._lock:
            while True:
                now = time.monotonic()
                for ticket, watch in list(self._armed.items()):
                    if now >= watch.deadline:
                        del self._armed[ticket]
                        watch.fired = True
                        _shut_down(watch.fd)
                if self._armed:
                    idle_since = now
                elif now - idle_since >= IDLE_EXIT:
                    self._thread = None  # under the lock: the next arm starts a new thread
                    return
                earliest = min((w.deadline for w in self._armed.values()), default=math.inf)
                self._wake_at = min(earliest, now + POLL)
                self._lock.wait(max(self._wake_at - now, 0.001))


def _shut_down(fd: int) -> None:
    """Shut the socket behind ``fd`` down both ways, without closing ``fd`` itself."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


_watchdog = _Watchdog()


def arm(fd: int, deadline: float) -> tuple[int, Watch]:
    """Shut down socket ``fd`` if still armed at ``deadline`` (monotonic s; at least 1 ms
    from now); ``(ticket for disarm, the Watch)``. The lean form of :func:`watch`."""
    return _watchdog.arm(fd, max(deadline - time.monotonic(), 0.001))


def disarm(ticket: int) -> None:
    """Undo :func:`arm` (a no-op if its deadline already fired)."""
    _watchdog.disarm(ticket)


@contextlib.contextmanager
def watch(fd: int, timeout: float | None) -> Iterator[Watch | None]:
    """Shut down socket ``fd`` if the block is still running ``timeout`` seconds from now.

    Yields the :class:`Watch` (None when ``timeout`` is None): after the block, its
    ``fired`` says whether the deadline cut the call short.
    """
    if timeout is None:
        yield None
        return
    ticket, armed = _watchdog.arm(fd, timeout)
    try:
        yield armed
    finally:
        _watchdog.disarm(ticket)


_budget = threading.local()
#: Seconds PyMySQL's greeting and authentication may take on a connection opened without a
#: call deadline and without a ``connect_timeout`` (an engine the store built has one, 10 s).
HANDSHAKE = 10.0


@contextlib.contextmanager
def connect_budget(timeout: float | None) -> Iterator[None]:
    """Within the block, connections this thread opens or takes from a pool get at most
    ``timeout`` seconds (None: their own timeouts)."""
    previous = getattr(_budget, "deadline", None)
    _budget.deadline = None if timeout is None else time.monotonic() + timeout
    try:
        yield
    finally:
        _budget.deadline = previous


def checkout_wait(configured: float) -> float:
    """How long a connection pool may wait for a free connection now: its ``configured``
    timeout, lowered to what is left of this thread's :func:`connect_budget` (at least 0)."""
    deadline = getattr(_budget, "deadline", None)
    if deadline is None:
        return configured
    left: float = deadline - time.monotonic()
    return max(min(configured, left), 0.0)


def connect_timeout(configured: object) -> int | None:
    """The libpq ``connect_timeout`` for a connection opened now: the configured one,
    lowered to this thread's :func:`connect_budget` (whole seconds, libpq's minimum 2)."""
    deadline = getattr(_budget, "deadline", None)
    if deadline is None:
        return None
    left = max(2, math.ceil(deadline - time.monotonic()))
    try:
        current = int(str(configured)) if configured is not None else 0
    except ValueError:
        current = 0
    return int(left if current <= 0 else min(left, current))


def bounded_connect(dialect: Any, _record: object, cargs: Any, cparams: dict[str, Any]) -> Any:
    """SQLAlchemy ``do_connect`` listener: a connection opened inside :func:`connect_budget`
    gives up connecting by then (``connect_timeout``, libpq's and PyMySQL's keyword), and a
    psycopg connect that gives up closes its socket at once.

    PyMySQL's ``connect_timeout`` covers the TCP connect only: the server's greeting, the
    authentication and the session set-up are read with ``read_timeout`` (none by default),
    so a server that accepts and never greets held the call forever. PyMySQL connections
    are therefore opened here with read and write timeouts of what is left of the budget
    (without one: the connection's ``connect_timeout``, 10 s unless the URL says otherwise,
    or the configured timeout if shorter), which are then given back their configured values
    (statements with a deadline have the watchdog's; those without, the configured ones).

    psycopg's connect, when its ``connect_timeout`` expires, leaves the half-made libpq
    connection in one of its frames, which the error's traceback keeps: its socket stayed
    open as long as the error (or, in a reference cycle, until the garbage collector ran).
    psycopg connections are therefore opened here, and a failed one's frames cleared."""
    timeout = connect_timeout(cparams.get("connect_timeout"))
    if timeout is not None:
        cparams["connect_timeout"] = timeout
    driver = getattr(dialect, "driver", None)
    if driver == "psycopg":
        return _closing_on_failure(dialect.connect, cargs, cparams)
    if driver != "pymysql":
        return None
    read, write = cparams.get("read_timeout"), cparams.get("write_timeout")
    if timeout is None:  # no call deadline: the handshake within the connect timeout
        handshake = _seconds(cparams.get("connect_timeout")) or HANDSHAKE
        reads, writes = (min(handshake, _seconds(t) or handshake) for t in (read, write))
    else:
        reads = writes = max(_budget.deadline - time.monotonic(), 0.001)
    connection = dialect.loaded_dbapi.connect(
        *cargs, **{**cparams, "read_timeout": reads, "write_timeout": writes}
    )
    connection._read_timeout, connection._write_timeout = read, write  # PyMySQL's own fields
    return connection


def _seconds(configured: object) -> float | None:
    """A configured timeout in seconds; None for none (or one that is not a positive number)."""
    try:
        seconds = float(str(configured)) if configured is not None else 0.0
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def _closing_on_failure(connect: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
    """``connect(*cargs, **cparams)``; if it raises, the finished frames of its traceback
    are cleared first, so what they held (a half-made connection) is freed at once."""
    try:
        return connect(*cargs, **cparams)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
