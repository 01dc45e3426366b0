"""The PostgreSQL store behind a private PgBouncer in transaction pooling mode.

Consecutive statements of one client may run on different server sessions, so nothing
may rely on session state; psycopg's automatic prepared statements are such state for
PgBouncer before 1.21, which is why ``ce_pgbouncer=true`` exists. The shared contract
suite is run once more through PgBouncer at the end of this module.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from celery_exclusive import BackendError, Lease, LockService
from celery_exclusive.providers._pg_listen import SignalsLost
from celery_exclusive.providers.base import Grant, Held, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import Store

# Waiting through PgBouncer in transaction mode (no session to LISTEN on: the waiters poll,
# test_waiters_poll_through_pgbouncer): a release is seen within the poll bound, a wait ends
# at its timeout, and a SIGKILLed holder's key is taken after its ttl.
from tests.contract.test_waiting import (  # noqa: F401
    subscribes,
    test_a_waiter_acquires_soon_after_the_release,
    test_a_waiter_on_a_sigkilled_holders_key_acquires_after_the_ttl,
    test_wait_ends_at_its_timeout_and_answers_as_without_wait,
)
from tests.scale._servers import binary
from tests.scale.conftest import contract_store, contract_tests, drop_table


@pytest.fixture(scope="module")
def table() -> Iterator[str]:
    """One lock table for this module, dropped (with its sequence) afterwards."""
    name = f"ce_bouncer_{uuid.uuid4().hex[:10]}"
    yield name
    drop_table(name)


@pytest.fixture
def url(pgbouncer: Callable[..., str], table: str) -> str:
    """The store URL through PgBouncer, prepared statements off."""
    return pgbouncer(table) + "&ce_pgbouncer=true"


def pgbouncer_version() -> tuple[int, int]:
    out = subprocess.run(
        [binary("pgbouncer", "/usr/sbin/pgbouncer"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def hammer(url: str, workers: int, cycles: int) -> list[str]:
    """``workers`` threads, a provider each, run ``cycles`` acquire/refresh/peek/release rounds."""
    providers = [SqlLockProvider.from_url(url) for _ in range(workers)]
    errors: list[str] = []

    def work(provider: SqlLockProvider) -> None:
        key = f"h{uuid.uuid4().hex[:8]}"
        for n in range(cycles):
            try:
                provider.acquire(key, f"t{n}", 30.0, 60.0, "{}")
                provider.refresh([RefreshRequest(key, f"t{n}", 30.0)])
                provider.peek(key)
                provider.release(key, f"t{n}")
            except BackendError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=work, args=(p,)) for p in providers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for provider in providers:
        provider.close()
    return errors


def test_automatic_prepared_statements_break_behind_old_pgbouncer(
    pgbouncer: Callable[..., str], table: str
) -> None:
    """Without ce_pgbouncer, psycopg's prepared statements fail behind PgBouncer < 1.21."""
    if pgbouncer_version() >= (1, 21):
        pytest.skip("PgBouncer >= 1.21 may pool prepared statements (max_prepared_statements)")
    errors = hammer(pgbouncer(table, own_pool=True), workers=4, cycles=20)
    assert any("prepared statement" in e for e in errors), errors[:3]


def test_many_threads_cycle_without_error(url: str) -> None:
    """With ce_pgbouncer=true, 8 threads x 40 acquire/refresh/peek/release rounds raise nothing."""
    assert hammer(url, workers=8, cycles=40) == []
    service = LockService(url, prefix="bs:")
    try:
        for n in range(30):
            with service.lock(f"k{n % 3}", ttl=30):
                assert service.peek(f"k{n % 3}") is not None
    finally:
        service.close()


