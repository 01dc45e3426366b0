"""What SQLite needs beyond its statements: the lease clock, the fork gate, the busy timeout.

Private to :mod:`celery_exclusive.providers.sql`. The fork gate is process-wide (one
instance, hooked into ``os.register_at_fork``); the clock and the busy timeout are per
provider and per connection.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import uuid
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from celery_exclusive.providers._sql_common import logger

__all__ = ["FORK_GATE", "ForkGate", "LeaseClock", "busy_timeout"]

_UNIX_EPOCH_JD = 2440587.5
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class LeaseClock:
    """SQLite's lease clock: ``CLOCK_BOOTTIME`` plus a per-boot anchor every process shares.

    The wall clock steps (an operator, NTP at boot, a VM resumed): leases measured on it
    expire early after a step forward and outlive their holder after a step back. The boot
    clock of Linux never steps (NTP only slews it) and is the same for every process of
    the machine, containers included (not across time namespaces, which can offset it).
    The first process of each boot stores ``anchor = wall clock - boot clock`` in the fence
    table (row ``id`` derived from the boot id, negative, so ``id = 1`` stays the counter);
    every process reads it back and measures ``anchor + boot clock``: close to the wall
    clock, so stamps stay readable and comparable with rows of earlier versions, but
    unaffected by any later step. Without a boot clock (not Linux) it is the wall clock.
    """

    def __init__(self) -> None:
        self.boot: int | None = None
        self.anchor: float | None = None
        if hasattr(time, "CLOCK_BOOTTIME"):
            with contextlib.suppress(OSError, ValueError), open(_BOOT_ID, encoding="ascii") as source:
                self.boot = -1 - (uuid.UUID(source.read().strip()).int >> 66)

    def setup(self, conn: Connection, sql: dict[str, sa.TextClause]) -> None:
        """Agree on this boot's anchor through the store (first writer wins), once."""
        if self.boot is None or self.anchor is not None:
            return
        base = round((time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)) * 1e6)
        conn.execute(sql["anchor_put"], {"boot": self.boot, "base": base})
        stored = int(conn.execute(sql["anchor_get"], {"boot": self.boot}).scalar_one())
        conn.execute(sql["anchor_gc"], {"boot": self.boot})
        conn.commit()
        self.anchor = stored / 1e6

    def seconds(self) -> float:
        """Now on the lease clock, in seconds since the Unix epoch (approximately)."""
        if self.boot is None or self.anchor is None:
            return time.time()
        return self.anchor + time.clock_gettime(time.CLOCK_BOOTTIME)

    def julian(self) -> float:
        """Now on the lease clock as a Julian day, SQLite's time format."""
        return _UNIX_EPOCH_JD + self.seconds() / 86400.0


#: How long a fork waits for the SQLite calls in flight (past SQLite's 30 s busy timeout).
_FORK_WAIT = 40.0


class ForkGate:
    """Holds ``fork()`` back while any thread of this process is inside a SQLite call.

    SQLite keeps process-wide state: its mutexes, and per database file the locks this
    process holds (which every connection of the process to that file shares). A child
    forked mid-call inherits them held, by a thread it does not have: even a brand-new
    connection then hangs, or waits out its busy timeout with "database is locked". So
    every SQLite call of every provider runs inside :meth:`call`, and the at-fork hook
    waits for the calls in flight to end (new ones wait for the fork). A fork from inside
    a call (never done here) does not wait for itself.
    """

    def __init__(self) -> None:
        self._reset()
        self._local = threading.local()

    def _reset(self) -> None:
        self._lock = threading.Lock()  # taken directly on the hot path; the condition's lock
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._forking = False

    def call(self) -> ForkGate:
        """The gate as a context manager around one SQLite call (re-entrant per thread)."""
        return self

    def __enter__(self) -> None:
        local = self._local
        depth: int = getattr(local, "depth", 0)
        if not depth:
            with self._lock:
                while self._forking:
                    self._cond.wait()
                self._active += 1
        local.depth = depth + 1

    def __exit__(self, *_: object) -> None:
        local = self._local
        local.depth -= 1
        if not local.depth:
            with self._lock:
                self._active -= 1
                if not self._active and self._forking:
                    self._cond.notify_all()

    def before_fork(self) -> None:
        if getattr(self._local, "depth", 0):
            return
        with self._cond:
            self._forking = True
            if not self._cond.wait_for(lambda: not self._active, _FORK_WAIT):
                logger.warning(
                    "fork() went ahead with %d SQLite lock-store call(s) still in flight after %.0f s: "
                    "the child may not be able to use that SQLite database",
                    self._active,
                    _FORK_WAIT,
                )

    def after_fork_in_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def after_fork_in_child(self) -> None:
        self._reset()  # the threads that were waiting or in a call do not exist here


FORK_GATE = ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_in_parent,
        after_in_child=FORK_GATE.after_fork_in_child,
    )


def busy_timeout(conn: Connection, timeout: float | None) -> None:
    """SQLite's busy timeout on ``conn`` for one call: at most ``timeout`` seconds (rounded
    up to 0.1 s, so a steady deadline sets it once per connection), or the connection's own
    (``timeout`` None: put back if an earlier call lowered it)."""
    info = conn.info  # the pooled connection's, kept across checkouts
    base = info.get("ce_busy_base")
    if base is None:
        if timeout is None:
            return
        dbapi: Any = conn.connection.driver_connection
        base = info["ce_busy_base"] = int(dbapi.execute("PRAGMA busy_timeout").fetchone()[0])
        info["ce_busy"] = base
    wanted = base if timeout is None else min(base, math.ceil(timeout * 10) * 100)
    if info["ce_busy"] != wanted:
        cast(Any, conn.connection.driver_connection).execute(f"PRAGMA busy_timeout = {wanted}")
        info["ce_busy"] = wanted
