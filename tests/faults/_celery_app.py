"""A Celery app for the fault tests' workers, configured by the environment.

``CE_FAULT_BROKER`` (Redis URL of the broker and result backend: the suite's private Redis),
``CE_FAULT_QUEUE``, and the package's own ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from celery import Celery

from celery_exclusive.errors import BackendError
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import close_lock_services
from tests.fork_safe_redis import SOCKET_TIMEOUT

app = Celery("cefaults", broker=os.environ["CE_FAULT_BROKER"], backend=os.environ["CE_FAULT_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ["CE_FAULT_QUEUE"],
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=True,
)


@exclusive_task(app=app, key="soft:{tag}", soft_time_limit=1.0, time_limit=30)
def soft_limited(tag: str) -> str:
    """Returns at once: only the acquire before it can run into the soft time limit."""
    return f"ran {tag}"


def _events() -> Any:
    """A client of the broker's Redis (the private server itself, never through a proxy)."""
    import redis

    return redis.Redis.from_url(os.environ["CE_FAULT_BROKER"], socket_timeout=SOCKET_TIMEOUT)


@exclusive_task(app=app, key="rerun:{tag}", on_locked="rerun", ttl=3, time_limit=60, bind=True)
def rerun_hand_on(self: Any, tag: str, n: int, wait: bool = False, drop: bool = False) -> int:
    """Records its run (``n``, fence, start, end) in ``<tag>:runs``. ``wait``: says so in
    ``<tag>:ready`` first and returns once the test pushes ``<tag>:go`` (what the test did
    meanwhile, such as stalling the store, meets the release); ``drop``: then closes this
    process's lock services without releasing, so the run's lease stays in the store until
    its ttl (3 s) and its release answers UNKNOWN without reaching the store."""
    return _hand_on_run(self, tag, n, wait=wait, drop=drop)


def _hand_on_run(task: Any, tag: str, n: int, *, wait: bool, drop: bool) -> int:
    events = _events()
    start = time.time()
    fence = task.lock.fence
    if wait:
        events.rpush(f"{tag}:ready", json.dumps({"start": start, "fence": fence}))
        events.blpop([f"{tag}:go"], timeout=60)
    events.rpush(f"{tag}:runs", json.dumps({"n": n, "fence": fence, "start": start, "end": time.time()}))
    if drop:
        close_lock_services(release=False)
    return n


#: The ttl of :func:`rerun_long_lease`'s lease, in seconds.
LONG_LEASE = 8.0


@exclusive_task(
    app=app,
    key="rerun:{tag}",
    on_locked="rerun",
    ttl=LONG_LEASE,
    time_limit=60,
    lock_max_retries=2,
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=0.5,
    bind=True,
)
def rerun_long_lease(self: Any, tag: str, n: int, wait: bool = False, drop: bool = False) -> int:
    """:func:`rerun_hand_on` with an 8 s lease and 2 lock retries of 0.1-0.5 s: a dropped
    lease outlasts every lock retry a rerun waiting behind it would count."""
    return _hand_on_run(self, tag, n, wait=wait, drop=drop)


@exclusive_task(app=app, key="rerun:{tag}", on_locked="rerun", on_lost="terminate", ttl=3, bind=True)
def rerun_terminated(self: Any, tag: str, n: int, wait: bool = False) -> int:
    """:func:`rerun_hand_on` under ``lock_on_lost="terminate"``; ``wait``: after saying so in
    ``<tag>:ready``, runs in short sleeps for up to 60 s (until the loss of its lease
    interrupts it)."""
    events = _events()
    start = time.time()
    fence = self.lock.fence
    if wait:
        events.rpush(f"{tag}:ready", json.dumps({"start": start, "fence": fence}))
        while time.time() < start + 60:
            time.sleep(0.05)
    events.rpush(f"{tag}:runs", json.dumps({"n": n, "fence": fence, "start": start, "end": time.time()}))
    return n


