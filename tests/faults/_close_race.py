"""``LockService.close()`` racing the heartbeat's store calls, round after round, in a
process of its own (``python -m tests.faults._close_race CONFIG``), so that a crash in a
driver (a connection freed under a reader) is the test's failing exit status, not pytest's.

CONFIG (JSON): url, prefix, seconds (the time budget), seed. Each round takes a few leases
with a short refresh interval (so a refresh is often in flight), reaching a server store
through a :class:`~tests.faults.servers.TcpProxy`; it may stall the relay (the calls hang,
the heartbeat gives them up and sends more on new connections) or cut it while close()
runs; then ``close(release=True or False)`` in this thread, the relay resumed (or reset
first: the calls in flight then fail after close()). Once the round's call threads have
ended (and a garbage collection ran: a connect psycopg gave up at its deadline leaves its
half-open socket to the collector), no socket of this process may still be connected to
the relay (SQLite: no descriptor of the database or its journals may be open). Some rounds
fork right after close(), the calls still in flight: the child takes and releases a lease
on a new service. The last round closes on a stalled relay and leaves it stalled: the
interpreter must still exit with call threads blocked in a driver.

A problem: a thread's uncaught exception, an unraisable exception, any warning (a
ResourceWarning of a connection left to the garbage collector, SQLAlchemy's warning of a
connection closed under its pool), a log record with a traceback or at ERROR (but
SQLAlchemy's own of a connection the relay reset as it was checked in), a call thread
saying after close() that it will retry. One JSON line on stdout says what was done and
found; the exit status is 1 if anything was found.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import sys
import threading
import time
import traceback
import warnings
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery_exclusive import LockService
from tests.faults.servers import TcpProxy

#: Leases per round, and their timing: a refresh every INTERVAL, each call given up after
#: at most INTERVAL (refresh_timeout), so a stall fills the call slots within a few tenths.
LEASES = 6
TTL = 3.0
INTERVAL = 0.05
#: The interval of a round closing with release=True on a stall (see _round).
SLOW_INTERVAL = 0.4
#: Longest a stall lasts before close(): a refresh sent on it is given up and sent again
#: on a new connection every INTERVAL or so; a longer stall piles up more calls than the
#: MariaDB engine's pool has connections, and those wait for a checkout until the pool's
#: timeout (SQLAlchemy's 30 s: not bounded by the call's deadline), outlasting a short run.
STALL = 0.15
#: Longest a round's call threads may take to end once the relay answers again (the pool
#: timeout above, and slack).
CALLS_END = 45.0

problems: list[str] = []
#: Most call threads seen alive at once after a close() (reported).
peak = [0]


def _problem(text: str) -> None:
    problems.append(text)
    sys.stderr.write(f"PROBLEM: {text}\n")


#: Set from a round's close() returning until its next round begins.
closed = threading.Event()


class _Tracebacks(logging.Handler):
    """A problem for each record carrying a traceback or at ERROR and above, and for a call
    thread saying after close() that it will retry (nothing retries then)."""

    def emit(self, record: logging.LogRecord) -> None:
        after_close = closed.is_set() and record.threadName == "celery-exclusive-call"
        if after_close and "retry" in record.getMessage():
            _problem(f"logged after close: {record.getMessage()}")
        if record.name.startswith("sqlalchemy.pool") and str(record.msg).startswith("Exception during reset"):
            return  # SQLAlchemy's own log of a connection the relay reset (cut) as it was checked in
        if record.exc_info or record.levelno >= logging.ERROR:
            _problem(f"logged by {record.threadName}: {self.format(record)}")


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit(":", 1)[0] if parts.port is not None else parts.netloc
    return urlunsplit(parts._replace(netloc=f"{netloc}:{port}"))


def _links() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def _open_to(port: int) -> int:
    """This process's sockets connected to ``port`` on 127.0.0.1 (as tests/contract/test_close.py)."""
    mine = _links()
    with open("/proc/net/tcp", encoding="ascii") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(
        1 for row in rows if int(row[2].rsplit(":", 1)[1], 16) == port and f"socket:[{row[9]}]" in mine
    )


def _open_files(path: str) -> int:
    """Descriptors of the database ``path`` and its journals (not of ``-waiters``: one per
    process for good, see providers/_sqlite.WaiterMarks)."""
    return sum(1 for link in _links() if link.startswith(path) and link != path + "-waiters")


def _calls() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "celery-exclusive-call" and t.is_alive()]


