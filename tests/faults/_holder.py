"""A lease holder run as its own process by the fault tests (``python -m tests.faults._holder``).

Takes one JSON argument (url, prefix, key, ttl, refresh_interval, optional skew in
seconds), acquires the key through a :class:`LockService` and then answers commands read
from stdin, one per line, with one JSON line each on stdout:

``state``    ``{"event": "state", "state": ..., "check": "ok" | "LockLost: ...", ...}``
``release``  ``{"event": "released", "outcome": "released" | "not_owned" | "unknown"}``
``exit``     closes the service and exits

It also reports on its own: ``acquired`` (fence, token, its wall clock) once, and ``lost``
from the ``on_lost`` callback. ``skew`` shifts ``time.time`` in this process when the
tests could not run it under libfaketime.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
from typing import Any

_out = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """Write one JSON report line (thread-safe: the heartbeat thread reports ``lost``)."""
    with _out:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


def _skew_wall_clock(seconds: float) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    if config.get("skew"):
        _skew_wall_clock(float(config["skew"]))
    from celery_exclusive import LockLost, LockService

    service = LockService(
        config["url"],
        prefix=config["prefix"],
        ttl=config["ttl"],
        refresh_interval=config.get("refresh_interval"),
    )
    lease = service.lock(config["key"])
    lease.on_lost(lambda _lease, reason: emit("lost", reason=reason))
    emit(
        "acquired",
        fence=lease.fence,
        token=lease.token,
        wall=time.time(),
        datetime=datetime.datetime.now(datetime.timezone.utc).timestamp(),
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "state":
            state = lease.state
            try:
                lease.check()
                check = "ok"
            except LockLost as exc:
                check = f"LockLost: {exc}"
            emit(
                "state",
                state=state.value,
                check=check,
                expires_in=lease.expires_in,
                heartbeat=service.heartbeat.running,
                wall=time.time(),
            )
        elif command == "release":
            emit("released", outcome=lease.release().value)
        elif command == "exit":
            break
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
