"""Stress: 2 prefork workers x 2 processes, 5 keys, skip/retry/rerun mixed on the same keys.

For a set time the test enqueues tasks of the three policies on the same five keys at random
intervals (single requests and bursts, short and long bodies), plus the lost-update oracle
(an unprotected read-modify-write of a Redis counter under its own lock, policy retry), on
PostgreSQL and on Redis as the lock store (``CE_LONG=1`` adds SQLite and MariaDB). Workers
log every critical section and every attempt to an append-only file (tests/stress/app.py);
tests/stress/checker.py then checks the log: no overlap, fences increasing, every task
accounted for, zero lost webhooks.

Short mode (CI): 15 s of enqueuing per store. ``CE_LONG=1``: 150 s per store;
``CE_STRESS_SECONDS`` overrides either, ``CE_STRESS_SEED`` fixes the random mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from celery_exclusive import LockService
from celery_exclusive.task import RERUN_SUFFIX
from tests.celery.conftest import (
    Process,
    delete_redis_prefix,
    drop_sql_table,
    spawn,
    stop_all,
    wait_ready,
)
from tests.conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_server, with_option
from tests.stress import app as stress
from tests.stress import checker

LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
SECONDS = float(os.environ.get("CE_STRESS_SECONDS") or (150 if LONG else 15))
KEYS = 5
WORKERS = 2
CONCURRENCY = 2
#: How long the workers get to finish everything after the last enqueue.
DRAIN_TIMEOUT = 90 + SECONDS / 2
POLICIES = {"skip": stress.stress_skip, "retry": stress.stress_retry, "rerun": stress.stress_rerun}

pytestmark = pytest.mark.timeout(int(2 * SECONDS + DRAIN_TIMEOUT + 120))


# -- workers -------------------------------------------------------------------------------


@dataclass
class StressGroup:
    """Worker subprocesses on one lock store and queue, and the log they share with the test."""

    store: str
    url: str
    prefix: str
    queue: str
    log: Path
    counter: str
    workers: list[Process] = field(default_factory=list)

    def events(self) -> list[dict[str, Any]]:
        """Every line of the shared log so far."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def dump(self) -> str:
        """The tail of every worker's log, for a failure report."""
        return "\n".join(f"===== {p.name} ({p.log}) =====\n{p.text()[-20000:]}" for p in self.workers)


