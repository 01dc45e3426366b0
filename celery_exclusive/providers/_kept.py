"""Driver connections a provider keeps outside its driver's pool, fork-aware.

A provider that sends its hot-path commands on connections of its own (to skip the pool's
checkout) keeps them here between calls: :meth:`KeptConnections.take` hands out the most
recently used one with how long it sat idle, :meth:`KeptConnections.give` puts it back.

Fork: a child must never use, or close, a connection of its parent (the replies would be
read by both processes; a closing handshake would end the parent's session). The first
call in a new process hands every inherited connection to ``on_fork`` and starts empty.
A new process is told by a generation number that one ``os.register_at_fork`` hook
(``after_in_child``, registered once for the module) bumps in every forked child: a take
compares two ints instead of asking the kernel for its pid (two ``getpid`` system calls per
lock cycle before). *Relies on* the child being made by ``os.fork`` (or anything that runs
CPython's at-fork hooks, as ``multiprocessing``'s and billiard's fork do): the same hook the
lock service already relies on for its token prefix and its heartbeat. The pid is still
checked where nothing is hot (:meth:`~KeptConnections.drain`, :meth:`~KeptConnections.close`).
The default ``on_fork`` drops them: right for redis-py, whose ``disconnect()`` shuts a
socket down only in the process that made it. A store whose close sends a goodbye on the
wire (libpq's Terminate) passes an
``on_fork`` that keeps them referenced, unclosed, instead.

Thread-safe without a lock (a list's ``append``, ``pop`` and ``remove`` are atomic): a
connection is used by one thread at a time, between :meth:`~KeptConnections.take` and
:meth:`~KeptConnections.give`; concurrent givers may overshoot ``limit`` by one each. A
give racing :meth:`~KeptConnections.close` looks at ``closed`` again after its append and
takes the connection back out if the close's drain missed it (one of the two gets it: the
giver's ``remove`` or the drain's ``pop``), so no connection is kept, unclosed, past a close.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Generic, TypeVar

C = TypeVar("C")

#: Bumped in every forked child (the hook below): a KeptConnections made in an earlier
#: generation holds connections of an ancestor process.
_generation = [0]


def _bump_generation() -> None:
    _generation[0] += 1


os.register_at_fork(after_in_child=_bump_generation)


def _drop(inherited: list[C]) -> None:
    """The default ``on_fork``: forget the parent's connections without touching them."""


class KeptConnections(Generic[C]):
    """Up to ``limit`` connections (``None``: no limit), each with its last use (monotonic s)."""

    __slots__ = ("_generation", "_idle", "_limit", "_on_fork", "_pid", "closed")

    def __init__(self, limit: int | None = None, on_fork: Callable[[list[C]], None] = _drop) -> None:
        self._idle: list[tuple[C, float]] = []
        self._limit = limit
        self._on_fork = on_fork
        self._pid = os.getpid()
        self._generation = _generation[0]
        #: Set by :meth:`close`: nothing is kept any more.
        self.closed = False

    def _forked(self) -> bool:
        """True (after handing the parent's connections to ``on_fork``) in a new process."""
        if self._generation == _generation[0] and self._pid == os.getpid():
            return False
        inherited, self._idle = self._idle, []
        self._pid, self._generation = os.getpid(), _generation[0]
        self._on_fork([conn for conn, _ in inherited])
        return True

    def take(self) -> tuple[C, float] | None:
        """The most recently used connection and its last use, or None if none is kept."""
        if self._generation != _generation[0]:  # forked since (see the module docstring)
            self._forked()
        try:
            return self._idle.pop()
        except IndexError:  # none kept, or another thread took the last one
            return None

    def has_room(self) -> bool:
        """Whether fewer than ``limit`` connections are kept (closed or not)."""
        return self._limit is None or len(self._idle) < self._limit

    def give(self, conn: C, used: float | None = None) -> bool:
        """Keep ``conn``, last used at ``used`` (default: now); False if full or closed (close
        it yourself). True once kept: a :meth:`close` from then on returns it."""
        limit = self._limit
        idle = self._idle
        refused = self.closed or (limit is not None and len(idle) >= limit)  # has_room(), inline
        if refused:
            return False
        entry = (conn, time.monotonic() if used is None else used)
        idle.append(entry)
        if self.closed:  # close() ran since the check: its drain may have come before the append
            try:
                idle.remove(entry)
            except ValueError:  # the drain (or a take) had it: the connection is theirs
                return True
            return False
        return True

    def drain(self) -> list[C]:
        """Every connection kept by this process, no longer kept (to close them)."""
        self._forked()
        # Popped one by one from the one list, never swapped for a new one: a give() that
        # looked the list up before a swap would append to the old list, which nobody drains.
        idle, drained = self._idle, []
        while True:
            try:
                drained.append(idle.pop()[0])
            except IndexError:
                return drained

    def close(self) -> list[C]:
        """Keep nothing from now on; :meth:`drain`'s connections (to close them)."""
        self.closed = True
        return self.drain()

    @property
    def idle(self) -> list[tuple[C, float]]:
        """``(connection, last use)`` of each kept connection, oldest first (for tests)."""
        return list(self._idle)

    def __len__(self) -> int:
        return len(self._idle)
