"""Child processes for multi-process runs: each takes a command, runs it for a fixed time, reports.

All children start a command at the same wall-clock instant and stop at the same one, so
their counts add up to a rate over exactly that window. Children are spawned (not forked)
and keep their connections across commands; :meth:`ProcPool.close` ends them.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import secrets
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.harness import (
    ORIGIN_TABLE,
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    UPSERT_TABLE,
    psycopg_dsn,
    with_table,
)
from celery_exclusive.providers import _pg_listen

TTL = 900.0
LIFE = 86400.0
HOLDER = '{"host":"benchmark-host","pid":0}'


def upsert_sql(table: str = UPSERT_TABLE) -> str:
    """The raw one-statement upsert: a failed attempt matches the conflict row and locks it."""
    return f"""INSERT INTO "{table}" AS t (key, value, expires_at, created_at, deadline, fence, holder)
VALUES (%(key)s, %(token)s, clock_timestamp() + make_interval(secs => %(ttl)s), clock_timestamp(),
        clock_timestamp() + make_interval(secs => %(life)s), nextval('"{table}_fence_seq"'), %(holder)s)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at,
  created_at = EXCLUDED.created_at, deadline = EXCLUDED.deadline, fence = EXCLUDED.fence,
  holder = EXCLUDED.holder
WHERE t.expires_at <= EXCLUDED.created_at OR t.deadline <= EXCLUDED.created_at
RETURNING t.fence"""


def upsert_release_sql(table: str = UPSERT_TABLE) -> str:
    """Token-bound release of the upsert peer."""
    return f'DELETE FROM "{table}" WHERE key = %(key)s AND value = %(token)s RETURNING true'


class _Child:
    """A child's cached resources (services, connections), built on first use."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self.cache:
            self.cache[name] = make()
        return self.cache[name]

    def service(self, store: str) -> Any:
        from celery_exclusive import LockService

        url = REDIS_URL if store == "redis" else with_table(POSTGRES_URL, TABLE)
        prefix = f"{REDIS_PREFIX}proc:" if store == "redis" else "proc:"
        return self.get(f"service-{store}", lambda: LockService(url, prefix=prefix, ttl=TTL))

    def pg(self) -> Any:
        import psycopg

        return self.get("pg", lambda: psycopg.connect(psycopg_dsn(), autocommit=True))

    def origin(self) -> Any:
        import sqlalchemy as sa

        from benchmarks.origin import OriginLock, origin_table

        return self.get(
            "origin",
            lambda: OriginLock(sa.create_engine(POSTGRES_URL), origin_table(sa.MetaData(), ORIGIN_TABLE)),
        )

    def close(self) -> None:
        for value in self.cache.values():
            with contextlib.suppress(Exception):
                value.close()


#: A prepared command: one attempt (True if it succeeded), and what to do once the time is up.
Prepared = tuple[Callable[[], bool], Callable[[], object] | None]


def cmd_contend(child: _Child, approach: str, key: str, pause: float = 0.0) -> Prepared:
    """Try to take ``key`` again and again; a winner releases at once, a loser sleeps ``pause`` s.

    ``approach``: ``package`` (LockService.try_lock), ``statement`` (the provider's own
    acquire and release statements on raw psycopg), ``upsert`` (the raw one-statement
    upsert on psycopg) or ``origin`` (the origin design). If the caller holds ``key``
    itself, every attempt fails: that is how the failed-attempt footprint is measured.
    """
    if approach == "package":
        service = child.service("postgres")

        def package() -> bool:
            lease = service.try_lock(key)
            if lease is None:
                return False
            lease.release()
            return True

        attempt = package
    elif approach in ("upsert", "statement"):
        conn = child.pg()
        channel = ""  # the upsert peer's release has no channel parameter
        if approach == "upsert":
            sql, release = upsert_sql(), upsert_release_sql()
        else:
            provider = child.service("postgres").provider
            statements = provider._psycopg_sql
            sql, release = statements["acquire"], statements["release"]
            key = "proc:" + key  # the package's rows, under the service's prefix
            # The release notifies the key's channel for waiters (providers/_pg_listen.py).
            channel = _pg_listen.channel(provider.table.name, key)
        # The upsert returns a row only when it won; the provider's statement says so in column 0.
        granted = 0 if approach == "statement" else None

        def raw() -> bool:
            params = {"key": key, "token": secrets.token_hex(16), "ttl": TTL, "life": LIFE, "holder": HOLDER}
            row = conn.execute(sql, params).fetchone()
            if row is None or (granted is not None and not row[granted]):
                return False
            conn.execute(release, {**params, "channel": channel}).fetchall()
            return True

        attempt = raw
    elif approach == "origin":
        origin = child.origin()

        def origin_design() -> bool:
            token = origin.try_acquire(key, TTL)
            if token is None:
                return False
            origin.release(key, token)
            return True

        attempt = origin_design
    else:
        raise ValueError(approach)
    if not pause:
        return attempt, None

    def paced() -> bool:
        if attempt():
            return True
        time.sleep(pause)
        return False

    return paced, None


