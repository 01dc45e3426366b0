"""celery-exclusive: at most one run at a time per key, across every worker and machine.

The lock core (:class:`LockService`, the providers) works without Celery; the Celery
integration (:class:`ExclusiveTask`, :func:`exclusive_task`) builds on it.
"""

from __future__ import annotations

from celery_exclusive.errors import (
    AlreadyDone,
    BackendError,
    ConfigurationError,
    ExclusiveError,
    InvalidArgumentError,
    LockedError,
    LockLost,
    LockRetriesExceeded,
    MissingDriverError,
)
from celery_exclusive.lease import Lease, LeaseState, ReleaseOutcome
from celery_exclusive.providers.base import (
    Completion,
    CompletionInfo,
    CompletionStore,
    Done,
    Grant,
    Held,
    LockInfo,
    LockProvider,
    RefreshRequest,
)
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.service import ExclusiveResult, LockService
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import ExclusiveTask, exclusive_task, is_skipped
from celery_exclusive.urls import mask_url
from celery_exclusive.worker import get_lock_service

__version__ = "0.1.0"

__all__ = [
    "AlreadyDone",
    "BackendError",
    "Completion",
    "CompletionInfo",
    "CompletionStore",
    "ConfigurationError",
    "Done",
    "ExclusiveError",
    "ExclusiveResult",
    "ExclusiveSettings",
    "ExclusiveTask",
    "Grant",
    "Held",
    "InvalidArgumentError",
    "Lease",
    "LeaseState",
    "LockInfo",
    "LockLost",
    "LockProvider",
    "LockRetriesExceeded",
    "LockService",
    "LockedError",
    "MemoryLockProvider",
    "MissingDriverError",
    "RefreshRequest",
    "ReleaseOutcome",
    "__version__",
    "exclusive_task",
    "get_lock_service",
    "is_skipped",
    "mask_url",
]
