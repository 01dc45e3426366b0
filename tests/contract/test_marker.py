"""``LockService.mark``: a detached lease (no heartbeat) on every store, the rerun marker's home.

A marker is taken once, lives for its ttl whatever its writer does (no refresh, no release at
close), and is deleted by whoever ``force_release``s its token.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_exclusive import BackendError, InvalidArgumentError, LockedError, LockService
from celery_exclusive.providers.base import AcquiresUnless, Held
from celery_exclusive.testing.contract import OUTAGE_SECRET
from celery_exclusive.validation import GUARD_INFIX, QUEUED_SUFFIX, RERUN_SUFFIX, derived_key
from tests.conftest import TIME_SLACK, Store


def test_mark_takes_the_key_once_with_its_holder_and_no_heartbeat(store: Store) -> None:
    """The first mark gets a token, the key reads as held with its metadata; it is no lease
    of the service; later marks and locks find it held; force_release with the token frees it."""
    service, other = store.service(), store.service()
    token = service.mark("m", ttl=60, holder={"rerun": {"args": [1]}})
    assert isinstance(token, str)
    assert token
    assert service.held() == []
    info = other.peek("m")
    assert info is not None
    assert (info.key, info.token) == ("m", token)
    assert info.holder["rerun"] == {"args": [1]}
    assert info.holder["pid"] == os.getpid()
    assert 0 < info.expires_in <= 60
    assert other.mark("m", ttl=60) is None
    assert service.mark("m", ttl=60) is None  # not re-entrant either
    with pytest.raises(LockedError) as held:
        other.lock("m")
    assert held.value.holder is not None
    assert held.value.holder.token == token
    assert not other.force_release("m", "some-other-token")
    assert other.force_release("m", token)
    assert other.peek("m") is None
    again = other.mark("m", ttl=60)
    assert again is not None
    assert again != token


def test_a_mark_outlives_its_service_and_expires_after_its_ttl(store: Store) -> None:
    """Closing the writer's service leaves the marker; nothing refreshes it past its ttl (0.6 s
    x the time slack: a loaded machine's close can outlast 0.6 s)."""
    writer, reader = store.service(), store.service()
    ttl = 0.6 * store.slack
    assert writer.mark("short", ttl=ttl) is not None
    writer.close(release=True)
    assert reader.peek("short") is not None
    time.sleep(ttl + 0.4)
    assert reader.peek("short") is None
    assert reader.mark("short", ttl=ttl) is not None


def test_mark_defaults_to_the_service_max_lifetime(store: Store) -> None:
    """Without ttl the marker lives the service's max_lifetime."""
    service = store.service(ttl=30, max_lifetime=120)
    assert service.mark("long") is not None
    info = service.peek("long")
    assert info is not None
    assert 60 < info.expires_in <= 120


def test_mark_on_a_held_key_answers_none_and_leaves_the_lease(store: Store) -> None:
    """A key held by a lease is not marked; the lease keeps it."""
    service = store.service()
    lease = service.lock("busy")
    assert service.mark("busy", ttl=60) is None
    assert lease.held
    peeked = service.peek("busy")
    assert peeked is not None
    assert peeked.token == lease.token
    lease.release()


@pytest.mark.parametrize(
    ("key", "kwargs", "message"),
    [
        ("", {}, "must not be empty"),
        ("k\x00", {}, "NUL"),
        ("k", {"ttl": 0}, "ttl must be a positive"),
        ("k", {"ttl": "60"}, "ttl must be seconds"),
        ("k", {"ttl": 25 * 3600}, "hard cap is 24 h"),
        ("k", {"holder": ["not", "a", "mapping"]}, "holder must be a mapping"),
    ],
)
def test_mark_rejects_bad_input_before_the_store(key: str, kwargs: dict[str, object], message: str) -> None:
    """Bad input is an InvalidArgumentError even on a store that cannot be reached."""
    service = LockService(f"redis://:{OUTAGE_SECRET}@127.0.0.1:1/0")
    try:
        with pytest.raises(InvalidArgumentError, match=message):
            service.mark(key, **kwargs)  # type: ignore[arg-type]
    finally:
        service.close()


def test_mark_on_an_unreachable_store_is_a_backend_error(store: Store) -> None:
    """An outage is a BackendError, never "held" (None), and names no credential."""
    if store.outage is None:
        pytest.skip(f"store {store.name!r} cannot be unreachable")
    service = store.outage()
    try:
        with pytest.raises(BackendError) as failed:
            service.mark("k", ttl=60)
        assert OUTAGE_SECRET not in str(failed.value)
    finally:
        service.close()


def test_mark_on_a_closed_service_is_refused() -> None:
    """A closed service takes no marker."""
    service = LockService("memory://")
    service.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        service.mark("k", ttl=60)