def test_waiters_behind_pgbouncer_poll_and_are_not_counted_but_direct_ones_are(url: str, table: str) -> None:
    """Through PgBouncer a waiter polls (no LISTEN) and still gets the key after its release,
    and registers nowhere, so the releaser is not told of it (does not give way); a waiter
    connected directly (psycopg, LISTEN) is told of by a PgBouncer releaser: the release
    statement's transaction-scoped try of the registration lock works in transaction mode."""
    from celery_exclusive.providers.postgres import PostgresLockProvider
    from tests.conftest import POSTGRES_URL

    prefix = f"bw{uuid.uuid4().hex[:8]}:"
    holder, waiter = LockService(url, prefix=prefix), LockService(url, prefix=prefix)
    direct = LockService(f"{POSTGRES_URL}?ce_table={table}", prefix=prefix)
    releaser = holder.provider
    assert isinstance(releaser, PostgresLockProvider)
    try:
        assert isinstance(releaser.acquire(prefix + "k", "h1", 30.0, 60.0, "{}"), Grant)
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(waiter.lock("k", ttl=30, wait=10)))
        thread.start()
        time.sleep(0.3)  # the waiter was refused and polls
        assert releaser.release(prefix + "k", "h1") is True  # the provider's own: told, not consumed
        assert releaser.had_waiters(prefix + "k") is False
        thread.join(15)
        assert len(got) == 1
        taken = got[0]
        assert isinstance(taken, Lease)
        assert isinstance(releaser.acquire(prefix + "d", "h2", 30.0, 60.0, "{}"), Grant)
        subscription = direct.provider.subscribe(prefix + "d")  # type: ignore[attr-defined]
        while subscription.wait(0.3):  # a first subscription may signal once ("look again")
            pass
        assert releaser.release(prefix + "d", "h2") is True
        assert releaser.had_waiters(prefix + "d") is True
        assert subscription.wait(5) is True
        subscription.close()
        taken.release()
    finally:
        holder.close()
        waiter.close()
        direct.close()


def test_acquire_contend_refresh_release(url: str) -> None:
    """Through PgBouncer one of 16 racers wins, a refresh of 200 leases answers in order, release frees."""
    service, rival = LockService(url, prefix="bp:"), LockService(url, prefix="bp:")
    try:
        provider = service.provider
        key = f"bp:race:{uuid.uuid4().hex[:8]}"
        barrier = threading.Barrier(16)
        results: list[object] = []

        def race(i: int) -> None:
            barrier.wait()
            results.append(provider.acquire(key, f"tok{i}", 30.0, 60.0, "{}"))

        threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len([r for r in results if isinstance(r, Grant)]) == 1
        assert len([r for r in results if isinstance(r, Held)]) == 15

        keys = [f"bp:many:{uuid.uuid4().hex[:8]}:{i}" for i in range(200)]
        fences = []
        for k in keys:
            grant = provider.acquire(k, "tok", 30.0, 600.0, "{}")
            assert isinstance(grant, Grant)
            fences.append(grant.fence)
        assert fences == sorted(set(fences))
        requests = [RefreshRequest(k, "tok" if i % 5 else "wrong", 90.0) for i, k in enumerate(keys)]
        answers = provider.refresh(requests)
        assert [a is None for a in answers] == [i % 5 == 0 for i in range(200)]
        assert all(a is None or 89.0 < a <= 90.0 for a in answers)
        assert all(provider.release(k, "tok") for k in keys)

        lease = service.lock("job")
        assert rival.try_lock("job") is None
        lease.release()
        again = rival.lock("job")
        assert again.fence > lease.fence
        again.release()
    finally:
        service.close()
        rival.close()


@pytest.fixture
def store(pgbouncer: Callable[..., str], table: str) -> Iterator[Store]:
    """PostgreSQL through PgBouncer as the contract suite's one store."""
    yield from contract_store("pgbouncer", pgbouncer(table) + "&ce_pgbouncer=true")


def test_waiters_poll_through_pgbouncer(store: Store) -> None:
    """With ``ce_pgbouncer=true`` a release cannot be listened for (LISTEN needs a session of
    its own): subscribe refuses, so the waiting tests above run polled."""
    service = store.service()
    assert not subscribes(service)
    with pytest.raises(SignalsLost, match="PgBouncer"):
        service.provider.subscribe(service.prefix + "k")  # type: ignore[attr-defined]


# The shared contract suite, collected here once more against the store above. The outage
# and guard tests are left out (this store declares neither capability).
globals().update(contract_tests())