def _forked_child_works(url: str, prefix: str, key: str) -> None:
    """Fork now; the child takes and releases ``key`` on a new service and exits 0."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            with LockService(url, prefix=prefix) as service, service.lock(key, ttl=TTL):
                pass
            status = 0
        except BaseException as exc:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"PROBLEM: forked child: {exc!r}\n")
        finally:
            os._exit(status)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if status != 0:
                _problem(f"forked child ended with wait status {status}")
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    _problem("forked child hung (killed after 30 s)")


def _round(n: int, rng: random.Random, *, url: str, prefix: str, proxy: TcpProxy | None, last: bool) -> str:
    """One round; the mode it ran."""
    modes = ["plain"] if proxy is None else ["plain", "stall", "stall", "cut"]
    mode = "stall" if last and proxy is not None else rng.choice(modes)
    # A stalled close(release=True) costs RELEASE_TIMEOUT (2 s): one round in four.
    release = rng.random() < (0.25 if mode == "stall" else 0.5)
    fork = not last and rng.random() < 0.1
    closed.clear()
    service = LockService(url if proxy is None else _via(url, proxy.port), prefix=prefix)
    # close(release=True) on a stall takes RELEASE_TIMEOUT (2 s), the heartbeat refreshing
    # all the while: a longer interval there keeps the calls fewer than MariaDB's pool
    # connections (see STALL).
    interval = SLOW_INTERVAL if mode == "stall" and release else INTERVAL
    for i in range(rng.randint(1, LEASES)):
        service.lock(f"r{n}-{i}", ttl=TTL, refresh_interval=interval)
    time.sleep(rng.uniform(0, 3 * interval))
    if mode == "stall":
        assert proxy is not None
        proxy.stall()
        time.sleep(rng.uniform(0, STALL))  # refreshes sent, unanswered, given up, sent again
    cutter = None
    if mode == "cut":
        assert proxy is not None
        cutter = threading.Timer(rng.uniform(0, 0.01), proxy.cut)
        cutter.start()
    service.close(release=release)
    closed.set()
    if fork:
        _forked_child_works(url, prefix, f"r{n}-fork")
    if cutter is not None:
        cutter.join()
    if last:
        return f"{mode}, left stalled"
    if mode == "stall":
        assert proxy is not None
        time.sleep(rng.uniform(0, 0.05))
        if rng.random() < 0.5:
            proxy.cut()  # the calls in flight fail after close() (else they are answered)
        proxy.resume()
    peak[0] = max(peak[0], len(_calls()))
    end = time.monotonic() + CALLS_END
    for call in _calls():
        call.join(max(0.0, end - time.monotonic()))
    if _calls():
        stacks = sys._current_frames()
        first = _calls()[0]
        where = "".join(traceback.format_stack(stacks[first.ident])) if first.ident in stacks else "?"
        _problem(f"round {n} ({mode}): {len(_calls())} calls running {CALLS_END} s after close: {where}")
        return mode
    gc.collect()  # a connect given up at its deadline: psycopg's half-open socket is garbage
    if proxy is not None and (left := _open_to(proxy.port)):
        _problem(f"round {n} ({mode}, release={release}): {left} connection(s) left open after close")
    return mode


def main(argv: list[str]) -> int:
    config: dict[str, Any] = json.loads(argv[1])
    url: str = config["url"]
    rng = random.Random(config["seed"])
    # Every warning, a connection's ResourceWarning at garbage collection among them.
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *_: _problem(f"warning: {category.__name__}: {message}")
    threading.excepthook = lambda args: _problem(
        f"uncaught in {args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}"
    )
    sys.unraisablehook = lambda args: _problem(
        f"unraisable: {args.exc_type.__name__}: {args.exc_value} ({args.err_msg} {args.object!r})"
    )
    handler = _Tracebacks()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    parts = urlsplit(url)
    proxy = None if parts.port is None else TcpProxy(parts.port, parts.hostname or "127.0.0.1")
    sqlite = url.startswith("sqlite") and "/" + parts.path.lstrip("/")
    end = time.monotonic() + float(config["seconds"])
    modes: dict[str, int] = {}
    n = 0
    while not problems:
        last = time.monotonic() >= end
        mode = _round(n, rng, url=url, prefix=config["prefix"], proxy=proxy, last=last)
        modes[mode] = modes.get(mode, 0) + 1
        n += 1
        if sqlite and not last and (left := _open_files(sqlite)):
            _problem(f"round {n}: {left} descriptor(s) of the database left open after close")
        if last:
            break
    print(json.dumps({"rounds": n, "modes": modes, "peak_calls": peak[0], "problems": problems}), flush=True)
    # No proxy.close(), no join: the interpreter exits with the last round's calls blocked.
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
