"""celery-exclusive: at most one run at a time per key, across every worker and machine.

The lock core (:class:`LockService`, the providers) works without Celery's worker; the
Celery integration (:class:`ExclusiveTask`, :func:`exclusive_task`) builds on it. The
integration's names are imported on first use (module ``__getattr__``), so importing the
package or the lock core imports neither ``celery_exclusive.task`` nor
``celery_exclusive.worker`` and connects no worker-signal receiver: those are connected
when ``celery_exclusive.worker`` is imported, which every exclusive task does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_exclusive import _lazy
from celery_exclusive.errors import (
    AlreadyDone,
    AlreadyQueued,
    BackendError,
    ConfigurationError,
    ExclusiveError,
    InvalidArgumentError,
    LockedError,
    LockLost,
    LockRetriesExceeded,
    MissingDriverError,
)
from celery_exclusive.lease import Lease, LeaseOwner, LeaseState, ReleaseOutcome
from celery_exclusive.many import LeaseSet
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
from celery_exclusive.urls import mask_url

if TYPE_CHECKING:
    from celery_exclusive.settings import ExclusiveSettings
    from celery_exclusive.task import ExclusiveTask, exclusive_task, is_skipped
    from celery_exclusive.worker import get_lock_service

__version__ = "0.1.0"

#: The Celery integration's names -> the module defining each, imported on first access.
_LAZY = {
    "ExclusiveSettings": "celery_exclusive.settings",
    "ExclusiveTask": "celery_exclusive.task",
    "exclusive_task": "celery_exclusive.task",
    "get_lock_service": "celery_exclusive.worker",
    "is_skipped": "celery_exclusive.task",
}


def __getattr__(name: str) -> Any:
    return _lazy.load(globals(), _LAZY, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AlreadyDone",
    "AlreadyQueued",
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
    "LeaseOwner",
    "LeaseSet",
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
