"""The Redis fast path: commands sent on connections the provider keeps out of the pool.

redis-py's pool checkout and command wrapper cost about as much Python time as the round
trip; this path keeps their safety checks: fork (a child never uses its parent's sockets,
see providers/_kept.py), and a connection idle long enough for the server to have closed
it (Redis's ``timeout`` counts whole seconds) is polled and reconnected before anything is
sent. A connection is never left with unread data: any failure mid-command disconnects it.
A per-call ``timeout`` bounds the whole call, connecting included, on the socket; past it
the connection is closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_exclusive.providers._kept import KeptConnections

#: Seconds a kept connection may sit idle before it is checked for a server-side close;
#: under Redis's smallest idle ``timeout`` (1 s) so no live connection goes unchecked.
POLL_AFTER = 0.5


def as_text(value: Any) -> str:
    """A reply's bytes (or number) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least 1 ms: a socket timeout of 0 would
    make the socket non-blocking instead of failing at once."""
    return max(deadline - time.monotonic(), 0.001)


def _connect_within(conn: Any, timeout: float) -> None:
    """Connect ``conn`` (TCP, TLS and the AUTH/HELLO/SELECT handshake) within ``timeout`` s."""
    connect_timeout, socket_timeout = conn.socket_connect_timeout, conn.socket_timeout
    conn.socket_connect_timeout = min(connect_timeout or timeout, timeout)
    conn.socket_timeout = min(socket_timeout or timeout, timeout)
    try:
        conn.connect()
    finally:
        conn.socket_connect_timeout, conn.socket_timeout = connect_timeout, socket_timeout


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

    def send_many(self, commands: Sequence[tuple[Any, ...]], timeout: float | None) -> list[Any]:
        """Send ``commands`` pipelined on one kept connection and read every reply; an error
        reply is raised for one command, returned in its place for several."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        conn, used = self._taken()
        try:
            self._ready(conn, now - used, deadline)
            self._send(conn, commands)
            if len(commands) == 1:
                return [conn.read_response()]
            return self._replies(conn, len(commands))
        except self._response_error:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self.kept.give(conn, now)

    def send_later(self, command: tuple[Any, ...], timeout: float | None) -> Callable[[], Any]:
        """Send one command now; the call returned reads its reply (an error reply is raised),
        exactly once, the connection this caller's alone until then. ``timeout`` bounds both
        halves, counted from now."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        conn, used = self._taken()
        try:
            self._ready(conn, now - used, deadline)
            self._send(conn, (command,))
        except BaseException:
            conn.disconnect()
            self.kept.give(conn, now)
            raise

        def reply() -> Any:
            try:
                if deadline is not None:
                    conn._sock.settimeout(left(deadline))
                return conn.read_response()
            except self._response_error:
                raise
            except BaseException:
                conn.disconnect()
                raise
            finally:
                self.kept.give(conn, now)

        return reply

    def _taken(self) -> tuple[Any, float]:
        """A kept connection and when it was last used, or a new unconnected one (0.0)."""
        taken = self.kept.take()
        return (
            taken if taken is not None else (self._pool.connection_class(**self._pool.connection_kwargs), 0.0)
        )

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

    def _ready(self, conn: Any, idle: float, deadline: float | None) -> None:
        """Make a kept connection fit to send on: polled if it sat idle (a server-side close
        is seen and reconnected), connected within ``deadline``, socket timeout set to it."""
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
        conn._sock.settimeout(conn.socket_timeout if deadline is None else left(deadline))

    def close(self) -> None:
        for conn in self.kept.drain():
            conn.disconnect()  # the fast path's own connections, never the pool's
