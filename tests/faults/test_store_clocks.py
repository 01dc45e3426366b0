"""What the Redis store's clock does to leases and fences (issue #17, items 7 and 8).

* Expiry precision: the scripts store milliseconds but report the time left in µs from
  ``TIME``'s microseconds, so a holder is never told its lease lasts longer than it does
  (it used to be told up to 1 ms too much, more than the safety margin of a ttl < 10 ms).
* A store clock that steps forward expires leases early: the holder learns it at its next
  refresh, so the overlap with a rival is at most one refresh interval (measured here).
* Fences under a clock step back (issue #16): a grant's fence is max(high-water + 1, TIME),
  the high-water key only ever rises, so a key's fences keep increasing when the server's
  clock steps back, also once the key's hash is gone. redis-server cannot run under
  libfaketime (its allocator recurses into the preload), so a step back of D is made as the
  state it leaves: the last fence granted (the high-water key) D ahead of TIME.
  Losing the high-water key itself is a data loss: the next fence is then the clock alone
  (measured below; see docs/faults.md for the bound).
"""

from __future__ import annotations

import time

import pytest
import redis

from celery_exclusive import LeaseState
from celery_exclusive.providers.base import Grant, RefreshRequest
from celery_exclusive.providers.redis import FENCES, RedisLockProvider
from tests.faults.conftest import SLACK, Backend, Faults, wait_until

pytestmark = pytest.mark.slow


def test_redis_never_reports_more_time_than_the_lease_has(redis_backend: Backend) -> None:
    """For every grant and refresh: (server time before the call) + reported ttl <= real expiry."""
    provider = RedisLockProvider(redis_backend.url())
    client = redis.Redis(host="127.0.0.1", port=redis_backend.port)
    try:
        for i in range(300):
            key = f"us:{i}"
            sec, usec = client.time()
            before = sec * 1_000_000 + usec
            grant = provider.acquire(key, "t", 0.05, 60, "{}")
            expires_us = int(client.hget(key, "expires") or 0) * 1000
            assert before + grant.ttl * 1e6 <= expires_us + 0.5, (i, before, grant.ttl, expires_us)
            assert grant.ttl <= 0.05
            sec, usec = client.time()
            before = sec * 1_000_000 + usec
            (left,) = provider.refresh([RefreshRequest(key, "t", 0.05)])
            assert left is not None
            expires_us = int(client.hget(key, "expires") or 0) * 1000
            assert before + left * 1e6 <= expires_us + 0.5, (i, before, left, expires_us)
    finally:
        provider.close()
        client.close()


def test_early_store_expiry_is_noticed_within_one_interval(redis_backend: Backend, faults: Faults) -> None:
    """The store ends leases early, as a forward step of its clock does (redis-server cannot run
    under libfaketime: its allocator recurses into the preload): each lease's ``expires`` is set
    to the store's now. A rival gets the key at once (inherent), and every holder is told at
    its next refresh: LOST within one refresh interval, the bound of the overlap."""
    ttl, interval = 10.0, 0.5
    holder = faults.service(redis_backend.url(), ttl=ttl, refresh_interval=interval)
    rival = faults.service(redis_backend.url())
    leases = [holder.lock(f"step-{i}") for i in range(3)]
    time.sleep(0.3)
    client = redis.Redis(host="127.0.0.1", port=redis_backend.port)
    try:
        sec, usec = client.time()
        now_ms = sec * 1000 + usec // 1000
        for lease in leases:
            client.hset(lease.store_key, "expires", str(now_ms))
    finally:
        client.close()
    stepped = time.monotonic()
    taken = rival.try_lock("step-0")
    assert taken is not None, "the store did not treat the lease as expired"
    assert wait_until(lambda: all(lease.state is LeaseState.LOST for lease in leases), interval + SLACK)
    noticed = time.monotonic() - stepped
    faults.record(store="redis", interval=interval, early_expiry_to_all_lost_s=round(noticed, 3))


def server_micros(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def test_fences_keep_increasing_when_the_clock_steps_back(redis_backend: Backend) -> None:
    """A step back of the server's clock by a day (made as its state: the last fence a day ahead
    of TIME): every key's next fence still exceeds all its earlier ones, for a key whose
    hash was released (deleted), one whose hash expired, and one held across the step;
    fences resume near the clock only once it has caught up with the high-water mark."""
    provider = RedisLockProvider(redis_backend.url())
    client = redis.Redis(host="127.0.0.1", port=redis_backend.port)
    day = 86_400 * 10**6
    try:
        last: dict[str, int] = {}
        for key in ("released", "expired", "held"):
            grant = provider.acquire(key, "t0", 0.2 if key == "expired" else 30.0, 60.0, "{}")
            assert isinstance(grant, Grant)
            last[key] = grant.fence
        assert provider.release("released", "t0") is True
        time.sleep(0.3)
        assert client.exists("released", "expired") == 0
        # The step: the server's clock now reads a day less than when those fences were granted.
        client.set(FENCES, str(server_micros(client) + day))
        ahead = int(client.get(FENCES) or 0)
        assert provider.release("held", "t0") is True
        for round_ in range(1, 4):
            for key, before in list(last.items()):
                grant = provider.acquire(key, f"t{round_}", 30.0, 60.0, "{}")
                assert isinstance(grant, Grant)
                assert grant.fence > before, (key, round_)
                assert grant.fence > ahead, (key, round_)
                last[key] = grant.fence
                assert provider.release(key, f"t{round_}") is True
        assert server_micros(client) < min(last.values()) - day + 10**6  # the clock is behind
        # Losing the high-water key too (a data loss): the next fence is the clock alone, a
        # day below this key's last one, the bound docs/faults.md states for a lost key.
        client.delete(FENCES)
        lost = provider.acquire("released", "t9", 30.0, 60.0, "{}")
        assert isinstance(lost, Grant)
        assert lost.fence < last["released"] - day + 10**6
        assert provider.release("released", "t9") is True
    finally:
        provider.close()
        client.close()
