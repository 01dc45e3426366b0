"""A forked child and the leases it inherits: they stay the parent's (service.py,
``_after_fork_in_child``), on every store."""

from __future__ import annotations

from celery_exclusive import LeaseState, ReleaseOutcome
from celery_exclusive.testing.contract import Store
from tests.conftest import in_forked_child


def test_a_forked_child_never_releases_the_parents_lease(store: Store) -> None:
    """A child leaving the parent's ``with`` block (or calling ``release()``) deletes
    nothing: its copy of the lease is RELEASED there, answers NOT_OWNED, and the key stays
    the parent's, refused to the child too; the parent still holds it and releases it."""
    service = store.make(ttl=30)
    lease = service.lock("inherited")

    def child() -> bool:
        with lease:  # the block the parent was in when it forked
            pass
        return (
            lease.release() is ReleaseOutcome.NOT_OWNED
            and lease.state is LeaseState.RELEASED
            and service.try_lock("inherited") is None
        )

    assert in_forked_child(child)
    found = service.peek("inherited")
    assert found is not None
    assert found.token == lease.token
    assert lease.state is LeaseState.HELD
    assert lease.release() is ReleaseOutcome.RELEASED
