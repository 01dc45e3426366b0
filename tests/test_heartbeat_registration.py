"""How an acquire registers its lease with a running heartbeat (heartbeat.py ``add``): without
its mutex, the thread taking the lease in at its next pass (issue #16)."""

from __future__ import annotations

import threading
import time

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
