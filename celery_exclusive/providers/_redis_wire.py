"""The Redis fast path: commands sent on connections the provider keeps out of the pool.

redis-py's pool checkout and command wrapper cost about as much Python time as the round
trip; this path keeps their safety checks: fork (a child never uses its parent's sockets,
see providers/_kept.py), and a connection idle long enough for the server to have closed
it (Redis's ``timeout`` counts whole seconds) is polled and reconnected before anything is
sent. A connection is never left with unread data: any failure mid-command disconnects it.
A per-call ``timeout`` bounds the whole call, connecting included; past it the connection
is closed.

A round trip is one ``send`` and one ``recv`` system call (:class:`_Line`): redis-py
connects (TCP, AUTH/HELLO, SELECT, Sentinel's primary), then the plain socket is made
blocking and the deadline is left to the kernel (``SO_SNDTIMEO``/``SO_RCVTIMEO``), set
again only when a call needs a shorter wait than the one armed. A socket with a Python
timeout instead costs a ``poll()`` before every send and receive, and redis-py's
``settimeout()`` per call an ``ioctl()``: five system calls where two do. The replies are
parsed by the connection's own hiredis Reader, fed from ``recv_into``; error replies
become redis-py's exceptions (its ``parse_error``) and are raised as its
``read_response()`` raises them. TLS, RESP3, ``health_check_interval`` and connection
classes that read replies their own way go through redis-py's ``read_response()`` with
the socket timeout set per call, as before.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_exclusive.providers._kept import KeptConnections
from celery_exclusive.providers._redis_sentinel import primary_of

#: Seconds a kept connection may sit idle before it is checked for a server-side close;
#: under Redis's smallest idle ``timeout`` (1 s) so no live connection goes unchecked.
POLL_AFTER = 0.5

#: Seconds by which a kernel timeout armed on a socket may reach past a call's deadline
#: before it is set again: about what ``poll()``'s millisecond rounding allowed before
#: (the kernel rounds up to its tick as well). Calls with the same timeout never re-arm.
TOLERANCE = 0.002

#: The longest one kernel wait is armed for (s); a longer deadline is waited for in such
#: slices, each expiry checked against it. It bounds what a signal whose handler returns
#: costs: CPython retries the interrupted ``recv`` with the kernel's timer started anew.
SLICE = 0.5

_TIMEVAL = struct.Struct("@ll")
_monotonic = time.monotonic


def as_text(value: Any) -> str:
    """A reply's bytes (or number) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least 1 ms: a socket timeout of 0 would
    make the socket non-blocking instead of failing at once."""
    return max(deadline - time.monotonic(), 0.001)


def _connect_within(conn: Any, timeout: float) -> None:
    """Connect ``conn`` (TCP, TLS and the AUTH/HELLO/SELECT handshake; a Sentinel-managed
    one's lookup of the primary first) within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    connect_timeout, socket_timeout = conn.socket_connect_timeout, conn.socket_timeout
    try:
        primary = primary_of(conn, deadline)
        timeout = left(deadline)
        conn.socket_connect_timeout = min(connect_timeout or timeout, timeout)
        conn.socket_timeout = min(socket_timeout or timeout, timeout)
        if primary is None:
            conn.connect()
        else:
            conn.connect_to(primary)  # as redis-py's connect() does, with the address found
    finally:
        conn.socket_connect_timeout, conn.socket_timeout = connect_timeout, socket_timeout


class _Redis:
    """What the lean path takes from redis-py, imported once (the provider imports redis)."""

    def __init__(self) -> None:
        from redis import exceptions
        from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser
        from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR
        from redis.connection import AbstractConnection
        from redis.sentinel import SentinelManagedConnection

        self.not_enough_data = NOT_ENOUGH_DATA
        self.hiredis_parser = _HiredisParser
        self.closed_message = SERVER_CLOSED_CONNECTION_ERROR
        self.connection_error = exceptions.ConnectionError
        self.timeout_error = exceptions.TimeoutError
        self.response_error = exceptions.ResponseError
        self.read_only = exceptions.ReadOnlyError
        #: redis-py's reply readers the lean path does the work of: the plain one, and
        #: Sentinel's (a demoted primary's READONLY is a ConnectionError: ``_Line.read``).
        self.own_reads = {
            AbstractConnection.read_response: False,
            SentinelManagedConnection.read_response: True,
        }


_loaded: list[_Redis] = []


def _lib() -> _Redis:
    """redis-py's parts, imported on first use."""
    if not _loaded:
        _loaded.append(_Redis())
    return _loaded[0]


def _lean(conn: Any) -> bool | None:
    """Whether ``conn`` (connected) can be driven by a :class:`_Line`: None if not, else
    whether a READONLY reply means its Sentinel primary was demoted."""
    try:
        lib = _lib()
    except (ImportError, AttributeError):  # a redis-py laid out otherwise: its own reading
        return None
    parser = conn._parser
    if (
        type(conn._sock) is not socket.socket  # TLS: the SSL layer buffers and blocks its own way
        or type(parser) is not lib.hiredis_parser
        or getattr(parser, "_reader", None) is None
        or not isinstance(getattr(parser, "_buffer", None), bytearray)
        or conn.protocol not in (2, 3)
        or conn.health_check_interval  # redis-py's PING before a send when one is due
    ):
        return None
    demoted = lib.own_reads.get(type(conn).read_response)
    if demoted is None:
        return None
    return demoted and bool(conn.connection_pool.is_master)


class _Line:
    """One connected redis-py connection's plain socket, driven here: blocking, its waits
    bounded by the kernel (``SO_SNDTIMEO``/``SO_RCVTIMEO``), its replies parsed by the
    connection's own hiredis Reader (so redis-py's ``can_read()`` still sees what is
    buffered). Valid while ``sock is conn._sock``: a reconnect makes a new one."""

    __slots__ = ("buf", "conn", "demoted", "lib", "limit", "push", "rcv", "reader", "snd", "sock")

    def __init__(self, conn: Any, demoted: bool) -> None:
        self.conn = conn
        self.lib = _lib()
        self.sock: socket.socket = conn._sock
        self.reader = conn._parser._reader
        self.buf = conn._parser._buffer
        #: RESP3's push messages (hiredis >= 3.2), handed to redis-py's handlers as it does.
        self.push: type | None = getattr(conn._parser, "_hiredis_PushNotificationType", None)
        self.demoted = demoted
        #: A call without a deadline: each wait within the client's socket timeout (None:
        #: unbounded), as redis-py's own socket timeout bounds each recv.
        self.limit: float | None = conn.socket_timeout
        self.sock.settimeout(None)  # blocking: no poll() before each send and recv
        #: The kernel's receive and send timeouts now armed (s).
        self.rcv = self._arm(socket.SO_RCVTIMEO, SLICE)
        self.snd = self._arm(socket.SO_SNDTIMEO, SLICE)

    def _arm(self, option: int, seconds: float) -> float:
        """Set the kernel's timeout ``option`` to ``seconds`` (at most :data:`SLICE`, at least
        1 µs: 0 would mean none); the value set."""
        seconds = min(max(seconds, 1e-6), SLICE)
        whole = int(seconds)
        self.sock.setsockopt(
            socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, max(int((seconds - whole) * 1e6), 1))
        )
        return seconds

    def _end(self, deadline: float | None) -> float | None:
        """When the next wait must end: the call's deadline, else the socket timeout from now."""
        if deadline is not None:
            return deadline
        return None if self.limit is None else _monotonic() + self.limit

    def _expired(self, option: int, end: float | None) -> None:
        """The kernel's timeout ran out: raise redis-py's TimeoutError if ``end`` has come,
        else arm the next slice of the wait."""
        now = _monotonic()
        if end is not None and now >= end:
            where = (
                "writing to socket"
                if option == socket.SO_SNDTIMEO
                else f"reading from {self.conn._host_error()}"
            )
            raise self.lib.timeout_error(f"Timeout {where}")
        armed = self._arm(option, SLICE if end is None else end - now)
        if option == socket.SO_RCVTIMEO:
            self.rcv = armed
        else:
            self.snd = armed

    def put(self, data: bytes, deadline: float | None) -> None:
        """Send ``data`` whole, each wait by ``deadline`` (None: the socket timeout)."""
        end = deadline if deadline is not None else self._end(None)
        if end is not None and end - _monotonic() + TOLERANCE < self.snd:
            self.snd = self._arm(socket.SO_SNDTIMEO, end - _monotonic())
        try:
            sent = self.sock.send(data)
        except BlockingIOError:  # nothing sent within the armed timeout
            sent = 0
        except OSError as exc:
            raise self._unsent(exc) from exc
        if sent < len(data):
            self._put_rest(memoryview(data)[sent:], deadline, end)

    def _put_rest(self, view: memoryview, deadline: float | None, end: float | None) -> None:
        """What a first ``send`` left (a full send buffer), each wait by ``end``."""
        try:
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except BlockingIOError:  # nothing sent within the armed timeout
                    self._expired(socket.SO_SNDTIMEO, end)
                    continue
                if deadline is None:
                    end = self._end(None)
        except OSError as exc:
            raise self._unsent(exc) from exc

    def _unsent(self, exc: OSError) -> Exception:
        """A failed send as redis-py's ``send_packed_command`` words it."""
        errno, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else exc.args[:2]
        return self.lib.connection_error(f"Error {errno} while writing to socket. {message}.")

    def read(self, deadline: float | None) -> Any:
        """The next reply as redis-py's ``read_response()`` leaves it, each wait by ``deadline``
        (None: the socket timeout). An error reply is returned, not raised, unless it is a
        connection-level one (or an array led by one); a READONLY from a Sentinel primary is
        raised as the ConnectionError that makes the next connect ask the sentinels again; a
        RESP3 push message before it goes to redis-py's handlers."""
        reader = self.reader
        reply = reader.gets()
        lib = self.lib
        if reply is lib.not_enough_data:
            reply = self._received(deadline)
        # The lock scripts' replies (an int, a list led by an int) are neither errors nor
        # push messages (whose types are hiredis's own): answered on their exact types,
        # without the isinstance() tests below, each of which also looks up the object's
        # __class__ when it fails (about 0.25k instructions on Python 3.11).
        kind = type(reply)
        if kind is int or (kind is list and reply and type(reply[0]) is int):
            return reply
        if isinstance(reply, Exception):
            if isinstance(reply, lib.connection_error):
                raise reply
            if self.demoted and isinstance(reply, lib.read_only):
                raise lib.connection_error("The previous master is now a slave")
        elif type(reply) is not list:
            push = self.push
            if push is not None and isinstance(reply, push):
                self.conn._parser.handle_push_response(reply)
                if self.sock.gettimeout() is not None:  # a handler set one (maintenance)
                    self.sock.settimeout(None)
                return self.read(deadline)
        elif reply and isinstance(reply[0], lib.connection_error):
            raise reply[0]
        return reply

    def _received(self, deadline: float | None) -> Any:
        """The next reply, read off the socket: each wait by ``deadline``."""
        reader, sock, buf, missing = self.reader, self.sock, self.buf, self.lib.not_enough_data
        end = deadline if deadline is not None else self._end(None)
        reply = missing
        try:
            while reply is missing:
                if end is not None and end - _monotonic() + TOLERANCE < self.rcv:
                    self.rcv = self._arm(socket.SO_RCVTIMEO, end - _monotonic())
                try:
                    count = sock.recv_into(buf)
                except BlockingIOError:  # nothing came within the armed timeout
                    self._expired(socket.SO_RCVTIMEO, end)
                    continue
                if not count:
                    raise self.lib.connection_error(self.lib.closed_message)
                reader.feed(buf, 0, count)
                reply = reader.gets()
                if deadline is None:
                    end = self._end(None)
        except OSError as exc:  # as redis-py's read_response words it
            raise self.lib.connection_error(
                f"Error while reading from {self.conn._host_error()} : {exc.args}"
            ) from exc
        return reply


