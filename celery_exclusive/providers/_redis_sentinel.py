"""Sentinel's primary, looked up within a call's deadline, a silent sentinel passed over.

A redis-py connection managed by Sentinel asks the sentinels for the primary's address
each time it connects, on the sentinels' own connections with their own socket timeout
(10 s by default), which no call's deadline reaches. The lookup runs here in a thread of
its own, one at a time per service and process (a caller joins the lookup running, or
starts one: never is an address from a lookup that ended before the call began; a forked
child starts its own), and a caller waits for it until its deadline, then fails.

redis-py asks the sentinels in turn, each until its socket timeout: a silent first
sentinel (a stopped process, a link that drops everything) held every lookup for those
10 s, so every call failed for as long although the next sentinel would have answered.
The sentinels of a client the provider built (:func:`sentinels`) are asked by
:func:`discover` instead: the first at once, and each next one as soon as every one asked
so far has failed, or once its share of the lookup's time (until the earliest deadline of
the calls waiting for it, split equally among the sentinels: :class:`Schedule`) has
passed without an answer, the ones asked before still listened to; the first valid answer
wins, and the sentinel that gave it is moved to the front, as redis-py does, so later
lookups ask it first. Each ask is bounded by the sentinels' own socket timeouts (the
URL's), not by the calls' deadlines: a slow sentinel may still be the first to answer,
and a call that gave up leaves nothing waiting but that ask's thread and connection
(closed by ``close()``). A lookup outside a call (redis-py's own connect: ``diagnose``)
spreads the sentinels over their socket timeout. A client you pass keeps redis-py's
lookup, still in a thread within each call's deadline.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

_starting = threading.Lock()
#: Guards the order of every manager's sentinel list (an answering one is moved to the front).
_order = threading.Lock()
#: The schedule of the lookup running on this thread (:class:`_Lookup`), seen by
#: :func:`discover` under redis-py's ``get_master_address`` (which keeps the pool's record
#: of the primary and drops idle connections to a former one).
_running = threading.local()
_classes: list[type] = []


def sentinels(hosts: list[tuple[str, int]], sentinel_kwargs: dict[str, Any], **kwargs: Any) -> Any:
    """A redis-py ``Sentinel`` for ``hosts`` whose lookup of a primary is :func:`discover`'s
    and whose ``close()`` closes its connections to the sentinels."""
    if not _classes:
        from redis.sentinel import Sentinel

        class Sentinels(Sentinel):
            closed = False

            def discover_master(self, service_name: str) -> Any:
                return discover(self, service_name, getattr(_running, "schedule", None))

            def close(self) -> None:
                """Close every sentinel's connections, each one even if another's close
                raised (the first error is raised after); a lookup's ask still under
                way closes its own when it ends (:func:`_ask`)."""
                self.closed = True
                first: Exception | None = None
                for client in list(self.sentinels):
                    try:
                        client.close()
                    except Exception as exc:  # the others are still closed
                        first = first or exc
                if first is not None:
                    raise first

        _classes.append(Sentinels)
    return _classes[0](hosts, sentinel_kwargs=sentinel_kwargs, **kwargs)


def primary_of(conn: Any, deadline: float) -> Any:
    """The (host, port) of the primary ``conn``'s sentinels name, looked up within
    ``deadline`` (monotonic; redis-py's TimeoutError past it); None if ``conn`` is not a
    connection to a Sentinel-managed primary."""
    from redis.sentinel import SentinelManagedConnection

    pool = getattr(conn, "connection_pool", None)
    if not isinstance(conn, SentinelManagedConnection) or not getattr(pool, "is_master", False):
        return None
    return _primary(pool, deadline)


class Schedule:
    """When :func:`discover` asks each next sentinel: the ``i``-th (from 0) at the latest
    at ``i/n`` of the way from the start to ``deadline`` (monotonic; None: only once every
    one asked has failed). A lookup's schedule is hurried by a caller with an earlier
    deadline (:meth:`hurry`); ``replies`` carries the sentinels' answers to the lookup."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.replies: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def hurry(self, deadline: float) -> None:
        """Keep to ``deadline`` if it is earlier (under ``_starting``), the lookup woken."""
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline
            self.replies.put(_HURRIED)

    def due(self, start: float, turn: int, count: int) -> float | None:
        """When the sentinel at ``turn`` of ``count`` is asked at the latest (None: never
        before the ones asked have all failed)."""
        deadline = self.deadline
        return None if deadline is None else start + turn * (deadline - start) / count


#: Put in a lookup's replies by :meth:`Schedule.hurry`: the schedule changed.
_HURRIED = object()


def discover(manager: Any, service: str, schedule: Schedule | None = None) -> tuple[Any, Any]:
    """The primary's (host, port) as ``manager``'s sentinels name it (redis-py's
    ``discover_master``: ``SENTINEL MASTERS``, the primary's state checked), the sentinels
    asked as the module docstring says, on ``schedule`` (None: over the sentinels' socket
    timeout from now; without one, in turn). ``MasterNotFoundError`` if none names one."""
    from redis import exceptions
    from redis.sentinel import MasterNotFoundError

    failures = (exceptions.ConnectionError, exceptions.ResponseError, exceptions.TimeoutError)
    start = time.monotonic()
    with _order:
        order = list(manager.sentinels)
    if schedule is None:
        timeout = _socket_timeout(order[0]) if order else None
        schedule = Schedule(None if timeout is None else start + timeout)
    replies = schedule.replies
    errors: list[str] = []
    pending = 0
    for index, client in enumerate(order):
        threading.Thread(
            target=_ask, args=(manager, client, replies), name="celery-exclusive-sentinel-ask", daemon=True
        ).start()
        pending += 1
        while pending:
            due = None if index == len(order) - 1 else schedule.due(start, index + 1, len(order))
            try:
                item = replies.get(timeout=None if due is None else max(due - time.monotonic(), 0.0))
            except queue.Empty:
                break  # the next sentinel's turn: the ones asked are still listened to
            if item is _HURRIED:
                continue
            pending -= 1
            asked, reply = item
            if isinstance(reply, Exception):
                if not isinstance(reply, failures):
                    raise reply  # as redis-py lets it through
                # redis-py's wording; repr() names only the class, str() keeps the reply text
                errors.append(f"{asked} - {reply!r}" + (f": {reply}" if str(reply) else ""))
                continue
            state = reply.get(service)
            if state and manager.check_master_state(state, service):
                _promote(manager, asked)
                forced = getattr(manager, "_force_master_ip", None)
                return (state["ip"] if forced is None else forced), state["port"]
    info = f" : {', '.join(errors)}" if errors else ""
    raise MasterNotFoundError(f"No master found for {service!r}{info}")


def _ask(manager: Any, client: Any, replies: queue.SimpleQueue[Any]) -> None:
    """``SENTINEL MASTERS`` to one sentinel, its reply (or error) put in ``replies``; its
    connection closed if the manager was closed meanwhile (no socket outlives close())."""
    reply: Any
    try:
        reply = client.sentinel_masters()
    except Exception as exc:  # handed to discover(), which raises what redis-py would
        reply = exc
    replies.put((client, reply))
    if getattr(manager, "closed", False):
        client.close()


def _promote(manager: Any, client: Any) -> None:
    """Move ``client`` (the sentinel that answered) to the front, as redis-py does."""
    with _order:
        listed = manager.sentinels
        if client in listed:
            at = listed.index(client)
            listed[0], listed[at] = listed[at], listed[0]


def _socket_timeout(client: Any) -> float | None:
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    return float(timeout) if isinstance(timeout, int | float) else None


class _Lookup:
    """One ask of the sentinels: ``done`` once it ended, with ``address`` or ``error``;
    ``schedule`` kept to the earliest deadline of the calls waiting for it."""

    def __init__(self, deadline: float) -> None:
        self.done = threading.Event()
        self.pid = os.getpid()
        self.schedule = Schedule(deadline)
        self.address: Any = None
        self.error: BaseException | None = None

    def run(self, pool: Any) -> None:
        _running.schedule = self.schedule  # this thread's own: discover() under redis-py's reads it
        try:
            self.address = pool.get_master_address()
        except Exception as exc:  # handed to the callers waiting for it
            self.error = exc
        finally:
            self.done.set()


def _primary(pool: Any, deadline: float) -> Any:
    """The primary's (host, port) as ``pool``'s sentinels name it: the lookup running
    (hurried to ``deadline`` if that is earlier than its own), or a new one, waited for
    until ``deadline``."""
    from redis.exceptions import TimeoutError as RedisTimeout

    start = False
    with _starting:
        lookup: _Lookup | None = pool.__dict__.get("_ce_lookup")
        # A lookup copied by fork never ends here: its thread stayed in the parent.
        if lookup is None or lookup.done.is_set() or lookup.pid != os.getpid():
            lookup = pool._ce_lookup = _Lookup(deadline)
            start = True
        else:
            lookup.schedule.hurry(deadline)
    if start:
        threading.Thread(
            target=lookup.run, args=(pool,), name="celery-exclusive-redis-sentinel", daemon=True
        ).start()
    if not lookup.done.wait(max(deadline - time.monotonic(), 0.0)):
        raise RedisTimeout(f"no sentinel named the primary of {pool.service_name!r} by the call's deadline")
    if lookup.error is not None:
        raise lookup.error
    return lookup.address
