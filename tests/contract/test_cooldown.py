"""``hold_at_least`` (a cooldown) on every store: a release within it shortens the lease to its
end instead of freeing the key, and the completion record is still written.

It rests on a refresh setting the expiry to ``min(store now + ttl, hard deadline)``, which
shortens a lease as well as extending it, on every store.
"""

from __future__ import annotations

import time

import pytest

from celery_exclusive import InvalidArgumentError, LockedError, ReleaseOutcome
from celery_exclusive.providers.base import Completion
from tests.conftest import Store


def test_a_release_within_the_cooldown_keeps_the_key_held_until_its_end(store: Store) -> None:
    service, other = store.service(), store.service()
    cooldown = 1.5 * store.slack  # the calls below, on a loaded machine, fit inside it
    before = time.monotonic()
    lease = service.lock("cool", hold_at_least=cooldown, task_id="t1")
    started = time.monotonic()
    assert lease.release(Completion("t1", "success", 0, 60.0)) is ReleaseOutcome.RELEASED
    assert service.held() == []  # the heartbeat no longer keeps it
    info = other.peek("cool")
    assert info is not None
    assert info.token == lease.token
    assert info.expires_in <= cooldown
    # It ends the cooldown after the grant (age + expires_in, on the store's clock), however
    # long the calls took; at most the lock call's own time later (the service counts from
    # its reply).
    assert cooldown - 0.05 < info.age + info.expires_in <= cooldown + (started - before) + 0.05
    with pytest.raises(LockedError):
        other.lock("cool")
    service.close()  # its writer going away neither frees nor extends it
    assert other.peek("cool") is not None
    record = other.completion("cool", "t1")
    assert record is not None
    assert record.outcome == "success"
    while other.peek("cool") is not None:
        assert time.monotonic() - started < 2 * cooldown, "the cooldown outlasted itself"
        time.sleep(0.05)
    assert time.monotonic() - before >= cooldown - 0.05
    again = other.try_lock("cool")
    assert again is not None
    assert again.fence > lease.fence
    again.release()


def test_a_release_after_the_cooldown_frees_the_key_at_once(store: Store) -> None:
    service = store.service()
    lease = service.try_lock("late", hold_at_least=0.2)
    assert lease is not None
    time.sleep(0.3)
    assert lease.release() is ReleaseOutcome.RELEASED
    assert service.peek("late") is None


def test_a_cooldown_longer_than_max_lifetime_is_rejected_before_the_store(store: Store) -> None:
    service = store.service(ttl=30, max_lifetime=60)
    with pytest.raises(InvalidArgumentError, match="hold_at_least"):
        service.lock("k", hold_at_least=61)
    with pytest.raises(InvalidArgumentError, match="hold_at_least"):
        service.try_lock("k", hold_at_least=0)
    assert service.peek("k") is None


def test_force_release_keep_for_ends_the_lease_then_instead_of_now(store: Store) -> None:
    """``force_release(key, token, keep_for=s)`` (a worker's main process ending a killed run
    with a cooldown) shortens the lease to end ``s`` from now, by token, and writes the record;
    a token that does not own the key changes nothing; ``keep_for`` must be positive."""
    holder, operator = store.service(), store.service()
    lease = holder.lock("kept", ttl=30, task_id="t2")
    holder.close(release=False)  # a dead run: nothing refreshes or releases it
    keep = 1.5 * store.slack
    assert not operator.force_release("kept", "not-its-token", keep_for=keep)
    with pytest.raises(InvalidArgumentError, match="keep_for"):
        operator.force_release("kept", lease.token, keep_for=0)
    assert operator.force_release(
        "kept", lease.token, completion=Completion("t2", "failure", 0, 60.0), keep_for=keep
    )
    info = operator.peek("kept")
    assert info is not None
    assert info.token == lease.token
    assert info.expires_in <= keep
    record = operator.completion("kept", "t2")
    assert record is not None
    assert record.outcome == "failure"
    wait_until = time.monotonic() + 2 * keep
    while operator.peek("kept") is not None:
        assert time.monotonic() < wait_until, "kept past keep_for"
        time.sleep(0.05)
