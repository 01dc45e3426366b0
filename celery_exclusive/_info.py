"""The store's read-only records: a live lease (:class:`LockInfo`) and a completion record
(:class:`CompletionInfo`), as a provider reports them.

A leaf module: it imports nothing of the package, so :mod:`celery_exclusive.errors` (whose
LockedError and AlreadyDone carry these) and the provider contract both build on it. Their
public home is :mod:`celery_exclusive.providers.base`, which re-exports them as the same
objects; ``__module__`` names it, so pickles and reprs of the types stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A live lease as the store sees it (times measured on the store's clock)."""

    key: str
    token: str
    fence: int
    age: float
    expires_in: float
    hard_expires_in: float
    holder: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line naming the holder: host, pid, task and fence where known."""
        parts = [f"{k}={self.holder[k]}" for k in ("host", "pid", "task_name", "task_id") if k in self.holder]
        parts.append(f"fence={self.fence}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class CompletionInfo:
    """A live completion record as the store sees it (times on the store's clock)."""

    key: str
    task_id: str
    outcome: str
    attempt: int
    age: float
    expires_in: float


# Set once the classes exist (the dataclass decorator reads the defining module).
for _record in (LockInfo, CompletionInfo):
    _record.__module__ = "celery_exclusive.providers.base"
