"""``self.retry()`` whose release the store refused: the retry finds its previous attempt's
lease still in the store, held by its own task id.

The attempt released its lease before sending the retry (a new message, the same task id),
but the store refused that release, so the lease stays until the heartbeat's background
release gets through (or its ttl, 20 s here). The retry, delivered meanwhile, is no copy of
a run in progress: it must run once that lease is gone, with or without completion
records, single lock or semaphore. A prefork worker whose lock store is the suite's private
Redis as an ACL user of its own; the test takes ``HDEL`` and ``DEL`` away from it (the
release script's, ``RELEASE_COMMANDS``; acquire, refresh and peek keep working) until the
retry has looked at its key once, and gives them back. One test takes ``SET`` away instead
(acquire.lua's alone): the store refuses the acquire, which ``autoretry_for=(BackendError,)``
retries until the store answers again.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery.exceptions import TimeoutError

from celery_exclusive.redelivery import COOLING_HEADER
from tests.faults.conftest import (
    LONG,
    SLACK,
    AclWorker,
    PgRoleWorker,
    acl_app_worker,
    pg_role_app_worker,
    refuse_redis_releases,
    shared_worker,
    wait_until,
)
from tests.faults.servers import PrivatePostgres, PrivateRedis, TcpProxy
from tests.fork_safe_redis import SOCKET_TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: How soon the retry runs once the store answers again (and its countdown is over): the
#: heartbeat retries the release each second, and the retry looks again within 2 s of that;
#: far below the lease's ttl (20 s), which a retry taken for a copy waited out.
SETTLED = 6.5 + 4 * SLACK
#: How long the retry may take to look at its key for the first time (a hang guard).
FIRST_LOOK = 30.0
#: The tasks the short mode retries with a countdown too: records on and off, single lock
#: and semaphore, each once (the countdown only delays the retry's first look; the store
#: calls after it are those of the countdown-0 cases). ``CE_LONG=1``: all four.
COUNTED_DOWN = {"retrying", "retrying_slot_unrecorded"}


@dataclass
class Worker(AclWorker):
    """The worker (:class:`AclWorker`); the tasks record their runs in ``admin``'s db."""

    def refuse_releases(self) -> None:
        """The store refuses every release of a lock from now on."""
        refuse_redis_releases(self.admin, self.user)

    def result(self, result: Any, timeout: float) -> Any:
        """``result.get(timeout=timeout)``, failing with the worker's log if it times out."""
        try:
            return result.get(timeout=timeout)
        except TimeoutError:
            pytest.fail(f"no result within {timeout:.1f} s:\n{self.text()[-6000:]}")

    def runs(self, tag: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.admin.lrange(f"{tag}:runs", 0, -1)]

    def first_look(self, task: str, task_id: str | None, key: str, after: int = 0) -> str:
        """Wait until the retry of ``task`` (``task_id``; None: any id) has looked at ``key``
        (a semaphore's: at its lease on the task id), logged past ``after`` (a length of the
        log): deferred behind its attempt's lease ("releasing"), or taken for a copy
        ("redelivered", the defect). Which of the two; fails if neither is logged within
        :data:`FIRST_LOOK`."""
        which = r"[^\]]+" if task_id is None else re.escape(task_id)
        name = rf"tests\.faults\._celery_app\.{task}\[{which}\]"
        pattern = re.compile(rf"(releasing|redelivered): {name} .* lock '{re.escape(key)}['#]")
        deadline = time.monotonic() + FIRST_LOOK
        while (match := pattern.search(self.text(), after)) is None:
            assert time.monotonic() < deadline, f"the retry never looked:\n{self.text()[-6000:]}"
            time.sleep(0.05)
        return match.group(1)

    def held_at_first_look(self, task: str, task_id: str | None, key: str, after: int = 0) -> Any:
        """Wait until the retry ``task_id`` (None: any id) has looked at ``key``
        (:meth:`first_look`, logged past ``after``) while the store refuses releases: it
        must have found its attempt's lease still there and deferred itself, not taken
        itself for a copy. That lease's info (a single lock's ``key``, or a semaphore's
        lease on the task id); the caller gives releases back."""
        looked = self.first_look(task, task_id, key, after)
        held = self.store.peek(key) or self.store.peek(f"{key}#id:{task_id}")
        assert held is not None, "the store refused the release: the lease is still there"
        assert looked == "releasing", f"the retry was taken for a copy:\n{self.text()[-6000:]}"
        return held

    def retried_behind_a_refused_release(
        self, task: str, countdown: float, *args: Any
    ) -> tuple[Any, str, float]:
        """Attempt 0 of ``task`` retries (``countdown``) while the store refuses its release;
        the store answers again once the retry has looked at the key and found the lease still
        there (:meth:`held_at_first_look`). The result, the tag, and when the store
        answered again."""
        tag = uuid.uuid4().hex[:8]
        result = getattr(self.app, task).apply_async((tag, countdown, *args), queue=self.queue)
        try:
            assert self.admin.blpop([f"{tag}:ready"], timeout=60) is not None, self.text()[-4000:]
            self.refuse_releases()
            self.admin.rpush(f"{tag}:go", 1)
            self.held_at_first_look(task, result.id, f"retry:{tag}")
        finally:
            self.answer()
        return result, tag, time.time()


