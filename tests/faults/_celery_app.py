"""A Celery app for the fault tests' workers, configured by the environment.

``CE_FAULT_BROKER`` (Redis URL of the broker and result backend: the suite's private Redis),
``CE_FAULT_QUEUE``, and the package's own ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_exclusive.task import exclusive_task

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
