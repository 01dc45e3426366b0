"""The Celery app of the redelivery tests (tests/celery/test_redelivery.py), run by workers.

Configured through the environment set by the test before starting a worker:

* ``CE_RD_BROKER``     broker URL: Redis (a short ``visibility_timeout``) or RabbitMQ
* ``CE_RD_BACKEND``    Redis URL for results and the body-run counters
* ``CE_RD_KEYPREFIX``  prefix of every Redis key this app writes (isolation, cleanup)
* ``CE_RD_QUEUE``      the queue the worker consumes
* ``CE_RD_VISIBILITY`` the Redis transport's ``visibility_timeout`` in seconds
* ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``  the lock store

Every body run increments ``<prefix>runs:<task id>`` and appends an event to
``<prefix>events``: the counters are what "one body run per task id" is checked against.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import redis
from celery import Celery

from celery_exclusive import signals
from celery_exclusive.task import exclusive_task
from tests.fork_safe_redis import ForkSafeRedis

BROKER = os.environ.get("CE_RD_BROKER", "redis://127.0.0.1:6379/12")
BACKEND = os.environ.get("CE_RD_BACKEND", "redis://127.0.0.1:6379/12")
KEYPREFIX = os.environ.get("CE_RD_KEYPREFIX", "cerd:")
QUEUE = os.environ.get("CE_RD_QUEUE", "cerd")
VISIBILITY = float(os.environ.get("CE_RD_VISIBILITY", "1"))
#: The lease ttl of the tasks here: short, so a dead holder's key frees within seconds.
TTL = 3.0
#: The ttl of ``once_long``: longer than a loaded worker takes to notice a SIGKILLed child
#: and requeue its message, so the redelivered copy surely meets the dead run's lease.
LONG_TTL = 8.0

app = Celery("cerd", broker=BROKER, backend=BACKEND)
transport: dict[str, Any] = {}
if BROKER.startswith("redis"):
    transport = {
        "global_keyprefix": KEYPREFIX,
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
    }
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options=transport,
    result_backend_transport_options={"global_keyprefix": KEYPREFIX},
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    result_expires=600,
    worker_hijack_root_logger=True,
)

_clients = ForkSafeRedis(BACKEND)


def client() -> redis.Redis:
    """A Redis client for counters and events, never shared across fork."""
    return _clients.get()


def runs(task_id: str) -> int:
    """Body runs of ``task_id`` so far."""
    return int(client().get(f"{KEYPREFIX}runs:{task_id}") or 0)


def events() -> list[dict[str, Any]]:
    """Every body-run event, in order."""
    return [json.loads(raw) for raw in client().lrange(f"{KEYPREFIX}events", 0, -1)]


_dying = threading.local()


@signals.lock_released.connect
def _die_after_release(sender: Any = None, **_: Any) -> None:
    """SIGKILL this child right after a body's release (its record is written), before the
    tracer stores the result or the worker acknowledges the message."""
    if getattr(_dying, "armed", False):
        os.kill(os.getpid(), signal.SIGKILL)


def _body(task: Any, duration: float, kill: str | None) -> dict[str, Any]:
    task_id = task.request.id
    r = client()
    r.incr(f"{KEYPREFIX}runs:{task_id}")
    r.rpush(
        f"{KEYPREFIX}events",
        json.dumps(
            {"task_id": task_id, "retries": task.request.retries, "pid": os.getpid(), "at": time.time()}
        ),
    )
    first = kill is not None and r.set(f"{KEYPREFIX}killed:{task_id}", 1, nx=True)
    if first and kill == "mid":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(duration)
    if first and kill == "after":
        _dying.armed = True
    return {"real": True, "task_id": task_id, "pid": os.getpid()}


def _callable_policy(task: Any, key: str, holder: Any) -> dict[str, Any]:
    return {"callable": True, "key": key}


POLICIES: dict[str, Any] = {
    "skip": "skip",
    "retry": "retry",
    "raise": "raise",
    "rerun": "rerun",
    "callable": _callable_policy,
}


def _policy_task(name: str, policy: Any, **options: Any) -> Any:
    def run(self: Any, key_id: str, duration: float = 0.0, kill: str | None = None) -> dict[str, Any]:
        return _body(self, duration, kill)

    run.__name__ = f"once_{name}"
    return exclusive_task(
        app=app,
        name=f"rd.once_{name}",
        key="rd:{key_id}",
        on_locked=policy,
        ttl=TTL,
        lock_retry_backoff=0.05,
        lock_retry_backoff_max=0.2,
        lock_max_retries=1000,
        bind=True,
        **options,
    )(run)


ONCE = {name: _policy_task(name, policy) for name, policy in POLICIES.items()}
#: The same body under the options added after issue #10: ``on_locked="wait"`` (#13), a
#: semaphore's slots (``limit``), and queued markers (``dedupe``, #12), each of which must
#: leave a copy of the running message as the single lock does.
VARIANTS = {
    "wait": _policy_task("wait", "wait", lock_wait=10),
    "limit2": _policy_task("limit2", "skip", limit=2),
    "limit2_wait": _policy_task("limit2_wait", "wait", limit=2, lock_wait=10),
    "dedupe": _policy_task("dedupe", "skip", dedupe="until_done"),
    "dedupe_start": _policy_task("dedupe_start", "skip", dedupe="until_start"),
}


@exclusive_task(app=app, name="rd.once_long", key="rdl:{key_id}", ttl=LONG_TTL, bind=True)
def once_long(self: Any, key_id: str, duration: float = 0.0, kill: str | None = None) -> dict[str, Any]:
    """Like ``once_skip``, on an 8 s lease."""
    return _body(self, duration, kill)


@exclusive_task(app=app, name="rd.retrying", key="retrying:{key_id}", ttl=TTL, max_retries=3, bind=True)
def retrying(self: Any, key_id: str) -> dict[str, Any]:
    """Retries itself until its fourth attempt (``retries`` 0..3), which returns."""
    result = _body(self, 0.0, None)
    if self.request.retries < 3:
        raise self.retry(countdown=0.1)
    return result


@exclusive_task(app=app, name="rd.retry_then_hang", key="rdh:{key_id}", ttl=TTL, max_retries=1, bind=True)
def retry_then_hang(self: Any, key_id: str, countdown: float, after_retry: bool = False) -> dict[str, Any]:
    """Its first attempt sends its retry (``throw=False``), then runs on into its hard time
    limit; the retry returns. ``after_retry``: the first attempt first waits (up to 20 s)
    for the retry's record, and notes ``<prefix>saw:<task id>`` once it is there, so its
    kill is recorded after the retry finished."""
    result = _body(self, 0.0, None)
    if not self.request.retries:
        self.retry(countdown=countdown, throw=False)
        deadline = time.monotonic() + 20
        while after_retry and time.monotonic() < deadline:
            record = self.lock_service.completion(f"rdh:{key_id}", self.request.id)
            if record is not None and (record.outcome, record.attempt) == ("success", 1):
                client().set(f"{KEYPREFIX}saw:{self.request.id}", 1)
                break
            time.sleep(0.05)
        time.sleep(30)
    return result
