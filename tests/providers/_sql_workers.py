"""Functions the SQL provider tests run in other processes (a module of their own, so the
forkserver of tests/contract/_processes.py preloads it instead of each child importing the
test module and pytest)."""

from __future__ import annotations

import os
from typing import Any

from celery_exclusive.providers.base import Grant
from celery_exclusive.providers.sql import SqlLockProvider


def race(url: str, table: str, keys: list[str], start: Any, results: Any) -> None:
    """Wait for every racer, then try each key once; report the keys won (or the error)."""
    provider = SqlLockProvider(url, table=table)
    won: list[str] = []
    try:
        start.wait()
        for key in keys:
            if isinstance(provider.acquire(key, f"{os.getpid()}-{key}", 30, 60, "{}"), Grant):
                won.append(key)
        results.put(("ok", won))
    except Exception as exc:
        results.put(("error", repr(exc)))
    finally:
        provider.close()
