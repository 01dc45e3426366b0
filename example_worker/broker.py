"""kombu's filesystem transport, with each message written atomically.

kombu's own ``_put`` creates the message file under its final name and then writes it, so
a consumer polling the folder can take the file while it is still empty, fail to decode
it, and lose the message (a worker may even stop on the error). Here a message is written
to a hidden temporary name in the same folder and renamed into place: a rename is atomic
on one file system, so consumers only ever see complete messages. Everything else
(moving a taken message away by rename, so exactly one consumer gets it) is kombu's.

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
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


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


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel
