"""Deduplication at enqueue (``dedupe``) with real producer processes, workers and broker.

On the lock stores that can serve workers in other processes: Redis and PostgreSQL by
default, SQLite (a file database) and MariaDB too with ``CE_LONG=1`` (their marker, record
and cooldown calls run on every store in tests/contract/test_marker.py, test_dedupe_race.py
and test_cooldown.py); not memory://, whose store lives inside one process. The
stores' workers start together once for the module (one prefork worker of two processes
each), and each store gets four producer processes (tests/celery/dedupe_producer.py
``--serve``) configured like its worker, started once and sent one spec at a time; the
specs that kill or reconfigure a producer run in a process of their own. The tests that
check only the Celery side, not the store, run on Redis alone (:data:`ONE_STORE`). The
broker is the suite's Redis, whose queue lists the tests read to count the messages a
deduplicated send published. A queue no worker consumes ("held") keeps messages waiting
until a test adds a consumer for it.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import redis

from tests.celery.conftest import (
    BROKER_URL,
    ROOT,
    WorkerGroup,
    module_groups,
    records,
    uid,
    wait_for,
)
from tests.conftest import TIME_SLACK

QUEUED = "#queued"
LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
#: The stores whose workers and producers share a lock store across processes: the two
#: served ones by default (about 100 s of this file's 200 s went to SQLite and MariaDB,
#: whose dedupe calls the contract tests cover on their own), all four with CE_LONG=1.
STORES = ["redis", "postgres", "sqlite", "mariadb"] if LONG else ["redis", "postgres"]
#: For tests of the Celery side only (what a worker does with the marker header of a message
#: it rejects; the cooldown's `held` label without records or while the run is in progress):
#: the store calls under them are those the other tests here, and
#: tests/contract/test_cooldown.py, make on every store.
ONE_STORE = pytest.mark.parametrize("group", ["redis"], indirect=True)
#: Producer processes per store: the concurrent-send test sends from four at once.
PRODUCERS = 4


pytestmark = pytest.mark.usefixtures("logs_on_failure")


def _stores_used(request: pytest.FixtureRequest) -> list[str]:
    """The stores the selected tests of this module run on."""
    used = {
        item.callspec.params.get("group")
        for item in request.session.items
        if item.path == request.path and hasattr(item, "callspec")
    }
    return [store for store in STORES if store in used]


@pytest.fixture(scope="module")
def groups(request: pytest.FixtureRequest, celery_logdir: Path) -> Iterator[dict[str, WorkerGroup]]:
    """One prefork worker of two processes per store, all started at once, for the module."""
    yield from module_groups(_stores_used(request), celery_logdir, workers=1)


@pytest.fixture(scope="module", params=STORES)
def group(request: pytest.FixtureRequest, groups: dict[str, WorkerGroup]) -> WorkerGroup:
    """The module's worker group on one store."""
    if request.param not in groups:
        pytest.skip(f"no worker group on {request.param} (its server is unreachable)")
    return groups[request.param]


class Producers:
    """Producer processes serving specs (``dedupe_producer --serve``) for one worker group."""

    def __init__(self, group: WorkerGroup, count: int) -> None:
        self.log = group.logdir / f"producers-{group.store}-{uid()}.log"
        with self.log.open("wb") as log:
            self.processes = [
                subprocess.Popen(
                    [sys.executable, "-m", "tests.celery.dedupe_producer", "--serve"],
                    cwd=ROOT,
                    env=_env(group),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
                for _ in range(count)
            ]

    def ask(self, index: int, spec: dict[str, Any]) -> None:
        """Hand producer ``index`` one spec (read its answers with :meth:`answers`)."""
        stdin = self.processes[index].stdin
        assert stdin is not None
        stdin.write(json.dumps(spec).encode() + b"\n")
        stdin.flush()

    def answers(self, index: int, timeout: float = 90.0) -> list[dict[str, Any]]:
        """The answers of producer ``index`` to the spec it was handed last."""
        stdout: IO[bytes] | None = self.processes[index].stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout)
        line = stdout.readline() if readable else b""
        assert line, f"producer {index} gave no answer; its log:\n{self.log.read_text()[-3000:]}"
        answers: list[dict[str, Any]] = json.loads(line)
        return answers

    def run(self, spec: dict[str, Any], index: int = 0) -> list[dict[str, Any]]:
        """One spec on producer ``index``; its answers."""
        self.ask(index, spec)
        return self.answers(index)

    def close(self) -> None:
        """End every producer (stdin closed), killed if it does not exit."""
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
            if process.stdout is not None:
                process.stdout.close()


