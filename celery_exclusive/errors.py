"""Exceptions raised by celery-exclusive.

Every exception the package raises on purpose derives from :class:`ExclusiveError`::

    ExclusiveError
    ├── ConfigurationError        bad or missing URL, unknown scheme, bad table/prefix name
    │   └── MissingDriverError    the provider's driver is not installed (names the pip line)
    ├── InvalidArgumentError      bad key, duration or option; raised before any backend call
    ├── BackendError              the lock store is down, refused, or answered nonsense
    ├── LockedError               the key is held by someone else (``key``, ``holder``)
    │   └── LockRetriesExceeded   a Celery task gave up waiting for the key
    ├── AlreadyDone               the task id already has a completion record on the key
    ├── AlreadyQueued             a deduplicated send found the key queued (``key``, ``task_id``)
    └── LockLost                  a held lease is gone or may be gone (``key``, ``fence``)

A backend outage is always a :class:`BackendError`, never "not acquired": an outage must
not look like contention. Driver exceptions are translated once, at the provider boundary,
and chained with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_exclusive._info import CompletionInfo, LockInfo


class ExclusiveError(Exception):
    """Base class of every exception raised by celery-exclusive."""


class ConfigurationError(ExclusiveError, ValueError):
    """The lock store is not configured, or configured wrongly."""


class MissingDriverError(ConfigurationError, ImportError):
    """The driver a provider needs is not installed; the message names the pip line.

    ``install`` replaces the default ``pip install 'celery-exclusive[<extra>]'`` when the
    extra would not help (a URL naming a driver the extra does not install).
    """

    def __init__(self, extra: str, module: str, install: str | None = None) -> None:
        self.extra = extra
        self.module = module
        line = install or f"pip install 'celery-exclusive[{extra}]'"
        super().__init__(f"the {module!r} package is required for this lock store; install it with: {line}")


class InvalidArgumentError(ExclusiveError, ValueError):
    """An argument was rejected before any backend was touched."""


class BackendError(ExclusiveError):
    """The lock store could not be reached or failed; the lock state is unknown."""


class LockedError(ExclusiveError):
    """The key is held by another owner.

    ``args`` are ``(key, holder as a dict without its token, message)`` so that Celery's
    result backends, which rebuild exceptions as ``cls(*args)``, give back an equal error;
    a holder rebuilt from a dict has an empty ``token``.
    """

    def __init__(
        self, key: str, holder: LockInfo | Mapping[str, Any] | None = None, message: str | None = None
    ) -> None:
        if isinstance(holder, Mapping):
            holder = LockInfo(**{"token": "", **holder})
        self.key = key
        self.holder = holder
        if message is None:
            who = f" by {holder.describe()}" if holder is not None else ""
            message = f"lock {key!r} is held{who}"
        self.message = message
        super().__init__(key, _holder_args(holder), message)

    def __str__(self) -> str:
        return self.message


class LockRetriesExceeded(LockedError):
    """A task retried for its lock ``lock_max_retries`` times and gave up."""


class AlreadyDone(ExclusiveError):
    """``LockService.lock(..., task_id=...)`` refused: ``record`` says that id already ran."""

    def __init__(self, key: str, record: CompletionInfo) -> None:
        self.key = key
        self.record = record
        super().__init__(key, record.task_id, record.outcome)

    def __str__(self) -> str:
        return (
            f"task {self.record.task_id!r} already finished a run on lock {self.key!r} "
            f"({self.record.outcome}, attempt {self.record.attempt})"
        )


class AlreadyQueued(ExclusiveError):
    """A send with ``dedupe`` and ``on_duplicate="raise"`` found the key already queued (or,
    under ``"until_done"``, running): nothing was published. ``task_id`` is the existing
    task's id (None when its holder did not say)."""

    def __init__(self, key: str, task_id: str | None) -> None:
        self.key = key
        self.task_id = task_id
        super().__init__(key, task_id)  # rebuildable as cls(*args), see LockedError

    def __str__(self) -> str:
        return f"lock {self.key!r} is already queued or running as task {self.task_id!r}; nothing was sent"


class LockLost(ExclusiveError):
    """The lease was lost (or may have been): another owner may now hold the key."""

    def __init__(self, key: str, fence: int, reason: str) -> None:
        self.key = key
        self.fence = fence
        self.reason = reason
        super().__init__(key, fence, reason)  # rebuildable as cls(*args), see LockedError

    def __str__(self) -> str:
        return f"lock {self.key!r} (fence {self.fence}) was lost: {self.reason}"


def _holder_args(holder: LockInfo | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    return {
        "key": holder.key,
        "fence": holder.fence,
        "age": holder.age,
        "expires_in": holder.expires_in,
        "hard_expires_in": holder.hard_expires_in,
        "holder": dict(holder.holder),
    }
