"""The Celery app of the integration suite: run by subprocess workers and beat, used by tests.

Configured only through the environment, which tests/celery/conftest.py sets (session-unique
values) before anything imports this module:

* ``CE_CELERY_BROKER``     Redis URL for broker, results and records (a dedicated DB number)
* ``CE_CELERY_KEYPREFIX``  global key prefix of every broker/result key (isolation, cleanup)
* ``CE_CELERY_QUEUE``      the queue a worker consumes (one per lock-store group)
* ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``  the lock store, read by the package
* ``CE_BEAT_INTERVAL`` / ``CE_BEAT_DURATION`` / ``CE_BEAT_TAG``  the beat schedule, if set
* ``CE_CELERY_BACKEND_RETRIES``  how often the result backend reconnects before it gives up
  (Celery's default, 20 retries about 1 s apart, if unset)

Every task body records its run (start/end wall time, key, fence, pid) in a Redis list;
``beat_job`` also records each send (in the beat process) and each skip (with the holder's fence).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import MaxRetriesExceededError, SoftTimeLimitExceeded
from celery.signals import after_task_publish, worker_ready

from celery_exclusive.errors import LockedError, LockLost
from celery_exclusive.signals import task_skipped
from celery_exclusive.task import LOCK_RETRIES_HEADER, exclusive_task
from celery_exclusive.worker import get_lock_service
from tests.fork_safe_redis import ForkSafeRedis

BROKER = os.environ.get("CE_CELERY_BROKER", "redis://127.0.0.1:6379/11")
KEYPREFIX = os.environ.get("CE_CELERY_KEYPREFIX", "cetest:")
QUEUE = os.environ.get("CE_CELERY_QUEUE", "cetest")
RECORDS = KEYPREFIX + "records"

BACKEND_OPTIONS: dict[str, object] = {"global_keyprefix": KEYPREFIX}
if os.environ.get("CE_CELERY_BACKEND_RETRIES"):
    BACKEND_OPTIONS["retry_policy"] = {"max_retries": int(os.environ["CE_CELERY_BACKEND_RETRIES"])}

app = Celery("cetest", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": KEYPREFIX, "visibility_timeout": 3600},
    result_backend_transport_options=BACKEND_OPTIONS,
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    result_expires=600,
    worker_hijack_root_logger=True,
)
if os.environ.get("CE_BEAT_INTERVAL"):
    app.conf.beat_schedule = {
        "beat-job": {
            "task": "tests.celery.app.beat_job",
            "schedule": float(os.environ["CE_BEAT_INTERVAL"]),
            "args": (os.environ.get("CE_BEAT_TAG", "beat"), float(os.environ.get("CE_BEAT_DURATION", "1"))),
            "options": {"queue": QUEUE},
        }
    }

_clients = ForkSafeRedis(BROKER)


def records_client() -> redis.Redis:
    """A Redis client for the records list, never shared across fork."""
    return _clients.get()


def record(kind: str, tag: str, **fields: Any) -> None:
    """Append one event to the records list."""
    records_client().rpush(RECORDS, json.dumps({"kind": kind, "tag": tag, "pid": os.getpid(), **fields}))


def _body(task: Any, tag: str, duration: float, *, block_term: bool = False) -> dict[str, Any]:
    lease = task.lock
    if block_term:
        # Like a body stuck in C code: SIGTERM stays pending, so no finally runs; only SIGKILL ends it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    start = time.time()
    common = {"task_id": task.request.id, "key": lease.key, "fence": lease.fence}
    record("start", tag, at=start, **common)
    time.sleep(duration)
    end = time.time()
    headers = task.request.headers or {}
    lock_retries = int(headers.get(LOCK_RETRIES_HEADER) or 0)
    record("run", tag, start=start, end=end, lock_retries=lock_retries, **common)
    return {"ran": True, "fence": lease.fence, "lock_retries": lock_retries, "retries": task.request.retries}


@exclusive_task(app=app, key="work:{key_id}", bind=True)
def work_skip(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Skips when its key is held."""
    return _body(self, tag, duration)


