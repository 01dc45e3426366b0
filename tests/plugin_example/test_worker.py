"""The same tasks on Celery's embedded test worker, sharing the plugin's store."""

import time

import pytest
from celery.contrib.testing.worker import start_worker
from shop_tasks import app, import_batch, sync_order

from celery_exclusive import LockLost
from celery_exclusive.testing import assert_not_skipped, assert_skipped


@pytest.fixture(scope="module")
def worker():
    # One worker for the module: its tasks find each test's exclusive_store when they run.
    with start_worker(app, pool="solo", perform_ping_check=False):
        yield


def wait_for_lease(store, key, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (lease := store.lease(key)) is None:
        assert time.monotonic() < deadline, f"no run took {key!r}"
        time.sleep(0.01)
    return lease


def test_skip_on_the_worker(exclusive_store, worker):
    with exclusive_store.hold("sync:1"):
        assert_skipped(sync_order.delay(1), key="sync:1")
    assert assert_not_skipped(sync_order.delay(1))["order"] == 1


def test_a_lost_lease_stops_the_run(exclusive_store, worker):
    result = import_batch.delay("b1")
    lease = wait_for_lease(exclusive_store, "import:b1")
    exclusive_store.lose(lease)
    with pytest.raises(LockLost):
        result.get(timeout=10)
    assert exclusive_store.peek("import:b1") is None
