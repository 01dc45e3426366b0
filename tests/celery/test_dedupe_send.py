"""The producer's side of ``dedupe`` in one process (no worker): on Redis the marker's
request goes out before Celery builds the message and its answer is read after, before
anything is done with the message (after a send that found a duplicate: before the message
is built); a duplicate sends nothing and calls no publish hook; a send failing before the
answer was read gives the marker back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import _marking
from celery_exclusive.dedupe import QUEUED_SUFFIX
from celery_exclusive.errors import AlreadyQueued
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


def test_a_callable_on_duplicate_decides_what_a_duplicate_send_returns(
    sending: tuple[Any, Any, list[str]],
) -> None:
    """on_duplicate=callable: called with (task, key, existing AsyncResult) for a duplicate
    only; its return value is what the send returns, and nothing is published."""
    app, _, _ = sending
    calls: list[tuple[Any, str, str]] = []

    def decide(task: Any, key: str, existing: Any) -> str:
        calls.append((task, key, existing.id))
        return f"duplicate of {existing.id}"

    def job(n: int) -> int:
        return n

    task = exclusive_task(
        app=app, key="cb:{n}", dedupe=True, on_duplicate=decide, shared=False, name=f"send.callable.{uid()}"
    )(job)
    first = task.delay(1)
    assert calls == []
    assert task.delay(1) == f"duplicate of {first.id}"
    assert calls == [(task, "cb:1", first.id)]
    assert _queued(app) == 1


def test_a_duplicates_dropped_callbacks_are_said_once_unless_on_duplicate_raises(
    sending: tuple[Any, Any, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """A duplicate with link=/link_error= logs one WARNING per task (a duplicate without
    callbacks none); with on_duplicate="raise" the AlreadyQueued says it and nothing is
    logged; a callable on_duplicate still decides what the send returns. One message each."""
    app, task, _ = sending
    cb = task.si(0)
    first = task.delay(1)
    with caplog.at_level(logging.DEBUG, logger="celery_exclusive.dedupe"):
        assert task.apply_async((1,)).id == first.id
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        for _ in range(3):
            assert task.apply_async((1,), link=cb, link_error=cb).id == first.id
        assert task.apply_async((1,), None, None, None, cb).id == first.id  # link by position
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert task.name in warned[0]
    assert "'k:1'" in warned[0]
    assert first.id in warned[0]
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 3  # the later ones, DEBUG
    caplog.clear()

    def job(n: int) -> int:
        return n

    raising = exclusive_task(
        app=app, key="r:{n}", dedupe=True, on_duplicate="raise", shared=False, name=f"send.raise.{uid()}"
    )(job)
    queued = raising.delay(2)
    with caplog.at_level(logging.WARNING, logger="celery_exclusive.dedupe"):
        with pytest.raises(AlreadyQueued) as refused:
            raising.apply_async((2,), link=cb)
        assert refused.value.task_id == queued.id
        assert caplog.records == []
    deciding = exclusive_task(
        app=app,
        key="d:{n}",
        dedupe=True,
        on_duplicate=lambda _task, _key, existing: existing.id,
        shared=False,
        name=f"send.decide.{uid()}",
    )(job)
    decided = deciding.delay(3)
    with caplog.at_level(logging.WARNING, logger="celery_exclusive.dedupe"):
        assert deciding.apply_async((3,), link_error=cb) == decided.id
    (said,) = [r.getMessage() for r in caplog.records]
    assert "link_error=" in said
    assert "link=" not in said.replace("link_error=", "")
    assert _queued(app) == 3


def test_the_apps_exclusive_dedupe_setting_dedupes_tasks_that_do_not_say(
    sending: tuple[Any, Any, list[str]],
) -> None:
    """app.conf.exclusive_dedupe=True: an exclusive task without a dedupe option dedupes."""
    app, _, _ = sending
    app.conf.exclusive_dedupe = True

    def job(n: int) -> int:
        return n

    task = exclusive_task(app=app, key="conf:{n}", shared=False, name=f"send.by_conf.{uid()}")(job)
    first = task.delay(1)
    assert task.delay(1).id == first.id
    assert _queued(app) == 1


def test_send_task_by_name_is_not_deduplicated(sending: tuple[Any, Any, list[str]]) -> None:
    """app.send_task by name never runs the task's apply_async: it publishes while the key is
    queued (its run is then excluded by the execution lock, like any producer's)."""
    app, task, _ = sending
    first = task.delay(7)
    assert get_lock_service(app).peek("k:7" + QUEUED_SUFFIX) is not None
    other = app.send_task(task.name, (7,))
    assert other.id != first.id
    assert _queued(app) == 2


def test_beat_dedupes_the_entries_of_tasks_it_has_registered_and_not_others(
    sending: tuple[Any, Any, list[str]],
) -> None:
    """celery beat calls a registered task's apply_async (deduplicated) and send_task for a
    name it does not know (not deduplicated): beat's own Scheduler.apply_async, no beat process."""
    from celery.beat import ScheduleEntry, Scheduler

    app, task, _ = sending
    scheduler = Scheduler(app, lazy=True)

    def entry(name: str) -> ScheduleEntry:
        return ScheduleEntry(name="every", task=name, args=(8,), schedule=60.0, app=app)

    first = scheduler.apply_async(entry(task.name), advance=False)
    assert scheduler.apply_async(entry(task.name), advance=False).id == first.id
    assert _queued(app) == 1
    del app.tasks[task.name]  # a beat process that does not import the task
    unknown = scheduler.apply_async(entry(task.name), advance=False)
    assert unknown.id != first.id
    assert _queued(app) == 2


def _queued_ids(app: Any) -> list[str]:
    """The task ids of the messages in the app's default queue."""
    import json

    client = redis.Redis.from_url(BROKER_URL)
    try:
        prefix = app.conf.broker_transport_options["global_keyprefix"]
        raw = client.lrange(prefix + app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    return sorted(json.loads(message)["headers"]["id"] for message in raw)


def test_canvas_members_take_no_marker_and_a_signature_sent_alone_dedupes(
    sending: tuple[Any, Any, list[str]],
) -> None:
    """Celery returns, and a chord counts, the ids it froze for a group's or chain's members and
    ignores what their sends return: a refused member would never complete (its group's or
    chain's get() would wait forever, a chain would lose its later steps). So they are
    published whatever is queued (their runs are excluded at execution); a signature sent
    alone returns its send's result and dedupes."""
    from celery import chain, group

    app, task, _ = sending
    first = task.s(9).delay()
    assert task.s(9).apply_async().id == first.id
    assert _queued_ids(app) == [first.id]
    grouped = group(task.s(9), task.s(9)).apply_async()
    chained = chain(task.s(9), task.si(10)).apply_async()
    members = [result.id for result in grouped.results]
    head = chained.parent.id
    assert _queued_ids(app) == sorted([first.id, *members, head])
    info = get_lock_service(app).peek("k:9" + QUEUED_SUFFIX)
    assert info is not None
    assert info.holder["task_id"] == first.id  # no member took or replaced the marker
