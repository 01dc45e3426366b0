"""How an acquire registers its lease with a running heartbeat (heartbeat.py ``add``): without
its mutex, the thread taking the lease in at its next pass (issue #16)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from celery_exclusive import LockService


def test_an_acquire_does_not_wait_for_the_heartbeats_mutex_while_its_thread_runs() -> None:
    """With the heartbeat thread running, lock() returns while another thread holds the
    heartbeat's mutex; the lease is kept (``held()``) once the mutex is free."""
    service = LockService("memory://", prefix="hb-add:")
    try:
        first = service.lock("first")  # starts the heartbeat thread
        assert service.heartbeat.running
        taken, free = threading.Event(), threading.Event()

        def hold_the_mutex() -> None:
            with service.heartbeat.mutex:
                taken.set()
                free.wait(30)

        holder = threading.Thread(target=hold_the_mutex, daemon=True)
        holder.start()
        assert taken.wait(10)
        started = time.monotonic()
        result: list[object] = []
        locker = threading.Thread(target=lambda: result.append(service.lock("second")), daemon=True)
        locker.start()
        locker.join(10)  # before: add() waited for the mutex, i.e. until free.set() below
        waited = time.monotonic() - started
        free.set()
        holder.join(10)
        assert result, f"lock() still waited for the heartbeat's mutex after {waited:.1f} s"
        second = result[0]
        assert {lease.key for lease in service.held()} == {"first", "second"}
        assert second in service.held()
        first.release()
    finally:
        service.close()


def test_a_lease_released_before_the_threads_next_pass_never_enters_its_leases() -> None:
    """A short run's lease is dropped when the thread takes new leases in, and the thread
    still exits once idle."""
    service = LockService("memory://", prefix="hb-short:")
    try:
        keep = service.lock("kept")
        for i in range(50):
            service.lock(f"short:{i}").release()
        assert [lease.key for lease in service.held()] == ["kept"]
        keep.release()
        assert service.held() == []
        deadline = time.monotonic() + 10
        while service.heartbeat.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service.heartbeat.running
        assert service.lock("again").release().value == "released"  # a new thread starts
        assert service.held() == []
    finally:
        service.close()


def test_a_stream_of_short_locks_keeps_one_heartbeat_thread() -> None:
    """Leases released before the thread's next pass still count as use: the thread stays
    while locks keep coming (it exited a second after the last one *held* before, and the
    next lock started a new thread every second or two), and exits once they stop."""
    service = LockService("memory://", prefix="hb-stream:")
    try:
        service.lock("first").release()
        threads = set()
        until = time.monotonic() + 3.0  # three times IDLE_EXIT
        while time.monotonic() < until:
            service.lock("short").release()
            threads.add(service.heartbeat._thread)
            time.sleep(0.01)
        threads.discard(None)
        assert len(threads) == 1, f"{len(threads)} heartbeat threads started for one stream of locks"
        deadline = time.monotonic() + 10
        while service.heartbeat.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service.heartbeat.running
    finally:
        service.close()


def test_a_released_lease_not_yet_taken_in_is_not_kept_alive_by_the_heartbeat() -> None:
    """A short run's lease, released before the thread's next pass, is dropped from the
    heartbeat's ``_fresh`` at release: nothing references it after (it stayed up to a
    second before, outliving the young garbage-collector generations)."""
    service = LockService("memory://", prefix="hb-drop:")
    try:
        kept = service.lock("kept")  # the thread runs
        lease = service.lock("short")
        assert lease.release().value == "released"
        assert all(fresh is not lease for fresh in service.heartbeat._fresh)
        assert [held.key for held in service.held()] == ["kept"]
        kept.release()
    finally:
        service.close()


class _Racing(deque):  # type: ignore[type-arg]
    """A ``_fresh`` deque into which another thread's add() lands right after a release
    looked at its newest lease (the window between that look and its pop)."""

    intruder: object = None

    def __getitem__(self, index: Any) -> Any:
        found = super().__getitem__(index)
        if self.intruder is not None:
            self.append(self.intruder)
            self.intruder = None
        return found


def test_a_lease_added_while_a_release_drops_its_own_is_kept() -> None:
    """The release takes its own lease back from ``_fresh``, never the one another
    thread's add() appended meanwhile: that one stays registered (a naive pop lost it)."""
    idle = lambda **_: threading.Thread(target=lambda: None)  # noqa: E731 - no thread adopts meanwhile
    service = LockService("memory://", prefix="hb-race:", thread_factory=idle)
    try:
        other = service.lock("other")
        heartbeat = service.heartbeat
        racing = _Racing(heartbeat._fresh)
        assert racing.pop() is other  # as if its add() had not happened yet
        heartbeat._fresh = racing
        short = service.lock("short")
        racing.intruder = other  # its add() lands between the release's look and its pop
        assert short.release().value == "released"
        assert [lease.key for lease in service.held()] == ["other"]
    finally:
        service.close(release=False)


def test_leases_added_by_other_threads_around_releases_are_all_kept() -> None:
    """Releases taking their lease back from ``_fresh`` while other threads add theirs:
    every lease still held at the end is kept alive (``held()``), none is lost."""
    service = LockService("memory://", prefix="hb-race:")
    try:
        held: list[object] = []
        start = threading.Barrier(4)

        def churn(worker: int) -> None:
            start.wait()
            for i in range(2000):
                lease = service.lock(f"w{worker}:{i}")
                if i % 2 == 0:
                    held.append(lease)  # kept: must stay registered
                else:
                    lease.release()

        threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert {id(lease) for lease in service.held()} == {id(lease) for lease in held}
        assert len(held) == 4 * 1000
    finally:
        service.close()


def test_a_release_drops_the_lease_wherever_the_heartbeat_keeps_it() -> None:
    """A released lease leaves the heartbeat whether it was taken in already (``held()``
    adopts it) or is still the newest fresh one, and whatever else is fresh behind it."""
    service = LockService("memory://", prefix="hb-discard:")
    try:
        adopted = service.lock("adopted")
        assert service.held() == [adopted]  # taken in from _fresh
        fresh = service.lock("fresh")  # the newest in _fresh, the adopted one not there
        adopted.release()
        assert service.held() == [fresh]
        newer = service.lock("newer")
        fresh.release()  # adopted by held() above; the newest fresh lease is another's
        newer.release()  # the newest fresh one
        assert service.held() == []
        assert not service.heartbeat._fresh
    finally:
        service.close()
