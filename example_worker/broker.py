"""kombu's filesystem transport, with each message written atomically.

kombu's own ``_put`` creates the message file under its final name and then writes it, so
a consumer polling the folder can take the file while it is still empty, fail to decode
it, and lose the message (a worker may even stop on the error). Here a message is written
to a hidden temporary name in the same folder and renamed into place: a rename is atomic
on one file system, so consumers only ever see complete messages. Everything else
(moving a taken message away by rename, so exactly one consumer gets it) is kombu's.

The exchange table (which queues an exchange routes to) has the same flaw in kombu's
``_queue_bind``: the first worker creates the file empty and only then locks and fills it,
so a second worker starting at the same moment can lock it first and fail to decode an
empty table. Here binds are serialised on a lock file of their own and the table is
replaced by rename, so a reader sees the old table or the new one, never a partial one.

Selected by the app's ``broker_transport`` setting when the broker URL is ``filesystem://``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.transport.filesystem import LOCK_EX, exchange_queue_t, lock, unlock
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads


class Channel(filesystem.Channel):
    """A filesystem channel whose messages appear in the queue folder complete, or not at all."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # kombu's name: creation time (ms) first, so a sorted listing is roughly FIFO.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # Starts with ".": kombu takes only files named "<stamp>_<uuid>.<queue>.msg".
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _queue_bind(
        self, exchange: str, routing_key: str | None, pattern: str | None, queue: str | None
    ) -> None:
        table = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        bound = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            with open(f"{table}.lock", "ab", buffering=0) as guard:
                lock(guard, LOCK_EX)
                try:
                    raw = table.read_bytes() if table.exists() else b""
                    queues = [exchange_queue_t(*q) for q in loads(bytes_to_str(raw))] if raw else []
                    if bound in queues:
                        return
                    partial = f"{table}.{uuid.uuid4()}.partial"
                    with open(partial, "wb") as file:
                        file.write(str_to_bytes(dumps([bound, *queues])))
                    os.replace(partial, table)
                finally:
                    unlock(guard)
        except OSError as exc:
            raise ChannelError(f"Cannot open {table}") from exc


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel
