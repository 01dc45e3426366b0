"""The Celery app of tests/celery/test_track_started.py: ``task_track_started`` on.

Configured by the environment before a worker starts: ``CE_ST_BROKER`` (Redis URL),
``CE_ST_BACKEND`` (result backend URL), ``CE_ST_KEYPREFIX`` (the broker's global key
prefix), ``CE_ST_QUEUE``, and ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_exclusive.task import exclusive_task

app = Celery(
    "cestarted",
    broker=os.environ.get("CE_ST_BROKER", "redis://127.0.0.1:6379/11"),
    backend=os.environ.get("CE_ST_BACKEND", "redis://127.0.0.1:6379/11"),
)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": os.environ.get("CE_ST_KEYPREFIX", "cest:")},
    result_backend_transport_options={"global_keyprefix": os.environ.get("CE_ST_KEYPREFIX", "cest:")},
    task_default_queue=os.environ.get("CE_ST_QUEUE", "cest"),
    task_track_started=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=True,
)


@exclusive_task(app=app, key="started:{tag}")
def tracked(tag: str, fail: bool = False, sleep: float = 0.0) -> str:
    """Returns after ``sleep`` seconds, or raises ValueError when ``fail``."""
    time.sleep(sleep)
    if fail:
        raise ValueError(f"failed {tag}")
    return f"ran {tag}"
