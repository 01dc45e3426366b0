"""A Celery app whose ``app.conf.exclusive_url`` carries a password, for the secrets tests.

The URL comes from ``CE_SECRETS_URL`` (set as a setting, not the environment variable, so
Celery's own views of ``app.conf`` have it to show); broker isolation as tests/celery/app.py.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_exclusive.task import exclusive_task

BROKER = os.environ.get("CE_CELERY_BROKER", "redis://127.0.0.1:6379/11")
KEYPREFIX = os.environ.get("CE_CELERY_KEYPREFIX", "cetest:")

app = Celery("cesecrets", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": KEYPREFIX},
    result_backend_transport_options={"global_keyprefix": KEYPREFIX},
    task_default_queue=os.environ.get("CE_CELERY_QUEUE", "cetest"),
    exclusive_url=os.environ.get("CE_SECRETS_URL"),
    exclusive_prefix=os.environ.get("CE_SECRETS_PREFIX", "cesecrets:"),
)


@exclusive_task(app=app, key="k", on_locked="skip")
def job() -> str:
    """Runs under the lock store the URL names."""
    return "ran"
