"""Functions the waiting / lock_many contract tests run in spawned processes."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from celery_exclusive import LockService


def hold_until_killed(url: str, prefix: str, key: str, ttl: float, ready: Any) -> None:
    """Take ``key`` with a short ttl, say so, then hang (the test SIGKILLs this process)."""
    service = LockService(url, prefix=prefix, ttl=ttl)
    lease = service.lock(key)
    ready.put(lease.fence)
    time.sleep(600)


def lock_random_sets(
    url: str,
    prefix: str,
    *,
    keys: list[str],
    seconds: float,
    cap: float,
    wait: float,
    busy_dir: str,
    seed: int,
    results: Any,
    start: Any,
    progress: Any,
) -> None:
    """Lock random 3-of-N key sets (in random order) with ``lock_many(wait=)`` for
    ``seconds``, and on until this process got one set (at most ``cap`` seconds); mark each
    key busy in ``busy_dir`` (O_EXCL files) while held, counting any key found already busy
    (an overlap). ``progress`` counts every process's acquisitions: a wait that ran out
    while it stood still is a stall (nobody could take anything: a deadlock), one that ran
    out while others were served is a starved wait (load, or bad luck on a polling store).
    Reports (seed, acquisitions, overlaps, stalls, starved waits)."""
    rng = random.Random(seed)
    service = LockService(url, prefix=prefix, ttl=30)
    acquired = overlaps = stalls = starved = 0
    service.peek(keys[0])  # connect before the start line
    start.wait()
    began = time.monotonic()
    try:
        while time.monotonic() - began < (seconds if acquired else cap):
            chosen = rng.sample(keys, 3)
            before = progress.value
            taken = service.try_lock_many(chosen, wait=wait)
            if taken is None:
                if progress.value == before:
                    stalls += 1
                else:
                    starved += 1
                continue
            with taken:
                marks = []
                for key in chosen:
                    mark = Path(busy_dir) / key
                    try:
                        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                        marks.append(mark)
                    except FileExistsError:
                        overlaps += 1
                time.sleep(rng.uniform(0.0, 0.004))
                for mark in marks:
                    mark.unlink()
            acquired += 1
            with progress.get_lock():
                progress.value += 1
    finally:
        service.close()
    results.put((seed, acquired, overlaps, stalls, starved))


def take_turns(
    url: str, prefix: str, key: str, *, seconds: float, start: Any, results: Any, served: Any, turns: int
) -> None:
    """Loop ``lock(key, wait=)`` / hold 5 ms / release after the start line until the
    processes together were served ``turns`` times (``served``, a shared counter, numbers
    the acquisitions in the order they were made) or ``seconds`` passed, then report
    ``(pid, acquisitions among the first turns, most acquisitions by others during one of
    its waits)``. Nothing else paces the loop: a releaser that is served again before the
    woken waiters is what fairness must survive."""
    service = LockService(url, prefix=prefix, ttl=30)
    service.peek(key)  # connect before the start line
    count = worst = 0
    start.wait()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and served.value < turns:
            before = served.value
            lease = service.try_lock(key, wait=max(0.0, end - time.monotonic()))
            with served.get_lock():
                ticket = served.value
                if lease is not None:
                    served.value += 1
            worst = max(worst, ticket - before)
            if lease is None:
                break
            time.sleep(0.005)
            lease.release()
            count += ticket < turns
    finally:
        service.close()
    results.put((os.getpid(), count, worst))


def mark_waiting_until_killed(url: str, key: str, ready: Any) -> None:
    """Mark this process as a waiter for ``key`` on the SQLite store ``url``, say so, then
    hang (the test SIGKILLs this process)."""
    from celery_exclusive.providers.sql import SqlLockProvider

    provider = SqlLockProvider(url)
    with provider.mark_waiting(key):
        ready.put(True)
        time.sleep(600)