worker = shared_worker(Worker)


@dataclass
class PgWorker(PgRoleWorker, Worker):
    """:class:`Worker` whose store is the private PostgreSQL as a role of its own, which
    the test refuses releases by taking ``DELETE`` away from (:class:`PgRoleWorker`)."""


def pg_module_worker(name: str) -> Any:
    """A module's fixture: a :class:`PgWorker` called ``name`` (two processes), its role,
    its table and the test's app; stopped and dropped afterwards. Its own, not shared:
    take it through :func:`on_store`."""

    @pytest.fixture(scope="module")
    def pg_worker(
        redis_server: PrivateRedis, pg_server: PrivatePostgres, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[PgWorker]:
        log_dir = tmp_path_factory.mktemp(f"celery-{name}")
        with pg_role_app_worker(redis_server, pg_server, name, log_dir, PgWorker, concurrency=2) as worker:
            yield worker

    return pg_worker


pg_worker = pg_module_worker("retrypg")


def on_store(request: pytest.FixtureRequest, store: str) -> Worker:
    """The test's worker of ``store``: the shared ACL worker's view (``"redis"``), or the
    module's PostgreSQL worker (``"postgres"``), its log read from the test's start as a
    shared worker's view is (:meth:`~tests.faults.conftest.AppWorker.settled`)."""
    if store == "redis":
        redis_worker: Worker = request.getfixturevalue("worker")
        return redis_worker
    pg: PgWorker = request.getfixturevalue("pg_worker")
    pg.since = len(pg.text())  # this test's deliveries are logged after
    return pg


@pytest.mark.parametrize("store", ["redis", "postgres"])
@pytest.mark.parametrize(
    "task",
    ["retrying", "retrying_unrecorded", "retrying_slot", "retrying_slot_unrecorded"],
)
@pytest.mark.parametrize("countdown", [0.0, 1.0])
def test_a_retry_behind_its_attempts_unreleased_lease_runs_once_that_lease_is_gone(
    request: pytest.FixtureRequest, store: str, task: str, countdown: float
) -> None:
    """The retry runs, once, after the store answered again, within seconds (with records
    it used to be taken for a copy of a run in progress and deferred until the lease's
    ttl; without records it was dropped: lost). On PostgreSQL (the worker's role may not
    ``DELETE``) under ``CE_LONG=1`` only, without a countdown: the short mode runs the
    replacements' PostgreSQL cases (tests/faults/test_replace_lingering_lease.py)."""
    if countdown and not LONG and task not in COUNTED_DOWN:
        pytest.skip("the short mode retries two of the four tasks with a countdown (CE_LONG=1: all)")
    if store == "postgres" and (countdown or not LONG):
        pytest.skip("on PostgreSQL under CE_LONG=1 only, without a countdown")
    worker = on_store(request, store)
    result, tag, answered = worker.retried_behind_a_refused_release(task, countdown)
    assert worker.result(result, countdown + SETTLED) == 1
    worker.settled(tag)  # a second run of the retry has started by now, if any was sent
    runs = worker.runs(tag)
    assert [run["attempt"] for run in runs] == [0, 1], runs
    assert runs[1]["start"] >= answered - SLACK, "the retry ran while its attempt's lease was held"
    assert f"redelivered: tests.faults._celery_app.{task}[{result.id}]" not in worker.text()


def test_an_autoretry_behind_its_attempts_unreleased_lease_runs(worker: Worker) -> None:
    """``autoretry_for`` with ``retry_backoff`` (1 s), without records: the retry runs once
    (it used to be dropped as a copy)."""
    result, tag, answered = worker.retried_behind_a_refused_release("autoretrying", 0.0)
    assert worker.result(result, 1.0 + SETTLED) == 1
    runs = worker.runs(tag)
    assert [run["attempt"] for run in runs] == [0, 1], runs
    assert runs[1]["start"] >= answered - SLACK, "the retry ran while its attempt's lease was held"


def test_autoretry_for_a_backend_error_rides_out_an_acquire_the_store_refuses(worker: Worker) -> None:
    """``autoretry_for=(BackendError,)``: while the store refuses the worker's acquires (its
    user may not ``SET``, which only acquire.lua calls), the run's BackendError is retried
    by Celery (``retry_backoff``), and a retry after the store answers again takes the key
    and runs the body once. The acquire is made outside the ``run`` that Celery's
    autoretry wraps, so the BackendError used to fail the task at once."""
    tag = uuid.uuid4().hex[:8]
    worker.admin.execute_command("ACL", "SETUSER", worker.user, "-set")
    try:
        result = worker.app.outage_autoretrying.apply_async((tag,), queue=worker.queue)
        retried = f"outage_autoretrying[{result.id}] retry: Retry in"
        looked = wait_until(lambda: result.ready() or retried in worker.text(), FIRST_LOOK)
        assert looked, worker.text()[-6000:]
    finally:
        worker.answer()
    attempt = worker.result(result, 60.0)
    assert attempt >= 1
    assert [run["attempt"] for run in worker.runs(tag)] == [attempt]


def test_a_copy_of_the_retrys_message_is_still_a_copy(worker: Worker) -> None:
    """Without records: while the retry runs, a copy of its message (the same task id,
    ``retries`` and headers, naming attempt 0's fence) finds the retry's own lease, which
    no message names: it is a copy and does not run (dropped), not a retry waiting."""
    result, tag, _ = worker.retried_behind_a_refused_release("retrying_unrecorded", 0.0, True)
    assert worker.admin.blpop([f"{tag}:ready"], timeout=30) is not None, worker.text()[-6000:]
    first, _retry = worker.runs(tag)
    worker.app.retrying_unrecorded.apply_async(
        (tag, 0.0, True),
        task_id=result.id,
        retries=1,
        headers={COOLING_HEADER: [first["fence"]]},
        queue=worker.queue,
    )
    copy = f"redelivered: tests.faults._celery_app.retrying_unrecorded[{result.id}]"
    try:
        assert wait_until(lambda: copy in worker.text(), 30), worker.text()[-6000:]
    finally:
        worker.admin.rpush(f"{tag}:go", 1)
    assert worker.result(result, 30) == 1
    worker.settled(tag)  # the copy, had it waited behind the retry's lease, has run by now
    assert [run["attempt"] for run in worker.runs(tag)] == [0, 1]


@dataclass
class ProxiedWorker(Worker):
    """:class:`Worker` whose store is reached through ``proxy``, which the test can stall."""

    proxy: TcpProxy


@pytest.fixture(scope="module")
def proxied(redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedWorker]:
    """A worker as :func:`worker`'s, its store through a proxy; stopped and deleted afterwards."""
    proxy = TcpProxy(redis_server.port)
    log_dir = tmp_path_factory.mktemp("celery-retry-soft")
    try:
        with acl_app_worker(
            redis_server, "retrysoft", log_dir, ProxiedWorker, proxy, store_port=proxy.port
        ) as worker:
            yield worker
    finally:
        proxy.close()


def test_a_retry_sent_after_its_release_was_interrupted_runs(proxied: ProxiedWorker) -> None:
    """Without records: the store stalls, and the soft time limit interrupts the release
    before ``self.retry()``; the attempt retries again, its lease released already (not
    confirmed by the store). The store then refuses releases (the heartbeat's retry of that
    one), so the lease stays: the retry still tells it from a copy, and runs once the store
    answers (it used to be dropped)."""
    worker = proxied
    tag = uuid.uuid4().hex[:8]
    result = worker.app.retrying_past_soft_limit.apply_async((tag,), queue=worker.queue)
    assert worker.admin.blpop([f"{tag}:ready"], timeout=60) is not None, worker.text()[-6000:]
    try:
        worker.proxy.stall()
        worker.admin.rpush(f"{tag}:go", 1)
        assert wait_until(lambda: worker.admin.llen(f"{tag}:soft"), 10), worker.text()[-6000:]
        worker.refuse_releases()
        worker.proxy.resume()
        held = worker.held_at_first_look("retrying_past_soft_limit", result.id, f"retry:{tag}")
    finally:
        worker.proxy.resume()
        worker.answer()
    answered = time.time()
    assert worker.result(result, SETTLED) == 1
    runs = worker.runs(tag)
    assert [run["attempt"] for run in runs] == [0, 1], runs
    assert runs[0]["fence"] == held.fence
    assert runs[1]["start"] >= answered - SLACK, "the retry ran while its attempt's lease was held"


#: The ttl of the eager test's lease, in seconds.
EAGER_TTL = 4.0


@pytest.mark.parametrize("answers", [True, False], ids=["answers", "refuses-past-ttl"])
def test_an_eager_retry_behind_its_attempts_unreleased_lease_runs_once(
    redis_server: PrivateRedis, answers: bool
) -> None:
    """``task_always_eager`` (the retry runs inline, in the same call): attempt 0's release
    is refused and it retries. The retry waits inline behind that lease (no message to
    re-publish), never running while it is held and never skipped (``on_locked="skip"``):
    it runs once, after the store answered again (as soon as the retry first found that
    lease: its ``lock_contended``; the heartbeat's background release then gets through),
    or, if the store refuses releases for good, once the lease expired (4 s)."""
    import redis
    from celery import Celery

    from celery_exclusive import signals
    from celery_exclusive.task import exclusive_task
    from tests.faults.conftest import acl_user

    admin = redis.Redis(port=redis_server.port, socket_timeout=SOCKET_TIMEOUT)
    answered: list[float] = []
    runs: list[tuple[int, int, float]] = []
    try:
        with acl_user(admin, "ce-eager") as (user, password):

            def answer(sender: Any, key: str, holder: Any, **_: Any) -> None:
                """The store answers again once the retry found attempt 0's lease held."""
                if holder is not None and runs and holder.fence == runs[0][1] and not answered:
                    admin.execute_command("ACL", "SETUSER", user, "+@all")
                    answered.append(time.time())

            app = Celery("eager_retry", broker="memory://", set_as_current=False)
            app.conf.update(
                task_always_eager=True,
                exclusive_url=f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0",
                exclusive_prefix=f"e{uuid.uuid4().hex[:10]}:",
            )

            @exclusive_task(app=app, key="k", ttl=EAGER_TTL, on_locked="skip", shared=False, bind=True)
            def job(self: Any) -> int:
                assert self.lock is not None
                runs.append((self.request.retries, self.lock.fence, time.time()))
                if not self.request.retries:
                    refuse_redis_releases(admin, user)
                    raise self.retry(countdown=0)
                return int(self.request.retries)

            if answers:
                signals.lock_contended.connect(answer, weak=False)
            try:
                assert job.delay().get() == 1
            finally:
                signals.lock_contended.disconnect(answer)
                job.lock_service.close()
    finally:
        admin.close()
    assert [attempt for attempt, _, _ in runs] == [0, 1], runs
    (_, first, began), (_, second, retried) = runs
    assert second != first
    if not answers:
        assert retried >= began + EAGER_TTL - SLACK, "the retry ran while its attempt's lease was held"
    else:
        assert answered, "the retry never found its attempt's lease held"
        assert retried >= answered[0] - SLACK, "the retry ran while its attempt's lease was held"