@exclusive_task(app=app, key="killed:{tag}", ttl=30, time_limit=3, bind=True)
def hard_killed(self: Any, tag: str) -> None:
    """Says so in ``<tag>:ready`` (its fence), then sleeps into its hard time limit (3 s): the
    worker's main process kills it and releases its lease (ttl 30 s) with its record."""
    _events().rpush(f"{tag}:ready", json.dumps({"fence": self.lock.fence}))
    time.sleep(60)


#: How long :func:`slow_to_die` takes to exit after its SIGTERM, in seconds.
DYING = 2.0


@exclusive_task(app=app, key="killed:{tag}", ttl=30, bind=True)
def slow_to_die(self: Any, tag: str) -> None:
    """Says so in ``<tag>:ready``, then sleeps until terminated (``revoke(terminate=True)``):
    on SIGTERM it waits 0.5 s (the main process has found its lease by then), says so in
    ``<tag>:dying`` and exits :data:`DYING` seconds later, without releasing its lease."""
    events = _events()

    def die(*_: Any) -> None:
        time.sleep(0.5)
        events.rpush(f"{tag}:dying", 1)
        time.sleep(DYING)
        os._exit(1)

    signal.signal(signal.SIGTERM, die)
    events.rpush(f"{tag}:ready", json.dumps({"fence": self.lock.fence}))
    time.sleep(60)


#: The ttl of the ``retrying*`` tasks' leases, in seconds: a lease whose release the store
#: refused stays in it that long (unless the heartbeat's background release gets through).
RETRY_TTL = 20.0


def _retrying_run(task: Any, tag: str, countdown: float, hold: bool = False, *, auto: bool = False) -> int:
    """Records its run (attempt, fence, start) in ``<tag>:runs``. Attempt 0 says so in
    ``<tag>:ready``, waits for ``<tag>:go`` (the test makes the store refuse releases
    meanwhile) and retries with ``countdown`` (``auto``: raises KeyError, which
    ``autoretry_for`` retries); a later attempt returns its number (``hold``: after it says
    so in ``<tag>:ready`` and the test pushes ``<tag>:go`` again)."""
    events = _events()
    attempt = int(task.request.retries or 0)
    events.rpush(
        f"{tag}:runs", json.dumps({"attempt": attempt, "fence": task.lock.fence, "start": time.time()})
    )
    if attempt == 0:
        events.rpush(f"{tag}:ready", 1)
        events.blpop([f"{tag}:go"], timeout=60)
        if auto:
            raise KeyError(tag)
        raise task.retry(countdown=countdown)
    if hold:
        events.rpush(f"{tag}:ready", 1)
        events.blpop([f"{tag}:go"], timeout=60)
    return attempt


@exclusive_task(app=app, key="retry:{tag}", ttl=RETRY_TTL, time_limit=60, bind=True)
def retrying(self: Any, tag: str, countdown: float) -> int:
    """:func:`_retrying_run`, completion records kept (the default)."""
    return _retrying_run(self, tag, countdown)


@exclusive_task(app=app, key="retry:{tag}", ttl=RETRY_TTL, time_limit=60, done_retention=False, bind=True)
def retrying_unrecorded(self: Any, tag: str, countdown: float, hold: bool = False) -> int:
    """:func:`_retrying_run` without completion records."""
    return _retrying_run(self, tag, countdown, hold)


@exclusive_task(app=app, key="retry:{tag}", ttl=RETRY_TTL, time_limit=60, limit=2, bind=True)
def retrying_slot(self: Any, tag: str, countdown: float) -> int:
    """:func:`_retrying_run` on a semaphore (a slot behind the lease on its task id)."""
    return _retrying_run(self, tag, countdown)


@exclusive_task(
    app=app, key="retry:{tag}", ttl=RETRY_TTL, time_limit=60, limit=2, done_retention=False, bind=True
)
def retrying_slot_unrecorded(self: Any, tag: str, countdown: float) -> int:
    """:func:`retrying_slot` without completion records."""
    return _retrying_run(self, tag, countdown)