class Wire:
    """Pipelined commands on kept connections of ``pool``'s kind (made here, not by the pool:
    its ``get_connection()`` connects with the client's own connect timeout, which no
    per-call deadline could then bound)."""

    def __init__(
        self, pool: Any, response_error: type[Exception], broken: tuple[type[Exception], ...]
    ) -> None:
        self._pool = pool
        self._response_error = response_error
        self._broken = broken
        self.kept: KeptConnections[Any] = KeptConnections()
        self._pack: Callable[[tuple[Any, ...]], bytes] | None = None
        try:  # redis-py packs through it too, after per-argument checks our arguments never need
            from hiredis import pack_command
        except ImportError:  # pragma: no cover - hiredis comes with the redis extra
            return
        self._pack = pack_command

    def send(self, *command: Any, timeout: float | None = None) -> Any:
        """Send one command and read its reply (an error reply is raised)."""
        return self.send_many((command,), timeout)[0]

    def send_many(
        self, commands: Sequence[tuple[Any, ...]] | bytes, timeout: float | None, start: float | None = None
    ) -> list[Any]:
        """Send ``commands`` pipelined on one kept connection and read every reply; an error
        reply is raised for one command, returned in its place for several. ``commands`` as
        bytes is one command packed already (RESP, ``_redis_resp``), sent as it is.
        ``start``: the caller's ``time.monotonic()`` read just before the call, from which
        ``timeout`` is counted (default: read here).

        The hot path of every lock operation: a connection used a moment ago is checked
        here, not in :meth:`_ready`."""
        now = _monotonic() if start is None else start
        deadline = None if timeout is None else now + timeout
        one = isinstance(commands, bytes) or len(commands) == 1
        taken = self.kept.take()  # _taken(), without its frame
        conn, used = taken if taken is not None else self._new()
        try:
            line = conn._ce_line  # set by _new (None) and _ready: no __dict__.get() call
            if line is None or now - used > POLL_AFTER or line.sock is not conn._sock:
                line = self._ready(conn, now - used, deadline)
                if line is None:
                    if isinstance(commands, bytes):  # one item: redis-py sends a list's items
                        conn.send_packed_command([commands])
                    else:
                        self._send(conn, commands)
                    if one:
                        return [conn.read_response()]
                    return self._replies(conn, len(commands))
            line.put(commands if isinstance(commands, bytes) else self._packed(commands), deadline)
            if one:
                reply = line.read(deadline)
                kind = type(reply)  # the usual replies, on their exact types (see _Line.read)
                if kind is not int and kind is not list and isinstance(reply, self._response_error):
                    raise reply
                return [reply]
            # A loop, not a comprehension: one would make ``line`` and ``deadline`` cells,
            # two objects made on every call of this hot path.
            replies = []
            for _ in commands:
                replies.append(line.read(deadline))
            return replies
        except self._response_error:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            if not self.kept.give(conn, now):  # _give, inline (the hot path): closed, so not kept
                conn.disconnect()

    def send_later(self, command: tuple[Any, ...], timeout: float | None) -> Callable[[], Any]:
        """Send one command now; the call returned reads its reply (an error reply is raised),
        exactly once, the connection this caller's alone until then. ``timeout`` bounds both
        halves, counted from now."""
        now = _monotonic()
        deadline = None if timeout is None else now + timeout
        conn, used = self._taken()
        try:
            line = self._ready(conn, now - used, deadline)
            if line is None:
                self._send(conn, (command,))
            else:
                line.put(self._packed((command,)), deadline)
        except BaseException:
            conn.disconnect()
            self.kept.give(conn, now)  # disconnected: nothing left open if refused
            raise

        def reply() -> Any:
            try:
                if line is not None:
                    got = line.read(deadline)
                    if isinstance(got, self._response_error):
                        raise got
                    return got
                if deadline is not None:
                    conn._sock.settimeout(left(deadline))
                return conn.read_response()
            except self._response_error:
                raise
            except BaseException:
                conn.disconnect()
                raise
            finally:
                self._give(conn, now)

        return reply

    def _give(self, conn: Any, used: float) -> None:
        """Keep ``conn`` for the next call, or disconnect it if the wire is closed (or full)."""
        if not self.kept.give(conn, used):
            conn.disconnect()

    def _taken(self) -> tuple[Any, float]:
        """A kept connection and when it was last used, or a new unconnected one (0.0)."""
        taken = self.kept.take()
        return taken if taken is not None else self._new()

    def _new(self) -> tuple[Any, float]:
        """A new unconnected connection, never used (0.0), without a :class:`_Line` yet."""
        conn = self._pool.connection_class(**self._pool.connection_kwargs)
        conn._ce_line = None
        return conn, 0.0

    def _packed(self, commands: Sequence[tuple[Any, ...]]) -> bytes:
        pack = self._pack
        assert pack is not None  # a hiredis parser (a _Line) comes with hiredis's packer
        if len(commands) == 1:
            return pack(commands[0])
        return b"".join([pack(command) for command in commands])

    def _send(self, conn: Any, commands: Sequence[tuple[Any, ...]]) -> None:
        if self._pack is None:
            conn.send_packed_command(conn.pack_commands(commands))
        else:
            conn.send_packed_command([self._pack(command) for command in commands])

    def _replies(self, conn: Any, count: int) -> list[Any]:
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except self._response_error as exc:
                replies.append(exc)
        return replies

    def _ready(self, conn: Any, idle: float, deadline: float | None) -> _Line | None:
        """Make a kept connection fit to send on: polled if it sat idle (a server-side close
        is seen and reconnected), connected within ``deadline``; its :class:`_Line`, or
        None with the socket timeout set to the deadline (redis-py reads the replies)."""
        line: _Line | None = conn.__dict__.get("_ce_line")
        if line is not None and idle <= POLL_AFTER and line.sock is conn._sock:
            return line  # in use a moment ago: nothing to check
        if idle > POLL_AFTER:
            try:
                if conn.is_connected and conn.can_read():
                    conn.disconnect()
            except self._broken:
                conn.disconnect()
        if not conn.is_connected:
            # connect(), not the implicit connect of sending: a Sentinel-managed connection
            # finds its primary only in connect().
            if deadline is None:
                conn.connect()
            else:
                _connect_within(conn, left(deadline))
        if line is None or line.sock is not conn._sock:
            demoted = _lean(conn)
            line = None if demoted is None else _Line(conn, demoted)
            conn._ce_line = line
        if line is None:
            conn._sock.settimeout(conn.socket_timeout if deadline is None else left(deadline))
        return line

    def close(self) -> None:
        """Disconnect the kept connections and keep none from now on: one given back while
        this runs, or by a call after it, is disconnected (``KeptConnections.close``)."""
        for conn in self.kept.close():
            conn.disconnect()  # the fast path's own connections, never the pool's
