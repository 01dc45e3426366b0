"""The example's Celery app, configured from the environment.

With nothing set, it needs no server at all: kombu's filesystem broker, Celery's file
result backend and a SQLite lock store, all under ``EXAMPLE_DATA_DIR``. docker-compose.yml
sets the same variables to PostgreSQL and Redis.

=========================  ===================================================================
variable                   meaning (default)
=========================  ===================================================================
EXAMPLE_DATA_DIR           broker folders, results, SQLite locks, run records (``.demo``)
EXAMPLE_BROKER_URL         Celery broker (``filesystem://localhost//``: folders under the data dir)
EXAMPLE_RESULT_BACKEND     result backend (``file://<data dir>/results``)
EXAMPLE_LOCK_BACKEND       where the locks live: ``sqlite``, ``postgres`` or ``redis`` (sqlite)
EXAMPLE_POSTGRES_URL       lock store for ``postgres``
                           (``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``)
EXAMPLE_REDIS_URL          lock store for ``redis`` (``redis://127.0.0.1:6379/0``)
EXAMPLE_LOCK_URL           any lock store URL, instead of the backend's (e.g. ``memory://``,
                           which excludes nothing across processes: the demo's check fails)
EXAMPLE_ROLLUP_EVERY       beat interval of the rollup job, seconds (10)
EXAMPLE_ROLLUP_SECONDS     how long one rollup takes, seconds (15: longer than the interval)
EXAMPLE_STARTUP_SECONDS    how long the start-up job takes, seconds (3; read by tasks.py)
CELERY_EXCLUSIVE_PREFIX    lock key prefix, read by celery-exclusive itself (``task-lock:``)
=========================  ===================================================================
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import after_task_publish, beat_init, celeryd_init

from example_worker import records

LOCK_BACKENDS = ("sqlite", "postgres", "redis")

DATA_DIR = Path(os.environ.get("EXAMPLE_DATA_DIR") or ".demo").resolve()
RECORDS_FILE = DATA_DIR / "runs.jsonl"
BROKER_URL = os.environ.get("EXAMPLE_BROKER_URL") or "filesystem://localhost//"
RESULT_BACKEND = os.environ.get("EXAMPLE_RESULT_BACKEND") or f"file://{DATA_DIR}/results"
LOCK_BACKEND = os.environ.get("EXAMPLE_LOCK_BACKEND") or "sqlite"
ROLLUP_EVERY = float(os.environ.get("EXAMPLE_ROLLUP_EVERY") or 10)
ROLLUP_SECONDS = float(os.environ.get("EXAMPLE_ROLLUP_SECONDS") or 15)


def lock_url(backend: str = LOCK_BACKEND) -> str:
    """The lock store URL: ``EXAMPLE_LOCK_URL``, else the one for ``backend`` (sqlite, postgres, redis)."""
    explicit = os.environ.get("EXAMPLE_LOCK_URL")
    if explicit:
        return explicit
    if backend == "sqlite":
        return f"sqlite:///{DATA_DIR / 'locks.sqlite3'}"
    if backend == "postgres":
        return (
            os.environ.get("EXAMPLE_POSTGRES_URL") or "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        )
    if backend == "redis":
        return os.environ.get("EXAMPLE_REDIS_URL") or "redis://127.0.0.1:6379/0"
    raise ValueError(f"EXAMPLE_LOCK_BACKEND must be one of {', '.join(LOCK_BACKENDS)}, got {backend!r}")


DATA_DIR.mkdir(parents=True, exist_ok=True)
broker_options: dict[str, Any] = {}
broker_transport = None
if BROKER_URL.startswith("filesystem://"):
    # One folder is both the in and the out box, so every process shares one queue. Taken
    # messages are *moved* to "processed" on the same file system: a rename, so exactly one
    # consumer gets each message (kombu's default moves them to /tmp, maybe another disk).
    broker_dir = DATA_DIR / "broker"
    for sub in ("queue", "processed", "control"):
        (broker_dir / sub).mkdir(parents=True, exist_ok=True)
    broker_options = {
        "data_folder_in": str(broker_dir / "queue"),
        "data_folder_out": str(broker_dir / "queue"),
        "store_processed": True,
        "processed_folder": str(broker_dir / "processed"),
        "control_folder": str(broker_dir / "control"),
        "polling_interval": 0.1,
    }
    broker_transport = "example_worker.broker:Transport"  # kombu's, but writes messages atomically
if RESULT_BACKEND.startswith("file://"):
    Path(RESULT_BACKEND.removeprefix("file://")).mkdir(parents=True, exist_ok=True)

app = Celery("example_worker", broker=BROKER_URL, backend=RESULT_BACKEND, include=["example_worker.tasks"])
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport=broker_transport,
    broker_transport_options=broker_options,
    task_default_queue="example",
    worker_prefetch_multiplier=1,  # a long task should not sit on messages another process could take
    exclusive_url=lock_url(),
    beat_schedule={
        # Runs longer than its interval on purpose: the ticks that find it running skip.
        "rollup-stats": {
            "task": "example_worker.tasks.rollup_stats",
            "schedule": ROLLUP_EVERY,
            "kwargs": {"seconds": ROLLUP_SECONDS},
        },
    },
    beat_schedule_filename=str(DATA_DIR / "celerybeat-schedule"),
)

# Who this process is, for the run records: "client" (whoever sends tasks), "worker" or "beat".
ROLE = {"role": "client", "worker": "client"}


@celeryd_init.connect
def _i_am_a_worker(sender: str | None = None, **_: Any) -> None:
    """A worker's main process (pool children inherit this when they fork)."""
    ROLE.update(role="worker", worker=(sender or "worker").split("@", 1)[0])


@beat_init.connect
def _i_am_beat(**_: Any) -> None:
    """The beat process."""
    ROLE.update(role="beat", worker="beat")


@after_task_publish.connect
def _record_publication(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Record every task message sent, so the demo can account for each one."""
    headers = headers or {}
    records.append(
        RECORDS_FILE,
        {
            "kind": "published",
            "task_id": headers.get("id"),
            "task": sender,
            "args": headers.get("argsrepr"),
            "kwargs": headers.get("kwargsrepr"),
            "pid": os.getpid(),
            "at": time.time(),
            **ROLE,
        },
    )
