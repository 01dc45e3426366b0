"""The exclusive runs in progress in this thread, and the release of a run's leases.

:mod:`celery_exclusive.task` pushes each run's lease (a :class:`LeaseSet` for a run holding
several keys, a :class:`Guarded` for a semaphore's) while its body runs, and pops and
releases it through :func:`finish`; ``self.lock``, ``self.locks`` and ``self.retry()`` find it
with :func:`current`. A run holding several keys releases its first key (canonical order)
last, a semaphore run its task id's lease: that lease carries the completion record.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from celery_exclusive.lease import Lease, LeaseState, ReleaseOutcome
from celery_exclusive.many import LeaseSet, release_each
from celery_exclusive.providers.base import Completion

_Outcome = TypeVar("_Outcome")


class _Running(threading.local):
    """Per-thread stack of (task, lease) for the runs in progress in this thread."""

    def __init__(self) -> None:
        self.stack: list[tuple[object, Lease | LeaseSet]] = []


_running = _Running()
#: The members as module constants: ``LeaseState.LOST`` is a class attribute read through
#: Python 3.11's ``EnumType.__getattr__`` hook (lease.py's ``_HELD``...), three per run here.
_LOST, _RELEASED, _NOT_OWNED = LeaseState.LOST, LeaseState.RELEASED, ReleaseOutcome.NOT_OWNED


class Guarded(LeaseSet):
    """A semaphore run's leases: its slot, then the lease on its own task id's key
    (:func:`celery_exclusive.redelivery.guard_key`), which carries the completion record and
    is released last (a copy of the message finds it held until the slot is free)."""


def _carrier(leases: LeaseSet) -> tuple[Lease, list[Lease]]:
    """The lease that carries the record, and the others in the order they are released."""
    if isinstance(leases, Guarded):
        *rest, guard = leases.leases
        return guard, rest[::-1]
    first, *rest = leases.leases
    return first, rest[::-1]


def _release_set(
    leases: LeaseSet, release: Callable[[Lease, Completion | None], _Outcome], done: Completion | None
) -> dict[str, _Outcome]:
    """``release`` each lease, the carrier last with ``done``: every one, even past a release
    that raises (:func:`~celery_exclusive.many.release_each`)."""
    carrier, others = _carrier(leases)
    return release_each([*others, carrier], lambda each: release(each, done if each is carrier else None))


def push(task: object, lease: Lease | LeaseSet) -> None:
    """``task``'s run holds ``lease`` from now on, in this thread."""
    _running.stack.append((task, lease))


def enter(task: object, lease: Lease | LeaseSet) -> bool:
    """:func:`push`; True unless a run of ``task`` was already in progress in this thread
    (:func:`inside` before the push, in the same call)."""
    stack = _running.stack
    outermost = not stack or all(running is not task for running, _ in stack)
    stack.append((task, lease))
    return outermost


def current(task: object) -> Lease | LeaseSet | None:
    """The lease(s) of ``task``'s innermost run in progress in this thread, or None."""
    for running, lease in reversed(_running.stack):
        if running is task:
            return lease
    return None


def inside(task: object) -> bool:
    """Whether a run of ``task`` is in progress in this thread (a call from its own body)."""
    stack = _running.stack
    return bool(stack) and any(running is task for running, _ in stack)


def _pop(lease: Lease | LeaseSet) -> None:
    stack = _running.stack
    for index in range(len(stack) - 1, -1, -1):
        if stack[index][1] is lease:
            del stack[index]
            return


def release(lease: Lease, done: Completion | None) -> bool:
    """Release ``lease`` (recording ``done``) unless released already; True if it had been lost."""
    state = lease.state
    lost = state is _LOST
    if state is not _RELEASED:
        lost = lease.release(done) is _NOT_OWNED or lost
    return lost


def finish(
    lease: Lease | LeaseSet,
    done: Completion | None,
    via: Callable[[Lease, Completion | None], ReleaseOutcome] | None = None,
) -> Lease | None:
    """Pop the run's lease(s) and release them, recording ``done`` on the first key in the
    same store call. The lease that had been lost (the first in canonical order), or None.
    A signal handler's exception raised in one release is raised once all are released.
    ``via``: what releases a single lease instead of ``lease.release`` (the task layer
    passes the service's own release when it has checked ``done`` itself)."""
    stack = _running.stack
    if stack and stack[-1][1] is lease:  # the innermost run, as usual: _pop without its loop
        del stack[-1]
    else:
        _pop(lease)
    # A Lease on its exact type first (the usual run): an isinstance() that fails costs more.
    if type(lease) is not Lease and isinstance(lease, LeaseSet):
        lost = _release_set(lease, release, done)
        return next((each for each in lease.leases if lost[each.key]), None)
    state = lease.state  # release() inlined: the single-key path makes no extra call
    gone = state is _LOST
    if state is not _RELEASED:
        outcome = lease.release(done) if via is None else via(lease, done)
        gone = outcome is _NOT_OWNED or gone
    return lease if gone else None


def release_all(lease: Lease | LeaseSet, done: Completion | None) -> list[Lease]:
    """Release every lease of a run (before ``self.retry()``), ``done`` on the carrier, last;
    all of them even if one release raises. The leases whose release the store did not
    confirm (UNKNOWN, NOT_OWNED): they may still be in the store."""
    if isinstance(lease, LeaseSet):
        outcomes = _release_set(lease, Lease.release, done)
        return [each for each in lease.leases if outcomes[each.key] is not ReleaseOutcome.RELEASED]
    return [] if lease.release(done) is ReleaseOutcome.RELEASED else [lease]


def carrier(lease: Lease | LeaseSet) -> Lease:
    """The run's lease that carries its completion record (:func:`finish` records it there)."""
    return _carrier(lease)[0] if isinstance(lease, LeaseSet) else lease


def first(lease: Lease | LeaseSet) -> Lease:
    """The run's first lease in canonical order (the one the policy hooks see)."""
    return lease.leases[0] if isinstance(lease, LeaseSet) else lease


def first_lost(leases: Sequence[Lease]) -> Lease:
    """The lease whose loss interrupted the run (the first one lost, in canonical order)."""
    return next((lease for lease in leases if lease.lost.is_set()), leases[0])
