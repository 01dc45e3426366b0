"""Dedupe markers across store failures: a marker whose release failed, or whose mark reply
was lost, must not outlive the failure by its ``dedupe_ttl``.

A marker left behind refuses every send of its key until it expires (an hour by default),
answering each with the ``AsyncResult`` of a message that already ran (or was never sent):
the sends are lost while their callers believe them queued.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_exclusive import BackendError
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import get_lock_service
from tests.faults.conftest import ROOT, Faults, acl_user, start_worker, wait_until
from tests.faults.servers import PrivateRedis
from tests.scale._servers import frozen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: How long a released-in-the-background marker may take to go once the store answers
#: again (the heartbeat retries each second; generous for a loaded machine).
RELEASED_WITHIN = 15.0


def _queued(url: str, prefix: str, key: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(client.exists(f"{prefix}{key}#queued"))
    finally:
        client.close()


def _event(events: Any) -> bytes | None:
    """The next keyspace event's name, or None (none yet, or a subscription's confirmation)."""
    message = events.get_message(timeout=0.1)
    return None if message is None else bytes(message["data"])


def test_a_marker_the_worker_could_not_release_goes_once_the_store_answers(
    redis_server: PrivateRedis, faults: Faults, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The store refuses the worker's calls (its ACL user loses every command) as a deduped
    message runs: the marker's release at the run's start fails, and so does the run. Once
    the store answers again, the worker releases the marker by itself, and the next send of
    the key publishes a new message (on main the marker stayed its dedupe_ttl, 300 s here,
    and every send meanwhile got the failed run's AsyncResult)."""
    admin = redis.Redis.from_url(redis_server.url)
    with contextlib.closing(admin), acl_user(admin, "ce-worker") as (user, password):
        broker = f"redis://127.0.0.1:{redis_server.port}/4"
        queue = f"cededupe-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CE_DD_BROKER": broker,
            "CE_DD_QUEUE": queue,
            "CELERY_EXCLUSIVE_URL": f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0",
            "CELERY_EXCLUSIVE_PREFIX": faults.prefix,
        }
        log = tmp_path_factory.mktemp("celery") / "worker.log"
        worker = start_worker("tests.faults._dedupe_app", queue, env, log)
        os.environ["CE_DD_BROKER"], os.environ["CE_DD_QUEUE"] = broker, queue
        from tests.faults import _dedupe_app

        app = _dedupe_app.app
        # The sender uses the store as the default user: only the worker's calls are refused.
        app.conf.update(exclusive_url=redis_server.url, exclusive_prefix=faults.prefix)
        tag = uuid.uuid4().hex[:8]
        try:
            assert wait_until(lambda: " ready." in log.read_text(errors="replace"), 60), log.read_text()
            warm = _dedupe_app.deduped.apply_async((f"warm-{tag}",), queue=queue)
            assert warm.get(timeout=60) == f"ran warm-{tag}"
            admin.execute_command("ACL", "SETUSER", user, "-@all")  # the worker's calls fail from now on
            first = _dedupe_app.deduped.apply_async((tag,), queue=queue)
            assert _queued(redis_server.url, faults.prefix, f"dd:{tag}")
            with pytest.raises(BackendError):
                first.get(timeout=60, propagate=True)
            assert "could not release the queued marker" in log.read_text(errors="replace")
            assert _queued(redis_server.url, faults.prefix, f"dd:{tag}")  # the store still refuses
            admin.execute_command("ACL", "SETUSER", user, "+@all")  # healed

            def gone() -> bool:
                return not _queued(redis_server.url, faults.prefix, f"dd:{tag}")

            assert wait_until(gone, RELEASED_WITHIN), "the marker outlived the outage"
            again = _dedupe_app.deduped.apply_async((tag,), queue=queue)
            assert again.id != first.id
            assert again.get(timeout=60) == f"ran {tag}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)


@pytest.mark.parametrize("after_a_duplicate", [False, True], ids=["first-send", "after-a-duplicate"])
def test_a_send_whose_mark_reply_was_lost_leaves_no_marker(
    redis_server: PrivateRedis, faults: Faults, after_a_duplicate: bool
) -> None:
    """The store is stopped (SIGSTOP) while a deduped send waits for its marker's reply: the
    send raises BackendError at the store's deadline and publishes nothing, and the mark the
    server runs once it resumes must not stay behind (on main it stayed its dedupe_ttl, and
    every send of the key got the AsyncResult of a task id that was never sent).
    ``after_a_duplicate``: the task's previous send found a duplicate, so this one reads
    the answer before building its message (another path through the send)."""
    name = f"ce-dd-lost-{uuid.uuid4().hex[:6]}"
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(exclusive_url=redis_server.url, exclusive_prefix=faults.prefix)

    @exclusive_task(app=app, key="lost:{tag}", dedupe=True, dedupe_ttl=300, name=f"{name}.send_me")
    def send_me(tag: str) -> str:
        return tag

    service = get_lock_service(app)
    assert redis_server._proc is not None
    pid = redis_server._proc.pid
    tag, task_id = uuid.uuid4().hex[:8], str(uuid.uuid4())
    marker = f"{faults.prefix}lost:{tag}#queued"
    admin = redis.Redis.from_url(redis_server.url)
    before = admin.config_get("notify-keyspace-events")["notify-keyspace-events"]
    admin.config_set("notify-keyspace-events", "Kh")  # the private server's: hash writes, per key
    events = admin.pubsub(ignore_subscribe_messages=True)
    events.subscribe(f"__keyspace@0__:{marker}")
    try:
        send_me.apply_async((f"warm-{tag}",))  # the marker's kept connection, used again at once
        if after_a_duplicate:
            send_me.apply_async((f"warm-{tag}",))  # refused: the next send reads its answer first
        with frozen(pid, at_most=service.call_timeout + 5.0), pytest.raises(BackendError):
            send_me.apply_async((tag,), task_id=task_id)
        # The server has resumed and runs the mark it had been sent: the premise, seen as a
        # hash write on the marker's key.
        assert wait_until(lambda: _event(events) == b"hset", RELEASED_WITHIN), "the mark never ran"

        def gone() -> bool:
            return not _queued(redis_server.url, faults.prefix, f"lost:{tag}")

        assert wait_until(gone, RELEASED_WITHIN), "the lost send's marker stayed behind"
        again = send_me.apply_async((tag,))
        assert again.id != task_id
    finally:
        events.close()
        admin.config_set("notify-keyspace-events", before)
        admin.close()
        service.close()