@pytest.fixture(scope="module")
def producers(group: WorkerGroup) -> Iterator[Producers]:
    """The group's producer processes, ready (each answered a spec that sends nothing)."""
    started = Producers(group, PRODUCERS)
    try:
        for index in range(PRODUCERS):
            started.ask(index, {"revoke_ids": []})
        for index in range(PRODUCERS):
            started.answers(index)
        yield started
    finally:
        started.close()


def _command(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "tests.celery.dedupe_producer", json.dumps(spec)]


def _env(group: WorkerGroup, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **group.env, **(extra or {})}


def produce_alone(
    group: WorkerGroup, spec: dict[str, Any], env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run one producer process of its own to its end (``env`` on top); its answers."""
    done = subprocess.run(
        _command(spec), check=False, cwd=ROOT, env=_env(group, env), capture_output=True, timeout=90
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    answers: list[dict[str, Any]] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return answers


def queue_length(queue: str) -> int:
    client = redis.Redis.from_url(BROKER_URL)
    try:
        return int(client.llen(os.environ["CE_CELERY_KEYPREFIX"] + queue))
    finally:
        client.close()


def consume(group: WorkerGroup, queue: str) -> None:
    """Have the group's worker consume ``queue`` from now on."""
    from tests.celery.app import app

    worker = group.workers[0].name
    replies = app.control.add_consumer(queue, reply=True, timeout=5, destination=[f"{worker}@{_host()}"])
    assert replies, "the worker did not answer add_consumer"


def _host() -> str:
    import socket

    return socket.gethostname()


def test_twenty_sends_from_four_processes_publish_one_message_and_share_its_result(
    group: WorkerGroup, producers: Producers
) -> None:
    """20 delay() calls for one key, from 4 processes at once: one message on the broker, one
    task id for all 20 callers, and its real result for every one of them; `list` shows the
    marker `queued` meanwhile."""
    from tests.celery.app import app

    key_id, tag = uid(), uid()
    held = f"{group.queue}-held-{uid()}"
    spec = {
        "task": "dedupe_start",
        "args": [key_id, tag, 0.2],
        "options": {"queue": held},
        "calls": 5,
        "start_at": time.time() + 1.0,  # the four get their spec first
    }
    for index in range(PRODUCERS):
        producers.ask(index, spec)
    answers = [answer for index in range(PRODUCERS) for answer in producers.answers(index)]
    assert len(answers) == 20
    ids = {answer.get("id") for answer in answers}
    assert None not in ids, answers
    assert len(ids) == 1
    assert queue_length(held) == 1
    marker = group.service.peek(f"dedupe:{key_id}{QUEUED}")
    assert marker is not None
    assert marker.holder["task_id"] in ids
    (listed,) = cli_list(group, f"dedupe:{key_id}")
    assert (listed["key"], listed["state"]) == (f"dedupe:{key_id}{QUEUED}", "queued")
    consume(group, held)
    (task_id,) = ids
    results = [app.AsyncResult(task_id).get(timeout=30) for _ in answers]
    assert all(result["ran"] is True for result in results)
    assert len([r for r in records(tag) if r["kind"] == "run"]) == 1
    assert group.service.peek(f"dedupe:{key_id}{QUEUED}") is None


def cli_list(group: WorkerGroup, key: str) -> list[dict[str, Any]]:
    """``celery-exclusive list --json KEY`` on the group's store: its leases."""
    from click.testing import CliRunner

    from celery_exclusive.cli import cli

    listed = CliRunner().invoke(
        cli,
        ["--url", group.url, "--prefix", group.prefix, "list", "--json", key],
        env={"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None},
    )
    assert listed.exit_code == 0, listed.output
    locks: list[dict[str, Any]] = json.loads(listed.output)["locks"]
    return locks


def test_until_start_a_send_during_the_run_publishes_exactly_one_more_message(
    group: WorkerGroup, producers: Producers
) -> None:
    """ "until_start": the marker ends when the run starts, so sends during the run publish one
    more message, and only one (they all get its id)."""
    key_id, tag = uid(), uid()
    (first,) = producers.run({"task": "dedupe_start", "args": [key_id, tag, 1.5 * TIME_SLACK]})
    wait_for(lambda: [r for r in records(tag) if r["kind"] == "start"], 20, what="the first run to start")
    held = f"{group.queue}-held-{uid()}"
    later = producers.run(
        {"task": "dedupe_start", "args": [key_id, tag, 0.0], "options": {"queue": held}, "calls": 4}
    )
    ids = {answer["id"] for answer in later}
    assert len(ids) == 1
    assert first["id"] not in ids
    assert queue_length(held) == 1
    assert [r for r in records(tag) if r["kind"] == "run"] == [], "(the run ended before the sends)"


def test_until_done_nothing_is_queued_while_one_runs(group: WorkerGroup, producers: Producers) -> None:
    """ "until_done": sends while the run is in progress get the running task's id; once it
    has finished, a send publishes a new message."""
    from tests.celery.app import app

    key_id, tag = uid(), uid()
    (first,) = producers.run({"task": "dedupe_done", "args": [key_id, tag, 1.5 * TIME_SLACK]})
    wait_for(lambda: [r for r in records(tag) if r["kind"] == "start"], 20, what="the run to start")
    assert group.service.peek(f"dedupe-done:{key_id}{QUEUED}") is None  # the execution lock took over
    during = producers.run({"task": "dedupe_done", "args": [key_id, tag, 0.0], "calls": 4})
    assert [r for r in records(tag) if r["kind"] == "run"] == [], "(the run ended before the sends)"
    assert {answer["id"] for answer in during} == {first["id"]}
    app.AsyncResult(first["id"]).get(timeout=30)
    wait_for(lambda: group.service.peek(f"dedupe-done:{key_id}") is None, 10, what="the lock's release")
    (after,) = producers.run({"task": "dedupe_done", "args": [key_id, tag, 0.0]})
    assert after["id"] != first["id"]
    assert app.AsyncResult(after["id"]).get(timeout=30)["ran"] is True


def test_on_duplicate_raise_names_the_queued_task(group: WorkerGroup, producers: Producers) -> None:
    """on_duplicate="raise": the duplicate send raises AlreadyQueued carrying the queued id."""
    key_id, held = uid(), f"{group.queue}-held-{uid()}"
    answers = producers.run(
        {"task": "dedupe_raise", "args": [key_id, "t"], "options": {"queue": held}, "calls": 2}
    )
    (first,) = [answer for answer in answers if "id" in answer]
    assert [answer for answer in answers if "id" not in answer] == [
        {"error": "AlreadyQueued", "task_id": first["id"]}
    ]
    assert queue_length(held) == 1


@ONE_STORE
def test_a_duplicates_callbacks_are_dropped_with_one_warning_and_the_originals_run(
    group: WorkerGroup, producers: Producers
) -> None:
    """link= / link_error= on a send answered as a duplicate: nothing is sent, so those
    callbacks never run; the caller gets the queued task's AsyncResult, whose own callbacks
    run, and the producer process logs one WARNING naming the task, the key and the queued
    id for its three dropped sends (they used to be dropped without a word)."""
    from tests.celery.app import app

    key_id, tag, held = uid(), uid(), f"{group.queue}-held-{uid()}"
    sent = {"task": "dedupe_start", "args": [key_id, tag, 0.0], "options": {"queue": held}}
    first, logged = producers.run({**sent, "link": ["callback", [tag, "first"]], "capture_log": True})
    assert logged == {"warnings": []}
    answers = produce_alone(
        group,
        {
            **sent,
            "link": ["callback", [tag, "dup"]],
            "link_error": ["callback", [tag, "dup-error"]],
            "calls": 3,
            "capture_log": True,
        },
    )
    assert answers[:3] == [{"id": first["id"]}] * 3
    (warning,) = answers[3]["warnings"]
    for named in (
        "tests.celery.app.dedupe_start",
        f"'dedupe:{key_id}'",
        first["id"],
        "link= and link_error=",
    ):
        assert named in warning, warning
    assert queue_length(held) == 1
    consume(group, held)
    assert app.AsyncResult(first["id"]).get(timeout=30)["ran"] is True
    wait_for(
        lambda: [r for r in records(tag) if r["kind"] == "callback"], 20, what="the first send's callback"
    )
    time.sleep(1.0 * TIME_SLACK)  # what a dropped callback's message would have had to arrive
    assert [r["name"] for r in records(tag) if r["kind"] == "callback"] == ["first"]
    assert queue_length(held) == 0


def test_revoke_frees_the_key_at_once_while_the_message_is_still_queued(
    group: WorkerGroup, producers: Producers
) -> None:
    """AsyncResult.revoke() in a producer frees the queued marker before it returns, while the
    message still sits in a queue no worker consumes: a send right after publishes anew."""
    key_id, tag, held = uid(), uid(), f"{group.queue}-held-{uid()}"
    spec = {"task": "dedupe_start", "args": [key_id, tag], "options": {"queue": held}}
    first, revoked, again = producers.run({**spec, "revoke": True, "then_send": True})
    assert revoked["revoke_seconds"] < 5.0, revoked  # one broadcast and one scan (typically ~0.01 s)
    assert "id" in again
    assert again["id"] != first["id"]
    assert queue_length(held) == 2  # the revoked message is still queued, and the new one
    marker = group.service.peek(f"dedupe:{key_id}{QUEUED}")
    assert marker is not None
    assert marker.holder["task_id"] == again["id"]
    # Revoked from another process (not the sender): the marker is gone when that returns.
    producers.run({"revoke_ids": [str(uuid.uuid4())]}, index=1)  # no such task: frees nothing
    assert group.service.peek(f"dedupe:{key_id}{QUEUED}") is not None
    (third,) = producers.run(spec)
    assert third["id"] == again["id"]  # still queued: a duplicate
    producers.run({"revoke_ids": [again["id"]]}, index=1)
    assert group.service.peek(f"dedupe:{key_id}{QUEUED}") is None
    assert queue_length(held) == 2


def test_a_revoked_queued_task_frees_its_key_when_the_worker_discards_it(
    group: WorkerGroup, producers: Producers
) -> None:
    """Revoked by a bare broadcast (as `celery control revoke` or Flower send it, which skip
    the producer's hook): the marker is released (task_revoked) when a worker meets the
    message; a new send then publishes."""
    from tests.celery.app import app

    key_id, tag, held = uid(), uid(), f"{group.queue}-held-{uid()}"
    (first,) = producers.run({"task": "dedupe_start", "args": [key_id, tag], "options": {"queue": held}})
    app.control.broadcast("revoke", arguments={"task_id": first["id"]})
    assert group.service.peek(f"dedupe:{key_id}{QUEUED}") is not None
    time.sleep(0.5)  # the broadcast reaches the worker
    consume(group, held)
    wait_for(lambda: group.service.peek(f"dedupe:{key_id}{QUEUED}") is None, 15, what="the marker's release")
    (again,) = producers.run({"task": "dedupe_start", "args": [key_id, tag]})
    assert again["id"] != first["id"]
    assert records(tag) == [] or all(r["task_id"] != first["id"] for r in records(tag))


def test_an_expiring_message_frees_its_key_by_its_expiry(group: WorkerGroup, producers: Producers) -> None:
    """expires=2 on a message no worker takes: its marker is gone 2 s later."""
    key_id, held = uid(), f"{group.queue}-held-{uid()}"
    sent = time.monotonic()
    (first,) = producers.run(
        {"task": "dedupe_start", "args": [key_id, "t"], "options": {"queue": held, "expires": 2}}
    )
    marker = group.service.peek(f"dedupe:{key_id}{QUEUED}")
    assert marker is not None
    assert marker.expires_in <= 2.0
    wait_for(lambda: group.service.peek(f"dedupe:{key_id}{QUEUED}") is None, 3, what="the marker's expiry")
    assert time.monotonic() - sent < 2.0 + 0.5 * TIME_SLACK
    (again,) = producers.run({"task": "dedupe_start", "args": [key_id, "t"], "options": {"queue": held}})
    assert again["id"] != first["id"]
    assert queue_length(held) == 2


def test_a_failed_publish_leaves_no_marker(group: WorkerGroup) -> None:
    """The broker is unreachable: the send raises and the marker it took is released. (The
    result backend, the same dead server, gives up after 1 retry, not Celery's 20 of ~1 s:
    the same RuntimeError, ~19 s sooner.)"""
    key_id = uid()
    answers = produce_alone(
        group,
        {"task": "dedupe_start", "args": [key_id, "t"], "options": {"retry": False}},
        env={"CE_CELERY_BROKER": "redis://127.0.0.1:1/11", "CE_CELERY_BACKEND_RETRIES": "1"},
    )
    # Kombu's OperationalError, or the result backend (same dead server) giving up first.
    assert answers[0].get("error") in ("OperationalError", "RuntimeError"), answers
    assert group.service.peek(f"dedupe:{key_id}{QUEUED}") is None


def test_a_producer_killed_between_marker_and_publish_blocks_the_key_at_most_dedupe_ttl(
    group: WorkerGroup, producers: Producers
) -> None:
    """SIGKILL right before the publish: the marker stays, at most dedupe_ttl (4 s)."""
    key_id, held = uid(), f"{group.queue}-held-{uid()}"
    spec = {"task": "dedupe_raise", "args": [key_id, "t"], "options": {"queue": held}}
    killed = subprocess.run(
        _command({**spec, "kill_before_publish": True}), check=False, cwd=ROOT, env=_env(group), timeout=60
    )
    assert killed.returncode == -9
    marker = group.service.peek(f"dedupe-raise:{key_id}{QUEUED}")
    assert marker is not None
    assert marker.expires_in <= 4.0
    wait_for(
        lambda: group.service.peek(f"dedupe-raise:{key_id}{QUEUED}") is None, 4.5, what="the marker's ttl"
    )
    (sent,) = producers.run(spec)
    assert "id" in sent
    assert queue_length(held) == 1


def test_a_countdown_marker_lasts_past_the_eta(group: WorkerGroup, producers: Producers) -> None:
    """A countdown with dedupe_ttl=4: the marker is still there after 5 s, past the 4 s ttl,
    so a send then is a duplicate, and it ends once the run has started. (The countdown,
    5 s + 1.5 s x TIME_SLACK, 8 s by default, leaves the second send inside it.)"""
    from tests.celery.app import app

    countdown = 5.0 + 1.5 * TIME_SLACK
    key_id, tag = uid(), uid()
    spec = {"task": "dedupe_raise", "args": [key_id, tag], "options": {"countdown": countdown}}
    (first,) = producers.run(spec)
    marker = group.service.peek(f"dedupe-raise:{key_id}{QUEUED}")
    assert marker is not None
    assert marker.expires_in > countdown - 1
    time.sleep(max(0.0, 5.0 - marker.age))
    (second,) = producers.run(spec)
    assert second == {"error": "AlreadyQueued", "task_id": first["id"]}
    assert app.AsyncResult(first["id"]).get(timeout=30)["ran"] is True
    assert group.service.peek(f"dedupe-raise:{key_id}{QUEUED}") is None


def test_rerun_args_latest_runs_the_follow_up_with_the_last_requests_arguments(group: WorkerGroup) -> None:
    """on_locked="rerun", rerun_args="latest": three requests while the key is held coalesce into
    one follow-up, which sees the arguments of the last of them."""
    from tests.celery.app import rerun_latest

    key_id, tag = uid(), uid()
    group.send(rerun_latest, key_id, tag, 0, 1.5 * TIME_SLACK)
    wait_for(lambda: [r for r in records(tag) if r["kind"] == "start"], 20, what="the first run to start")
    for n in (1, 2, 3):
        group.send(rerun_latest, key_id, tag, n).get(timeout=20)  # each is coalesced at once
    assert [r for r in records(tag) if r["kind"] == "run"] == [], "(the first run ended before them)"
    wait_for(lambda: len([r for r in records(tag) if r["kind"] == "run"]) == 2, 30, what="the follow-up run")
    time.sleep(1.0)  # a wrong third run would show up by now
    assert [r["n"] for r in records(tag) if r["kind"] == "arg"] == [0, 3]


def test_cooldown_runs_at_most_once_per_window(group: WorkerGroup) -> None:
    """cooldown=3: 10 requests over 9 s run 3 or 4 times, never two starts within 3 s; the
    others find the key held (cooling down) and skip."""
    from celery_exclusive import is_skipped
    from tests.celery.app import cooled

    key_id, tag = uid(), uid()
    sent = []
    for _ in range(10):
        sent.append(group.send(cooled, key_id, tag, 0.1))
        time.sleep(0.9)
    results = [result.get(timeout=30) for result in sent]
    starts = sorted(r["start"] for r in records(tag) if r["kind"] == "run")
    assert 2 <= len(starts) <= 4, starts  # 3 or 4 expected; a slow pickup may merge one window
    assert all(after - before >= 2.95 for before, after in itertools.pairwise(starts)), starts
    assert len([r for r in results if is_skipped(r)]) == 10 - len(starts)


def _planted_marker(group: WorkerGroup, key: str) -> tuple[str, dict[str, Any]]:
    """A queued marker taken here (as a send would) and the header that names it."""
    from celery_exclusive.dedupe import HEADER

    task_id = str(uuid.uuid4())
    token = group.service.mark(key + QUEUED, ttl=120, holder={"task_id": task_id})
    assert token is not None
    return task_id, {HEADER: {"key": key, "token": token, "mode": "until_start"}}


@ONE_STORE
def test_a_message_for_an_unregistered_task_frees_its_marker(group: WorkerGroup) -> None:
    """The worker rejects a message naming a task it does not know (task_unknown): the marker
    its header names is released then, not at its 120 s ttl."""
    from tests.celery.app import app

    key = f"dedupe:{uid()}"
    task_id, headers = _planted_marker(group, key)
    app.send_task(
        "tests.celery.app.no_such_task", ("x",), task_id=task_id, headers=headers, queue=group.queue
    )
    wait_for(lambda: group.service.peek(key + QUEUED) is None, 20, what="the marker's release")
    wait_for(lambda: "no_such_task" in group.dump(), 10, what="the worker's log of the unknown task")


@ONE_STORE
def test_a_message_the_worker_cannot_read_as_a_task_frees_its_marker(group: WorkerGroup) -> None:
    """A message without a task name (a foreign publish) is rejected (task_rejected): the
    marker its header names is released then."""
    import kombu

    from tests.celery.app import app

    key = f"dedupe:{uid()}"
    _, headers = _planted_marker(group, key)
    with app.producer_or_acquire() as producer:
        producer.publish(
            {"not": "a task"},
            exchange="",
            routing_key=group.queue,
            headers=headers,
            serializer="json",
            declare=[kombu.Queue(group.queue)],
        )
    wait_for(lambda: group.service.peek(key + QUEUED) is None, 20, what="the marker's release")


def test_a_worker_killed_during_the_cooldown_does_not_extend_it_and_list_shows_cooling(
    group: WorkerGroup,
) -> None:
    """cooldown=3: once the run has ended, `list` shows its key `cooling`; SIGKILL of the
    worker process that ran it changes nothing: the key is free 3 s after the run started
    (no heartbeat keeps a cooling lease), not at the lease's ttl."""
    from tests.celery.app import cooled

    key_id, tag = uid(), uid()
    key = f"cool:{key_id}"
    group.send(cooled, key_id, tag, 0.0).get(timeout=30)
    (run,) = [r for r in records(tag) if r["kind"] == "run"]
    (lease,) = cli_list(group, key)
    assert lease["state"] == "cooling", lease
    assert lease["holder"]["cooldown"] == 3
    assert lease["expires_in"] <= 3.0
    os.kill(run["pid"], 9)  # the prefork pool replaces the process
    wait_for(lambda: group.service.peek(key) is None, 10, what="the cooldown's end")
    assert time.time() - run["start"] < 3.0 + 1.5
    assert time.time() - run["start"] > 2.9


@ONE_STORE
def test_the_cooldown_holds_without_completion_records(group: WorkerGroup) -> None:
    """cooldown=3 with done_retention=False: the ended run's key stays held until 3 s after
    it started (no record is written; `list` can only say `held`), then it is free."""
    from celery_exclusive.cli import full_state
    from tests.celery.app import cooled_without_records

    key_id, tag = uid(), uid()
    key = f"coolbare:{key_id}"
    group.send(cooled_without_records, key_id, tag, 0.0).get(timeout=30)
    (run,) = [r for r in records(tag) if r["kind"] == "run"]
    info = group.service.peek(key)
    assert info is not None, "the cooldown did not keep the key"
    assert info.expires_in <= 3.0
    assert group.service.completion(key, info.holder["task_id"]) is None
    assert full_state(group.service, info) == "held"
    wait_for(lambda: group.service.peek(key) is None, 10, what="the cooldown's end")
    assert 2.9 < time.time() - run["start"] < 3.0 + 1.5


def test_a_run_killed_at_its_hard_time_limit_keeps_its_cooldown(group: WorkerGroup) -> None:
    """cooldown=4, a 60 s lease, killed at its 1 s hard time limit: the worker's main process
    ends the dead run's lease at the cooldown's end (4 s after the start), as the run's own
    release would have; not at once (a second run within the cooldown), nor at the ttl."""
    from celery.exceptions import TimeLimitExceeded

    from tests.celery.app import cooled_deaf

    key_id, tag = uid(), uid()
    key = f"cooldeaf:{key_id}"
    result = group.send(cooled_deaf, key_id, tag, 30.0, _options={"time_limit": 1})
    (start,) = wait_for(
        lambda: [r for r in records(tag) if r["kind"] == "start"], 20, what="the run to start"
    )
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=20)
    time.sleep(max(0.0, start["at"] + 2.5 - time.time()))  # the kill hook has acted by now
    assert group.service.peek(key) is not None, "the kill ended the cooldown"
    wait_for(lambda: group.service.peek(key) is None, 10, what="the cooldown's end")
    assert time.time() - start["at"] < 4.0 + 1.5


@ONE_STORE
def test_a_retry_within_the_cooldown_runs_once_it_is_over(group: WorkerGroup) -> None:
    """cooldown=2, done_retention=False: the attempt's release before ``self.retry()`` leaves
    its key cooling, held by its own task id. The retry is not a copy of a run in progress
    (which, without records, is dropped): it runs, once the cooldown is over."""
    from tests.celery.app import cooled_retrying

    key_id, tag = uid(), uid()
    result = group.send(cooled_retrying, key_id, tag).get(timeout=20)
    assert result["retries"] == 1
    first, second = sorted(r["start"] for r in records(tag) if r["kind"] == "run")
    assert second - first > 1.9  # the cooldown (from the grant, just before the first start)


@ONE_STORE
def test_a_semaphore_retry_waits_for_its_own_cooling_slot_when_every_slot_is_full(
    group: WorkerGroup,
) -> None:
    """limit=2, cooldown=2: slot 1 held by another holder, the attempt runs on slot 2 and
    retries, leaving slot 2 cooling. The store names slot 1's holder only, yet the retry
    finds its own previous attempt cooling on slot 2 and runs once the cooldown is over (it
    used to meet on_locked and skip)."""
    from celery_exclusive import is_skipped
    from tests.celery.app import cooled_semaphore_retrying

    key_id, tag = uid(), uid()
    with group.service.lock(f"coolsem:{key_id}", limit=2, ttl=30, holder={"task_id": "other"}):
        result = group.send(cooled_semaphore_retrying, key_id, tag).get(timeout=20)
    assert not is_skipped(result)
    assert result["retries"] == 1
    first, second = sorted(r["start"] for r in records(tag) if r["kind"] == "run")
    assert second - first > 1.9


@ONE_STORE
def test_a_replacement_within_the_cooldown_runs_once_it_is_over(group: WorkerGroup) -> None:
    """cooldown=1, done_retention=False: ``self.replace()`` by a run of the same key leaves
    the key cooling under the task id the replacement takes over; the replacement is no copy
    (which, without records, is dropped): it runs once the cooldown is over."""
    from tests.celery.app import replacing_cooled

    key_id, tag = uid(), uid()
    assert group.send(replacing_cooled, key_id, tag, 1).get(timeout=20) == {"pages": 2}
    first, second = sorted(r["start"] for r in records(tag) if r["kind"] == "run")
    assert second - first > 0.9  # the cooldown (from the grant, just before the first start)


@ONE_STORE
def test_a_replacement_groups_task_within_the_cooldown_runs_once_it_is_over(group: WorkerGroup) -> None:
    """cooldown=1, done_retention=False: ``self.replace(group(...))`` by a run of the same
    key, under an id of its own, waits for the replaced run's cooling lease as the
    replacement taking the id does, and runs once the cooldown is over (it used to meet it
    as another holder's lease: skipped under ``on_locked="skip"``)."""
    from tests.celery.app import replacing_cooled

    key_id, tag = uid(), uid()
    assert group.send(replacing_cooled, key_id, tag, 1, True).get(timeout=20) == [{"pages": 2}]
    first, second = sorted(r["start"] for r in records(tag) if r["kind"] == "run")
    assert second - first > 0.9  # the cooldown (from the grant, just before the first start)


@ONE_STORE
def test_list_shows_a_cooldown_lease_held_while_its_run_is_in_progress(group: WorkerGroup) -> None:
    """A running task with a cooldown is `held` (no completion record yet), not `cooling`; a
    run longer than its cooldown frees the key when it ends."""
    from celery_exclusive.cli import full_state
    from tests.celery.app import cooled

    key_id, tag = uid(), uid()
    result = group.send(cooled, key_id, tag, 4.0)
    wait_for(lambda: [r for r in records(tag) if r["kind"] == "start"], 20, what="the run to start")
    info = group.service.peek(f"cool:{key_id}")
    assert info is not None
    assert full_state(group.service, info) == "held"
    result.get(timeout=30)
    assert group.service.peek(f"cool:{key_id}") is None
