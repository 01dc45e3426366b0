"""``LockService.close()`` racing the heartbeat's store calls in flight, on every store.

close() does not wait for the heartbeat's calls (refreshes, retried releases): the store is
closed while such a call may be inside a driver call on a connection, and each closes the
store again when it ends. Each test runs ``tests.faults._close_race`` in a process of its
own, round after round (leases refreshed every 50 ms, the shared server behind a relay
that some rounds stall or cut, ``close(release=True/False)``, a fork after some closes),
and passes only if that process exits 0 by itself: no crash in a driver (a connection
freed under its reader would be a signal here, not a dead pytest), no hang at exit with
calls still blocked, no connection left open once the calls ended, nothing printed by
their threads. Short mode about 12 s of rounds per store; ``CE_LONG=1``: 120 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import psycopg
import pytest

from celery_exclusive import BackendError, LockService
from tests.conftest import POSTGRES_URL, Store, require_server, with_option
from tests.contract.test_close import _via
from tests.faults._close_race import CALLS_END
from tests.faults.conftest import LONG, ROOT
from tests.faults.servers import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SECONDS = 120.0 if LONG else 12.0


def test_close_racing_the_heartbeats_calls_leaves_nothing_behind(store: Store) -> None:
    prefix = store.service().prefix
    config = {"url": store.url, "prefix": prefix, "seconds": SECONDS, "seed": os.getpid()}
    # The budget, one round that waits out its calls, and slack for a slow machine.
    limit = SECONDS + 2 * CALLS_END + 30 * store.slack
    try:
        run = subprocess.run(
            [sys.executable, "-m", "tests.faults._close_race", json.dumps(config)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=limit,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"no exit within {limit:g} s (a hang, at exit or in a round): {exc.stderr!r}")
    tail = "\n".join(run.stderr.splitlines()[-40:])
    if run.returncode < 0:
        pytest.fail(f"the process died of {signal.Signals(-run.returncode).name}:\n{tail}")
    assert run.returncode == 0, f"seed {config['seed']}: {run.stdout}\n{tail}"
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["rounds"] > 1, report


def test_a_call_after_close_reset_mid_statement_fails_as_a_store_error(sql_tables: dict[str, str]) -> None:
    """PostgreSQL: once the store is closed its kept connections are gone, so a call still
    under way (the heartbeat's, which closes the store again when it ends) runs on a pooled
    connection. Reset mid-statement (blocked on the lease's row, locked by another session),
    it fails as a BackendError: its connection is invalidated once (a second invalidation
    warned "Can't invalidate an already-closed connection" from the call's thread; this
    suite's warning filter makes that an error)."""
    require_server(POSTGRES_URL)
    port = urlsplit(POSTGRES_URL).port
    assert port is not None
    proxy = TcpProxy(port)
    table = sql_tables["postgres"]
    service = LockService(
        with_option(_via(POSTGRES_URL, proxy.port), "table", table), prefix=f"cr{os.getpid()}:"
    )
    blocker = psycopg.connect(POSTGRES_URL.replace("postgresql+psycopg", "postgresql"))
    try:
        lease = service.lock("reset", ttl=30)
        blocker.execute(f"SELECT 1 FROM {table} WHERE key = %s FOR UPDATE", (lease.store_key,))
        service.close(release=False)
        cut = threading.Timer(0.5, proxy.cut)
        cut.start()
        with pytest.raises(BackendError):
            service.provider.release(lease.store_key, lease.token, timeout=10)
        cut.join()
    finally:
        blocker.rollback()
        blocker.close()
        proxy.close()
    with LockService(with_option(POSTGRES_URL, "table", table), prefix=service.prefix) as direct:
        direct.force_release("reset", lease.token)  # (the reset session may have deleted it)
