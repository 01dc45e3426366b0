"""Sentinel's primary, looked up within a call's deadline.

A redis-py connection managed by Sentinel asks the sentinels for the primary's address
each time it connects, on the sentinels' own connections with their own socket timeout
(10 s by default), which no call's deadline reaches: on a silent sentinel (a stopped
process, a link that drops everything) each call took those 10 s. The lookup runs here in
a thread of its own, one at a time per service and process (a caller joins the lookup
running, or starts one: never is an address from a lookup that ended before the call
began; a forked child starts its own), and a caller waits for it until its deadline,
then fails. The lookup is redis-py's own (``get_master_address``: the sentinels in
turn, the one that answered asked first next time, idle connections to a former primary
dropped), only off the caller's thread.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

_starting = threading.Lock()


def primary_of(conn: Any, deadline: float) -> Any:
    """The (host, port) of the primary ``conn``'s sentinels name, looked up within
    ``deadline`` (monotonic; redis-py's TimeoutError past it); None if ``conn`` is not a
    connection to a Sentinel-managed primary."""
    from redis.sentinel import SentinelManagedConnection

    pool = getattr(conn, "connection_pool", None)
    if not isinstance(conn, SentinelManagedConnection) or not getattr(pool, "is_master", False):
        return None
    return _primary(pool, deadline)


class _Lookup:
    """One ask of the sentinels: ``done`` once it ended, with ``address`` or ``error``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.pid = os.getpid()
        self.address: Any = None
        self.error: BaseException | None = None

    def run(self, pool: Any) -> None:
        try:
            self.address = pool.get_master_address()
        except Exception as exc:  # handed to the callers waiting for it
            self.error = exc
        finally:
            self.done.set()


def _primary(pool: Any, deadline: float) -> Any:
    """The primary's (host, port) as ``pool``'s sentinels name it: the lookup running, or
    a new one, waited for until ``deadline``."""
    from redis.exceptions import TimeoutError as RedisTimeout

    start = False
    with _starting:
        lookup: _Lookup | None = pool.__dict__.get("_ce_lookup")
        # A lookup copied by fork never ends here: its thread stayed in the parent.
        if lookup is None or lookup.done.is_set() or lookup.pid != os.getpid():
            lookup = pool._ce_lookup = _Lookup()
            start = True
    if start:
        threading.Thread(
            target=lookup.run, args=(pool,), name="celery-exclusive-redis-sentinel", daemon=True
        ).start()
    if not lookup.done.wait(max(deadline - time.monotonic(), 0.0)):
        raise RedisTimeout(f"no sentinel named the primary of {pool.service_name!r} by the call's deadline")
    if lookup.error is not None:
        raise lookup.error
    return lookup.address
