"""``self.replace(sig)`` by an exclusive run: the replacement, which Celery gives the run's
own task id (a single signature; the last task of a chain), must run once, never be taken
for a copy of the run it replaced.

The run releases its lease before the replacement is sent, but the store refuses that
release (the worker's Redis ACL user may not ``HDEL`` or ``DEL``; on PostgreSQL, the worker's role may
not ``DELETE`` from the lock table: see :mod:`tests.faults.test_retry_lingering_lease`), so
the lease stays until the heartbeat's background release gets through (or its ttl, 20 s). A
replacement of the same key and task id delivered meanwhile finds it; and a run that retried
before it replaced itself left a completion record (``retried``, attempt 0) that the
replacement (attempt 0 again) finds. The short mode runs two of the PostgreSQL cases
(:data:`PG_SHORT`); ``CE_LONG=1``: all.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from celery_exclusive.redelivery import ATTEMPTS_HEADER
from tests.faults.conftest import LONG, SLACK, shared_worker, wait_until
from tests.faults.test_retry_lingering_lease import SETTLED, Worker, on_store, pg_module_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


worker = shared_worker(Worker)
pg_worker = pg_module_worker("replacepg")

#: The cases the short mode runs on PostgreSQL: (test, task, how). ``CE_LONG=1``: all, and
#: :func:`test_a_replacement_after_a_retry_behind_its_unreleased_lease_runs` on Redis too.
PG_SHORT = {
    ("unreleased", "replacing", ""),
    ("retried-unreleased", "replacing", "retried-held"),
}


def on(request: pytest.FixtureRequest, store: str, case: tuple[str, str, str]) -> Worker:
    """The worker of ``store`` ("redis", "postgres") for ``case`` (:func:`on_store`); skips
    a case the short mode leaves out (:data:`PG_SHORT`)."""
    if store == "postgres" and not LONG and case not in PG_SHORT:
        pytest.skip("the short mode runs two PostgreSQL cases (CE_LONG=1: all)")
    return on_store(request, store)


#: The replacements whose task of the replaced run's key has an id of its own: a chain's
#: first or middle task, a group's (Celery's ``accumulate`` takes the run's id).
OWN_ID = {"chain-first", "chain-middle", "group"}


def replaced_behind_a_refused_release(worker: Worker, task: str, how: str) -> tuple[Any, str, float]:
    """Stage 0 of ``task`` (under ``"retried-held"``: its attempt 1) replaces itself
    (``how``) while the store refuses its release; the store answers again once the
    replacement of the same key (the one that takes the run's task id, or under
    :data:`OWN_ID` the one under an id of its own) has looked at the key and found the
    lease still there (``held_at_first_look``). The result, the tag, and when the store
    answered again."""
    tag = uuid.uuid4().hex[:8]
    result = getattr(worker.app, task).apply_async((tag, 0, how), queue=worker.queue)
    try:
        assert worker.admin.blpop([f"{tag}:ready"], timeout=60) is not None, worker.text()[-4000:]
        worker.refuse_releases()
        waited = len(worker.text())  # a look before (a retry's at its attempt's lease) aside
        worker.admin.rpush(f"{tag}:go", 1)
        looker = None if how in OWN_ID else result.id
        worker.held_at_first_look(task, looker, f"replace:{tag}", waited)
    finally:
        worker.answer()
    return result, tag, time.time()


STORES = pytest.mark.parametrize("store", ["redis", "postgres"])


@STORES
@pytest.mark.parametrize("task", ["replacing", "replacing_unrecorded"])
@pytest.mark.parametrize("how", ["", "chain"])
def test_a_replacement_behind_its_runs_unreleased_lease_runs_once_that_lease_is_gone(
    request: pytest.FixtureRequest, store: str, task: str, how: str
) -> None:
    """The replacement (the same task and key, the same task id; or the last task of a
    chain, which takes the id) runs once, soon after the store answered again: not taken
    for a copy (deferred to the lease's ttl with records, dropped without)."""
    worker = on(request, store, ("unreleased", task, how))
    result, tag, answered = replaced_behind_a_refused_release(worker, task, how)
    assert worker.result(result, SETTLED) == 1
    worker.settled(tag)  # a second run of the replacement has started by now, if any was sent
    runs = worker.runs(tag)
    assert [run["stage"] for run in runs] == [0, 1], runs
    assert runs[1]["id"] == result.id
    assert runs[1]["start"] >= answered - SLACK, "the replacement ran while the lease was held"
    assert f"redelivered: tests.faults._celery_app.{task}[{result.id}]" not in worker.text()
    if how == "chain":
        assert worker.admin.llen(f"{tag}:noted") == 1


@STORES
@pytest.mark.parametrize("how", ["chain-first", "chain-middle"])
def test_a_replacement_chains_first_task_behind_its_runs_unreleased_lease_runs(
    request: pytest.FixtureRequest, store: str, how: str
) -> None:
    """The chain's first task (a new task id, its parent the replaced run's; the chain's
    last task takes the run's id), or its middle one (its parent the first), locks the same
    key: it waits for the replaced run's lease, as a retry does, and runs once (it met that
    lease as any other holder: under ``on_locked="skip"`` it was skipped; the middle one
    until its message named the replaced run's id, header ``celery_exclusive_replaced``).
    The middle one under ``CE_LONG=1`` only."""
    if how == "chain-middle" and not LONG:
        pytest.skip("the short mode runs a chain's first task (CE_LONG=1: its middle one too)")
    worker = on(request, store, ("unreleased", "replacing", how))
    result, tag, answered = replaced_behind_a_refused_release(worker, "replacing", how)
    assert worker.result(result, SETTLED) is None  # the chain's last task: noted
    runs = worker.runs(tag)
    assert [run["stage"] for run in runs] == [0, 1], runs
    assert runs[1]["id"] != result.id
    assert runs[1]["start"] >= answered - SLACK, "the replacement ran while the lease was held"
    assert worker.admin.llen(f"{tag}:noted") == (1 if how == "chain-first" else 2)


def test_a_replacement_after_a_retry_runs(worker: Worker) -> None:
    """Attempt 0 retries (its record: ``retried``, attempt 0), attempt 1 replaces itself:
    the replacement, attempt 0 of the same task id again, is no copy of attempt 0 (it was
    ended as ``already_done``: lost)."""
    tag = uuid.uuid4().hex[:8]
    result = worker.app.replacing.apply_async((tag, 0, "retried"), queue=worker.queue)
    assert worker.result(result, 30) == 1
    runs = worker.runs(tag)
    assert [(run["stage"], run["attempt"]) for run in runs] == [(0, 0), (0, 1), (1, 0)], runs


#: The group and chord cases the short mode runs: (task, how), each a run that was lost.
#: ``CE_LONG=1``: all four.
GROUPED_SHORT = {("replacing", "group"), ("replacing_unrecorded", "chord")}


@pytest.mark.parametrize("task", ["replacing", "replacing_unrecorded"])
@pytest.mark.parametrize("how", ["group", "chord"])
def test_a_replacement_group_or_chord_behind_its_runs_unreleased_lease_runs_once_that_lease_is_gone(
    worker: Worker, task: str, how: str
) -> None:
    """The run replaces itself by a group (the same task and key beside a run of
    :func:`~tests.faults._celery_app.noted`, each under an id of its own; Celery's
    ``accumulate`` takes the run's id) or a chord (a run of ``noted``, then the same task
    and key as the body, which takes the id). The task of the same key runs once, soon
    after the store answered again. Before, the group's met the replaced run's lease as
    any other holder's and was skipped (lost, records on or off); the chord's body was
    taken for a copy: deferred to the lease's ttl with records, dropped (lost, its result
    never stored) without."""
    if not LONG and (task, how) not in GROUPED_SHORT:
        pytest.skip("the short mode runs two of the four group and chord cases (CE_LONG=1: all)")
    result, tag, answered = replaced_behind_a_refused_release(worker, task, how)
    assert worker.result(result, SETTLED) == ([1, None] if how == "group" else 1)
    worker.settled(tag)  # a second run of the task has started by now, if any was sent
    runs = worker.runs(tag)
    assert [run["stage"] for run in runs] == [0, 1], runs
    assert (runs[1]["id"] == result.id) is (how == "chord"), runs
    assert runs[1]["start"] >= answered - SLACK, "the replacement ran while the lease was held"
    assert worker.admin.llen(f"{tag}:noted") == 1
    assert f"redelivered: tests.faults._celery_app.{task}[{result.id}]" not in worker.text()
    assert f"is part of the replacement of run {result.id}, and lock 'replace:{tag}'" in worker.text()


@STORES
def test_a_replacement_after_a_retry_behind_its_unreleased_lease_runs(
    request: pytest.FixtureRequest, store: str
) -> None:
    """Attempt 0 retries (its record: ``retried``, attempt 0), attempt 1 replaces itself
    while the store refuses its release: the replacement (attempt 0 of the same task id
    again, counted as attempt 1; naming attempt 1's lease) is neither ended by attempt 0's
    record nor taken for a copy of attempt 1: it runs once, soon after the store answered
    again."""
    if store == "redis" and not LONG:
        pytest.skip("the short mode runs this case on PostgreSQL (CE_LONG=1: Redis too)")
    worker = on(request, store, ("retried-unreleased", "replacing", "retried-held"))
    result, tag, answered = replaced_behind_a_refused_release(worker, "replacing", "retried-held")
    assert worker.result(result, SETTLED) == 1
    worker.settled(tag)  # a second run of the replacement has started by now, if any was sent
    runs = worker.runs(tag)
    assert [(run["stage"], run["attempt"]) for run in runs] == [(0, 0), (0, 1), (1, 0)], runs
    assert runs[2]["start"] >= answered - SLACK, "the replacement ran while the lease was held"
    assert f"redelivered: tests.faults._celery_app.replacing[{result.id}]" not in worker.text()
    assert f"already_done: tests.faults._celery_app.replacing[{result.id}]" not in worker.text()


def test_a_copy_of_a_killed_replacement_does_not_run(worker: Worker) -> None:
    """A replacement sent by a retry (attempt 1 of its task id, though its own ``retries``
    is 0) killed at its hard time limit: the worker's main process records its failure at
    that attempt, so a copy of its message ends as ``already_done`` (the record named
    attempt 0, and the copy ran the body again)."""
    from billiard.exceptions import TimeLimitExceeded

    tag = uuid.uuid4().hex[:8]
    result = worker.app.replaced_then_killed.apply_async((tag,), queue=worker.queue)
    raw = worker.admin.blpop([f"{tag}:ready"], timeout=60)
    assert raw is not None, worker.text()[-4000:]
    with pytest.raises(TimeLimitExceeded):
        worker.result(result, 30)
    worker.app.replaced_then_killed.apply_async(
        (tag, 1), task_id=result.id, headers={ATTEMPTS_HEADER: 1}, queue=worker.queue
    )
    done = f"already_done: tests.faults._celery_app.replaced_then_killed[{result.id}]"
    assert wait_until(lambda: done in worker.text(), 30), worker.text()[-6000:]
    assert worker.admin.llen(f"{tag}:ready") == 0, "the copy ran"
