"""What SQLite needs beyond its statements: lease clock, fork gate, busy timeout, waiter marks.

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
import zlib
from collections.abc import Iterator
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers._sql_common import logger

try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - not POSIX: only this process's waiters are seen
    _fcntl = None  # type: ignore[assignment]

__all__ = ["FORK_GATE", "ForkGate", "LeaseClock", "LocalWaiters", "WaiterMarks", "busy_timeout"]

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


#: The oldest SQLite library the store runs on: a completion record is written by an upsert
#: with a condition (``INSERT ... ON CONFLICT ... DO UPDATE ... WHERE``), SQLite 3.24 (2018).
MIN_VERSION = (3, 24, 0)


def check_version(dialect: Dialect) -> None:
    """Raise ConfigurationError, before any connection, if the SQLite library Python links
    is older than :data:`MIN_VERSION` (its statements would fail at first use, as syntax
    errors)."""
    found = getattr(dialect.dbapi, "sqlite_version_info", None)
    if found is not None and tuple(found) < MIN_VERSION:
        raise ConfigurationError(
            f"the SQLite lock store needs SQLite {'.'.join(map(str, MIN_VERSION))} or later; "
            f"this Python links SQLite {'.'.join(map(str, found))}"
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


class WaiterMarks:
    """Which keys of one SQLite database have waiters, across the machine's processes.

    SQLite is embedded: every waiter runs on this machine. A waiting process holds a
    shared ``fcntl`` lock on one byte of the side file ``<database>-waiters`` (the byte is
    a CRC-32 of the key: a collision only makes a releaser give way once for nothing);
    the kernel drops it when the process dies, so a dead waiter never counts. A releaser
    asks by trying an exclusive lock on that byte, released at once: refused means another
    process waits. Waiters of this process are counted here (POSIX locks do not conflict
    within a process). One instance per database file and process (:meth:`of`), never
    closed: closing any descriptor of the file would drop all of this process's locks on
    it. Without ``fcntl`` (not POSIX) or when the side file cannot be opened, only this
    process's waiters are seen.
    """

    _instances: dict[str, WaiterMarks] = {}  # the process-wide registry
    _instances_lock = threading.Lock()

    def __init__(self, path: str | None) -> None:
        self._path = path  # None: an in-memory database, this process's waiters only
        self._lock = threading.Lock()
        self._pid = -1
        self._fd: int | None = None
        self._counts: dict[int, int] = {}

    @classmethod
    def of(cls, database: str | None) -> WaiterMarks:
        """The marks of the database file ``database`` (None: an in-memory one, unshared)."""
        if database in (None, "", ":memory:"):
            return cls(None)
        path = os.path.realpath(str(database)) + "-waiters"
        with cls._instances_lock:
            found = cls._instances.get(path)
            if found is None:
                found = cls._instances[path] = cls(path)
            return found

    def _file(self) -> int | None:
        """The side file (holding the lock); a forked child starts with no marks."""
        if self._pid != os.getpid():
            self._pid, self._counts = os.getpid(), {}  # locks are not inherited; the fd is
            if self._fd is None and _fcntl is not None and self._path is not None:
                with contextlib.suppress(OSError):
                    self._fd = os.open(
                        self._path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666
                    )
        return self._fd

    @contextlib.contextmanager
    def waiting(self, key: str) -> Iterator[None]:
        """This process waits for ``key`` while inside."""
        byte = zlib.crc32(key.encode()) & 0x7FFFFFFF
        with self._lock:
            fd = self._file()
            count = self._counts.get(byte, 0)
            if not count and fd is not None:
                _share(fd, byte)
            self._counts[byte] = count + 1
        try:
            yield
        finally:
            with self._lock:
                if self._pid == os.getpid():  # else the marks were a parent's
                    left = self._counts.pop(byte, 1) - 1
                    if left:
                        self._counts[byte] = left
                    elif fd is not None and _fcntl is not None:
                        with contextlib.suppress(OSError):
                            _fcntl.lockf(fd, _fcntl.LOCK_UN, 1, byte)

    def anyone(self, key: str) -> bool:
        """Whether any process (this one included) waits for ``key`` now."""
        byte = zlib.crc32(key.encode()) & 0x7FFFFFFF
        with self._lock:
            fd = self._file()
            if self._counts.get(byte) or fd is None or _fcntl is None:
                return bool(self._counts.get(byte))
            try:
                _fcntl.lockf(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB, 1, byte)
            except OSError:
                return True  # another process holds a shared mark there
            with contextlib.suppress(OSError):
                _fcntl.lockf(fd, _fcntl.LOCK_UN, 1, byte)
            return False


class LocalWaiters:
    """The SQL store's waiter methods: on SQLite (``_marks`` set) every waiter is on this
    machine, marked in :class:`WaiterMarks`; MariaDB/MySQL (``_marks`` None) has none."""

    _marks: WaiterMarks | None = None

    def mark_waiting(self, key: str) -> contextlib.AbstractContextManager[None]:
        """SQLite: this process waits for ``key`` while inside (``MarksWaiters``)."""
        return contextlib.nullcontext() if self._marks is None else self._marks.waiting(key)

    def had_waiters(self, key: str) -> bool:
        """SQLite: whether any process waits for ``key`` now (``KnowsWaiters``, asked right
        after a release; two fcntl calls). MariaDB/MySQL: False."""
        return self._marks is not None and self._marks.anyone(key)

    @property
    def waiters_peek(self) -> bool:
        """True on SQLite: a waiter peeks (a deferred read) before each retry, as a refused
        acquire takes the database's write lock (``BEGIN IMMEDIATE``), and 8 waiters doing
        so starved each other in SQLite's busy handler. False on MariaDB/MySQL, whose
        refused acquires queue in order on the fence row's lock."""
        return self._marks is not None


def _share(fd: int, byte: int) -> None:
    """A shared lock on ``byte``: refused only while a releaser tests it (microseconds), so
    a few quick retries; never blocking (a stopped releaser must not stall a wait)."""
    for _ in range(10):
        try:
            _fcntl.lockf(fd, _fcntl.LOCK_SH | _fcntl.LOCK_NB, 1, byte)
            return
        except OSError:
            time.sleep(0.0005)
    logger.debug("could not mark a SQLite waiter; its waits are not seen by releasers")
