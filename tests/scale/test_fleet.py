"""64 worker processes on one PostgreSQL with ``max_connections=100``, through PgBouncer.

The fleet recipe of docs/scaling.md, run by ``benchmarks/fleet.py``'s :func:`measure` on a
private PostgreSQL and a private PgBouncer (transaction mode, ``default_pool_size=20``):
each process holds 4 leases kept alive by its heartbeat (ttl 3 s, a refresh every second)
and cycles ``lock()`` + ``release()`` twice a second on keys of its own.

Short mode (CI): 8 s of cycling. ``CE_LONG=1``: 120 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.fleet import Fleet, measure, private_servers
from tests.faults.servers import ServerUnavailable
from tests.scale._servers import unavailable

LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
SECONDS = 120.0 if LONG else 8.0
PROCESSES = 64
POOL = 20


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """The fleet's measurement, on servers started for it and stopped after."""
    servers = private_servers(POOL)
    try:
        url, server_dsn, admin_dsn = servers.__enter__()
    except ServerUnavailable as exc:
        unavailable(str(exc))
        raise AssertionError from None  # unreachable: unavailable() skips or fails
    try:
        yield measure(
            url, server_dsn, admin_dsn=admin_dsn, pool_size=POOL, processes=PROCESSES, seconds=SECONDS
        )
    finally:
        servers.__exit__(None, None, None)


def test_no_lease_is_lost_and_no_call_fails(fleet: Fleet) -> None:
    """Every process reports, every held lease is still held at the end, no store call failed."""
    report = "\n".join(fleet.lines())
    assert fleet.reported == PROCESSES, report
    assert fleet.held == PROCESSES * 4, report
    assert fleet.lost == 0, report
    assert fleet.errors == [], report


def test_the_server_sees_at_most_the_pool(fleet: Fleet) -> None:
    """The server never has more client backends than PgBouncer's pool, while PgBouncer has
    more clients than the pool (and more than max_connections would allow directly)."""
    report = "\n".join(fleet.lines())
    assert fleet.max_connections == 100, report
    assert 0 < fleet.server_max <= POOL, report
    assert fleet.clients_max >= PROCESSES > POOL, report


def test_leases_were_refreshed_and_keys_cycled(fleet: Fleet) -> None:
    """The heartbeats refreshed (each process at least once a ttl) and every process cycled."""
    report = "\n".join(fleet.lines())
    assert len(fleet.refresh) >= PROCESSES * int(SECONDS / 3), report
    assert fleet.cycles >= PROCESSES * SECONDS, report
