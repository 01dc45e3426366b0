"""The example's tasks: each lock idiom the way an application would use it.

=====================  =======================  ================================================
job                    lock key                 when the key is already held
=====================  =======================  ================================================
sync_community_pr      community-pr:{work_id}   return 0: another worker is syncing that item
rollup_stats           rollup:stats             skip: beat sends it more often than it finishes
import_upload          import:{account}         retry with backoff: every upload must be imported
handle_webhook         webhook:{repo}           rerun once after the current run: many
                                                deliveries during a run need one more run
warm_caches            startup:warm-caches      skip: one worker of the cluster does it at
(worker_ready)                                  start-up, through get_lock_service()
=====================  =======================  ================================================

Every attempt is appended to the run records (:mod:`example_worker.records`): the bodies
record what they did holding the lock, and the hooks at the bottom record the attempts
that found the key held. That is all the demo needs to draw its timeline and check it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery.signals import task_postrun, task_retry, worker_ready

from celery_exclusive import LockedError, LockInfo, exclusive_task, get_lock_service, is_skipped
from example_worker import records
from example_worker.app import RECORDS_FILE, ROLE, app

STARTUP_KEY = "startup:warm-caches"
STARTUP_SECONDS = float(os.environ.get("EXAMPLE_STARTUP_SECONDS") or 3)


def zero_when_locked(task: Any, key: str, holder: LockInfo | None) -> int:
    """``on_locked`` for the per-resource sync: someone else is on it, so this run synced 0."""
    record(task, "skipped", key, holder=holder_dict(holder), result=0)
    return 0


@exclusive_task(app=app, key="community-pr:{work_id}", on_locked=zero_when_locked, bind=True)
def sync_community_pr(self: Any, work_id: int, seconds: float = 1.0) -> int:
    """Walk the open PRs of one community work item; returns how many were synced."""
    with recorded_run(self) as run:
        time.sleep(seconds)  # stands in for the calls to the forge's API
        run["result"] = synced = 3 + work_id % 4
    return synced


@exclusive_task(app=app, key="rollup:stats", on_locked="skip", ttl=120, bind=True)
def rollup_stats(self: Any, seconds: float = 15.0) -> str:
    """Rebuild the statistics rollup; beat sends it every few seconds, it takes longer."""
    with recorded_run(self):
        time.sleep(seconds)
    return "rolled up"


@exclusive_task(
    app=app,
    key="import:{account}",
    on_locked="retry",
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=1.0,
    lock_max_retries=100,
    bind=True,
)
def import_upload(self: Any, account: str, upload: str, seconds: float = 0.5) -> str:
    """Import one uploaded file into an account; two imports of one account never run at once."""
    with recorded_run(self, upload=upload):
        time.sleep(seconds)  # every upload must be imported (no skipping), in any order
    return upload


@exclusive_task(app=app, key="webhook:{repo}", on_locked="rerun", bind=True)
def handle_webhook(self: Any, repo: str, delivery: str, seconds: float = 1.5) -> str:
    """Re-read a repository's state after a push webhook; deliveries during a run coalesce."""
    with recorded_run(self, delivery=delivery):
        time.sleep(seconds)  # re-reads the *current* state: one more run covers every delivery
    return delivery


# -- a once-per-cluster start-up job through the lock service --------------------------------


@worker_ready.connect
def warm_caches_once(**_: Any) -> None:
    """When a worker is ready, try the start-up job in the background (never block the worker)."""
    threading.Thread(target=warm_caches, name="warm-caches", daemon=True).start()


def warm_caches() -> None:
    """Warm the shared caches unless another worker is doing it right now."""

    def job() -> tuple[float, float]:
        start = time.time()
        time.sleep(STARTUP_SECONDS)  # stands in for loading the caches
        return start, time.time()

    outcome = get_lock_service(app).run_exclusive(STARTUP_KEY, job, ttl=60, holder={"worker": ROLE["worker"]})
    if outcome.acquired and outcome.result is not None:
        start, end = outcome.result
        record(None, "ran", STARTUP_KEY, start=start, end=end, fence=outcome.fence)
    else:
        record(None, "skipped", STARTUP_KEY, holder=holder_dict(outcome.holder))


# -- the run records ---------------------------------------------------------------------------


def holder_dict(holder: LockInfo | None) -> dict[str, Any] | None:
    """The holder's metadata (host, pid, worker, task id) and fence, or None."""
    return None if holder is None else {**holder.holder, "fence": holder.fence}


def record(task: Any, outcome: str, key: str, **fields: Any) -> None:
    """Append one attempt of ``task`` (None: not a task) on ``key`` to the run records."""
    now = time.time()
    request = None if task is None else task.request
    entry: dict[str, Any] = {
        "kind": "run",
        "outcome": outcome,
        "key": key,
        "task": None if task is None else task.name,
        "task_id": None if request is None else request.id,
        "args": None if request is None else list(request.args or ()),
        "worker": ROLE["worker"],
        "pid": os.getpid(),
        "start": now,
        "end": now,
    }
    entry.update(fields)
    records.append(RECORDS_FILE, entry)


@contextmanager
def recorded_run(task: Any, **fields: Any) -> Iterator[dict[str, Any]]:
    """Record a body's run: key and fence of the lease it holds, start and end (both inside it)."""
    lease = task.lock
    run: dict[str, Any] = {"fence": lease.fence, "start": time.time(), **fields}
    try:
        yield run
    except BaseException as exc:
        run.update(outcome="failed", error=repr(exc))
        raise
    finally:
        run["end"] = time.time()
        record(task, run.pop("outcome", "ran"), lease.key, **run)


@task_postrun.connect
def _record_marker(sender: Any = None, retval: Any = None, **_: Any) -> None:
    """A skip (``on_locked="skip"``) or a coalesced request (``"rerun"``) returns a marker."""
    if sender is not None and is_skipped(retval) and isinstance(retval, Mapping):
        record(sender, retval["celery_exclusive"], retval["key"], holder=retval.get("holder"))


@task_retry.connect
def _record_lock_retry(sender: Any = None, reason: Any = None, **_: Any) -> None:
    """``on_locked="retry"``: the task was re-sent with a countdown because its key was held."""
    locked = getattr(reason, "exc", None)
    if sender is not None and isinstance(locked, LockedError):
        record(sender, "retry", locked.key, holder=holder_dict(locked.holder), countdown=reason.when)
