"""Markers of keys as long as the store takes, on every store and a real (embedded) worker.

A queued marker (``dedupe``) lives on ``<key>#queued`` and a pending rerun
(``on_locked="rerun"``) on ``<key>#rerun``: seven and six characters past the key. A key
within that much of the store's longest (with the prefix) must dedupe and rerun all the
same, as its runs work: its marker's key is made to fit (the key's start, a hash of the
whole key, the suffix), the same text in the sender and in the worker that releases it. A
key longer than the store takes is refused at the send, naming the key's own limit.

A semaphore's keys are derived too: slot ``i`` of ``key`` is ``{key}#i``, and a semaphore
task's run also holds ``<key>#id:<task id>``; near the store's longest key they are made to
fit the same way, so ``limit=N`` works on every key its plain lock works on.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from celery_exclusive import InvalidArgumentError, policies, redelivery, signals
from celery_exclusive.dedupe import QUEUED_SUFFIX
from celery_exclusive.policies import RERUN_SUFFIX
from celery_exclusive.task import exclusive_task, is_skipped
from celery_exclusive.worker import close_lock_services, get_lock_service
from tests.celery.conftest import embedded_app, wait_for
from tests.conftest import Store


def test_keys_up_to_the_stores_longest_dedupe_and_run(store: Store) -> None:
    """For the longest key the store takes, and one 3 characters shorter (its marker's key
    would be 4 too long): under until_start and until_done, a second send while the first
    is queued sends nothing and answers the first's id; the worker runs the message and
    frees the key, so the next send queues a new one. One character more is refused at the
    send with InvalidArgumentError, nothing sent."""
    prefix = store.service().prefix
    app = embedded_app(f"ce-long-{store.name}", f"ce-long-{uuid.uuid4().hex[:8]}")
    app.conf.update(exclusive_url=store.url, exclusive_prefix=prefix)
    tag = uuid.uuid4().hex[:8]
    tasks: dict[str, Any] = {}
    for mode in ("until_start", "until_done"):

        def job(k: str) -> int:
            return len(k)

        tasks[mode] = exclusive_task(app=app, key="{k}", dedupe=mode, name=f"long.{mode}.{tag}")(job)
    try:
        service = get_lock_service(app)
        room = service.provider.max_key_length - len(prefix)
        keys = {mode: [f"{mode}-{n}-".ljust(n, "k") for n in (room, room - 3)] for mode in tasks}
        first = {(mode, key): tasks[mode].delay(key) for mode in tasks for key in keys[mode]}
        for (mode, key), sent in first.items():
            assert tasks[mode].delay(key).id == sent.id  # a duplicate: nothing sent
        markers = [info for info in service.locks() if info.key.endswith(QUEUED_SUFFIX)]
        assert len(markers) == len(first)
        assert all(len(prefix + info.key) <= service.provider.max_key_length for info in markers)
        for task in tasks.values():
            with pytest.raises(InvalidArgumentError, match=f"at most {room}"):
                task.delay("x" * (room + 1))
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=30):
            for (_, key), sent in first.items():
                assert sent.get(timeout=30) == len(key)
            again = {(mode, key): tasks[mode].delay(key) for mode, key in first}
            for (mode, key), sent in again.items():
                assert sent.id != first[mode, key].id  # the key was freed: a new message
                assert sent.get(timeout=30) == len(key)
        assert [info for info in service.locks() if info.key.endswith(QUEUED_SUFFIX)] == []
    finally:
        close_lock_services()


def test_a_rerun_of_the_longest_key_is_recorded_and_sent(store: Store) -> None:
    """A run of the longest key the store takes, finding it held by a rerun-policy run,
    records its rerun (coalesced) instead of failing on its marker's key; the holder sends
    the rerun when it ends, and the rerun runs."""
    prefix = store.service().prefix
    app = embedded_app(f"ce-long-rerun-{store.name}", f"ce-long-rerun-{uuid.uuid4().hex[:8]}")
    app.conf.update(exclusive_url=store.url, exclusive_prefix=prefix)
    started, go = threading.Event(), threading.Event()
    runs: list[str] = []

    def job(k: str) -> int:
        runs.append(k)
        started.set()
        assert go.wait(30)
        return len(runs)

    name = f"long.rerun.{uuid.uuid4().hex[:8]}"
    task = exclusive_task(app=app, key="{k}", on_locked="rerun", name=name)(job)
    try:
        service = get_lock_service(app)
        key = "rerun-".ljust(service.provider.max_key_length - len(prefix), "k")
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=30):
            first = task.delay(key)
            assert started.wait(30)
            second = task.delay(key)
            assert is_skipped(second.get(timeout=30))  # coalesced: its rerun recorded
            assert [info.key[-len(RERUN_SUFFIX) :] for info in service.locks() if info.key != key] == [
                RERUN_SUFFIX
            ]
            go.set()
            assert first.get(timeout=30) == 1
            wait_for(lambda: len(runs) == 2, 30, what="the rerun")
            wait_for(lambda: service.peek(key) is None, 30, what="the rerun's release")
        assert service.locks() == []
    finally:
        go.set()
        close_lock_services()


def test_a_semaphore_of_keys_up_to_the_stores_longest_holds_its_limit(store: Store) -> None:
    """``limit=3`` on the longest key the store takes and on keys 1, 3 and 4 characters
    shorter (slot ``i``, ``{key}#i``, is 3 + len(i) characters past the key): three leases at
    once, each on a store key the store takes, a fourth refused (also after waiting), the
    slots free again once released. A key with room for its slot keys keeps their names
    (``{key}#2``); one with none gets slot keys made to fit, the same in another service.
    One character more than the store takes is refused naming the key's own limit."""
    service, other = store.service(), store.service()
    prefix, longest = service.prefix, service.provider.max_key_length
    room = longest - len(prefix)
    for n in (room, room - 1, room - 3, room - 4):
        key = f"sem-{n}-".ljust(n, "k")
        leases = [service.lock(key, ttl=30, limit=3) for _ in range(3)]
        assert all(lease.key == key for lease in leases)
        slots = sorted(lease.store_key[len(prefix) :] for lease in leases)
        assert len(set(slots)) == 3
        assert all(len(prefix + slot) <= longest for slot in slots)
        if n <= room - 4:
            assert slots == sorted([key, f"{{{key}}}#2", f"{{{key}}}#3"])
        assert other.try_lock(key, ttl=30, limit=3) is None
        assert other.try_lock(key, ttl=30, limit=3, wait=0.2) is None
        assert sorted(info.key for info in other.locks(key[:10])) == slots
        leases[1].release()
        again = other.lock(key, ttl=30, limit=3)
        assert again.store_key == leases[1].store_key
        for lease in (leases[0], leases[2], again):
            lease.release()
        assert other.locks(key[:10]) == []
    with pytest.raises(InvalidArgumentError, match=f"at most {room}"):
        service.lock("x" * (room + 1), limit=3)


def test_a_semaphore_task_of_the_longest_key_holds_its_slots_and_task_id_leases(store: Store) -> None:
    """An exclusive task with ``limit=3`` on the longest key the store takes, and on one 5
    characters shorter (its slot keys fit as they are, its run's task-id lease's key does
    not): three runs at once, each holding a slot and the lease on its own task id
    (``<key>#id:<task id>``, made to fit the store); a copy of a running message finds that
    lease and does not run (``redelivered``); a fourth run is skipped; all end and leave
    nothing behind."""
    prefix = store.service().prefix
    app = embedded_app(f"ce-long-sem-{store.name}", f"ce-long-sem-{uuid.uuid4().hex[:8]}")
    app.conf.update(exclusive_url=store.url, exclusive_prefix=prefix)
    go = threading.Event()
    running: list[str] = []
    reasons: list[str] = []

    def job(k: str) -> int:
        running.append(k)
        assert go.wait(30)
        return len(k)

    def skipped(sender: Any = None, reason: str = "", **_: Any) -> None:
        reasons.append(reason)

    task = exclusive_task(app=app, key="{k}", limit=3, name=f"long.sem.{uuid.uuid4().hex[:8]}")(job)
    signals.task_skipped.connect(skipped, weak=False)
    try:
        service = get_lock_service(app)
        longest = service.provider.max_key_length
        room = longest - len(prefix)
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=30):
            for n in (room, room - 5):
                go.clear()
                running.clear()
                reasons.clear()
                key = f"sem-{n}-".ljust(n, "k")
                runs = [task.delay(key) for _ in range(3)]
                wait_for(lambda: len(running) == 3, 30, what="three runs")
                held = [info.key for info in service.locks()]
                assert len(held) == 6
                assert all(len(prefix + each) <= longest for each in held)
                guards = [
                    each.rsplit(redelivery.GUARD_INFIX, 1) for each in held if redelivery.GUARD_INFIX in each
                ]
                assert sorted(task_id for _, task_id in guards) == sorted(run.id for run in runs)
                task.apply_async((key,), task_id=runs[0].id)  # a copy of a running message
                wait_for(lambda: reasons == [redelivery.REDELIVERED], 30, what="the copy's end")
                assert is_skipped(task.delay(key).get(timeout=30))
                go.set()
                assert [run.get(timeout=30) for run in runs] == [n] * 3
                assert len(running) == 3
                wait_for(lambda: service.locks() == [], 30, what="the releases")
    finally:
        signals.task_skipped.disconnect(skipped)
        go.set()
        close_lock_services()


def test_a_rerun_of_the_longest_key_behind_an_earlier_versions_holder_is_not_lost(store: Store) -> None:
    """A run of an earlier version holds the longest key the store takes: its holder metadata
    says it hands on reruns, but it looks for them on ``<key>#rerun``, which the store does
    not take, never on the marker made to fit. A rerun-policy run finding it held does not
    coalesce behind it (nobody would send that rerun: it was lost); it waits its turn like
    ``"retry"`` and runs once the holder releases. Behind a holder of this version it
    coalesces (the rerun test above)."""
    prefix = store.service().prefix
    app = embedded_app(f"ce-long-old-{store.name}", f"ce-long-old-{uuid.uuid4().hex[:8]}")
    app.conf.update(exclusive_url=store.url, exclusive_prefix=prefix)
    runs: list[str] = []
    contended = threading.Event()

    def job(k: str) -> int:
        runs.append(k)
        return len(runs)

    name = f"long.old.{uuid.uuid4().hex[:8]}"
    task = exclusive_task(app=app, key="{k}", on_locked="rerun", lock_retry_backoff=0.1, name=name)(job)
    try:
        service = get_lock_service(app)
        key = "old-".ljust(service.provider.max_key_length - len(prefix), "k")

        def refused(sender: Any = None, **kwargs: Any) -> None:  # held (before: coalesced)
            if kwargs.get("key") == key:
                contended.set()

        earlier = {"task_name": name, "task_id": uuid.uuid4().hex, policies.HANDS_ON_RERUNS: True}
        lease = service.lock(key, ttl=60, holder=earlier)
        signals.task_skipped.connect(refused, weak=False)
        signals.lock_contended.connect(refused, weak=False)
        try:
            with start_worker(
                app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=30
            ):
                sent = task.delay(key)
                assert contended.wait(30)
                lease.release()  # as the earlier version's run ends: it hands nothing on
                result = sent.get(timeout=30)
                assert not is_skipped(result), result
                assert runs == [key]
                wait_for(lambda: service.locks() == [], 30, what="the run's release")
        finally:
            signals.task_skipped.disconnect(refused)
            signals.lock_contended.disconnect(refused)
    finally:
        close_lock_services()
