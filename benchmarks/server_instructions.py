"""The Redis server's instructions per lock call, with and without a completion record,
counted by callgrind (issue #16).

``python -m benchmarks.server_instructions [--calls N] [--package DIR]`` starts a private
``redis-server`` (from ``PATH``; no persistence, ``--hz 1``, a free loopback port) under
``valgrind --tool=callgrind``, runs the provider's ``acquire`` then ``release`` on N distinct
keys, first without a record (``floor``: a plain acquire, a release that deletes the hash),
then with one (``once``: the acquire checks a new task id's record, the release writes it,
kept a day, as an exclusive Celery run's do), after a warm-up of each, and prints the
server's instructions per call of each phase, and per acquire + release: zeroed before the
phase and dumped after it (``callgrind_control``), so they hold the script's run, the
command's parsing and reply, and the event loop's turn per call (the ``hz`` timer's few
turns, at ``--hz 1``, are in them too). Instruction counts do not move with the machine's
load (runs agree within ~1.5k per call), which the server's own ``usec_per_call`` does.
``--package DIR`` imports celery_exclusive (and so its scripts) from ``DIR``, for
before/after rows; the server is stopped and its directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

_TOTALS = re.compile(r"^(?:totals|summary):\s*(\d+)", re.MULTILINE)
_TRIGGER = re.compile(r"^desc: Trigger: dump (\S+)", re.MULTILINE)
HOLDER = '{"host":"instr-host","pid":12345}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _phases(provider: Any, server_pid: int, calls: int) -> None:
    """Each phase's acquires, then its releases, each between a zeroing and a dump."""
    from celery_exclusive.providers.base import Completion

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(server_pid)], check=True, capture_output=True)

    for name, once in (("warm-floor", False), ("warm-once", True), ("floor", False), ("once", True)):
        keys = [f"ceinstr:{name}:{i}" for i in range(calls)]
        tokens = [secrets.token_hex(16) for _ in keys]
        ids = [str(uuid.uuid4()) for _ in keys]  # Celery's task ids
        records = [Completion(i, "success", 0, 86400.0) if once else None for i in ids]
        control("-z")
        for key, token, record in zip(keys, tokens, records, strict=True):
            task_id = None if record is None else record.task_id
            provider.acquire(key, token, 30.0, 3600.0, HOLDER, task_id=task_id, timeout=60.0)
        control("-d", f"{name}:acquire")
        for key, token, record in zip(keys, tokens, records, strict=True):
            provider.release(key, token, record, timeout=60.0)
        control("-d", f"{name}:release")


def count(calls: int) -> dict[str, float]:
    """Server instructions per call, by ``phase:operation``."""
    import redis

    from celery_exclusive.providers.redis import RedisLockProvider

    server = shutil.which("redis-server")
    if server is None or shutil.which("valgrind") is None:
        raise SystemExit("needs redis-server and valgrind (callgrind_control) on PATH")
    folder = Path(tempfile.mkdtemp(prefix="ce-server-instr-"))
    port = _free_port()
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/callgrind.out",
        server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(folder), "--protected-mode", "no", "--hz", "1",
    ]  # fmt: skip
    with (folder / "valgrind.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        client = redis.Redis(port=port, socket_timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"redis-server under callgrind did not start (see {folder})") from None
                time.sleep(0.1)
        client.close()
        provider = RedisLockProvider(f"redis://127.0.0.1:{port}/0?socket_timeout=60")
        try:
            _phases(provider, proc.pid, calls)
        finally:
            provider.close()
    finally:
        proc.terminate()
        proc.wait(60)
    found: dict[str, float] = {}
    try:
        for dump in folder.glob("callgrind.out*"):
            text = dump.read_text(errors="replace")
            trigger, totals = _TRIGGER.search(text), _TOTALS.search(text)
            if trigger and totals and not trigger.group(1).startswith("warm"):
                found[trigger.group(1)] = int(totals.group(1)) / calls
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--package", help="import celery_exclusive from this directory")
    args = parser.parse_args(argv)
    if args.package:
        sys.path.insert(0, args.package)
    import celery_exclusive

    if args.package and not celery_exclusive.__file__.startswith(os.path.abspath(args.package)):
        raise SystemExit(f"celery_exclusive not imported from {args.package}: {celery_exclusive.__file__}")
    per_call = count(args.calls)
    for op in ("acquire", "release"):
        floor, once = per_call[f"floor:{op}"], per_call[f"once:{op}"]
        print(f"{op:8} floor {floor:9,.0f}  once {once:9,.0f}  (+{once - floor:,.0f}) per call")
    floor = per_call["floor:acquire"] + per_call["floor:release"]
    once = per_call["once:acquire"] + per_call["once:release"]
    print(f"{'cycle':8} floor {floor:9,.0f}  once {once:9,.0f}  (+{once - floor:,.0f}, {once / floor:.3f}x)")


if __name__ == "__main__":
    main()
