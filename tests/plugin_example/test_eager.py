"""The user's tasks in eager mode, against the plugin's store."""

import pytest
from shop_tasks import app, charge, nightly_report, sync_order

from celery_exclusive import LockedError, LockRetriesExceeded
from celery_exclusive.testing import assert_not_skipped, assert_skipped


@pytest.fixture(autouse=True)
def eager():
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


def test_runs_when_the_key_is_free(exclusive_store):
    assert assert_not_skipped(sync_order.delay(7))["order"] == 7


def test_is_skipped_while_another_worker_holds_the_key(exclusive_store):
    exclusive_store.hold(sync_order.lock_key_for((7,)), holder={"host": "worker-2"})
    marker = assert_skipped(sync_order.delay(7), key="sync:7")
    assert marker["holder"]["host"] == "worker-2"
    assert_not_skipped(sync_order.delay(8))  # other keys are not affected


def test_raise_policy_fails_with_the_holder(exclusive_store):
    exclusive_store.hold("report", holder={"task_id": "abc"})
    with pytest.raises(LockedError) as raised:
        nightly_report.delay().get()
    assert raised.value.holder.holder["task_id"] == "abc"


def test_retry_policy_gives_up_after_its_lock_retries(exclusive_store):
    exclusive_store.hold("charge:1")
    with pytest.raises(LockRetriesExceeded):
        charge.delay(1).get()


def test_a_dead_holders_lease_runs_out_with_the_clock(exclusive_store):
    exclusive_store.hold("sync:7", ttl=60)
    assert_skipped(sync_order.delay(7))
    exclusive_store.advance(61)
    assert_not_skipped(sync_order.delay(7))


def test_an_expired_key_is_free_again(exclusive_store):
    exclusive_store.hold("sync:7")
    assert exclusive_store.expire("sync:7")
    assert_not_skipped(sync_order.delay(7))
