"""A silent store: a TCP server that accepts every connection and never answers a byte.

What a hung server or a half-dead network looks like to a client: the connect succeeds and
every request then waits for the driver's own timeouts. Real sockets, no mock.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """Listen on a free port of 127.0.0.1 for the block; yields the port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # the server socket was closed: the block is over
                return
            accepted.append(connection)  # kept open, never read nor written

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)
        for connection in accepted:
            connection.close()
