"""A holder of several leases, run inside a network namespace by ``test_partitions.py``.

``python -m tests.faults._partition_holder CONFIG`` (JSON: url, prefix, ttl,
refresh_interval). Commands on stdin, one per line: ``lock KEY``, ``release KEY``,
``deadline KEY``, ``exit``. Reports on stdout, one JSON line each, every one stamped with this process's
``time.monotonic()`` (``t``), which is the test's clock too (one kernel, no time
namespace): ``acquired`` / ``acquire_failed`` per ``lock``, ``lost`` from ``on_lost``,
``refreshed`` (the keys each confirmed refresh covered), ``released``, ``deadline`` (the
lease's local deadline on that clock, final once LOST). ``refreshed``, ``lost`` and
``deadline`` also carry the heartbeat thread's ``cpu_wait`` so far (None once it went idle).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

_out = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    with _out:
        sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    from celery_exclusive import BackendError, Lease, LockService, signals
    from tests.faults.conftest import cpu_wait

    options = {"call_timeout": config["call_timeout"]} if "call_timeout" in config else {}
    service = LockService(
        config["url"],
        prefix=config["prefix"],
        ttl=config["ttl"],
        refresh_interval=config["refresh_interval"],
        **options,
    )

    def refreshed(sender: object = None, leases: list[Lease] = (), **_: Any) -> None:  # type: ignore[assignment]
        emit("refreshed", keys=[lease.key for lease in leases], cpu_wait=cpu_wait(service.heartbeat._thread))

    signals.lock_refreshed.connect(refreshed, sender=service, weak=False)
    leases: dict[str, Lease] = {}
    emit("ready")
    for line in sys.stdin:
        command, _, key = line.strip().partition(" ")
        if command == "lock":
            sent = time.monotonic()
            try:
                lease = service.lock(key)
            except BackendError as exc:
                emit("acquire_failed", key=key, sent=sent, error=str(exc))
                continue
            leases[key] = lease
            lease.on_lost(
                lambda lost, reason: emit(
                    "lost", key=lost.key, reason=reason, cpu_wait=cpu_wait(service.heartbeat._thread)
                )
            )
            emit("acquired", key=key, sent=sent, fence=lease.fence)
        elif command == "release":
            sent = time.monotonic()
            outcome = leases.pop(key).release()
            emit("released", key=key, sent=sent, outcome=outcome.value)
        elif command == "deadline":
            deadline = time.monotonic() + leases[key].expires_in
            emit("deadline", key=key, deadline=deadline, cpu_wait=cpu_wait(service.heartbeat._thread))
        elif command == "exit":
            break
    service.close(release=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
