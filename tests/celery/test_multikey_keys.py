"""Several keys per task, without a worker: the key spec's checks at declaration and at call
time, and direct calls on the memory store (all or none, self.lock / self.locks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_exclusive import InvalidArgumentError, LockedError, get_lock_service
from celery_exclusive.task import ExclusiveTask, exclusive_task, is_skipped


@pytest.fixture
def app() -> Iterator[Celery]:
    """A throwaway app on a fresh memory store."""
    app = Celery("ce_multikey", set_as_current=False, broker="memory://")
    app.conf.exclusive_url = "memory://"
    yield app
    if str(app.conf.exclusive_url).startswith("memory"):
        get_lock_service(app).close()


def test_a_key_list_gives_sorted_keys_and_lock_key_for_refuses_it(app: Celery) -> None:
    """Templates are filled from the bound arguments and sorted (the order lock_many takes
    them in); lock_key_for, which names one key, refuses a call with several."""

    @exclusive_task(app=app, shared=False, key=["tenant:{tenant}", "resource:{resource}"])
    def move(tenant: str, resource: int = 7) -> None: ...

    assert move.lock_keys_for(("acme",)) == ["resource:7", "tenant:acme"]
    assert move.lock_keys_for((), {"tenant": "acme", "resource": 7}) == ["resource:7", "tenant:acme"]
    with pytest.raises(InvalidArgumentError, match=r"several lock keys.*lock_keys_for"):
        move.lock_key_for(("acme",))


def test_a_single_key_task_is_unchanged(app: Celery) -> None:
    """A str key (or a callable returning one key, or a list of one) gives that one key."""

    @exclusive_task(app=app, shared=False, key="pr:{n}")
    def one(n: int) -> None: ...

    @exclusive_task(app=app, shared=False, key=lambda n: [f"pr:{n}"])
    def listed(n: int) -> None: ...

    assert one.lock_key_for((1,)) == "pr:1"
    assert one.lock_keys_for((1,)) == ["pr:1"]
    assert listed.lock_key_for((1,)) == "pr:1"


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ([], "must not be empty"),
        (["a:{n}", "a:{n}"], "repeats a template"),
        (["a:{n}", "b:{n"], "malformed"),
        (["a:{n}", "b:{m}"], "no parameter 'm'"),
        (["a:{n}", 3], "or a callable, got int"),
        ([f"k{i}:{{n}}" for i in range(65)], "at most 64"),
    ],
)
def test_a_bad_key_list_is_refused_at_declaration(app: Celery, key: Any, match: str) -> None:
    """Every template of a list is checked when the decorator runs."""
    with pytest.raises(InvalidArgumentError, match=match):

        @exclusive_task(app=app, shared=False, key=key)
        def bad(n: int) -> None: ...


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"on_locked": "rerun"}, "rerun"),
        ({"cooldown": 2}, "cooldown"),
        ({"dedupe": True}, "dedupe"),
        ({"limit": 2}, "limit=2"),
    ],
)
def test_options_that_name_one_key_are_refused_with_a_key_list(
    app: Celery, options: dict[str, Any], match: str
) -> None:
    """rerun, cooldown, dedupe and a semaphore (limit > 1) act on one key: refused with
    several, naming the task."""
    with pytest.raises(InvalidArgumentError, match=f"ce_multikey.t_refused has several lock keys.*{match}"):

        @exclusive_task(
            app=app, shared=False, key=["a:{n}", "b:{n}"], name="ce_multikey.t_refused", **options
        )
        def refused(n: int) -> None: ...


def test_the_class_form_refuses_them_too(app: Celery) -> None:
    """lock_key as a list on an ExclusiveTask subclass: checked when the class is made."""
    with pytest.raises(InvalidArgumentError, match=r"several lock keys.*rerun"):

        class Sync(ExclusiveTask):  # type: ignore[misc]
            lock_key = ("a:{n}", "b:{n}")
            lock_on_locked = "rerun"

            def run(self, n: int) -> None: ...


@pytest.mark.parametrize(
    ("ids", "match"),
    [([], "must not be empty"), (["x", "x"], "repeated: \\['k:x'\\]"), (list(range(65)), "at most 64")],
)
def test_a_bad_key_list_from_a_callable_is_refused_before_the_store(
    app: Celery, ids: list[Any], match: str
) -> None:
    """At call time, naming the task, on a store that is not even reachable: nothing is asked of it."""
    app.conf.exclusive_url = "redis://127.0.0.1:1/0"

    @exclusive_task(
        app=app, shared=False, key=lambda ids: [f"k:{i}" for i in ids], name="ce_multikey.from_ids"
    )
    def from_ids(ids: list[Any]) -> None: ...

    with pytest.raises(InvalidArgumentError, match=f"the lock keys of ce_multikey.from_ids: .*{match}"):
        from_ids(ids)


def test_an_app_wide_rerun_policy_is_refused_at_call_time(app: Celery) -> None:
    """Settings known only at call time (the app's on_locked) are checked before the store."""
    app.conf.exclusive_on_locked = "rerun"

    @exclusive_task(app=app, shared=False, key=lambda a, b: [a, b])
    def pair(a: str, b: str) -> None: ...

    with pytest.raises(InvalidArgumentError, match=r"several lock keys.*rerun"):
        pair("x", "y")


def test_an_app_wide_limit_is_refused_at_call_time_before_the_store(app: Celery) -> None:
    """exclusive_limit > 1 from the app with a callable giving several keys: refused at the
    call, naming the task, on a store that is not even reachable; limit=1 is no semaphore."""
    app.conf.exclusive_url = "redis://127.0.0.1:1/0"
    app.conf.exclusive_limit = 3

    @exclusive_task(app=app, shared=False, key=lambda a, b: [a, b], name="ce_multikey.pair_limited")
    def pair(a: str, b: str) -> None: ...

    with pytest.raises(
        InvalidArgumentError, match=r"ce_multikey.pair_limited has several lock keys.*limit=3"
    ):
        pair("x", "y")

    @exclusive_task(app=app, shared=False, key=["a:{n}", "b:{n}"], limit=1, name="ce_multikey.limit_one")
    def limit_one(n: int) -> None: ...


def test_a_direct_call_holds_every_key_or_none(app: Celery) -> None:
    """The body sees every lease (self.locks, canonical order; self.lock is the first key's);
    with one key held elsewhere the call skips naming it and leaves the other free."""

    @exclusive_task(app=app, shared=False, key=["tenant:{tenant}", "resource:{resource}"], bind=True)
    def move(self: Any, tenant: str, resource: str) -> dict[str, Any]:
        assert self.lock is self.locks.leases[0]
        self.locks.check()
        return {"keys": self.locks.keys, "held": [info.key for info in self.lock_service.locks()]}

    service = get_lock_service(app)
    ran = move("acme", "db")
    assert ran == {"keys": ["resource:db", "tenant:acme"], "held": ["resource:db", "tenant:acme"]}
    assert service.locks() == []
    with service.lock("tenant:acme", holder={"task_id": "elsewhere"}):
        skipped = move("acme", "db")
        assert service.peek("resource:db") is None
    assert is_skipped(skipped)
    assert skipped["key"] == "tenant:acme"
    assert skipped["holder"]["task_id"] == "elsewhere"


def test_raise_names_the_refused_key(app: Celery) -> None:
    """on_locked="raise" with several keys: LockedError names the key that was held."""

    @exclusive_task(app=app, shared=False, key=lambda ids: [f"r:{i}" for i in ids], on_locked="raise")
    def batch(ids: list[int]) -> str:
        return "ran"

    service = get_lock_service(app)
    with service.lock("r:2"), pytest.raises(LockedError) as caught:
        batch([3, 2, 1])
    assert caught.value.key == "r:2"
    assert service.locks() == []
    assert batch([3, 2, 1]) == "ran"


def test_wait_takes_the_whole_set_once_the_refused_key_is_released(app: Celery) -> None:
    """on_locked="wait" with several keys: waits on the refused key holding nothing, then
    takes every key once that key is released."""

    @exclusive_task(app=app, shared=False, key=["w:{a}", "w:{b}"], on_locked="wait", lock_wait=10, bind=True)
    def pair(self: Any, a: str, b: str) -> list[str]:
        return list(self.locks.keys)

    service = get_lock_service(app)
    lease = service.lock("w:y")
    seen_free: list[bool] = []

    def release_later() -> None:
        time.sleep(0.5)
        seen_free.append(service.peek("w:x") is None)  # the waiter holds nothing meanwhile
        lease.release()

    releaser = threading.Thread(target=release_later)
    releaser.start()
    started = time.monotonic()
    try:
        assert pair("y", "x") == ["w:x", "w:y"]
    finally:
        releaser.join()
    assert seen_free == [True]
    assert 0.4 < time.monotonic() - started < 5
    assert service.locks() == []
