"""Functions the semaphore contract tests run in spawned processes."""

from __future__ import annotations

import time
from typing import Any

from celery_exclusive import LockService

#: Adds ARGV[1] (1 on entering, -1 on leaving) to the holder count in hash KEYS[1] and
#: keeps its peak, in one script (atomic on the server); returns the count after.
_REDIS_COUNT = """
local now = redis.call('HINCRBY', KEYS[1], 'cur', ARGV[1])
if now > tonumber(redis.call('HGET', KEYS[1], 'peak') or '0') then
  redis.call('HSET', KEYS[1], 'peak', now)
end
redis.call('PEXPIRE', KEYS[1], 3600000)
return now
"""


class HolderCounter:
    """The oracle's count of concurrent holders, kept in a real store other than the one
    under test: a Redis hash (``("redis", url, key)``: one Lua script per step) or a
    PostgreSQL row (``("postgres", url, table)``: one ``UPDATE ... RETURNING`` per step,
    the row lock serialising them). :func:`create_counter` makes it, :func:`read_counter`
    reads ``(now, peak)``, :func:`drop_counter` removes it."""

    def __init__(self, spec: tuple[str, str, str]) -> None:
        self.kind, url, self.name = spec
        if self.kind == "redis":
            import redis

            self._redis = redis.Redis.from_url(url, socket_timeout=30)
            self._script = self._redis.register_script(_REDIS_COUNT)
            self._script(keys=[self.name], args=[0])  # connect and load the script
        else:
            import psycopg

            self._pg = psycopg.connect(conninfo(url), autocommit=True)
            self._pg.execute(f"SELECT cur FROM {self.name}").fetchone()

    def step(self, delta: int) -> int:
        """Add ``delta`` (1 or -1) to the count, keeping its peak; the count after."""
        if self.kind == "redis":
            return int(self._script(keys=[self.name], args=[delta]))
        row = self._pg.execute(
            f"UPDATE {self.name} SET cur = cur + %(d)s, peak = greatest(peak, cur + %(d)s) RETURNING cur",
            {"d": delta},
        ).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        if self.kind == "redis":
            self._redis.close()
        else:
            self._pg.close()


def conninfo(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as libpq takes it."""
    return "postgresql://" + url.split("://", 1)[1]


def create_counter(spec: tuple[str, str, str]) -> None:
    kind, url, name = spec
    if kind == "redis":
        import redis

        with redis.Redis.from_url(url) as client:
            client.hset(name, mapping={"cur": 0, "peak": 0})
            client.pexpire(name, 3_600_000)
    else:
        import psycopg

        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {name} (cur int NOT NULL, peak int NOT NULL)")
            conn.execute(f"INSERT INTO {name} VALUES (0, 0)")


def read_counter(spec: tuple[str, str, str]) -> tuple[int, int]:
    """The counter's ``(now, peak)``."""
    kind, url, name = spec
    if kind == "redis":
        import redis

        with redis.Redis.from_url(url) as client:
            now, peak = client.hmget(name, ["cur", "peak"])
            return int(now), int(peak)
    import psycopg

    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        row = conn.execute(f"SELECT cur, peak FROM {name}").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def drop_counter(spec: tuple[str, str, str]) -> None:
    kind, url, name = spec
    if kind == "redis":
        import redis

        with redis.Redis.from_url(url) as client:
            client.delete(name)
    else:
        import psycopg

        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {name}")


def count_under_semaphore(
    url: str,
    prefix: str,
    key: str,
    *,
    limit: int,
    iterations: int,
    counter: tuple[str, str, str],
    start: Any,
    results: Any,
) -> None:
    """Take ``key`` with ``limit`` ``iterations`` times (waiting up to 10 s each), counting the
    holders in ``counter`` (a :class:`HolderCounter` in another store) strictly inside the
    held section: up after ``try_lock`` returned the lease, down before it is released.
    Reports (acquisitions, timeouts, fences seen per slot key)."""
    service = LockService(url, prefix=prefix, ttl=10)
    service.peek(key)  # connect before the start line
    holders = HolderCounter(counter)
    start.wait()
    acquired = timeouts = 0
    fences: dict[str, list[int]] = {}
    try:
        for _ in range(iterations):
            lease = service.try_lock(key, limit=limit, wait=10.0)
            if lease is None:
                timeouts += 1
                continue
            with lease:
                holders.step(1)
                time.sleep(0.02)  # long enough for 3 to overlap on a serialising store (SQLite)
                holders.step(-1)
            acquired += 1
            fences.setdefault(lease.store_key, []).append(lease.fence)
    finally:
        holders.close()
        service.close()
    results.put((acquired, timeouts, fences))


def hold_slot_until_killed(url: str, prefix: str, key: str, *, limit: int, ttl: float, ready: Any) -> None:
    """Take a slot of ``key`` with a short ttl, say which, then hang (the test SIGKILLs this)."""
    service = LockService(url, prefix=prefix, ttl=ttl)
    lease = service.lock(key, limit=limit)
    ready.put(lease.store_key)
    time.sleep(600)