@exclusive_task(
    app=app,
    key="retry:{tag}",
    ttl=RETRY_TTL,
    time_limit=60,
    done_retention=False,
    autoretry_for=(KeyError,),
    retry_backoff=1,
    retry_jitter=False,
    max_retries=2,
    bind=True,
)
def autoretrying(self: Any, tag: str, countdown: float) -> int:
    """:func:`_retrying_run` whose attempt 0 raises KeyError: ``autoretry_for`` retries it
    after ``retry_backoff`` (1 s), without completion records (``countdown`` unused)."""
    return _retrying_run(self, tag, countdown, auto=True)


@exclusive_task(
    app=app,
    key="outage:{tag}",
    time_limit=60,
    autoretry_for=(BackendError,),
    retry_backoff=1,
    retry_jitter=False,
    max_retries=10,
    bind=True,
)
def outage_autoretrying(self: Any, tag: str) -> int:
    """``autoretry_for=(BackendError,)``: an acquire the store refuses is retried after
    ``retry_backoff`` (1, 2, 4... s); records its run (attempt, fence) in ``<tag>:runs``
    and returns its attempt."""
    attempt = int(self.request.retries or 0)
    _events().rpush(f"{tag}:runs", json.dumps({"attempt": attempt, "fence": self.lock.fence}))
    return attempt


@exclusive_task(
    app=app,
    key="retry:{tag}",
    ttl=RETRY_TTL,
    soft_time_limit=1.0,
    time_limit=60,
    done_retention=False,
    bind=True,
)
def retrying_past_soft_limit(self: Any, tag: str) -> int:
    """Attempt 0 says so in ``<tag>:ready``, waits for ``<tag>:go`` (the test stalls the
    store meanwhile) and retries: its release waits for the store until the soft time limit
    (1 s) interrupts it, and it retries again from there (noted in ``<tag>:soft``). Records
    its runs as :func:`_retrying_run` does; a later attempt returns its number."""
    from celery.exceptions import SoftTimeLimitExceeded

    events = _events()
    attempt = int(self.request.retries or 0)
    events.rpush(
        f"{tag}:runs", json.dumps({"attempt": attempt, "fence": self.lock.fence, "start": time.time()})
    )
    if attempt:
        return attempt
    events.rpush(f"{tag}:ready", 1)
    events.blpop([f"{tag}:go"], timeout=60)
    try:
        raise self.retry(countdown=0)
    except SoftTimeLimitExceeded:
        events.rpush(f"{tag}:soft", 1)
        raise self.retry(countdown=0) from None


def _replacing_run(task: Any, tag: str, stage: int, how: str, replacement: Any) -> int:
    """Records its run (stage, attempt, fence, start, task id) in ``<tag>:runs``. Stage 0 of
    attempt 0 says so in ``<tag>:ready`` and waits for ``<tag>:go`` (the test makes the store
    refuse releases meanwhile; ``how`` ``"retried"``: it retries first, at once, and its
    attempt 1 replaces itself without waiting; ``"retried-held"``: it retries first, at once,
    and its attempt 1 waits instead); then ``self.replace()`` by stage 1 of ``replacement``
    (``how`` ``"chain"``: behind a run of :func:`noted`, which takes the task id;
    ``"chain-first"``: before it, under an id of its own; ``"chain-middle"``: between two,
    under an id of its own, its parent the first; ``"group"``: beside a run of
    :func:`noted`, in a group, under an id of its own, Celery's ``accumulate`` taking the
    task id; ``"chord"``: as the body, which takes the task id, of a chord whose header is a
    run of :func:`noted`); stage 1 returns 1."""
    from celery import chain, chord, group

    events = _events()
    attempt = int(task.request.retries or 0)
    run = {
        "stage": stage,
        "attempt": attempt,
        "fence": task.lock.fence,
        "start": time.time(),
        "id": task.request.id,
    }
    events.rpush(f"{tag}:runs", json.dumps(run))
    if stage:
        return 1
    if attempt == 0 and how.startswith("retried"):
        raise task.retry(countdown=0)
    if how != "retried":
        events.rpush(f"{tag}:ready", 1)
        events.blpop([f"{tag}:go"], timeout=60)
    follow = replacement.si(tag, 1, how)
    if how == "chain":
        raise task.replace(chain(noted.si(tag), follow))
    if how == "chain-first":
        raise task.replace(chain(follow, noted.si(tag)))
    if how == "chain-middle":
        raise task.replace(chain(noted.si(tag), follow, noted.si(tag)))
    if how == "group":
        raise task.replace(group(follow, noted.si(tag)))
    if how == "chord":
        raise task.replace(chord([noted.si(tag)], follow))
    raise task.replace(follow)


