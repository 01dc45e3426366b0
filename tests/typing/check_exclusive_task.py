"""Static typing of the public API, checked by mypy (never imported by pytest).

scripts/test runs mypy on this module twice: with celery-types (``--always-true
CELERY_TYPES``) and as a project without them sees it (``--no-site-packages
--always-false CELERY_TYPES``: Celery is then ``Any``). ``assert_type`` fails mypy on a
wrong inferred type; each ``# type: ignore[code]`` line is a call that MUST be rejected,
because ``warn_unused_ignores`` (part of --strict) fails mypy if it is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from typing_extensions import assert_type

from celery_exclusive import ExclusiveTask, Lease, LeaseSet, exclusive_task, is_skipped

#: True in the mypy run with celery-types installed, False in the run without.
CELERY_TYPES = True

app = Celery("typing")


@exclusive_task
def bare(item: int, label: str = "") -> float:
    return float(item)


@exclusive_task(key="sync:{work_id}", on_locked="skip", app=app, max_retries=3, acks_late=True)
def unbound(work_id: int) -> list[int]:
    return [work_id]


@exclusive_task(key="sync:{work_id}", bind=True, on_lost="raise")
def bound(self: ExclusiveTask[Any, Any], work_id: int, *, force: bool = False) -> str:
    assert_type(self.lock, Lease | None)
    return str(work_id)


@exclusive_task(key=["tenant:{tenant}", "resource:{resource}"], bind=True)
def several(self: ExclusiveTask[Any, Any], tenant: str, resource: int) -> dict[str, int]:
    assert_type(self.locks, LeaseSet | None)
    return {} if self.locks is None else self.locks.fences


@exclusive_task(key=lambda ids: [f"item:{i}" for i in ids])
def from_ids(ids: list[int]) -> None:
    pass


assert_type(several.lock_keys_for(("acme", 1)), list[str])


@exclusive_task()
def empty_call() -> None:
    pass


# Direct calls: parameters and result types survive the decorator.
assert_type(bare(1), float)
assert_type(bare(1, label="x"), float)
assert_type(unbound(2), list[int])
assert_type(bound(3, force=True), str)
assert_type(empty_call(), None)
bare("1")  # type: ignore[arg-type]
bare(1, 2)  # type: ignore[arg-type]
bare()  # type: ignore[call-arg]
unbound(work_id="2")  # type: ignore[arg-type]
bound(self=None, work_id=3)  # type: ignore[call-arg]
empty_call(1)  # type: ignore[call-arg]

# delay() and si() check arguments against the body's parameters.
bare.delay(1, "x")
unbound.delay(work_id=2)
bound.si(3, force=False)
bare.delay("1")  # type: ignore[arg-type]
unbound.delay()  # type: ignore[call-arg]
bound.delay(3, force="yes")  # type: ignore[arg-type]
bound.si("3")  # type: ignore[arg-type]


# The bound form needs a first parameter for the task.
@exclusive_task(bind=True)  # type: ignore[arg-type]
def bound_without_self() -> None:
    pass


def not_a_result(value: object) -> None:
    if is_skipped(value):
        assert_type(value, Mapping[str, Any])


# app.task(base=ExclusiveTask): celery-types types it as the base class; annotate it.
def via_base(work_id: int) -> int:
    return work_id


based: ExclusiveTask[[int], int] = app.task(base=ExclusiveTask, lock_key="b:{work_id}")(via_base)
assert_type(based(1), int)
based.delay("1")  # type: ignore[arg-type]


class Subclassed(ExclusiveTask[[int], str]):
    lock_key = "sub:{n}"

    def run(self, n: int) -> str:
        return str(n)


assert_type(Subclassed()(1), str)

if CELERY_TYPES:
    # Only celery-types types AsyncResult, Signature and apply_async's options.
    from celery.canvas import Signature
    from celery.result import AsyncResult

    assert_type(bare.delay(1), AsyncResult[float])
    assert_type(unbound.delay(2).get(), list[int])
    assert_type(bound.si(3), Signature[str])
    assert_type(unbound.apply_async((2,), countdown=1.5, queue="q"), AsyncResult[list[int]])
    unbound.apply_async((2,), countdown="soon")  # type: ignore[arg-type]
    assert_type(based.delay(1).get(), int)
