"""An acquire whose reply was lost, while the server still executes it (PostgreSQL; and
MariaDB, which a transaction protects).

The client gives up at ``call_timeout``, drops the connection, raises BackendError and hands
the token to the heartbeat's release retry. On PostgreSQL the dropped session is still
running the statement (here: its backend is SIGSTOPped, as by a stalled disk); a retried
release that finds nothing then is not final: the acquire commits later. The retry must
keep going until that session is gone, then release the late lease, long before its ttl.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from celery_exclusive import BackendError, LockService
from celery_exclusive.providers.base import Grant
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import MYSQL_URL, drop_lock_table, require_server
from tests.faults.conftest import wait_until
from tests.faults.servers import PrivatePostgres

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TTL = 30.0
STOPPED_FOR = 3.0  # the backend is stopped this long from the acquire's send; call_timeout is 1.5 s


def test_pg_acquire_committed_after_its_client_gave_up_is_released_soon(pg_server: PrivatePostgres) -> None:
    app = f"ce-lost-{uuid.uuid4().hex[:8]}"
    prefix = f"lost{uuid.uuid4().hex[:6]}:"
    service = LockService(PrivatePostgres.url_for(pg_server.port, app), prefix=prefix, call_timeout=1.5)
    observer = LockService(PrivatePostgres.url_for(pg_server.port, app + "-obs"), prefix=prefix)
    stopped: list[int] = []
    try:
        service.lock("warm", ttl=TTL).release()  # the schema and a kept connection
        pids = [
            int(str(row[0]))
            for row in pg_server.admin("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))
        ]
        assert pids
        for pid in pids:  # the acquire below is sent to one of these
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

        def resume() -> None:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)

        timer = threading.Timer(STOPPED_FOR, resume)
        start = time.monotonic()
        timer.start()
        with pytest.raises(BackendError):
            service.lock("k", ttl=TTL)
        assert time.monotonic() - start < STOPPED_FOR  # the client gave up while the backend was stopped
        timer.join()

        # The stalled acquire commits once resumed: the key is held for a moment at most ...
        # (on main it stayed held for the whole ttl: the retried release had found nothing
        # while the backend was stopped, and was dropped as done).
        def settled() -> bool:
            return observer.peek("k") is None and not service.heartbeat._pending_release

        assert wait_until(settled, 8.0), (observer.peek("k"), service.heartbeat._pending_release)
        assert time.monotonic() - start < TTL / 2
        # ... and the key is free for good, and takeable by another client.
        time.sleep(0.5)
        assert observer.peek("k") is None
        observer.lock("k", ttl=5).release()
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        service.close()
        observer.close()


def test_mariadb_acquire_stalled_after_its_client_gave_up_leaves_the_key_free() -> None:
    """MariaDB/MySQL's side of the same fault (docs/faults.md, item 9): the acquire is a
    transaction, so a statement the server still runs after the client dropped the session
    (here the fence bump, waiting for a row lock another session holds) ends in a rollback,
    not a lease; the key is free once it resumes, with no release pending."""
    require_server(MYSQL_URL)
    table = f"ce_lost_{uuid.uuid4().hex[:8]}"
    service = LockService(SqlLockProvider(MYSQL_URL, table=table), call_timeout=1.5)
    observer = SqlLockProvider(MYSQL_URL, table=table)
    engine = sa.create_engine(MYSQL_URL)
    try:
        service.lock("warm", ttl=TTL).release()  # the tables
        with engine.connect() as blocker:
            blocker.execute(sa.text(f"UPDATE {table}_fence SET n = n WHERE id = 1"))  # its row lock, held
            start = time.monotonic()
            with pytest.raises(BackendError):
                service.lock("k", ttl=TTL)
            assert time.monotonic() - start < 1.5 + 1.0
            time.sleep(1.0)  # the retried release has found nothing by now
            blocker.commit()  # the stalled bump goes on, on a session its client has left
        time.sleep(1.0)
        assert wait_until(lambda: not service.heartbeat._pending_release, 5.0)
        assert observer.peek("task-lock:k") is None
        assert isinstance(observer.acquire("task-lock:k", "other", 5, 60, "{}"), Grant)
    finally:
        service.close()
        observer.close()
        engine.dispose()
        drop_lock_table(MYSQL_URL, table)