@exclusive_task(
    app=app,
    key="retry:{key_id}",
    on_locked="retry",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.4,
    lock_max_retries=500,
    max_retries=0,
    bind=True,
)
def work_retry(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Waits for its key by lock retries; its own max_retries is 0."""
    return _body(self, tag, duration)


@exclusive_task(
    app=app,
    key="limit2:{key_id}",
    limit=2,
    on_locked="retry",
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.2,
    lock_max_retries=500,
    max_retries=0,
    bind=True,
)
def work_limit2(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """A leased semaphore of 2: at most two runs hold its key at once; the others lock-retry."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="raise:{key_id}", on_locked="raise", bind=True)
def work_raise(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Fails with LockedError when its key is held."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="rerun:{key_id}", on_locked="rerun", bind=True)
def work_rerun(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Coalesces requests that arrive while its key is held into one rerun."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="rerunretry:{key_id}", on_locked="rerun", ttl=2, max_lifetime=3, bind=True)
def rerun_retrying(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """:func:`work_rerun` whose runs live 3 s at most (its rerun marker too); the run of
    ``tag == key_id`` records ``start``, sleeps ``duration`` and retries once, 4 s later."""
    if tag == key_id and not self.request.retries:
        record("start", tag, at=time.time())
        time.sleep(duration)
        raise self.retry(countdown=4)
    return _body(self, tag, 0.0)


@exclusive_task(app=app, key="rerun2:{key_id}", on_locked="rerun", limit=2, bind=True)
def work_rerun_limit2(self: Any, key_id: str, tag: str, hold: bool = False) -> dict[str, Any]:
    """A semaphore of 2 under ``"rerun"``. ``hold``: records ``holding`` (its fence), then
    waits until the test pushes ``<tag>:go`` (at most 60 s) before it runs."""
    if hold:
        record("holding", tag, slot=self.lock.store_key.endswith("}#2") + 1, fence=self.lock.fence)
        records_client().blpop([f"{KEYPREFIX}{tag}:go"], timeout=60)
    return _body(self, tag, 0.0)


@exclusive_task(app=app, key="dedupe:{key_id}", dedupe=True, bind=True)
def dedupe_start(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Deduplicated at enqueue until its run starts (the default lifetime)."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="dedupe-done:{key_id}", dedupe="until_done", bind=True)
def dedupe_done(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Deduplicated at enqueue until its run ends."""
    return _body(self, tag, duration)


@exclusive_task(
    app=app, key="dedupe-raise:{key_id}", dedupe=True, dedupe_ttl=4, on_duplicate="raise", bind=True
)
def dedupe_raise(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Deduplicated with a 4 s marker ttl; a duplicate send raises AlreadyQueued."""
    return _body(self, tag, duration)


@app.task
def callback(tag: str, name: str) -> None:
    """A ``link`` / ``link_error`` callback (sent as ``callback.si(tag, name)``): records its run."""
    record("callback", tag, name=name)


@exclusive_task(app=app, key="cool:{key_id}", cooldown=3, bind=True)
def cooled(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Its key stays held 3 s after each run started (later requests in that window skip)."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="coolbare:{key_id}", cooldown=3, done_retention=False, bind=True)
def cooled_without_records(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """``cooled`` keeping no completion records: the cooldown holds all the same."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="cooldeaf:{key_id}", cooldown=4, ttl=60, bind=True)
def cooled_deaf(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """``cooled`` on a 60 s lease, deaf to SIGTERM (only SIGKILL ends it: the kill hooks release)."""
    return _body(self, tag, duration, block_term=True)


@exclusive_task(app=app, key="coolretry:{key_id}", cooldown=2, done_retention=False, bind=True)
def cooled_retrying(self: Any, key_id: str, tag: str) -> dict[str, Any]:
    """Runs, then retries once 0.2 s later, within its 2 s cooldown; keeps no completion records."""
    result = _body(self, tag, 0.0)
    if not self.request.retries:
        raise self.retry(countdown=0.2)
    return result


@exclusive_task(app=app, key="coolsem:{key_id}", limit=2, cooldown=2, bind=True)
def cooled_semaphore_retrying(self: Any, key_id: str, tag: str) -> dict[str, Any]:
    """``cooled_retrying`` on a semaphore of 2 (skips when both slots are held)."""
    result = _body(self, tag, 0.0)
    if not self.request.retries:
        raise self.retry(countdown=0.2)
    return result


@exclusive_task(app=app, key="latest:{key_id}", on_locked="rerun", rerun_args="latest", bind=True)
def rerun_latest(self: Any, key_id: str, tag: str, n: int, duration: float = 0.0) -> dict[str, Any]:
    """A debounced rerun: the follow-up runs with the last coalesced request's arguments."""
    record("arg", tag, n=n)
    return _body(self, tag, duration)


_HOLD_RETRY = {"on_locked": "retry", "lock_retry_backoff": 0.05, "lock_retry_backoff_max": 0.25}


@exclusive_task(app=app, key="hold:{key_id}", ttl=3, lock_max_retries=1000, bind=True, **_HOLD_RETRY)
def hold_short_ttl(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """A long run on a 3 s lease (refreshed every second); waits for its key by lock retries."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="hold:{key_id}", ttl=60, bind=True)
def hold_long_ttl(
    self: Any, key_id: str, tag: str, duration: float = 0.0, block_term: bool = False
) -> dict[str, Any]:
    """A long run on a 60 s lease; ``block_term`` makes it deaf to SIGTERM."""
    return _body(self, tag, duration, block_term=block_term)


@exclusive_task(app=app, key="hold2:{key_id}", limit=2, ttl=60, bind=True)
def hold_long_ttl_limit2(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """``hold_long_ttl`` as a semaphore of 2: two runs hold its key at once, on 60 s leases."""
    return _body(self, tag, duration)


class SlowReplace(Task):  # type: ignore[misc]  # celery-types' Task is generic; this base is not
    """A base whose ``on_replace`` goes on for 0.5 s once the replacement is sent."""

    def on_replace(self, sig: Any) -> Any:
        try:
            return super().on_replace(sig)
        finally:
            time.sleep(0.5)


@exclusive_task(app=app, key="replace:{key_id}", base=SlowReplace, bind=True)
def replacing(self: Any, key_id: str, tag: str, page: int) -> dict[str, Any]:
    """Replaces itself (same task id, same key) with its next page, up to page 2."""
    record("page", tag, page=page)
    if page < 2:
        raise self.replace(replacing.si(key_id, tag, page + 1))
    return {"pages": page}


@exclusive_task(app=app, key="replaceretry:{key_id}", bind=True)
def replacing_retried(self: Any, key_id: str, tag: str, page: int) -> dict[str, Any]:
    """Page 1 retries once (at once), then its retry replaces itself (same task id, same
    key) with page 2."""
    record("page", tag, page=page, attempt=self.request.retries)
    if page < 2:
        if not self.request.retries:
            raise self.retry(countdown=0)
        raise self.replace(replacing_retried.si(key_id, tag, page + 1))
    return {"pages": page}


@exclusive_task(app=app, key="replacecool:{key_id}", cooldown=1, done_retention=False, bind=True)
def replacing_cooled(self: Any, key_id: str, tag: str, page: int, grouped: bool = False) -> dict[str, Any]:
    """``replacing`` with a 1 s cooldown and no completion records (``grouped``: page 1 is
    replaced by a group of page 2, which runs under an id of its own)."""
    from celery import group

    record("run", tag, start=time.time(), page=page)
    if page < 2:
        follow = replacing_cooled.si(key_id, tag, page + 1)
        raise self.replace(group(follow) if grouped else follow)
    return {"pages": page}


def _attempt(task: Any, tag: str, fail_until: int) -> dict[str, Any]:
    """Record the attempt (its ``retries`` and fence); raise KeyError below ``fail_until``."""
    attempt, fence = task.request.retries, task.lock.fence
    headers = task.request.headers or {}
    lock_retries = int(headers.get(LOCK_RETRIES_HEADER) or 0)
    record("attempt", tag, attempt=attempt, fence=fence, lock_retries=lock_retries, task_id=task.request.id)
    if attempt < fail_until:
        raise KeyError(tag)
    return {"attempt": attempt, "fence": fence, "lock_retries": lock_retries}


@exclusive_task(
    app=app,
    key="autoretry:{key_id}",
    autoretry_for=(KeyError,),
    retry_backoff=1,
    retry_jitter=False,
    max_retries=2,
    lock_max_retries=100,
    bind=True,
    **_HOLD_RETRY,
)
def autoretrying(self: Any, key_id: str, tag: str, fail_until: int = 99) -> dict[str, Any]:
    """Raises KeyError on its attempts below ``fail_until``: ``autoretry_for`` retries it after
    ``retry_backoff`` (1, then 2 s), at most twice; waits for its key by lock retries."""
    return _attempt(self, tag, fail_until)


@exclusive_task(
    app=app,
    key="autolocked:{key_id}",
    on_locked="raise",
    autoretry_for=(LockedError,),
    retry_backoff=1,
    retry_jitter=False,
    max_retries=5,
    bind=True,
)
def autoretry_locked(self: Any, key_id: str, tag: str) -> dict[str, Any]:
    """``on_locked="raise"`` whose LockedError ``autoretry_for`` retries (after 1, 2, 4... s)."""
    return _attempt(self, tag, 0)


def _losing(task: Any, tag: str, lose_until: int, *, wait_for_loss: bool) -> dict[str, Any]:
    """Record the attempt (as ``_attempt``) and the completion record of its task id it finds
    (``before``: the previous attempt's). Below ``lose_until``, wait for the test to take the
    lease away: ``wait_for_loss``, until the store no longer holds it, then return (the
    release finds it gone); else sleep in short sleeps, which ``on_lost="terminate"``
    interrupts, for at most 30 s."""
    lease = task.lock
    found = get_lock_service(app).completion(lease.key, task.request.id)
    before = None if found is None else [found.outcome, found.attempt]
    value = {**_attempt(task, tag, 0), "before": before}
    if value["attempt"] >= lose_until:
        return value
    deadline = time.time() + 30
    while time.time() < deadline:
        if wait_for_loss:
            stored = get_lock_service(app).peek(lease.key)
            if stored is None or stored.token != lease.token:
                break
        time.sleep(0.05)
    return value


_LOST_RETRY: dict[str, Any] = {
    "key": "lostretry:{key_id}",
    "ttl": 3,
    "autoretry_for": (LockLost,),
    "retry_backoff": 1,
    "retry_jitter": False,
    "max_retries": 1,
    "bind": True,
}


@exclusive_task(app=app, on_lost="terminate", **_LOST_RETRY)
def lost_terminate_retrying(self: Any, key_id: str, tag: str, lose_until: int = 99) -> dict[str, Any]:
    """``on_lost="terminate"`` with ``autoretry_for=(LockLost,)`` (``max_retries=1``): its
    attempts below ``lose_until`` run until their lease is taken away (interrupted)."""
    return _losing(self, tag, lose_until, wait_for_loss=False)


@exclusive_task(app=app, on_lost="raise", **_LOST_RETRY)
def lost_raise_retrying(self: Any, key_id: str, tag: str, lose_until: int = 99) -> dict[str, Any]:
    """``on_lost="raise"`` with ``autoretry_for=(LockLost,)`` (``max_retries=1``): its
    attempts below ``lose_until`` return once their lease is taken away, without ``check()``."""
    return _losing(self, tag, lose_until, wait_for_loss=True)


_LOST: dict[str, Any] = {key: value for key, value in _LOST_RETRY.items() if key != "autoretry_for"}


@exclusive_task(app=app, on_lost="terminate", **_LOST)
def lost_terminate(self: Any, key_id: str, tag: str, lose_until: int = 99) -> dict[str, Any]:
    """``on_lost="terminate"`` without ``autoretry_for``: runs until its lease is taken away."""
    return _losing(self, tag, lose_until, wait_for_loss=False)


@exclusive_task(app=app, on_lost="raise", **_LOST)
def lost_raise(self: Any, key_id: str, tag: str, lose_until: int = 99) -> dict[str, Any]:
    """``on_lost="raise"`` without ``autoretry_for``: returns once its lease is taken away."""
    return _losing(self, tag, lose_until, wait_for_loss=True)


@exclusive_task(app=app, key="selfretry:{key_id}", max_retries=1, bind=True)
def self_retrying(
    self: Any, key_id: str, tag: str, fail_until: int = 99, fallback: bool = False
) -> dict[str, Any]:
    """Retries itself (``self.retry(countdown=0.2)``) on its attempts below ``fail_until``,
    at most once: then Celery raises MaxRetriesExceededError, which ``fallback`` catches
    (records ``fallback``: whether its lease is still held, in the store too, and returns)."""
    try:
        return _attempt(self, tag, fail_until)
    except KeyError:
        try:
            raise self.retry(countdown=0.2) from None
        except MaxRetriesExceededError:
            if not fallback:
                raise
    lease = self.lock
    stored = get_lock_service(app).peek(lease.key)
    record("fallback", tag, held=lease.held, stored=stored is not None and stored.token == lease.token)
    return {"fallback": True}


@app.task
def collect(results: list[Any]) -> list[Any]:
    """A chord body: returns its header's results."""
    return results


@exclusive_task(app=app, key="soft:{key_id}", soft_time_limit=0.5, time_limit=10, acks_late=True, bind=True)
def soft_limited(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Runs into its soft time limit (SoftTimeLimitExceeded in the body)."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="pos:{work_id}", bind=True)
def positional(self: Any, work_id: int, tag: str = "", duration: float = 0.0) -> dict[str, Any]:
    """Keyed by a parameter that callers pass by position or by keyword."""
    return _body(self, tag, duration)


@exclusive_task(app=app, bind=True)
def beat_job(self: Any, tag: str, duration: float) -> dict[str, Any]:
    """The beat-scheduled job: one global lock (the task name), skip when held."""
    return _body(self, tag, duration)


@after_task_publish.connect
def record_beat_send(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
    """Record each ``beat_job`` message once published (only beat processes send it): ``sent``
    with its task id and the sender's pid."""
    if sender == beat_job.name:
        args, _kwargs, _embed = body
        record("sent", args[0], at=time.time(), task_id=headers["id"])


@task_skipped.connect
def record_beat_skip(sender: Any = None, holder: Any = None, **_: Any) -> None:
    """Record each skipped ``beat_job``: ``skip`` with its task id and the holder's fence."""
    if getattr(sender, "name", None) == beat_job.name:
        request = sender.request
        fence = None if holder is None else holder.fence
        record("skip", request.args[0], at=time.time(), task_id=request.id, holder_fence=fence)


def _multi_body(task: Any, tag: str, duration: float) -> dict[str, Any]:
    """Record a run holding several keys: each key's own fence."""
    leases = task.locks
    start = time.time()
    record("start", tag, at=start, task_id=task.request.id, fences=leases.fences)
    deadline = start + duration
    while time.time() < deadline:  # short sleeps: lock_on_lost="terminate" interrupts between them
        time.sleep(0.05)
    record("run", tag, start=start, end=time.time(), task_id=task.request.id, fences=leases.fences)
    return {"ran": True, "keys": leases.keys, "fences": leases.fences}


_MULTI_RETRY = {"on_locked": "retry", "lock_retry_backoff": 0.05, "lock_retry_backoff_max": 0.3}


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], bind=True)
def multi_skip(self: Any, a: str, b: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Holds two keys (a list of templates); skips when either is held."""
    return _multi_body(self, tag, duration)


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], lock_max_retries=500, bind=True, **_MULTI_RETRY)
def multi_retry(self: Any, a: str, b: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Holds two keys; waits for them by lock retries."""
    return _multi_body(self, tag, duration)


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], on_locked="raise", bind=True)
def multi_raise(self: Any, a: str, b: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Holds two keys; fails with LockedError naming the refused one."""
    return _multi_body(self, tag, duration)


@exclusive_task(app=app, key=lambda ids, tag, duration=0.0: [f"multi:{i}" for i in ids], bind=True)
def multi_callable(self: Any, ids: list[str], tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Its key callable returns one key per id."""
    return _multi_body(self, tag, duration)


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], bind=True)
def multi_release_interrupted(self: Any, a: str, b: str, tag: str) -> dict[str, Any]:
    """Holds two keys; the first store release after its body is interrupted by
    SoftTimeLimitExceeded (as a soft time limit firing during the release would)."""
    provider = get_lock_service(app).provider

    def interrupted(*args: Any, **kwargs: Any) -> bool:
        del provider.release  # once: the class's release again
        raise SoftTimeLimitExceeded()

    provider.release = interrupted  # type: ignore[method-assign]
    return _multi_body(self, tag, 0.0)


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], ttl=2, on_lost="raise", bind=True)
def multi_lost_raise(self: Any, a: str, b: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Two keys on a 2 s lease; losing either fails the run with LockLost."""
    return _multi_body(self, tag, duration)


@exclusive_task(app=app, key=["multi:{a}", "multi:{b}"], ttl=2, on_lost="terminate", bind=True)
def multi_lost_terminate(self: Any, a: str, b: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Two keys on a 2 s lease; losing either interrupts the body."""
    return _multi_body(self, tag, duration)


_WAIT = {"on_locked": "wait", "bind": True}


@exclusive_task(app=app, key="wait:{key_id}", lock_wait=3, **_WAIT)
def wait_skip(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Waits up to 3 s for its key in the worker slot, then skips (the default fallback)."""
    return _body(self, tag, duration)


@exclusive_task(app=app, key="wait:{key_id}", lock_wait=1, lock_wait_fallback="raise", **_WAIT)
def wait_raise(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Waits up to 1 s for its key, then fails with LockedError."""
    return _body(self, tag, duration)


@exclusive_task(
    app=app, key="wait:{key_id}", lock_wait=1, lock_wait_fallback="retry", lock_max_retries=0, **_WAIT
)
def wait_retry(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """Waits up to 1 s for its key, then lock-retries; with no lock retries left it fails."""
    return _body(self, tag, duration)


@exclusive_task(
    app=app,
    key="wait:{key_id}",
    lock_wait=4,
    acks_late=True,
    reject_on_worker_lost=True,
    **_WAIT,
)
def wait_late(self: Any, key_id: str, tag: str, duration: float = 0.0) -> dict[str, Any]:
    """``wait_skip`` acknowledged after the run, requeued when its pool child dies."""
    return _body(self, tag, duration)


@app.task
def leak_lease(key: str, tag: str) -> int:
    """Acquires a lease through the app's service and returns still holding it (kept alive)."""
    lease = get_lock_service(app).lock(key, ttl=60)
    record("leaked", tag, key=key, fence=lease.fence)
    return int(lease.fence)


@worker_ready.connect
def startup_job(sender: Any = None, **_: Any) -> None:
    """A once-at-a-time start-up job per worker group, through the app's lock service."""
    tag = f"startup:{QUEUE}"
    start = time.time()
    outcome = get_lock_service(app).run_exclusive(tag, lambda: time.sleep(1.0))
    record("startup", tag, ran=outcome.acquired, start=start, end=time.time(), fence=outcome.fence)