def spawn_worker(name: str, env: dict[str, str], logdir: Path, queue: str) -> Process:
    """Start ``celery -A tests.stress.app worker`` (prefork) in a new process group."""
    args = [
        "worker",
        "-P",
        "prefork",
        "-c",
        str(CONCURRENCY),
        "-n",
        f"{name}@%h",
        "-Q",
        queue,
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    return spawn(name, args, env, logdir, app="tests.stress.app")


#: The stores the Celery stress runs on; CE_LONG=1 adds SQLite and MariaDB (every store's
#: fence order is also checked, in CI, by test_fence_order.py without Celery).
STORES = ["postgres", "redis", *(["sqlite", "mariadb"] if LONG else [])]


@pytest.fixture(params=STORES)
def group(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StressGroup]:
    """Two prefork workers of two processes on one lock store; stopped and cleaned up afterwards."""
    store: str = request.param
    require_server(stress.BROKER)
    tag = uuid.uuid4().hex[:8]
    table = f"ce_stress_{tag}"
    if store == "postgres":
        require_server(POSTGRES_URL)
        url = with_option(POSTGRES_URL, "table", table)
    elif store == "mariadb":
        require_server(MYSQL_URL)
        url = with_option(MYSQL_URL, "table", table)
    elif store == "sqlite":
        url = f"sqlite:///{tmp_path / 'stress.sqlite3'}"
    else:
        require_server(REDIS_URL)
        url = REDIS_URL
    group = StressGroup(
        store=store,
        url=url,
        prefix=f"cestress{tag}:",
        queue=f"{stress.KEYPREFIX}{tag}",
        log=tmp_path / "stress.jsonl",
        counter=f"{stress.KEYPREFIX}counter:{tag}",
    )
    env = {
        "CE_STRESS_BROKER": stress.BROKER,
        "CE_STRESS_KEYPREFIX": stress.KEYPREFIX,
        "CE_STRESS_QUEUE": group.queue,
        "CE_STRESS_LOG": str(group.log),
        "CE_STRESS_COUNTER": group.counter,
        "CELERY_EXCLUSIVE_URL": url,
        "CELERY_EXCLUSIVE_PREFIX": group.prefix,
    }
    monkeypatch.setenv("CE_STRESS_LOG", str(group.log))  # the test's own publishes are logged too
    try:
        for index in range(WORKERS):
            group.workers.append(spawn_worker(f"stress-{store}{index}-{tag}", env, tmp_path, group.queue))
        wait_ready(group.workers)
        yield group
    finally:
        stop_all(group.workers)
        with contextlib.suppress(Exception):
            delete_redis_prefix(stress.BROKER, stress.KEYPREFIX)
        if store == "redis":
            delete_redis_prefix(REDIS_URL, group.prefix)
        elif store in ("postgres", "mariadb"):
            drop_sql_table(POSTGRES_URL if store == "postgres" else MYSQL_URL, table)


# -- load ------------------------------------------------------------------------------------


def send(group: StressGroup, sent: list[dict[str, Any]], policy: str, key_id: str, duration: float) -> None:
    """Enqueue one stress task and remember it."""
    req = uuid.uuid4().hex[:12]
    result = POLICIES[policy].apply_async(
        kwargs={"key_id": key_id, "req": req, "duration": duration}, queue=group.queue
    )
    sent.append({"task_id": result.id, "key": f"stress:{key_id}", "policy": policy, "req": req})


def send_counter(group: StressGroup, sent: list[dict[str, Any]], pause: float) -> None:
    """Enqueue one increment of the lost-update oracle."""
    req = uuid.uuid4().hex[:12]
    result = stress.counter_increment.apply_async(kwargs={"req": req, "pause": pause}, queue=group.queue)
    sent.append({"task_id": result.id, "key": "counter", "policy": "retry", "req": req})


def enqueue(group: StressGroup, rng: random.Random, seconds: float) -> list[dict[str, Any]]:
    """Random single requests and bursts of the three policies on the same keys, for ``seconds``."""
    sent: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key_id = str(rng.randrange(KEYS))
        policy = rng.choices(list(POLICIES), weights=[4, 3, 3])[0]
        burst = 1 if rng.random() < 0.8 else rng.randint(2, 5)
        for _ in range(burst):
            long_body = rng.random() < 0.08
            send(group, sent, policy, key_id, rng.uniform(0.6, 1.5) if long_body else rng.uniform(0.02, 0.25))
        if rng.random() < 0.08:
            for _ in range(rng.randint(2, 4)):
                send_counter(group, sent, rng.uniform(0.005, 0.03))
        time.sleep(rng.expovariate(1 / 0.1))
    return sent


def quiescent(group: StressGroup, sent: list[dict[str, Any]]) -> bool:
    """Every task sent has a final outcome and every message published was attempted."""
    events = group.events()
    final = checker.final_outcomes(events)
    if any(final.get(task["task_id"], "retry") == "retry" for task in sent):
        return False
    published = len(checker.of_kind(events, "pub"))
    return published == len(checker.of_kind(events, "post"))


def drain(group: StressGroup, sent: list[dict[str, Any]], timeout: float) -> bool:
    """Wait until quiescent twice in a row (no rerun or retry in flight); False on timeout."""
    deadline = time.monotonic() + timeout
    streak = 0
    while time.monotonic() < deadline:
        streak = streak + 1 if quiescent(group, sent) else 0
        if streak >= 2:
            return True
        time.sleep(0.5)
    return False


def pending_reruns(service: LockService) -> list[str]:
    """The keys whose ``#rerun`` marker is held: reruns recorded but not sent yet."""
    return [f"stress:{k}" for k in range(KEYS) if service.peek(f"stress:{k}{RERUN_SUFFIX}") is not None]


def backend_outcomes(sent: list[dict[str, Any]]) -> dict[str, str]:
    """task_id -> outcome, read back from the result backend (no waiting: all are final)."""
    outcomes = {}
    for task in sent:
        result = stress.app.AsyncResult(task["task_id"])
        if result.state in ("SUCCESS", "FAILURE"):
            value = result.result
            outcomes[task["task_id"]] = stress.outcome_of(result.state, value)
    return outcomes


def unlocked_counter(group: StressGroup, n: int) -> int:
    """Run ``n`` unprotected increments at once and return the counter (below n: updates lost)."""
    counter = group.counter + ":unlocked"
    results = [
        stress.counter_increment_unlocked.apply_async((counter, 0.05), queue=group.queue) for _ in range(n)
    ]
    for result in results:
        result.get(timeout=60)
    return int(stress.redis_client().get(counter) or 0)


# -- the stress test -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.celery
def test_stress_mixed_policies(group: StressGroup) -> None:
    """Mixed skip/retry/rerun load on shared keys: no overlap, increasing fences, nothing lost."""
    seed = int(os.environ.get("CE_STRESS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    started = time.monotonic()
    sent = enqueue(group, rng, SECONDS)
    enqueued_for = time.monotonic() - started
    drained = drain(group, sent, DRAIN_TIMEOUT)
    # Reruns recorded behind a skip/retry holder wait for the key's next rerun-policy run to
    # finish (docs/celery.md: only "rerun" tasks look for the marker). A closing request per
    # key is that next run: it must send every rerun still pending.
    service = LockService(group.url, prefix=group.prefix)
    try:
        stranded = pending_reruns(service)
        closing_at = time.time()
        for key_id in range(KEYS):
            send(group, sent, "rerun", str(key_id), 0.01)
        drained = drain(group, sent, DRAIN_TIMEOUT) and drained
        left = pending_reruns(service)
    finally:
        service.close()
    drained_for = time.monotonic() - started - enqueued_for
    events = group.events()
    results = backend_outcomes(sent)
    violations = checker.check(events, sent, results, stranded, closing_at)
    if not drained:
        violations.append(f"not quiescent {DRAIN_TIMEOUT:.0f} s after the last enqueue")
    violations += [f"{key}: a rerun is still pending at the end" for key in left]
    counter_sent = sum(task["key"] == "counter" for task in sent)
    counter = int(stress.redis_client().get(group.counter) or 0)
    if counter != counter_sent:
        violations.append(f"lost update: counter is {counter} after {counter_sent} locked increments")
    unlocked = unlocked_counter(group, 20)
    figures = {
        "store": group.store,
        "seed": seed,
        "enqueue_s": round(enqueued_for, 1),
        "drain_s": round(drained_for, 1),
        **checker.summary(events, sent, results),
        "stranded_reruns": len(stranded),
        "counter": f"{counter}/{counter_sent}",
        "unlocked_counter": f"{unlocked}/20",
        "violations": len(violations),
    }
    print("stress summary: " + json.dumps(figures))
    if violations:
        print(group.dump())
    assert not violations, "\n".join(violations[:50])
    assert unlocked < 20, "the unprotected counter lost no update: the oracle could not detect one"


# -- the checker can fail ----------------------------------------------------------------------


def _run(task_id: str, fence: int, start: float, end: float, *, key: str = "stress:0", **extra: Any) -> dict:
    return {
        "event": "run",
        "key": key,
        "fence": fence,
        "start": start,
        "end": end,
        "task_id": task_id,
        "req": extra.pop("req", task_id),
        "policy": extra.pop("policy", "skip"),
        "lock_retries": 0,
        **extra,
    }


def _attempt(
    task_id: str, outcome: str, arrived: float, *, key: str = "stress:0", req: str = ""
) -> list[dict]:
    return [
        {"event": "pub", "task_id": task_id},
        {
            "event": "post",
            "task_id": task_id,
            "key": key,
            "req": req or task_id,
            "outcome": outcome,
            "arrived": arrived,
        },
    ]


def _clean_log() -> tuple[list[dict], list[dict], dict[str, str]]:
    """Three runs in turn, one skip, one coalesced request answered by a rerun."""
    events = [
        *_attempt("a", "ran", 0.0),
        _run("a", 1, 0.0, 1.0),
        *_attempt("b", "skipped", 0.5),
        *_attempt("c", "coalesced", 0.6, req="rc"),
        *_attempt("r", "ran", 1.1, req="rc"),
        _run("r", 2, 1.1, 1.2, req="rc", policy="rerun"),
        *_attempt("d", "ran", 1.3),
        _run("d", 3, 1.3, 1.4, policy="retry"),
    ]
    sent = [
        {"task_id": "a", "key": "stress:0", "policy": "skip", "req": "a"},
        {"task_id": "b", "key": "stress:0", "policy": "skip", "req": "b"},
        {"task_id": "c", "key": "stress:0", "policy": "rerun", "req": "rc"},
        {"task_id": "d", "key": "stress:0", "policy": "retry", "req": "d"},
    ]
    results = {"a": "ran", "b": "skipped", "c": "coalesced", "d": "ran"}
    return events, sent, results


def test_checker_passes_a_clean_log() -> None:
    """A hand-made log without faults gives no violations and the expected figures."""
    events, sent, results = _clean_log()
    assert checker.check(events, sent, results) == []
    figures = checker.summary(events, sent, results)
    assert figures["runs"] == 3
    assert figures["skipped"] == 1
    assert figures["coalesced"] == 1
    assert figures["reruns_ran"] == 1


def test_checker_finds_an_overlap() -> None:
    """Two critical sections of one key that overlap in time are reported."""
    runs = [_run("a", 1, 0.0, 1.0), _run("b", 2, 0.9, 1.5), _run("c", 3, 2.0, 2.1, key="stress:1")]
    violations = checker.check_exclusion(runs)
    assert len(violations) == 1
    assert "overlap" in violations[0]
    assert "a(" in violations[0]
    assert "b(" in violations[0]


def test_checker_finds_an_overlap_hidden_behind_a_short_run() -> None:
    """A long run overlapping a later run past a short one in between is still reported."""
    runs = [_run("a", 1, 0.0, 5.0), _run("b", 2, 1.0, 1.1), _run("c", 3, 2.0, 2.1)]
    assert len(checker.check_exclusion(runs)) == 2


def test_checker_finds_a_fence_regression() -> None:
    """A later critical section of a key with a smaller (or equal) fence is reported."""
    runs = [_run("a", 5, 0.0, 1.0), _run("b", 4, 1.5, 2.0), _run("c", 4, 2.5, 3.0)]
    violations = checker.check_fences(runs)
    assert len(violations) == 2
    assert all("fence regression" in violation for violation in violations)
    assert checker.check_exclusion(runs) == []


def test_checker_finds_a_lost_task() -> None:
    """A task enqueued but never attempted, without a result, is reported as lost."""
    events, sent, results = _clean_log()
    sent.append({"task_id": "e", "key": "stress:0", "policy": "retry", "req": "e"})
    events.append({"event": "pub", "task_id": "e"})
    violations = checker.check(events, sent, results)
    assert any(v.startswith("lost: task e") for v in violations)
    assert any("task e: 1 messages published but 0 attempts" in v for v in violations)


def test_checker_finds_a_result_without_its_run() -> None:
    """A task whose result says it ran but whose critical section is missing from the log is reported."""
    events, sent, results = _clean_log()
    events = [event for event in events if not (event["event"] == "run" and event["task_id"] == "d")]
    violations = checker.check(events, sent, results)
    assert violations == ["task d (retry, stress:0): outcome 'ran' but 0 critical sections logged"]


def test_checker_finds_a_forbidden_outcome() -> None:
    """A retry-policy task that was skipped breaks its policy and is reported."""
    events, sent, results = _clean_log()
    events = [event for event in events if event.get("task_id") != "d"] + _attempt("d", "skipped", 1.3)
    results["d"] = "skipped"
    violations = checker.check(events, sent, results)
    assert violations == ["task d (retry, stress:0): outcome 'skipped' is not allowed for policy retry"]


def test_checker_finds_a_lost_webhook() -> None:
    """A coalesced request with no rerun starting after it arrived is reported."""
    events, sent, results = _clean_log()
    events = [event for event in events if event.get("task_id") != "r"]
    violations = checker.check(events, sent, results)
    assert any(v.startswith("lost webhook: c") for v in violations)


def test_checker_finds_a_rerun_that_started_too_early() -> None:
    """A rerun that started before the coalesced request arrived does not answer it."""
    events, sent, results = _clean_log()
    for event in events:
        if event.get("task_id") == "c" and event["event"] == "post":
            event["arrived"] = 1.15
    violations = checker.check(events, sent, results)
    assert any(v.startswith("lost webhook: c") for v in violations)
    assert any("answers no coalesced request" in v for v in violations)


def test_checker_finds_a_rerun_left_by_a_rerun_holder() -> None:
    """A rerun left pending when the key's last run had policy rerun is reported; after retry it is not."""
    events, sent, results = _clean_log()
    assert checker.check(events, sent, results, stranded=["stress:0"], closing_at=5.0) == []
    events[-1]["policy"] = "rerun"
    violations = checker.check(events, sent, results, stranded=["stress:0"], closing_at=5.0)
    assert len(violations) == 1
    assert "left pending" in violations[0]


def test_max_concurrent_keys() -> None:
    """Concurrent keys are counted across keys, never within one."""
    runs = [
        _run("a", 1, 0.0, 1.0, key="k1"),
        _run("b", 1, 0.5, 1.5, key="k2"),
        _run("c", 1, 0.7, 0.8, key="k3"),
        _run("d", 2, 1.0, 2.0, key="k1"),
    ]
    assert checker.max_concurrent_keys(runs) == 3
