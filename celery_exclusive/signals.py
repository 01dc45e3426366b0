"""Celery-style signals for lock events; connect with ``@lock_acquired.connect``.

Every signal but ``task_skipped`` (sender = the task) is sent with ``sender`` = the
:class:`~celery_exclusive.LockService`. Receivers run synchronously in the thread that
caused the event (for ``lock_refreshed``, ``refresh_failed`` and usually ``lock_lost``, the
heartbeat's call thread that sent the refresh, ``celery-exclusive-call``; the threads of
each signal are in docs/observability.md); an exception in a receiver is logged and never
breaks the lock.

============== ==========================================================================
signal         keyword arguments
============== ==========================================================================
lock_acquired  ``key``, ``lease``
lock_contended ``key``, ``holder`` (LockInfo or None)
lock_refreshed ``leases`` (list of Lease), ``duration`` (seconds the round trip took)
refresh_failed ``leases`` (list of Lease, now in JEOPARDY), ``error`` (the exception)
lock_lost      ``key``, ``lease``, ``reason``
lock_released  ``key``, ``lease``, ``outcome`` (ReleaseOutcome), ``held_for`` (seconds)
task_skipped   ``key``, ``task``, ``holder``, ``reason`` (``"locked"``, ``"redelivered"`` or
               ``"already_done"``), ``record`` (CompletionInfo for ``already_done``, else
               None); sent by the Celery integration, sender=task
============== ==========================================================================
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="lock_acquired", providing_args=["key", "lease"])
lock_contended = Signal(name="lock_contended", providing_args=["key", "holder"])
lock_refreshed = Signal(name="lock_refreshed", providing_args=["leases", "duration"])
refresh_failed = Signal(name="refresh_failed", providing_args=["leases", "error"])
lock_lost = Signal(name="lock_lost", providing_args=["key", "lease", "reason"])
lock_released = Signal(name="lock_released", providing_args=["key", "lease", "outcome", "held_for"])
task_skipped = Signal(name="task_skipped", providing_args=["key", "task", "holder", "reason", "record"])


def send(signal: Signal, sender: object, **kwargs: Any) -> None:
    """Send ``signal`` only when someone listens: the common case costs one attribute read."""
    if signal.receivers:
        signal.send(sender=sender, **kwargs)
