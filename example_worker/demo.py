"""The demo behind ``scripts/demo``: real workers contend for locks, and a timeline shows it.

    python -m example_worker.demo [--backend sqlite|postgres|redis] [--short] [--data-dir DIR]
    python -m example_worker.demo --attach     # send the work to workers already running

It starts two ``celery worker`` processes of two pool processes each, plus ``celery beat``
(the very commands docker-compose.yml runs: :data:`WORKER_COMMAND`, :data:`BEAT_COMMAND`),
sends work that contends for the same keys, stops beat, waits until every task message
sent (by the demo, by beat, or by a worker: lock retries and reruns) has finished, stops
the workers and reads the run records. It prints a timeline of who ran, skipped, retried
or coalesced which key when, and ends with one line::

    CHECK: no two runs of one key overlapped (N runs, K keys)

or ``CHECK FAILED: ...`` and exit status 1 if two runs of a key overlapped, fences went
backwards, or a task is unaccounted for (never finished, failed, or left no record).
Workers and beat are always stopped on exit, also on Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

#: The worker command, also in docker-compose.yml (tests/test_compose.py compares them).
WORKER_COMMAND = (
    "celery",
    "-A",
    "example_worker.app",
    "worker",
    "--concurrency",
    "2",
    "--loglevel",
    "INFO",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
)
#: The beat command, also in docker-compose.yml. The schedule file is set by the app's config.
BEAT_COMMAND = ("celery", "-A", "example_worker.app", "beat", "--loglevel", "INFO")
#: The demo's workers; docker-compose.yml has one service of each name.
WORKER_NAMES = ("worker1", "worker2")
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT = 15.0


def worker_command(name: str) -> list[str]:
    """The command that runs worker ``name`` (its node name is ``name@<host>``)."""
    return [*WORKER_COMMAND, "--hostname", f"{name}@%h"]


def beat_command() -> list[str]:
    """The command that runs beat."""
    return list(BEAT_COMMAND)


@dataclass(frozen=True)
class Plan:
    """How much work the demo sends, and how long things take (seconds)."""

    rollup_every: float  # beat interval of rollup_stats
    rollup_seconds: float  # one rollup: longer than its interval
    beat_phase: float  # how long beat keeps sending after the workers are ready
    sync_ids: tuple[int, ...]  # community work items to sync ...
    sync_copies: int  # ... each sent this many times at once
    sync_seconds: float
    webhook_repos: tuple[str, ...]
    webhook_deliveries: int  # deliveries per repo, webhook_gap apart
    webhook_gap: float
    webhook_seconds: float
    import_accounts: tuple[str, ...]
    import_uploads: int  # uploads per account, all sent at once
    import_seconds: float
    settle_timeout: float  # how long to wait for the last tasks after beat stopped


SHORT = Plan(
    rollup_every=2,
    rollup_seconds=3,
    beat_phase=8,
    sync_ids=(1, 2),
    sync_copies=3,
    sync_seconds=1.0,
    webhook_repos=("acme/api",),
    webhook_deliveries=4,
    webhook_gap=0.4,
    webhook_seconds=2.5,
    import_accounts=("acct-7",),
    import_uploads=3,
    import_seconds=0.8,
    settle_timeout=30,
)
FULL = Plan(
    rollup_every=3,
    rollup_seconds=5,
    beat_phase=20,
    sync_ids=(1, 2, 3),
    sync_copies=4,
    sync_seconds=1.5,
    webhook_repos=("acme/api", "acme/web"),
    webhook_deliveries=6,
    webhook_gap=0.4,
    webhook_seconds=2.5,
    import_accounts=("acct-7", "acct-9"),
    import_uploads=4,
    import_seconds=0.5,
    settle_timeout=60,
)


class DemoError(Exception):
    """The demo could not run (a worker did not start, the lock store is unreachable...)."""


class Clock:
    """Seconds since the demo started, for progress lines and the timeline."""

    def __init__(self) -> None:
        self.t0 = time.time()

    def since(self, when: float) -> float:
        """``when`` (a time.time() value) relative to the start."""
        return when - self.t0

    def say(self, message: str) -> None:
        """Print one progress line."""
        print(f"[{time.time() - self.t0:6.1f}s] {message}", flush=True)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Process:
    """A worker or beat we started: in its own process group, its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    killed: bool = False

    def text(self) -> str:
        """The log so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 25) -> str:
        """The last lines of the log."""
        return "\n".join(self.text().splitlines()[-lines:])

    def terminate(self) -> None:
        """Ask for a warm shutdown: SIGTERM to the main process only (it stops its pool itself)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL whatever is left of the process group (pool children too), and reap; once."""
        if self.killed:
            return
        self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # the group is ours alone: new session
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def stop(processes: Sequence[Process], timeout: float = STOP_TIMEOUT) -> None:
    """Warm-shut down all of ``processes`` at once; kill what is left after ``timeout``."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        process.kill()


