"""The part of ExclusiveTask its helper modules use, as a Protocol.

``policies`` and ``redelivery`` are called by :mod:`celery_exclusive.task` with the task;
typing their argument with this Protocol instead of ``ExclusiveTask`` keeps them from
importing the module that imports them (no import cycle, see tests/test_layering.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from celery_exclusive.lease import Lease
    from celery_exclusive.many import LeaseSet
    from celery_exclusive.service import LockService
    from celery_exclusive.settings import ExclusiveSettings


class TaskView(Protocol):
    """What the task's helpers (policies, redelivery) use of the
    :class:`~celery_exclusive.task.ExclusiveTask` that calls them."""

    @property
    def name(self) -> str: ...
    @property
    def app(self) -> Any: ...
    @property
    def request(self) -> Any: ...
    @property
    def lock_settings(self) -> ExclusiveSettings: ...
    @property
    def lock_service(self) -> LockService: ...
    def signature_from_request(self, request: Any, args: Any, kwargs: Any, **options: Any) -> Any: ...
    def _acquire(self, key: str, once: str | None, request: Any) -> Lease | LeaseSet: ...
    def _run_holding(
        self, lease: Lease | LeaseSet, args: Any, kwargs: Any, request: Any, record: str | None
    ) -> Any: ...
