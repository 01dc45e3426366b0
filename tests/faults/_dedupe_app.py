"""The Celery app of tests/faults/test_dedupe_faults.py's worker, configured by the environment.

``CE_DD_BROKER`` (Redis URL of the broker and result backend: the suite's private Redis),
``CE_DD_QUEUE``, and the package's own ``CELERY_EXCLUSIVE_URL`` / ``CELERY_EXCLUSIVE_PREFIX``.
An app of its own: the test's process configures its lock store as no other test did.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_exclusive.task import exclusive_task

app = Celery("cededupe", broker=os.environ["CE_DD_BROKER"], backend=os.environ["CE_DD_BROKER"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ["CE_DD_QUEUE"],
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=True,
)


@exclusive_task(app=app, key="dd:{tag}", dedupe=True, dedupe_ttl=300)
def deduped(tag: str) -> str:
    """A deduplicated task: its marker lives 300 s unless released."""
    return f"ran {tag}"