def celery_executable() -> str:
    """The ``celery`` script of this interpreter's environment."""
    beside = Path(sys.executable).with_name("celery")
    if beside.exists():
        return str(beside)
    found = shutil.which("celery")
    if found is None:
        raise DemoError("the 'celery' command is not installed in this environment")
    return found


def spawn(name: str, argv: Sequence[str], env: dict[str, str], logs: Path) -> Process:
    """Start ``argv`` (a command starting with ``celery``) in a new session, output to a log."""
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [celery_executable(), *argv[1:]],
            cwd=PACKAGE_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Process(name, popen, log)


def wait_ready(workers: list[Process], timeout: float = 60.0) -> None:
    """Wait until every worker logged that it is ready."""
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        pending = [w for w in pending if " ready." not in w.text()]
        for worker in pending:
            if worker.popen.poll() is not None:
                raise DemoError(
                    f"{worker.name} exited with status {worker.popen.returncode}:\n{worker.tail()}"
                )
        if pending and time.monotonic() > deadline:
            raise DemoError(f"{', '.join(w.name for w in pending)} not ready after {timeout:g} s")
        time.sleep(0.1)


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt, so cleanup runs as on Ctrl-C; and make
    SIGINT raise it too even if it was inherited ignored (a shell's background job)."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the work ----------------------------------------------------------------------------------


def send_work(plan: Plan, tasks: ModuleType, clock: Clock) -> None:
    """Send work that contends for keys: duplicates, uploads, and a burst of webhook deliveries."""
    deliveries = itertools.count(1)
    for repo in plan.webhook_repos:
        tasks.handle_webhook.delay(repo, f"d{next(deliveries)}", plan.webhook_seconds)
    for account in plan.import_accounts:
        for upload in range(1, plan.import_uploads + 1):
            tasks.import_upload.delay(account, f"upload-{upload}.csv", plan.import_seconds)
    for work_id in plan.sync_ids:
        for _ in range(plan.sync_copies):
            tasks.sync_community_pr.delay(work_id, plan.sync_seconds)
    clock.say(
        f"sent: sync_community_pr x{plan.sync_copies} for work items {list(plan.sync_ids)} (skip: 0), "
        f"import_upload x{plan.import_uploads} for {list(plan.import_accounts)} (retry), "
        f"handle_webhook for {list(plan.webhook_repos)} (rerun)"
    )
    for _ in range(plan.webhook_deliveries - 1):
        time.sleep(plan.webhook_gap)
        for repo in plan.webhook_repos:
            tasks.handle_webhook.delay(repo, f"d{next(deliveries)}", plan.webhook_seconds)
    clock.say(
        f"sent: {plan.webhook_deliveries - 1} more webhook deliveries per repo, "
        f"{plan.webhook_gap:g} s apart, while the first one runs ({plan.webhook_seconds:g} s)"
    )


# -- accounting and checking -------------------------------------------------------------------


def first_publications(
    recs: list[dict[str, Any]], since: float, include_beat: bool
) -> dict[str, dict[str, Any]]:
    """Task id -> the record of its first publication (lock retries re-send the same id)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in recs:
        if rec.get("kind") != "published" or rec.get("at", 0) < since or not rec.get("task_id"):
            continue
        if rec.get("role") == "beat" and not include_beat:
            continue
        out.setdefault(rec["task_id"], rec)
    return out


#: Outcomes that end a task (a retry does not: the task runs again).
FINAL_OUTCOMES = ("ran", "failed", "skipped", "coalesced")


def recorded_task_ids(recs: list[dict[str, Any]]) -> set[str]:
    """Ids of the tasks whose final outcome is in the run records."""
    return {
        r["task_id"]
        for r in recs
        if r.get("kind") == "run" and r.get("task_id") and r["outcome"] in FINAL_OUTCOMES
    }


def task_states(app: Any, task_ids: list[str]) -> dict[str, tuple[str, Any]]:
    """Task id -> (state, result) from the result backend."""
    states: dict[str, tuple[str, Any]] = {}
    for task_id in task_ids:
        try:
            meta = app.backend.get_task_meta(task_id)
        except Exception:  # a result file being written right now: ask again later
            states[task_id] = ("PENDING", None)
            continue
        states[task_id] = (meta.get("status", "PENDING"), meta.get("result"))
    return states


def wait_settled(
    app: Any,
    records_file: Path,
    clock: Clock,
    *,
    timeout: float,
    include_beat: bool,
    startup_runs: int,
    alive: Callable[[], None],
) -> dict[str, tuple[str, Any]]:
    """Wait until every task sent since the start has finished (and the start-up jobs reported)."""
    from celery import states as celery_states

    from example_worker import records

    deadline = time.monotonic() + timeout
    while True:
        alive()
        recs = records.read(records_file)
        ids = list(first_publications(recs, clock.t0, include_beat))
        found = task_states(app, ids)
        recorded = recorded_task_ids(recs)
        # A skip is recorded by task_postrun, just after its result is stored: wait for both.
        pending = [
            i
            for i, (state, _) in found.items()
            if state not in celery_states.READY_STATES or (state == "SUCCESS" and i not in recorded)
        ]
        startups = sum(1 for r in recs if r.get("kind") == "run" and r.get("task") is None)
        if not pending and startups >= startup_runs:
            return found
        if time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def check(
    recs: list[dict[str, Any]],
    found: dict[str, tuple[str, Any]],
    publications: dict[str, dict[str, Any]],
    startup_runs: int,
) -> tuple[list[str], int, int]:
    """Problems found (none: success), the number of runs, and the number of keys run."""
    problems: list[str] = []
    attempts = [r for r in recs if r.get("kind") == "run"]
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in attempts:
        if rec["outcome"] in ("ran", "failed"):
            runs[rec["key"]].append(rec)
    for key, key_runs in runs.items():
        key_runs.sort(key=lambda r: r["start"])
        for before, after in itertools.pairwise(key_runs):
            if after["start"] < before["end"]:
                problems.append(
                    f"{key}: run of {before['worker']} pid {before['pid']} (fence {before['fence']}) "
                    f"overlapped run of {after['worker']} pid {after['pid']} (fence {after['fence']}) "
                    f"by {before['end'] - after['start']:.3f} s"
                )
            if after["fence"] <= before["fence"]:
                problems.append(f"{key}: fence went from {before['fence']} to {after['fence']}")
    recorded = recorded_task_ids(recs)
    for task_id, publication in publications.items():
        state, result = found.get(task_id, ("PENDING", None))
        what = f"{publication['task'].rsplit('.', 1)[-1]}{publication.get('args') or ''} [{task_id[:8]}]"
        if state == "SUCCESS" and task_id not in recorded:
            problems.append(f"{what} succeeded but left no run record")
        elif state != "SUCCESS":
            problems.append(f"{what} is unaccounted for: {state}" + (f" ({result})" if result else ""))
    startups = sum(1 for r in attempts if r.get("task") is None)
    if startups < startup_runs:
        problems.append(f"only {startups} of {startup_runs} workers reported their start-up job")
    return problems, sum(len(v) for v in runs.values()), len(runs)


# -- the timeline ------------------------------------------------------------------------------


def short_worker(name: Any) -> str:
    """``worker1@host`` -> ``worker1``."""
    return str(name or "?").split("@", 1)[0]


def describe_holder(holder: dict[str, Any] | None) -> str:
    """Who held the key, as the attempt that found it held was told."""
    if not holder:
        return "held (holder gone by the time it looked)"
    return (
        f"held by {short_worker(holder.get('worker'))} pid {holder.get('pid')} (fence {holder.get('fence')})"
    )


HEADER = (
    f"  {'start':>7} {'end':>7}  {'worker':<8} {'pid':>7}  {'key':<22} {'outcome':<10} {'fence':>5}  detail"
)
LEGEND = """\
  RAN        the body ran holding the lock (fence: the lock's fencing number, growing per key)
  RERUN      the one extra run owed to requests that arrived during a run (on_locked="rerun")
  skipped    the key was held: the body did not run (on_locked="skip", or a callable returning 0)
  retry      the key was held: the task was re-sent with a backoff (on_locked="retry")
  coalesced  the key was held: the request was folded into the rerun (on_locked="rerun")"""


def run_details(rec: dict[str, Any], publication: dict[str, Any] | None, rerun: bool) -> list[str]:
    """What the timeline says about a run that held the lock."""
    bits = [f"{rec['end'] - rec['start']:.2f} s"]
    if rec.get("task") is None:
        bits.append("start-up job (worker_ready -> get_lock_service(app).run_exclusive)")
    for field, form in (("result", "returned {}"), ("upload", "{}"), ("delivery", "delivery {}")):
        if field in rec:
            bits.append(form.format(rec[field]))
    if rerun and publication is not None:
        bits.append(f"sent by {short_worker(publication.get('worker'))} when its run ended")
    elif publication is not None and publication.get("role") == "beat":
        bits.append("sent by beat")
    if rec["outcome"] == "failed":
        bits.append(str(rec.get("error")))
    return bits


def held_details(rec: dict[str, Any]) -> list[str]:
    """What the timeline says about an attempt that found the key held."""
    bits = [describe_holder(rec.get("holder"))]
    outcome = rec["outcome"]
    if outcome == "skipped" and "result" in rec:
        bits.append(f"returned {rec['result']}")
    elif outcome == "coalesced":
        bits.append("rerun recorded")
    elif outcome == "retry":
        bits.append(f"retry in {rec.get('countdown', 0):.2f} s")
    return bits


def timeline(
    recs: list[dict[str, Any]], publications: dict[str, dict[str, Any]], clock: Clock
) -> tuple[list[str], dict[str, Counter[str]]]:
    """The timeline lines, and per key a count of each outcome."""
    attempts = sorted((r for r in recs if r.get("kind") == "run"), key=lambda r: (r["start"], r["end"]))
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    lines = [HEADER]
    for rec in attempts:
        outcome = rec["outcome"]
        publication = publications.get(rec.get("task_id") or "")
        held = outcome in ("ran", "failed")
        rerun = held and publication is not None and publication.get("role") == "worker"
        label = "RERUN" if rerun else outcome.upper() if held else outcome
        counts[rec["key"]][label.lower()] += 1
        end = f"{clock.since(rec['end']):+7.2f}" if held else ""
        fence = str(rec.get("fence")) if held else ""
        bits = run_details(rec, publication, rerun) if held else held_details(rec)
        lines.append(
            f"  {clock.since(rec['start']):+7.2f} {end:>7}  {short_worker(rec.get('worker')):<8} "
            f"{rec.get('pid', ''):>7}  {rec['key']:<22} {label:<10} {fence:>5}  {', '.join(bits)}"
        )
    return lines, counts


def summary(counts: dict[str, Counter[str]]) -> list[str]:
    """One line per key: how many runs, reruns, skips, retries, coalesced requests."""
    columns = ("ran", "rerun", "failed", "skipped", "retry", "coalesced")
    lines = [f"  {'key':<22} " + " ".join(f"{c:>9}" for c in columns)]
    for key in sorted(counts):
        lines.append(f"  {key:<22} " + " ".join(f"{counts[key][c]:>9}" for c in columns))
    return lines


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="scripts/demo",
        description="Two Celery workers and beat contend for celery-exclusive locks; prints a timeline.",
    )
    parser.add_argument(
        "--backend",
        choices=("sqlite", "postgres", "redis"),
        default=os.environ.get("EXAMPLE_LOCK_BACKEND") or "sqlite",
        help="where the locks live (default sqlite: no server). postgres and redis read "
        "EXAMPLE_POSTGRES_URL / EXAMPLE_REDIS_URL (defaults on 127.0.0.1)",
    )
    parser.add_argument("--short", action="store_true", help="the CI-sized run (well under a minute)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("EXAMPLE_DATA_DIR") or ".demo"),
        help="broker folders, results, SQLite locks, run records and logs (default .demo)",
    )
    parser.add_argument(
        "--attach",
        action="store_true",
        help="don't start workers or beat: send the work to running ones (docker compose run demo)",
    )
    return parser.parse_args(argv)


def reset_data_dir(data_dir: Path) -> None:
    """Remove what an earlier run left (only the demo's own files)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("broker", "results", "logs"):
        shutil.rmtree(data_dir / name, ignore_errors=True)
    for pattern in ("runs.jsonl", "locks.sqlite3*", "celerybeat-schedule*"):
        for path in data_dir.glob(pattern):
            path.unlink()


def probe_lock_store(url: str, prefix: str) -> None:
    """Fail early, with the reason, if the lock store cannot be reached."""
    from celery_exclusive import LockService, mask_url

    try:
        with LockService(url, prefix=prefix) as service:
            service.peek("demo-probe")
    except Exception as exc:
        raise DemoError(f"cannot use the lock store {mask_url(url)}: {exc}") from None


def delete_redis_keys(url: str, prefix: str) -> None:
    """Delete the run's lock keys (Redis keeps a small fence hash per key name)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0912, PLR0915 - one linear script
    """Run the demo; 0 if the check passed, 1 if it failed, 2 if the demo could not run."""
    args = parse_args(argv)
    plan = SHORT if args.short else FULL
    clock = Clock()
    data_dir = args.data_dir.resolve()
    if not args.attach:
        reset_data_dir(data_dir)
        os.environ.update(
            EXAMPLE_DATA_DIR=str(data_dir),
            EXAMPLE_LOCK_BACKEND=args.backend,
            EXAMPLE_ROLLUP_EVERY=str(plan.rollup_every),
            EXAMPLE_ROLLUP_SECONDS=str(plan.rollup_seconds),
        )
        # Each run its own key prefix: keys left by an interrupted run never get in the way.
        os.environ.setdefault("CELERY_EXCLUSIVE_PREFIX", f"demo-{uuid.uuid4().hex[:8]}:")
    app_module = importlib.import_module("example_worker.app")
    tasks = importlib.import_module("example_worker.tasks")
    from celery_exclusive import get_lock_service, mask_url
    from example_worker import records

    app = app_module.app
    url = app.conf.exclusive_url
    prefix = get_lock_service(app).prefix
    mode = "attached to running workers" if args.attach else "2 workers x 2 processes + beat"
    print(f"celery-exclusive demo ({'short' if args.short else 'full'} run, {mode})")
    print(f"  lock store : {mask_url(url)}  (key prefix {prefix!r})")
    print(f"  broker     : {mask_url(app.conf.broker_url)}   results: {mask_url(app.conf.result_backend)}")
    print(
        f"  run records: {app_module.RECORDS_FILE}"
        + ("" if args.attach else f"   logs: {data_dir / 'logs'}/")
    )

    processes: list[Process] = []
    status = 2
    try:
        with terminate_on_signals():
            probe_lock_store(url, prefix)
            workers: list[Process] = []
            if not args.attach:
                logs = data_dir / "logs"
                logs.mkdir(parents=True, exist_ok=True)
                env = {
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])
                    ),
                }
                clock.say(
                    f"starting {', '.join(WORKER_NAMES)} and beat "
                    f"(rollup every {plan.rollup_every:g} s, takes {plan.rollup_seconds:g} s)"
                )
                for name in WORKER_NAMES:
                    workers.append(spawn(name, worker_command(name), env, logs))
                processes.extend(workers)
                beat = spawn("beat", beat_command(), env, logs)
                processes.append(beat)
                wait_ready(workers)
                clock.say(f"ready: {', '.join(WORKER_NAMES)}; each tries the start-up job on worker_ready")

            def alive() -> None:
                for process in workers:
                    if process.popen.poll() is not None:
                        raise DemoError(f"{process.name} exited early:\n{process.tail()}")

            send_work(plan, tasks, clock)
            if not args.attach:
                remaining = plan.beat_phase - (time.time() - clock.t0)
                clock.say(f"letting beat send rollup_stats for {max(remaining, 0):.0f} s more")
                end = time.monotonic() + max(remaining, 0)
                while time.monotonic() < end:
                    alive()
                    time.sleep(0.2)
                stop([beat])
                clock.say("stopped beat; waiting for every task sent to finish")
            found = wait_settled(
                app,
                app_module.RECORDS_FILE,
                clock,
                timeout=plan.settle_timeout,
                include_beat=not args.attach,
                startup_runs=0 if args.attach else len(WORKER_NAMES),
                alive=alive,
            )
            if not args.attach:
                clock.say("stopping the workers")
                stop(processes)
            recs = records.read(app_module.RECORDS_FILE)
            if args.attach:
                recs = [r for r in recs if r.get("start", r.get("at", 0)) >= clock.t0]
            publications = first_publications(recs, clock.t0, include_beat=not args.attach)
            found.update(task_states(app, [i for i in publications if i not in found]))
            problems, n_runs, n_keys = check(
                recs, found, publications, 0 if args.attach else len(WORKER_NAMES)
            )
            lines, counts = timeline(recs, publications, clock)
            print("\nTimeline (seconds since the demo started; fence = the lock's fencing number)")
            print("\n".join(lines))
            print(LEGEND)
            print("\nPer key")
            print("\n".join(summary(counts)))
            print()
            if problems:
                print("Problems\n" + "\n".join(f"  - {problem}" for problem in problems) + "\n")
                count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
                print(f"CHECK FAILED: {count}; the first: {problems[0]}")
                status = 1
            else:
                print(f"CHECK: no two runs of one key overlapped ({n_runs} runs, {n_keys} keys)")
                status = 0
    except DemoError as exc:
        print(f"CHECK FAILED: the demo could not run: {exc}", flush=True)
        status = 2
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers and beat", flush=True)
        status = 130
    finally:
        stop(processes)
        with contextlib.suppress(Exception):
            get_lock_service(app).close()
        if args.backend == "redis" and not args.attach:
            with contextlib.suppress(Exception):
                delete_redis_keys(url, prefix)
    return status


if __name__ == "__main__":
    sys.exit(main())
