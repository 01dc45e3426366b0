"""Completion records across a store failure at release: a release whose answer was lost is
retried in the background, and the retry must still write the run's completion record.

Without the record, a copy of the task's message that arrives later (a copy deferred during
the run, a broker's redelivery) finds the key free and no record, and runs the body again.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_exclusive import AlreadyDone, LockService, ReleaseOutcome
from celery_exclusive.providers.base import Completion
from tests.faults.conftest import Faults, acl_user, wait_until
from tests.faults.servers import PrivateRedis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@contextlib.contextmanager
def stores(
    redis_server: PrivateRedis, faults: Faults, ttl: float = 30.0
) -> Iterator[tuple[redis.Redis, str, LockService, LockService]]:
    """(admin connection, user, the holder's service, an observer's service): the holder
    logs in as an ACL user of its own, whose commands the test takes away (``-@all``) and
    gives back (``+@all``); at the end the user gets them back, the holder's service is
    closed and the user deleted."""
    admin = redis.Redis.from_url(redis_server.url)
    try:
        with acl_user(admin, "ce-rec") as (user, password):
            service = faults.service(f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0", ttl=ttl)
            try:
                yield admin, user, service, faults.service(redis_server.url)
            finally:
                admin.execute_command("ACL", "SETUSER", user, "+@all")  # so that close() releases
                service.close()
    finally:
        admin.close()


def test_a_release_retried_after_a_store_failure_still_writes_the_completion_record(
    redis_server: PrivateRedis, faults: Faults
) -> None:
    """The store refuses the holder's commands (its ACL user loses them) as the run releases
    with its record: the release is UNKNOWN and retried in the background. Once the store
    answers again, the retry frees the key and writes the record, so a copy of the run's
    message ends as ``already_done`` (on main the retry released without the record: the
    copy got the key and would have run the body a second time)."""
    task_id = str(uuid.uuid4())
    with stores(redis_server, faults) as (admin, user, service, observer):
        lease = service.lock("job", task_id=task_id)
        admin.execute_command("ACL", "SETUSER", user, "-@all")  # the holder's calls fail now
        outcome = lease.release(Completion(task_id, "success", 0, 600.0))
        assert outcome is ReleaseOutcome.UNKNOWN
        admin.execute_command("ACL", "SETUSER", user, "+@all")  # healed

        def settled() -> bool:
            return observer.peek("job") is None and not service.heartbeat._pending_release

        assert wait_until(settled, 15.0), (observer.peek("job"), service.heartbeat._pending_release)
        record = observer.completion("job", task_id)
        assert record is not None, "the retried release wrote no completion record"
        assert (record.outcome, record.attempt) == ("success", 0)
        with pytest.raises(AlreadyDone):  # a copy of the message: it does not run again
            observer.lock("job", task_id=task_id)


def test_a_cooldown_release_retried_after_a_store_failure_still_writes_the_record(
    redis_server: PrivateRedis, faults: Faults
) -> None:
    """The same for a lease with a cooldown (``hold_at_least``), whose release shortens the
    lease and writes the record in a second call: when the store fails there, the record is
    written by the background retry once the store answers (on main it was never written)."""
    task_id = str(uuid.uuid4())
    with stores(redis_server, faults) as (admin, user, service, observer):
        lease = service.lock("cool", task_id=task_id, hold_at_least=20)
        admin.execute_command("ACL", "SETUSER", user, "-@all")
        assert lease.release(Completion(task_id, "success", 0, 600.0)) is ReleaseOutcome.UNKNOWN
        admin.execute_command("ACL", "SETUSER", user, "+@all")
        assert wait_until(lambda: observer.completion("cool", task_id) is not None, 15.0)
        assert wait_until(lambda: not service.heartbeat._pending_release, 15.0)


def test_a_record_is_still_written_after_an_outage_longer_than_the_lease(
    redis_server: PrivateRedis, faults: Faults
) -> None:
    """The store refuses the holder's commands from the release on for longer than the
    lease's ttl (2 s) and the release retries' old limit (the lease's deadline plus a ttl):
    once it answers again, the background retry still writes the record, which is kept for
    10 minutes (before, the retry gave up with the lease: a copy of the message arriving
    after the outage found the key free and no record, and ran the body again)."""
    task_id = str(uuid.uuid4())
    with stores(redis_server, faults, ttl=2.0) as (admin, user, service, observer):
        lease = service.lock("long", task_id=task_id)
        admin.execute_command("ACL", "SETUSER", user, "-@all")
        assert lease.release(Completion(task_id, "success", 0, 600.0)) is ReleaseOutcome.UNKNOWN
        assert wait_until(lambda: observer.peek("long") is None, 15.0), "the lease did not expire"
        time.sleep(3.0)  # past the lease's deadline plus a ttl, where the retries used to stop
        assert service.heartbeat._pending_release, "the release is no longer retried"
        admin.execute_command("ACL", "SETUSER", user, "+@all")
        assert wait_until(lambda: observer.completion("long", task_id) is not None, 15.0)
        assert wait_until(lambda: not service.heartbeat._pending_release, 15.0)
        with pytest.raises(AlreadyDone):
            observer.lock("long", task_id=task_id)
