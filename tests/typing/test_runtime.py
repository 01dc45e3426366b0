"""The spellings that tests/typing/check_exclusive_task.py checks statically also run."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from celery_exclusive import ExclusiveTask, exclusive_task, is_skipped


def test_generic_subclass_and_typed_decorator_run_eagerly() -> None:
    app = Celery(f"ce_typing_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(exclusive_url="memory://", task_always_eager=True)

    class Subclassed(ExclusiveTask[[int], str]):
        name = f"{app.main}.subclassed"
        lock_key = "sub:{n}"

        def run(self, n: int) -> str:
            return str(n)

    task = app.register_task(Subclassed())
    assert task.delay(3).get() == "3"

    @exclusive_task(app=app, key="bound:{n}", bind=True, name=f"{app.main}.bound")
    def bound(self: ExclusiveTask[Any, Any], n: int) -> int:
        assert self.lock is not None
        return n

    assert isinstance(bound, ExclusiveTask)
    assert bound(4) == 4
    assert bound.delay(5).get() == 5
    assert not is_skipped(bound.delay(6).get())
