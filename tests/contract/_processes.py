"""The multiprocessing context of the cross-process contract tests."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkServerContext

#: What the forkserver imports once, before it forks any child.
PRELOAD = [
    "celery_exclusive.testing._workers",
    "tests.contract._wait_workers",
    "tests.contract._semaphore_workers",
    "tests.providers._sql_workers",
    "sqlalchemy",
    "psycopg",
    "pymysql",
    "redis",
]


def process_context() -> ForkServerContext:
    """Fresh processes, each opening its own store connections as under spawn, forked from a
    forkserver that imported the workers and the drivers once (it never runs test code, so
    no connection, lock or thread of the test process is inherited): an 8-process test no
    longer starts 8 interpreters (the 8 starvation / random-set tests of test_waiting.py:
    ~56 s under spawn, ~31 s so, load ~6)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