def cmd_refresh(child: _Child, store: str, leases: int) -> Prepared:
    """Hold ``leases`` leases through the provider; each attempt refreshes them all in one call."""
    from celery_exclusive import RefreshRequest

    provider = child.service(store).provider
    tag = f"{REDIS_PREFIX if store == 'redis' else ''}cap:{os.getpid()}:"
    requests = []
    for i in range(leases):
        token = secrets.token_hex(16)
        provider.acquire(f"{tag}{i}", token, TTL, LIFE, HOLDER)
        requests.append(RefreshRequest(f"{tag}{i}", token, TTL))

    def refresh() -> bool:
        answers = provider.refresh(requests)
        if any(answer is None for answer in answers):
            raise RuntimeError("a held lease was not refreshed")
        return True

    def release() -> None:
        for request in requests:
            provider.release(request.key, request.token)

    return refresh, release


def cmd_acquire_release(child: _Child, store: str) -> Prepared:
    """Uncontended LockService.lock + release on this child's own keys."""
    service = child.service(store)
    pid, n = os.getpid(), [0]

    def acquire_release() -> bool:
        n[0] += 1
        service.lock(f"ar:{pid}:{n[0] % 512}").release()
        return True

    return acquire_release, None


COMMANDS: dict[str, Callable[..., Prepared]] = {
    "contend": cmd_contend,
    "refresh": cmd_refresh,
    "acquire_release": cmd_acquire_release,
}


def _serve(conn: Connection) -> None:
    """Per command: set up, say "ready", wait for the start instant, run until the stop instant."""
    child = _Child()
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            name, kwargs = message
            try:
                attempt, finish = COMMANDS[name](child, **kwargs)
                attempt()  # first use: connections, prepared statements, scripts
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(("ready", None))
            start_at, duration = conn.recv()
            try:
                delay = start_at - time.time()
                if delay > 0:
                    time.sleep(delay)
                until = start_at + duration
                ok = failed = 0
                begun = time.perf_counter()
                while time.time() < until:
                    if attempt():
                        ok += 1
                    else:
                        failed += 1
                elapsed = time.perf_counter() - begun
                if finish is not None:
                    finish()
                conn.send(("ok", {"ok": ok, "failed": failed, "elapsed": elapsed}))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        child.close()


class ProcPool:
    """``n`` spawned children that run the same command in step."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, name: str, duration: float, **kwargs: Any) -> list[dict[str, Any]]:
        """Run command ``name`` in every child for ``duration`` s, all starting at one instant.

        Each child first sets up (connections, leases to hold) and reports ready; only then
        is the start instant chosen, so a slow set-up never eats into the measured window.
        """
        for conn in self._conns:
            conn.send((name, kwargs))
        ready = [conn.recv() for conn in self._conns]
        errors = [value for status, value in ready if status == "error"]
        start_at = time.time() + 0.1
        waiting = [conn for conn, (status, _) in zip(self._conns, ready, strict=True) if status == "ready"]
        for conn in waiting:  # after a failed set-up elsewhere, the others run for no time
            conn.send((start_at, 0.0 if errors else duration))
        results = [conn.recv() for conn in waiting]
        errors += [value for status, value in results if status == "error"]
        if errors:
            raise RuntimeError(f"child failed {name}: {errors[0]}")
        return [value for _, value in results]

    def close(self) -> None:
        """Stop the children (they release what they hold), killing any that hang."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
