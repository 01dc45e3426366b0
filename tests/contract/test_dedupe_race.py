"""``until_done`` markers under contention, on every store: senders hammer one key while a
worker runs the queued messages one after another (take the execution key, then release the
marker, as ``dedupe`` does).

An oracle outside the store counts messages sent and not yet finished: at most one at any
time (nothing queued while one is queued or running), and every refused send names a task
that was really sent (a refusal by a marker that was then given back, as the take-look-give-
back steps allow, names a message that never existed; a short run rarely meets that window,
so the steps pass too: this checks the invariants, not the absence of steps, which
test_marker.py's call count does). Short by default; CE_LONG=1 runs longer.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import uuid
from typing import Any

import pytest

from celery_exclusive import LockService
from celery_exclusive.providers.base import Held
from tests.conftest import Store

LONG = os.environ.get("CE_LONG") == "1"
SENDERS = 4
#: Senders run at least this long, then until 3 messages were sent and a send was refused
#: (a loaded machine may need longer for that), at most UP_TO seconds.
SECONDS = 8.0 if LONG else 0.7
UP_TO = 30.0


class Oracle:
    """What the test saw, under one mutex: messages outstanding (sent, not finished), the
    most at once, the ids sent and the ids refusals named."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.outstanding = 0
        self.most = 0
        self.sent: set[str] = set()
        self.named: list[str | None] = []
        self.errors: list[BaseException] = []


def _sender(service: LockService, oracle: Oracle, messages: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            task_id = uuid.uuid4().hex
            answer = service.try_mark("race#queued", ttl=30, holder={"task_id": task_id}, unless="race")
            if isinstance(answer, Held):
                with oracle.mutex:
                    oracle.named.append(
                        None if answer.holder is None else answer.holder.holder.get("task_id")
                    )
                time.sleep(random.uniform(0, 0.002))  # so the worker is not starved (SQLite's one writer)
                continue
            with oracle.mutex:
                oracle.outstanding += 1
                oracle.most = max(oracle.most, oracle.outstanding)
                oracle.sent.add(task_id)
            messages.put((task_id, answer))  # the publish
    except BaseException as exc:  # pragma: no cover - reported by the test
        oracle.errors.append(exc)


def _worker(service: LockService, oracle: Oracle, messages: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        while not stop.is_set() or not messages.empty():
            try:
                task_id, token = messages.get(timeout=0.1)
            except queue.Empty:
                continue
            lease = service.lock("race", holder={"task_id": task_id})  # the run takes over
            assert service.force_release("race#queued", token)  # ... and ends its marker
            time.sleep(random.uniform(0, 0.004))
            with oracle.mutex:  # the run ends before its key is free
                oracle.outstanding -= 1
            lease.release()
    except BaseException as exc:  # pragma: no cover - reported by the test
        oracle.errors.append(exc)


def test_until_done_markers_never_queue_a_second_message_nor_name_one_never_sent(store: Store) -> None:
    """4 senders, one worker, one key, for 0.7 s and until 3 messages were sent (8 s with
    CE_LONG=1): at most one message outstanding, every refusal names a sent task (or nobody:
    changed mid-call)."""
    senders = [store.service() for _ in range(SENDERS)]
    worker = store.service()
    oracle, messages, stop = Oracle(), queue.Queue[Any](), threading.Event()
    threads = [threading.Thread(target=_sender, args=(s, oracle, messages, stop)) for s in senders]
    threads.append(threading.Thread(target=_worker, args=(worker, oracle, messages, stop)))
    for thread in threads:
        thread.start()
    started = time.monotonic()
    time.sleep(SECONDS)
    while time.monotonic() - started < UP_TO and not oracle.errors:
        with oracle.mutex:
            if len(oracle.sent) >= 3 and oracle.named:
                break
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert not oracle.errors, oracle.errors
    assert oracle.most == 1, f"{oracle.most} messages outstanding at once"
    assert len(oracle.sent) >= 3, oracle.sent
    never_sent = [name for name in oracle.named if name is not None and name not in oracle.sent]
    assert never_sent == [], f"{len(never_sent)} of {len(oracle.named)} refusals named tasks never sent"
    if not oracle.named:
        pytest.fail("no send was refused: the senders never met a queued or running task")
