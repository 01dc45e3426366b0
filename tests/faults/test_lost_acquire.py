"""An acquire whose reply was lost, while the server still executes it.

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

from celery_exclusive import BackendError, LockService
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
