"""The producer's side of ``dedupe`` in one process (no worker): on Redis the marker's
request goes out before Celery builds the message and its answer is read after, before
anything is done with the message (after a send that found a duplicate: before the message
is built); a duplicate sends nothing and calls no publish hook; a send failing before the
answer was read gives the marker back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import _marking
from celery_exclusive.dedupe import QUEUED_SUFFIX
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import get_lock_service
from tests.celery.conftest import BROKER_URL, delete_redis_prefix, uid
from tests.conftest import REDIS_URL, delete_redis_keys, require_server


@pytest.fixture
def sending() -> Iterator[tuple[Any, Any, list[str]]]:
    """An app on the Redis broker and lock store, its deduplicated task, and the events log."""
    require_server(BROKER_URL)
    require_server(REDIS_URL)
    run = uid()
    app = Celery(f"dedupe-send-{run}", broker=BROKER_URL, set_as_current=False)
    events: list[str] = []

    def route(name: str, *_: Any, **__: Any) -> dict[str, Any] | None:
        events.append("route")
        if getattr(app, "fail_routing", False):
            raise RuntimeError("router failed")
        return None

    app.conf.update(
        broker_transport_options={"global_keyprefix": f"cetest-send-{run}:"},
        task_default_queue=f"cetest-send-{run}",
        task_ignore_result=True,
        task_routes=(route,),
        exclusive_url=REDIS_URL,
        exclusive_prefix=f"cetest-send-{run}:lock:",
    )

    def job(n: int) -> int:
        return n

    task = exclusive_task(app=app, key="k:{n}", dedupe=True, name=f"send.{run}")(job)

    def published(**_: Any) -> None:
        events.append("publish")

    celery_signals.before_task_publish.connect(published, weak=False)
    try:
        yield app, task, events
    finally:
        celery_signals.before_task_publish.disconnect(published)
        get_lock_service(app).close()
        delete_redis_prefix(BROKER_URL, f"cetest-send-{run}:")
        delete_redis_keys(f"cetest-send-{run}:")


def _queued(app: Any) -> int:
    client = redis.Redis.from_url(BROKER_URL)
    try:
        prefix = app.conf.broker_transport_options["global_keyprefix"]
        return int(client.llen(prefix + app.conf.task_default_queue))
    finally:
        client.close()


def test_the_answer_is_read_after_the_message_is_built_and_before_its_publish_but_first_after_a_duplicate(
    sending: tuple[Any, Any, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, task, events = sending
    answer = _marking.PendingMark.answer

    def logged(self: _marking.PendingMark) -> Any:
        events.append("answer")
        return answer(self)

    monkeypatch.setattr(_marking.PendingMark, "answer", logged)
    first = task.delay(1)
    assert events == ["route", "answer", "publish"]
    events.clear()
    again = task.delay(1)  # a duplicate: no before_task_publish, nothing published
    assert events == ["route", "answer"]
    assert again.id == first.id
    events.clear()
    assert task.delay(1).id == first.id  # duplicates come in runs: the next reads it first
    assert events == ["answer"]
    events.clear()
    task.delay(4)  # so do new keys: this one was read first (the last send was refused)...
    assert events == ["answer", "route", "publish"]
    events.clear()
    task.delay(5)  # ...and the next overlaps again
    assert events == ["route", "answer", "publish"]
    assert _queued(app) == 3


def test_a_send_failing_before_the_answer_was_read_gives_the_marker_back(
    sending: tuple[Any, Any, list[str]],
) -> None:
    app, task, _ = sending
    app.fail_routing = True
    with pytest.raises(RuntimeError, match="router failed"):
        task.delay(2)
    service = get_lock_service(app)
    assert service.peek("k:2" + QUEUED_SUFFIX) is None
    app.fail_routing = False
    sent = task.delay(2)  # the store's connection was left clean
    assert service.peek("k:2" + QUEUED_SUFFIX) is not None
    assert _queued(app) == 1
    assert task.delay(2).id == sent.id


def test_given_producers_pool_producers_and_a_given_connection_dedupe_alike(
    sending: tuple[Any, Any, list[str]],
) -> None:
    app, task, _ = sending
    with app.connection_for_write() as connection, connection.Producer() as producer:
        first = task.apply_async((3,), producer=producer)
        assert task.apply_async((3,)).id == first.id  # a producer from the app's pool
        assert task.apply_async((3,), connection=connection).id == first.id
        assert task.apply_async((3,), publisher=producer).id == first.id
    assert _queued(app) == 1