def test_lock_and_mark_store_the_holder_over_host_and_pid(store: Store) -> None:
    """The stored holder is this process's host and pid overridden by the caller's mapping,
    values JSON cannot hold written as their str (the service's prebuilt encoder)."""
    service, other = store.service(), store.service()
    odd = {"host": "elsewhere", "when": time.gmtime(0)[:2], "obj": InvalidArgumentError("x"), "é": "ü"}
    expected = {"host": "elsewhere", "pid": os.getpid(), "when": [1970, 1], "obj": "x", "é": "ü"}
    with service.lock("h", holder=odd):
        info = other.peek("h")
        assert info is not None
        assert info.holder == expected
    assert service.mark("hm", ttl=60, holder=odd) is not None
    marked = other.peek("hm")
    assert marked is not None
    assert marked.holder == expected
    with pytest.raises(InvalidArgumentError, match="holder must be a mapping"):
        service.lock("h", holder={1: "int key"})  # type: ignore[dict-item]


def test_try_mark_answers_who_holds_and_is_refused_while_unless_is_held(store: Store) -> None:
    """try_mark names the holder that refused it: the lease on ``unless`` first, else the
    marker's; ``unless`` free, the marker is taken; a plain held ``unless`` takes nothing."""
    service, other = store.service(), store.service()
    run = other.lock("job")
    refused = service.try_mark("job#queued", ttl=60, holder={"task_id": "b"}, unless="job")
    assert isinstance(refused, Held)
    assert refused.holder is not None
    assert (refused.holder.key, refused.holder.token) == ("job", run.token)
    assert service.peek("job#queued") is None  # nothing was taken
    run.release()
    token = service.try_mark("job#queued", ttl=60, holder={"task_id": "a"}, unless="job")
    assert isinstance(token, str)
    queued = other.try_mark("job#queued", ttl=60, unless="job")
    assert isinstance(queued, Held)
    assert queued.holder is not None
    assert (queued.holder.key, queued.holder.token) == ("job#queued", token)
    assert queued.holder.holder["task_id"] == "a"
    run = other.lock("job")  # the run starts while its marker still exists: the run wins
    both = other.try_mark("job#queued", ttl=60, unless="job")
    assert isinstance(both, Held)
    assert both.holder is not None
    assert both.holder.key == "job"
    assert service.force_release("job#queued", token)
    run.release()
    assert isinstance(other.try_mark("plain", ttl=60), str)
    answer = service.try_mark("plain", ttl=60)
    assert isinstance(answer, Held)
    assert answer.holder is not None
    assert answer.holder.key == "plain"


def test_try_mark_checks_unless_before_the_store() -> None:
    """A bad ``unless`` key is an InvalidArgumentError even on an unreachable store."""
    service = LockService(f"redis://:{OUTAGE_SECRET}@127.0.0.1:1/0")
    try:
        with pytest.raises(InvalidArgumentError, match="NUL"):
            service.try_mark("k", ttl=60, unless="k\x00")
    finally:
        service.close()


def _counted(monkeypatch: pytest.MonkeyPatch, provider: Any) -> Counter[str]:
    """Every call the service makes to ``provider``'s store methods, counted by name."""
    calls: Counter[str] = Counter()
    for name in ("acquire", "acquire_unless", "acquire_any", "peek", "release", "scan", "refresh"):
        method = getattr(provider, name, None)
        if method is None:
            continue

        def counting(
            *args: Any, _name: str = name, _method: Callable[..., Any] = method, **kwargs: Any
        ) -> Any:
            calls[_name] += 1
            return _method(*args, **kwargs)

        monkeypatch.setattr(provider, name, counting)
    return calls