@app.task
def noted(tag: str) -> None:
    """Notes in ``<tag>:noted`` that it ran (the first link of a replacement chain)."""
    _events().rpush(f"{tag}:noted", 1)


@exclusive_task(app=app, key="replace:{tag}", ttl=RETRY_TTL, time_limit=60, bind=True)
def replacing(self: Any, tag: str, stage: int, how: str = "") -> int:
    """:func:`_replacing_run` by itself, completion records kept (the default)."""
    return _replacing_run(self, tag, stage, how, replacing)


@exclusive_task(app=app, key="replace:{tag}", ttl=RETRY_TTL, time_limit=60, done_retention=False, bind=True)
def replacing_unrecorded(self: Any, tag: str, stage: int, how: str = "") -> int:
    """:func:`_replacing_run` by itself without completion records."""
    return _replacing_run(self, tag, stage, how, replacing_unrecorded)


@exclusive_task(app=app, key="killed:{tag}", ttl=30, time_limit=3, bind=True)
def replaced_then_killed(self: Any, tag: str, stage: int = 0) -> None:
    """Stage 0 retries once (at once), and its retry replaces itself by stage 1, which says
    so in ``<tag>:ready`` (stage, attempt, fence) and sleeps into its hard time limit (3 s):
    the worker's main process kills it and releases its lease with its record."""
    if not stage:
        if not self.request.retries:
            raise self.retry(countdown=0)
        raise self.replace(replaced_then_killed.si(tag, 1))
    ready = {"stage": stage, "attempt": self.request.retries, "fence": self.lock.fence}
    _events().rpush(f"{tag}:ready", json.dumps(ready))
    time.sleep(60)


def _rerun_retrying_run(task: Any, tag: str, n: int, countdown: float) -> int:
    """Records its run (``n``, attempt, fence, start, end) in ``<tag>:runs``. Run 1's attempt
    0 says so in ``<tag>:ready`` (its fence), waits for ``<tag>:go`` and retries with
    ``countdown``; any other run returns ``n``."""
    events = _events()
    attempt, start = int(task.request.retries or 0), time.time()
    run = {"n": n, "attempt": attempt, "fence": task.lock.fence, "start": start}
    if n == 1 and not attempt:
        events.rpush(f"{tag}:ready", json.dumps(run))
        events.blpop([f"{tag}:go"], timeout=60)
        events.rpush(f"{tag}:runs", json.dumps({**run, "end": time.time()}))
        raise task.retry(countdown=countdown)
    events.rpush(f"{tag}:runs", json.dumps({**run, "end": time.time()}))
    return n


@exclusive_task(app=app, key="rerun:{tag}", on_locked="rerun", ttl=RETRY_TTL, time_limit=60, bind=True)
def rerun_retrying(self: Any, tag: str, n: int, countdown: float = 0.0) -> int:
    """:func:`_rerun_retrying_run` under ``on_locked="rerun"``."""
    return _rerun_retrying_run(self, tag, n, countdown)


#: The max_lifetime of :func:`rerun_retrying_short`'s runs (and so its rerun marker's ttl).
SHORT_LIFETIME = 3.0


@exclusive_task(
    app=app,
    key="rerun:{tag}",
    on_locked="rerun",
    ttl=2,
    max_lifetime=SHORT_LIFETIME,
    time_limit=60,
    bind=True,
)
def rerun_retrying_short(self: Any, tag: str, n: int, countdown: float = 0.0) -> int:
    """:func:`rerun_retrying` whose runs live 3 s at most: a recorded rerun's marker too."""
    return _rerun_retrying_run(self, tag, n, countdown)
