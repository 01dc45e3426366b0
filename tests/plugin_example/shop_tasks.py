"""A user's project: its Celery app and exclusive tasks (the example of docs/testing.md)."""

import time

from celery import Celery

from celery_exclusive import exclusive_task

app = Celery("shop", broker="memory://", backend="cache+memory://")
app.conf.update(
    exclusive_url="memory://",
    broker_connection_retry_on_startup=True,
    broker_transport_options={"polling_interval": 0.01},  # a quick embedded worker in tests
)


@exclusive_task(app=app, key="sync:{order_id}", bind=True)
def sync_order(self, order_id):
    """Default policy: a second sync of the same order while one runs is skipped."""
    return {"order": order_id, "fence": self.lock.fence}


@exclusive_task(app=app, key="report", on_locked="raise")
def nightly_report():
    """Fails with LockedError if another report is running."""
    return "done"


@exclusive_task(
    app=app,
    key="charge:{order_id}",
    on_locked="retry",
    lock_max_retries=3,
    lock_retry_backoff=0.01,
    lock_retry_backoff_max=0.05,
)
def charge(order_id):
    """Waits for the lock (lock retries), then gives up with LockRetriesExceeded."""
    return f"charged {order_id}"


@exclusive_task(app=app, key="import:{batch}", bind=True)
def import_batch(self, batch, steps=200):
    """Long work that checks its lease between steps, so a lost lock stops it."""
    for _ in range(steps):
        self.lock.check()  # raises LockLost once the lease is gone
        time.sleep(0.01)
    return f"imported {batch}"
