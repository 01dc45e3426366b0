"""Completion records, run against every store: memory, SQLite, PostgreSQL, MariaDB, Redis.

A record says "task id T finished a run on lock key K"; it is written by the release that
ends the run, read by the acquire of a later copy (same call), expired by the store's clock.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from celery_exclusive import (
    AlreadyDone,
    InvalidArgumentError,
    LockedError,
    LockProvider,
    LockService,
    MemoryLockProvider,
    ReleaseOutcome,
)
from celery_exclusive.providers.base import MAX_ATTEMPT, MAX_RETAIN, Completion, CompletionStore, Done, Grant
from tests.conftest import Store


def done(task_id: str, retain: float = 60.0, outcome: str = "success", attempt: int = 0) -> Completion:
    return Completion(task_id=task_id, outcome=outcome, attempt=attempt, retain=retain)


def test_release_records_and_acquire_refuses_that_task_id(store: Store) -> None:
    """After a release with a record, the same task id is refused on that key; others are not."""
    service = store.service()
    lease = service.lock("job", task_id="t-1")
    assert lease.release(done("t-1")) is ReleaseOutcome.RELEASED
    with pytest.raises(AlreadyDone) as refused:
        service.lock("job", task_id="t-1")
    record = refused.value.record
    assert (record.key, record.task_id, record.outcome, record.attempt) == ("job", "t-1", "success", 0)
    assert 0 <= record.age < 30
    assert 30 < record.expires_in <= 60
    assert service.peek("job") is None  # the refusal took nothing
    other = service.lock("job", task_id="t-2")  # another id, and a plain acquire, still get it
    other.release()
    service.lock("job").release()
    read, listed = service.completion("job", "t-1"), service.completions()
    assert read is not None
    assert [(r.key, r.task_id, r.outcome) for r in listed] == [("job", "t-1", "success")]


def test_a_record_is_per_key(store: Store) -> None:
    """A record on one key does not refuse the same task id on another key."""
    service = store.service()
    service.lock("a", task_id="t").release(done("t"))
    service.lock("b", task_id="t").release()
    assert service.completion("b", "t") is None


def test_record_is_written_even_when_the_lease_was_not_owned(store: Store) -> None:
    """The run ended, so its record is kept even if its lease had expired and been taken."""
    first, second = store.service(), store.service()
    lease = first.lock("k", ttl=0.5, refresh_interval=0.4)
    first.heartbeat.stop()  # no refresh: the lease expires in the store
    time.sleep(0.8)
    taker = second.lock("k")
    assert lease.release(done("t-lost", outcome="failure")) is ReleaseOutcome.NOT_OWNED
    assert taker.held
    assert second.peek("k") is not None
    assert second.peek("k").token == taker.token
    record = second.completion("k", "t-lost")
    assert record is not None
    assert record.outcome == "failure"
    taker.release()


def test_force_release_records_whether_or_not_the_token_owns_the_key(store: Store) -> None:
    """force_release(completion=...) (a worker's main process ending a run it killed) records
    in the same call: with the holder's token it also deletes the lease; with a token that
    owns nothing it deletes nothing and still records, so the holder keeps its lease."""
    holder, operator = store.service(), store.service()
    lease = holder.lock("killed")
    failed = done("t-k", outcome="failure")
    assert operator.force_release("killed", "owns-nothing", completion=failed) is False
    assert lease.held
    assert operator.peek("killed") is not None
    record = operator.completion("killed", "t-k")
    assert record is not None
    assert record.outcome == "failure"
    with pytest.raises(AlreadyDone):
        operator.lock("killed", task_id="t-k")  # refused before the held key is even looked at
    assert operator.force_release("killed", lease.token, completion=done("t-k2")) is True
    assert operator.peek("killed") is None
    assert operator.completion("killed", "t-k2") is not None


def test_records_expire_by_the_store_clock(store: Store) -> None:
    """A record kept half a second is gone after it, for acquire, read and list alike."""
    service = store.service()
    service.lock("short", task_id="t").release(done("t", retain=0.5))
    assert service.completion("short", "t") is not None
    time.sleep(0.8)
    assert service.completion("short", "t") is None
    assert service.completions("short") == []
    service.lock("short", task_id="t").release()


def test_a_new_record_replaces_the_old_one(store: Store) -> None:
    """A retried attempt's record is replaced by the final one of the same task id."""
    service = store.service()
    service.lock("r", task_id="t").release(done("t", outcome="retried", attempt=0))
    with pytest.raises(AlreadyDone) as first:
        service.lock("r", task_id="t")
    assert (first.value.record.outcome, first.value.record.attempt) == ("retried", 0)
    service.lock("r").release(done("t", outcome="success", attempt=1))
    record = service.completion("r", "t")
    assert record is not None
    assert (record.outcome, record.attempt) == ("success", 1)
    assert len(service.completions("r")) == 1


def test_list_and_forget(store: Store) -> None:
    """completions() lists live records by key then task id; forget() removes exactly one."""
    service = store.service()
    for key, task_id in (("b", "2"), ("a", "9"), ("b", "1")):
        service.lock(key, task_id=task_id).release(done(task_id))
    listed = [(r.key, r.task_id) for r in service.completions()]
    assert listed == [("a", "9"), ("b", "1"), ("b", "2")]
    assert [r.task_id for r in service.completions("b")] == ["1", "2"]
    assert service.forget("b", "1") is True
    assert service.forget("b", "1") is False
    assert [(r.key, r.task_id) for r in service.completions()] == [("a", "9"), ("b", "2")]
    service.lock("b", task_id="1").release()  # forgotten: it runs again


def test_records_are_not_leases(store: Store) -> None:
    """Records never show up as leases, never make a key look held, and do not change fences."""
    service = store.service()
    lease = service.lock("x")
    fence = lease.fence
    lease.release(done("t"))
    assert service.locks() == []
    assert service.peek("x") is None
    again = service.try_lock("x")
    assert again is not None
    assert again.fence > fence
    with pytest.raises(LockedError):
        service.lock("x", task_id="someone-else")
    again.release()
    assert service.completion("x", "t") is not None


def test_a_record_does_not_override_a_held_lease_check(store: Store) -> None:
    """A live record answers Done before anything else; without one, a held key is Held."""
    service = store.service()
    provider = service.provider
    key = service.prefix + "p"
    grant = provider.acquire(key, "tok-1", 30.0, 60.0, "{}")
    assert isinstance(grant, Grant)
    assert provider.release(key, "tok-1", done("t")) is True
    assert isinstance(provider.acquire(key, "tok-2", 30.0, 60.0, "{}", task_id="t"), Done)
    assert provider.completion(key, "missing") is None
    assert provider.forget(key, "t") is True


def test_bad_completion_input_is_rejected_before_the_store(store: Store) -> None:
    """A bad task id or record is an InvalidArgumentError, and the lease is still held."""
    service = store.service()
    lease = service.lock("bad")
    for bad in (
        Completion("", "success", 0, 60.0),
        Completion("t", "maybe", 0, 60.0),
        Completion("t", "success", -1, 60.0),
        Completion("t", "success", 0, 0.0),
        Completion("x" * 201, "success", 0, 60.0),
    ):
        with pytest.raises(InvalidArgumentError):
            lease.release(bad)
    assert lease.held
    with pytest.raises(InvalidArgumentError):
        service.lock("bad2", task_id="")
    with pytest.raises(InvalidArgumentError):
        service.forget("bad", "a\x00b")
    lease.release()


@pytest.mark.parametrize(
    "bad",
    [
        Completion("t", "success", MAX_ATTEMPT + 1, 60.0),  # the SQL stores' int column overflows
        Completion("t", "success", 2**70, 60.0),  # SQLite raised OverflowError mid-release
        Completion("t", "success", 0, MAX_RETAIN * 2),  # MariaDB's DATETIME ends in 9999
        Completion("t", "success", 0, 1e300),  # Redis: PEXPIRE out of range, a key never expiring
    ],
    ids=["attempt-2**31", "attempt-2**70", "retain-20y", "retain-1e300"],
)
def test_a_completion_no_store_can_write_leaves_the_lease_held_and_releasable(
    store: Store, bad: Completion
) -> None:
    """A record out of every store's range is an InvalidArgumentError before anything
    changes: the lease stays HELD, its heartbeat keeps it (its token still owns the key), and
    a later release, with a record at the limits, releases it and writes that record."""
    service = store.service()
    lease = service.lock("range", ttl=30)
    with pytest.raises(InvalidArgumentError, match=r"attempt|retain"):
        lease.release(bad)
    assert lease.held
    assert lease in service.held()
    info = service.peek("range")
    assert info is not None
    assert info.token == lease.token
    assert lease.release(done("t", retain=MAX_RETAIN, attempt=MAX_ATTEMPT)) is ReleaseOutcome.RELEASED
    assert service.peek("range") is None
    if isinstance(service.provider, CompletionStore):
        record = service.completion("range", "t")
        assert record is not None
        assert record.attempt == MAX_ATTEMPT
        assert MAX_RETAIN - 60 < record.expires_in <= MAX_RETAIN
        assert service.forget("range", "t")


@pytest.mark.parametrize("hold_at_least", [None, 5.0])
def test_a_timedelta_retain_is_a_duration_like_any_other(store: Store, hold_at_least: float | None) -> None:
    """retain=timedelta(...) passed the check but reached the store as a timedelta: a
    TypeError after the lease was marked released, its key held with no heartbeat until its
    ttl. It is converted to seconds, on a plain release and on a ``hold_at_least`` one."""
    service = store.service()
    lease = service.lock("delta", ttl=30, hold_at_least=hold_at_least)
    assert lease.release(done("t", retain=timedelta(minutes=1))) is ReleaseOutcome.RELEASED  # type: ignore[arg-type]
    assert not lease.held
    if hold_at_least is None:
        assert service.peek("delta") is None
    record = service.completion("delta", "t")
    assert record is not None
    assert 30 < record.expires_in <= 60


class _LeasesOnly:
    """A third-party provider written before completion records: the LockProvider methods only."""

    max_key_length = 1024

    def __init__(self) -> None:
        self.inner = MemoryLockProvider()

    def acquire(self, *args: Any) -> Any:
        return self.inner.acquire(*args)

    def refresh(self, requests: Any) -> Any:
        return self.inner.refresh(requests)

    def release(self, key: str, token: str) -> bool:
        return self.inner.release(key, token)

    def peek(self, key: str) -> Any:
        return self.inner.peek(key)

    def scan(self, prefix: str) -> Any:
        return self.inner.scan(prefix)

    def close(self) -> None:
        self.inner.close()

    def diagnose(self) -> Any:
        return self.inner.diagnose()


def test_a_provider_without_record_methods_still_works() -> None:
    """Such a provider is still a LockProvider: the service just keeps no records."""
    provider = _LeasesOnly()
    assert isinstance(provider, LockProvider)
    assert not isinstance(provider, CompletionStore)
    service = LockService(provider)
    try:
        assert not service.keeps_records
        service.lock("k", task_id="t").release(done("t"))
        service.lock("k", task_id="t").release()  # nothing was recorded
        assert service.completion("k", "t") is None
        assert service.completions() == []
        assert service.forget("k", "t") is False
    finally:
        service.close()
    assert isinstance(MemoryLockProvider(), CompletionStore)
