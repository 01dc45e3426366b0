"""The app of the first-task benchmark (``celery -A benchmarks.first_task_app worker``).

Environment: ``CE_BENCH_BROKER``, ``CE_BENCH_KEYPREFIX``, ``CE_BENCH_QUEUE`` as for
benchmarks.celery_app, the lock store by ``CELERY_EXCLUSIVE_URL``/``_PREFIX``, and
``CE_FIRST_HOOKS``: ``none`` disconnects the package's start-up hooks (how workers
behaved before them), ``preload`` keeps only the main process's driver import, ``all``
(the default) keeps the pool processes' connection at ``worker_process_init`` too.
Each task stamps the wall time its body starts.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import exclusive_task

BROKER = os.environ.get("CE_BENCH_BROKER", "redis://127.0.0.1:6379/12")
KEYPREFIX = os.environ.get("CE_BENCH_KEYPREFIX", "cebench-local:")
STARTS = KEYPREFIX + "first-starts"

app = Celery("cefirst", broker=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CE_BENCH_QUEUE", "cefirst"),
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": KEYPREFIX},
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
)

HOOKS = os.environ.get("CE_FIRST_HOOKS", "all")
if HOOKS in ("none", "preload"):
    celery_signals.worker_process_init.disconnect(dispatch_uid="celery_exclusive.warm_up_process")
if HOOKS == "none":
    celery_signals.celeryd_after_setup.disconnect(dispatch_uid="celery_exclusive.check_at_worker_start")


def _stamp(tag: str) -> None:
    at = time.time()  # before anything else this body does
    client = redis.Redis.from_url(BROKER)
    try:
        client.rpush(STARTS, json.dumps({"tag": tag, "at": at, "pid": os.getpid()}))
    finally:
        client.close()


@exclusive_task(app=app, key="first:{tag}")
def exclusive_first(tag: str) -> None:
    _stamp(tag)


@app.task
def plain_first(tag: str) -> None:
    _stamp(tag)
