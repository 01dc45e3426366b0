"""Pure checks of a stress run's log: each returns the violations it finds (empty means none).

Inputs, all plain data:

* ``events``: the JSON lines of the shared log (see tests/stress/app.py): ``run`` (one per
  critical section: key, fence, start, end, worker, pid, task_id, req, policy), ``pub`` (a
  message published: task_id, parent_id), ``pre`` and ``post`` (an attempt started / ended:
  task_id, key, req, outcome, arrived = when the attempt started).
* ``sent``: what the test enqueued, one dict per task: task_id, key, policy, req.
* ``results``: task_id -> outcome read back from the result backend (``ran``, ``skipped``,
  ``coalesced``, ``failed:LockRetriesExceeded``...), for the tasks the test enqueued.
* ``stranded``: the ``#rerun`` markers found once everything had finished but before the
  closing requests (key), and ``closing_at``, when those requests were sent.

Outcomes: ``ran`` (possibly after lock retries), ``skipped``, ``coalesced`` (recorded for a
rerun), ``failed:LockRetriesExceeded`` (lock retries exhausted), ``retry`` (an attempt that
re-sent itself; never final).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]

#: The final outcomes each policy may end in.
ALLOWED = {
    "skip": {"ran", "skipped"},
    "retry": {"ran", "failed:LockRetriesExceeded"},
    "rerun": {"ran", "coalesced"},
}


def of_kind(events: Iterable[Event], kind: str) -> list[Event]:
    """The events of one kind (``run``, ``pub``, ``pre``, ``post``), in log order."""
    return [event for event in events if event.get("event") == kind]


def _by_key(runs: Iterable[Event]) -> dict[str, list[Event]]:
    keyed: dict[str, list[Event]] = defaultdict(list)
    for run in runs:
        keyed[run["key"]].append(run)
    for group in keyed.values():
        group.sort(key=lambda run: (run["start"], run["end"]))
    return keyed


def _name(run: Event) -> str:
    return f"{run.get('task_id')}(fence {run.get('fence')}, {run.get('start'):.6f}-{run.get('end'):.6f})"


def check_exclusion(runs: Sequence[Event]) -> list[str]:
    """No two critical sections of one key overlap in wall time."""
    violations = []
    for key, group in _by_key(runs).items():
        latest: Event | None = None  # the run ending last among those started so far
        for run in group:
            if run["end"] < run["start"]:
                violations.append(f"{key}: run {_name(run)} ends before it starts")
            if latest is not None and run["start"] < latest["end"]:
                violations.append(f"{key}: overlap: {_name(latest)} and {_name(run)}")
            if latest is None or run["end"] > latest["end"]:
                latest = run
    return violations


def check_fences(runs: Sequence[Event]) -> list[str]:
    """Per key, fences strictly increase in the order the critical sections started."""
    violations = []
    for key, group in _by_key(runs).items():
        for before, after in itertools.pairwise(group):
            if not after["fence"] > before["fence"]:
                violations.append(
                    f"{key}: fence regression: {_name(before)} started first but {_name(after)} "
                    "does not have a larger fence"
                )
    return violations


def final_outcomes(events: Sequence[Event]) -> dict[str, str]:
    """task_id -> the outcome of its last attempt that did not re-send itself, from the log."""
    final: dict[str, str] = {}
    for post in of_kind(events, "post"):
        if post["outcome"] != "retry":
            final[post["task_id"]] = post["outcome"]
        else:
            final.setdefault(post["task_id"], "retry")
    return final


def check_accounting(events: Sequence[Event], sent: Sequence[Event], results: Mapping[str, str]) -> list[str]:
    """Every task enqueued, and every rerun a worker sent, ends in an outcome its policy allows,
    consistent between the result backend and the log: zero lost tasks."""
    violations = []
    runs_of: Counter[str] = Counter(run["task_id"] for run in of_kind(events, "run"))
    final = final_outcomes(events)
    published: Counter[str] = Counter(pub["task_id"] for pub in of_kind(events, "pub"))
    attempted: Counter[str] = Counter(post["task_id"] for post in of_kind(events, "post"))
    sent_ids = {task["task_id"] for task in sent}
    for task in sent:
        task_id, policy = task["task_id"], task["policy"]
        what = f"task {task_id} ({policy}, {task['key']})"
        outcome = results.get(task_id)
        if outcome is None:
            violations.append(f"lost: {what} has no outcome in the result backend")
            continue
        if outcome not in ALLOWED[policy]:
            violations.append(f"{what}: outcome {outcome!r} is not allowed for policy {policy}")
        if final.get(task_id) != outcome:
            violations.append(f"{what}: backend says {outcome!r}, the log says {final.get(task_id)!r}")
        expected_runs = 1 if outcome == "ran" else 0
        if runs_of[task_id] != expected_runs:
            violations.append(f"{what}: outcome {outcome!r} but {runs_of[task_id]} critical sections logged")
    reruns = [task_id for task_id in published if task_id not in sent_ids]
    for task_id in reruns:
        outcome = final.get(task_id)
        if outcome not in ALLOWED["rerun"]:
            violations.append(f"lost: rerun {task_id} was sent but ended in {outcome!r}")
        elif runs_of[task_id] != (1 if outcome == "ran" else 0):
            violations.append(f"rerun {task_id}: outcome {outcome!r} but {runs_of[task_id]} runs logged")
    for task_id in sorted(set(published) | set(attempted)):
        if published[task_id] != attempted[task_id]:
            violations.append(
                f"task {task_id}: {published[task_id]} messages published but {attempted[task_id]} attempts"
            )
    for task_id in sorted(set(runs_of) - set(published)):
        violations.append(f"critical section of {task_id}, a task never published")
    return violations


def check_reruns(
    events: Sequence[Event],
    sent: Sequence[Event],
    stranded: Sequence[str] = (),
    closing_at: float | None = None,
) -> list[str]:
    """Every coalesced request is followed by a rerun of its key starting after it arrived (zero
    lost webhooks); every rerun answers such a request; a rerun left pending is only ever left
    by a holder of another policy (which, as documented, does not look for reruns)."""
    violations = []
    sent_ids = {task["task_id"] for task in sent}
    runs = of_kind(events, "run")
    reruns_by_key = _by_key(run for run in runs if run["task_id"] not in sent_ids)
    coalesced = [post for post in of_kind(events, "post") if post["outcome"] == "coalesced"]
    for request in coalesced:
        later = [run for run in reruns_by_key.get(request["key"], []) if run["start"] > request["arrived"]]
        if not later:
            violations.append(
                f"lost webhook: {request['task_id']} ({request['key']}) coalesced at "
                f"{request['arrived']:.6f} and no rerun of its key started afterwards"
            )
    for key, group in reruns_by_key.items():
        for run in group:
            asked = [
                request
                for request in coalesced
                if request["key"] == key
                and request["req"] == run["req"]
                and request["arrived"] < run["start"]
            ]
            if not asked:
                violations.append(f"{key}: rerun {_name(run)} answers no coalesced request")
    by_key = _by_key(runs)
    for key in stranded:
        before = [run for run in by_key.get(key, []) if closing_at is None or run["end"] < closing_at]
        last = max(before, key=lambda run: run["end"], default=None)
        if last is None or last["policy"] == "rerun":
            violations.append(
                f"{key}: a rerun was left pending although the last run of the key "
                f"({'none' if last is None else _name(last)}) had policy rerun"
            )
    return violations


def max_concurrent_keys(runs: Sequence[Event]) -> int:
    """The largest number of distinct keys inside a critical section at the same instant."""
    edges = sorted(
        [(run["start"], 1, run["key"]) for run in runs] + [(run["end"], -1, run["key"]) for run in runs],
        key=lambda edge: (edge[0], edge[1]),  # an end before a start at the same instant
    )
    active: Counter[str] = Counter()
    best = 0
    for _, step, key in edges:
        active[key] += step
        if active[key] <= 0:
            del active[key]
        best = max(best, len(active))
    return best


def check(
    events: Sequence[Event],
    sent: Sequence[Event],
    results: Mapping[str, str],
    stranded: Sequence[str] = (),
    closing_at: float | None = None,
) -> list[str]:
    """Every check above, on one stress run."""
    runs = of_kind(events, "run")
    return [
        *check_exclusion(runs),
        *check_fences(runs),
        *check_accounting(events, sent, results),
        *check_reruns(events, sent, stranded, closing_at),
    ]


def summary(events: Sequence[Event], sent: Sequence[Event], results: Mapping[str, str]) -> dict[str, int]:
    """The figures of a run: tasks enqueued, runs, skips, coalesced, reruns, lock retries..."""
    sent_ids = {task["task_id"] for task in sent}
    runs = of_kind(events, "run")
    posts = of_kind(events, "post")
    outcomes = Counter(results.get(task["task_id"], "missing") for task in sent)
    ran_after_retry = {run["task_id"] for run in runs if run["task_id"] in sent_ids and run["lock_retries"]}
    return {
        "enqueued": len(sent),
        "runs": len(runs),
        "ran": outcomes["ran"],
        "skipped": sum(post["outcome"] == "skipped" for post in posts),
        "coalesced": sum(post["outcome"] == "coalesced" for post in posts),
        "reruns_sent": len({pub["task_id"] for pub in of_kind(events, "pub")} - sent_ids),
        "reruns_ran": sum(run["task_id"] not in sent_ids for run in runs),
        "lock_retries": sum(post["outcome"] == "retry" for post in posts),
        "retried_then_ran": len(ran_after_retry),
        "retries_exhausted": outcomes["failed:LockRetriesExceeded"],
        "leases_lost": sum(bool(run.get("lost")) for run in runs),
        "keys": len({run["key"] for run in runs}),
        "max_concurrent_keys": max_concurrent_keys(runs),
    }