def test_try_mark_unless_is_one_store_call_naming_the_task_that_refused_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every store of ours checks ``unless`` in the same operation (``AcquiresUnless``: Redis one
    script, memory one mutex hold, PostgreSQL one statement, SQLite and MariaDB one
    transaction): a granted, a run-refused and a marker-refused ``try_mark(unless=)`` are each
    one provider call, and the refusal names the task id of the holder that refused it."""
    service, other = store.service(), store.service()
    assert isinstance(service.provider, AcquiresUnless)
    calls = _counted(monkeypatch, service.provider)
    token = service.try_mark("job#queued", ttl=60, holder={"task_id": "queued-a"}, unless="job")
    assert isinstance(token, str)
    assert calls == {"acquire_unless": 1}
    calls.clear()
    queued = service.try_mark("job#queued", ttl=60, holder={"task_id": "b"}, unless="job")
    assert isinstance(queued, Held)
    assert queued.holder is not None
    assert (queued.holder.key, queued.holder.holder["task_id"]) == ("job#queued", "queued-a")
    assert calls == {"acquire_unless": 1}
    run = other.lock("job", holder={"task_id": "running-r"})
    assert other.force_release("job#queued", token)  # the run took over from its marker
    calls.clear()
    running = service.try_mark("job#queued", ttl=60, holder={"task_id": "c"}, unless="job")
    assert isinstance(running, Held)
    assert running.holder is not None
    assert (running.holder.key, running.holder.holder["task_id"]) == ("job", "running-r")
    assert calls == {"acquire_unless": 1}
    assert other.peek("job#queued") is None  # refused: nothing taken
    run.release()


def test_begin_mark_sends_at_once_and_answers_as_try_mark(store: Store) -> None:
    """``begin_mark``'s request is in the store before its answer is read (Redis: not read
    yet, ``ready`` False; the others answer at once); the answers are try_mark's, with the
    caller's token, ``unless`` included."""
    service, other = store.service(), store.service()
    pending = service.begin_mark("b", ttl=60, holder={"task_id": "t1"}, token="tok-1")
    assert pending.ready is (store.name != "redis")
    deadline = time.monotonic() + 5 * store.slack
    while other.peek("b") is None:  # the request went out without waiting for its answer
        assert time.monotonic() < deadline, "the marker never appeared before answer()"
        time.sleep(0.005)
    assert pending.answer() == "tok-1"
    refused = other.begin_mark("b", ttl=60, token="tok-2").answer()
    assert isinstance(refused, Held)
    assert refused.holder is not None
    assert (refused.holder.key, refused.holder.token, refused.holder.holder["task_id"]) == (
        "b",
        "tok-1",
        "t1",
    )
    with other.lock("run"):
        blocked = service.begin_mark("c", ttl=60, unless="run", token="tok-3").answer()
        assert isinstance(blocked, Held)
        assert blocked.holder is not None
        assert blocked.holder.key == "run"
    assert other.peek("c") is None
    assert service.begin_mark("c", ttl=60, unless="run", token="tok-4").answer() == "tok-4"
    with pytest.raises(InvalidArgumentError, match="hard cap"):
        service.begin_mark("d", ttl=2 * 86400, token="tok-5")


def test_begin_mark_answer_within_the_call_timeout_when_redis_goes_silent() -> None:
    """Redis stalls after the request went out: ``answer()`` raises BackendError by the
    call's deadline (counted from the send), and the next call works once it answers again."""
    from tests.conftest import REDIS_URL, delete_redis_keys, require_server
    from tests.faults.servers import TcpProxy

    require_server(REDIS_URL)
    proxy = TcpProxy(urlsplit(REDIS_URL).port or 6379)
    prefix = f"tbm{os.getpid()}-{time.monotonic_ns()}:"
    service = LockService(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix, call_timeout=0.5)
    try:
        assert service.begin_mark("warm", ttl=5, token="w").answer() == "w"  # connected
        proxy.stall()
        pending = service.begin_mark("k", ttl=5, token="t")
        started = time.monotonic()
        with pytest.raises(BackendError):
            pending.answer()
        assert time.monotonic() - started < 0.5 * TIME_SLACK + 0.5
        proxy.resume()
        assert service.peek("warm") is not None
    finally:
        proxy.resume()
        service.close()
        proxy.close()
        delete_redis_keys(prefix)


def test_locks_by_a_long_key_include_its_hashed_markers(store: Store) -> None:
    """A key too long for ``<key>#queued``, ``#rerun`` or ``#id:<task id>`` has markers
    ``<start>~<hash><suffix>``, which keep only the key's start: locks() by the key itself
    lists them (by the key's hash), and so does locks() by a longer start than the one kept
    for a key whose own lease it lists; never the markers of another long key that shares
    the kept start."""
    service = store.service()
    limit = service.provider.max_key_length
    longest = limit - len(service.prefix)
    base = f"long-{uuid.uuid4().hex[:8]}-"
    first, second, third = (base + "k" * (longest - len(base) - 1) + end for end in "abc")
    task_id = str(uuid.uuid4())

    def marker(key: str, suffix: str) -> str:
        return derived_key(key, suffix, prefix=service.prefix, max_length=limit)

    first_queued, second_rerun = marker(first, QUEUED_SUFFIX), marker(second, RERUN_SUFFIX)
    third_guard = marker(third, GUARD_INFIX + task_id)
    markers = (first_queued, second_rerun, third_guard)
    assert all("~" in key and not key.startswith(first[:-1]) for key in markers)
    tokens = {key: service.mark(key, ttl=60) for key in markers}
    held = [service.lock(key, ttl=30) for key in (second, third)]  # first is only queued
    try:

        def listed(prefix: str) -> list[str]:
            return [info.key for info in service.locks(prefix)]

        assert listed(first) == [first_queued]
        assert listed(second) == [second, second_rerun]
        assert listed(third) == [third, third_guard]
        # A start longer than the markers keep: the markers of the keys held under it.
        assert listed(first[:-1]) == [second, second_rerun, third, third_guard]
        assert sorted(listed(base)) == sorted([*markers, second, third])
        assert listed(first + "x") == []
    finally:
        for lease in held:
            lease.release()
        for key, token in tokens.items():
            assert token is not None
            service.force_release(key, token)
