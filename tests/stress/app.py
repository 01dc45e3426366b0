"""The Celery app of the stress suite: run by subprocess workers, used by the enqueuing test.

Configured through the environment (tests/stress/test_stress.py passes it to the workers):

* ``CE_STRESS_BROKER``     Redis URL of broker and results (default: DB 11, as tests/celery)
* ``CE_STRESS_KEYPREFIX``  global key prefix of every broker/result key (isolation, cleanup)
* ``CE_STRESS_QUEUE``      the queue the workers consume
* ``CE_STRESS_LOG``        the append-only JSON-lines log shared by workers and test
* ``CE_STRESS_COUNTER``    the plain Redis key of the lost-update oracle's counter
* ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``  the lock store, read by the package

Three tasks share the lock keys ``stress:{key_id}``, one per policy (skip, retry, rerun).
Every critical section appends one ``run`` line (key, fence, wall start/end, worker, pid,
task id, request id, policy); Celery signals append ``pub`` (every message published, by the
test or by a worker: lock retries and reruns), ``pre`` and ``post`` (every attempt and its
outcome) lines, so every message can be followed to its end from the log alone.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery
from celery.signals import after_task_publish, task_postrun, task_prerun

from celery_exclusive.task import LOCK_RETRIES_HEADER, exclusive_task, is_skipped
from example_worker import records
from tests.fork_safe_redis import ForkSafeRedis


def _default_broker() -> str:
    explicit = os.environ.get("CE_TEST_CELERY_BROKER")
    if explicit:
        return explicit
    parts = urlsplit(os.environ.get("CE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return urlunsplit(parts._replace(path="/11"))


# setdefault: the test process picks the values and its worker subprocesses inherit them.
BROKER = os.environ.setdefault("CE_STRESS_BROKER", _default_broker())
KEYPREFIX = os.environ.setdefault("CE_STRESS_KEYPREFIX", f"cestress-{uuid.uuid4().hex[:10]}:")
QUEUE = os.environ.get("CE_STRESS_QUEUE", KEYPREFIX + "queue")
TASK_PREFIX = "tests.stress.app."
#: Lease ttl of the stress tasks: runs of up to 2 s need refreshes (every 2 s) to survive.
TTL = 6.0

app = Celery("cestress", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": KEYPREFIX, "visibility_timeout": 3600},
    result_backend_transport_options={"global_keyprefix": KEYPREFIX},
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    result_expires=3600,
    worker_hijack_root_logger=True,
)

_clients = ForkSafeRedis(BROKER)


def redis_client() -> redis.Redis:
    """A client of the broker's Redis DB (the oracle's counter), never shared across fork."""
    return _clients.get()


def append(event: dict[str, Any]) -> None:
    """Append one JSON line to the shared log under an exclusive ``flock`` (no-op without a log)."""
    path = os.environ.get("CE_STRESS_LOG")
    if path:
        records.append(Path(path), event)


def _lock_retries(task: Any) -> int:
    headers = task.request.headers or {}
    return int(headers.get(LOCK_RETRIES_HEADER) or 0)


def _critical(task: Any, policy: str, req: str, duration: float) -> dict[str, Any]:
    """The critical section: hold the lock for ``duration`` and log one ``run`` line inside it."""
    lease = task.lock
    start = time.time()
    time.sleep(duration)
    end = time.time()
    append(
        {
            "event": "run",
            "key": lease.key,
            "fence": lease.fence,
            "start": start,
            "end": end,
            "worker": task.request.hostname,
            "pid": os.getpid(),
            "task_id": task.request.id,
            "req": req,
            "policy": policy,
            "lock_retries": _lock_retries(task),
            "lost": lease.lost.is_set(),
        }
    )
    return {"ran": True, "fence": lease.fence, "lock_retries": _lock_retries(task)}


@exclusive_task(app=app, key="stress:{key_id}", on_locked="skip", ttl=TTL, bind=True)
def stress_skip(self: Any, key_id: str, req: str, duration: float) -> dict[str, Any]:
    """Skips when its key is held."""
    return _critical(self, "skip", req, duration)


@exclusive_task(
    app=app,
    key="stress:{key_id}",
    on_locked="retry",
    ttl=TTL,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.5,
    lock_max_retries=100,
    max_retries=0,
    bind=True,
)
def stress_retry(self: Any, key_id: str, req: str, duration: float) -> dict[str, Any]:
    """Waits for its key by lock retries (at most 100, then LockRetriesExceeded)."""
    return _critical(self, "retry", req, duration)


@exclusive_task(app=app, key="stress:{key_id}", on_locked="rerun", ttl=TTL, bind=True)
def stress_rerun(self: Any, key_id: str, req: str, duration: float) -> dict[str, Any]:
    """Coalesces into one rerun when its key is held (the webhook pattern)."""
    return _critical(self, "rerun", req, duration)


def _read_modify_write(counter: str, pause: float) -> int:
    client = redis_client()
    value = int(client.get(counter) or 0)
    time.sleep(pause)  # widen the window in which an unprotected update would be lost
    client.set(counter, value + 1)
    return value + 1


@exclusive_task(
    app=app,
    key="counter",
    on_locked="retry",
    ttl=TTL,
    lock_retry_backoff=0.02,
    lock_retry_backoff_max=0.3,
    lock_max_retries=10_000,
    max_retries=0,
    bind=True,
)
def counter_increment(self: Any, req: str, pause: float) -> dict[str, Any]:
    """The lost-update oracle: an unprotected GET, sleep, SET of a counter, under the lock."""
    lease = self.lock
    start = time.time()
    _read_modify_write(os.environ["CE_STRESS_COUNTER"], pause)
    end = time.time()
    append(
        {
            "event": "run",
            "key": lease.key,
            "fence": lease.fence,
            "start": start,
            "end": end,
            "worker": self.request.hostname,
            "pid": os.getpid(),
            "task_id": self.request.id,
            "req": req,
            "policy": "retry",
            "lock_retries": _lock_retries(self),
            "lost": lease.lost.is_set(),
        }
    )
    return {"ran": True, "fence": lease.fence, "lock_retries": _lock_retries(self)}


@app.task
def counter_increment_unlocked(counter: str, pause: float) -> int:
    """The same read-modify-write without a lock: shows that the oracle does detect lost updates."""
    return _read_modify_write(counter, pause)


# -- outcome log: every message published and every attempt, from Celery's signals ----------


def _ours(name: object) -> bool:
    return isinstance(name, str) and name.startswith(TASK_PREFIX) and not name.endswith("_unlocked")


_arrived = threading.local()


@after_task_publish.connect
def _log_publish(sender: Any = None, headers: Mapping[str, Any] | None = None, **_: Any) -> None:
    headers = headers or {}
    if _ours(sender):
        append(
            {
                "event": "pub",
                "task_id": headers.get("id"),
                "task": sender,
                "parent_id": headers.get("parent_id"),
                "pid": os.getpid(),
                "t": time.time(),
            }
        )


@task_prerun.connect
def _log_prerun(
    task_id: str = "", task: Any = None, kwargs: Mapping[str, Any] | None = None, **_: Any
) -> None:
    if task is None or not _ours(task.name):
        return
    _arrived.t = time.time()
    append(
        {
            "event": "pre",
            "task_id": task_id,
            "task": task.name,
            "req": (kwargs or {}).get("req"),
            "pid": os.getpid(),
            "t": _arrived.t,
        }
    )


def outcome_of(state: str, value: object) -> str:
    """One word for an attempt's outcome: ran, skipped, coalesced, retry or failed:<Exception>."""
    if state == "SUCCESS":
        if is_skipped(value):
            return str(value["celery_exclusive"])  # type: ignore[index]
        if isinstance(value, Mapping) and value.get("ran"):
            return "ran"
        return f"unexpected:{value!r}"
    if state == "RETRY":
        return "retry"
    if state == "FAILURE":
        return f"failed:{type(value).__name__}"
    return f"state:{state}"


@task_postrun.connect
def _log_postrun(
    task_id: str = "",
    task: Any = None,
    kwargs: Mapping[str, Any] | None = None,
    retval: Any = None,
    state: str = "",
    **_: Any,
) -> None:
    if task is None or not _ours(task.name):
        return
    kwargs = kwargs or {}
    holder = retval.get("holder") if is_skipped(retval) else None
    append(
        {
            "event": "post",
            "task_id": task_id,
            "task": task.name,
            "key": task.lock_key_for((), kwargs),
            "req": kwargs.get("req"),
            "outcome": outcome_of(state, retval),
            "holder_task_id": (holder or {}).get("task_id"),
            "holder_fence": (holder or {}).get("fence"),
            "arrived": getattr(_arrived, "t", None),
            "pid": os.getpid(),
            "t": time.time(),
        }
    )
