"""The run records: one JSON object per line, appended under an exclusive ``fcntl`` lock.

Every process (workers, their pool children, beat, the demo driver) appends to the same
file, so each line is written whole under ``flock``; readers take a shared lock and ignore
a torn last line. Two kinds of record:

* ``{"kind": "published", "task_id", "task", "args", "role", "worker", "pid", "at"}``:
  a task message was sent (by the driver, beat, or a worker: a lock retry or a rerun).
* ``{"kind": "run", "outcome", "key", "task", "task_id", "worker", "pid", "start", "end",
  "fence", "holder", ...}``: what one attempt did. ``outcome`` is ``ran`` or ``failed`` (the
  body ran holding the lock, ``fence`` is its fencing number) or ``skipped``, ``coalesced``,
  ``retry`` (the key was held: ``holder`` says by whom; ``start == end``).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def append(path: Path, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one line; concurrent appenders never interleave."""
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.write(fd, line)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read(path: Path) -> list[dict[str, Any]]:
    """Every complete record in the file, in the order written ([] if there is no file)."""
    try:
        with path.open("rb") as file:
            fcntl.flock(file.fileno(), fcntl.LOCK_SH)
            try:
                data = file.read()
            finally:
                fcntl.flock(file.fileno(), fcntl.LOCK_UN)
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn line (a process killed mid-write): not a record
    return out
