"""The demo: its check and run records on their own, and ``scripts/demo --short`` end to end.

The end-to-end tests run the README's command as a subprocess (real worker and beat
processes) in a data directory of their own (broker folders, results, run records) with a
lock key prefix of their own, and check the verdict line, the exit status and the timeline.
PostgreSQL and Redis runs use a table / key prefix of their own and leave nothing behind.
The short mode runs the demo on Redis only of the two servers (the same demo, checked the
same way, and Redis's run also checks that no key is left); ``CE_LONG=1`` adds PostgreSQL.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from example_worker import records
from example_worker.demo import check
from tests.conftest import LONG, POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts" / "demo"
CHECK = re.compile(r"^CHECK: no two runs of one key overlapped \((\d+) runs, (\d+) keys\)$", re.MULTILINE)
RUN_TIMEOUT = 100


def demo_env(prefix: str, **extra: str) -> dict[str, str]:
    """The environment without any celery-exclusive or example setting of the caller's, plus ``extra``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("CELERY_EXCLUSIVE_", "EXAMPLE_"))
    }
    return {**env, "CELERY_EXCLUSIVE_PREFIX": prefix, **extra}


def new_prefix() -> str:
    """A lock key prefix of the test's own."""
    return f"cedemo{uuid.uuid4().hex[:8]}:"


def run_demo(
    data_dir: Path, *args: str, prefix: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/demo --short`` to completion and return its output."""
    prefix = prefix or new_prefix()
    return subprocess.run(
        [str(DEMO), "--short", "--data-dir", str(data_dir), *args],
        cwd=ROOT,
        env=demo_env(prefix, **env),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )


def assert_demo_passed(result: subprocess.CompletedProcess[str]) -> None:
    """The demo exited 0 with the check line, and its timeline shows skips, retries and a rerun."""
    report = (
        f"exit {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr[-5000:]}"
    )
    assert result.returncode == 0, report
    match = CHECK.search(result.stdout)
    assert match, report
    assert int(match.group(1)) >= 5, report
    assert int(match.group(2)) >= 5, report
    assert "CHECK FAILED" not in result.stdout, report
    timeline = result.stdout.split("Timeline", 1)[1]
    assert re.search(r"\bskipped\b", timeline), report
    assert re.search(r"\bRERUN\b", timeline), report
    assert re.search(r"\bretry\b", timeline), report
    assert re.search(r"startup:warm-caches\s+RAN\b", timeline), report


def processes_using(data_dir: Path) -> list[int]:
    """Pids of live processes whose environment names ``data_dir`` as the example's data dir."""
    needle = f"EXAMPLE_DATA_DIR={data_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """The demo's data directory; afterwards no process of the demo may still be running."""
    path = tmp_path / "demo"
    yield path
    left = processes_using(path)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the demo left processes running: {left}"


def run(key: str, start: float, end: float, fence: int, task_id: str = "") -> dict[str, object]:
    """A run record as the example's tasks write it."""
    return {
        "kind": "run",
        "outcome": "ran",
        "key": key,
        "start": start,
        "end": end,
        "fence": fence,
        "worker": "w",
        "pid": 1,
        "task_id": task_id,
        "task": "t",
    }


def test_check_finds_overlaps_fence_regressions_and_unaccounted_tasks() -> None:
    """The demo's check flags overlapping runs, fences that do not grow, and tasks without an outcome."""
    recs = [
        run("a", 0.0, 1.0, 1, "t1"),
        run("a", 0.5, 2.0, 2, "t2"),  # overlaps the first run of "a"
        run("b", 0.0, 1.0, 5, "t3"),
        run("b", 1.0, 2.0, 4, "t4"),  # back to back is fine, but the fence went down
    ]
    publications = {
        tid: {"task": "example_worker.tasks.t", "args": "()", "task_id": tid}
        for tid in ("t1", "t2", "t3", "t4", "t5", "t6")
    }
    found = dict.fromkeys(("t1", "t2", "t3", "t4", "t6"), ("SUCCESS", None))
    found["t5"] = ("FAILURE", "boom")
    problems, n_runs, n_keys = check(recs, found, publications, startup_runs=0)
    assert (n_runs, n_keys) == (4, 2)
    assert any(p.startswith("a: run of") and "overlapped" in p for p in problems), problems
    assert "b: fence went from 5 to 4" in problems
    assert any("[t5]" in p and "FAILURE" in p for p in problems), problems
    assert any("[t6]" in p and "no run record" in p for p in problems), problems
    assert len(problems) == 4, problems


def test_check_passes_back_to_back_runs() -> None:
    """Runs of one key that follow each other with growing fences, all accounted for, pass."""
    recs = [run("a", 0.0, 1.0, 1, "t1"), run("a", 1.0, 2.0, 3, "t2"), run("b", 0.5, 1.5, 2, "t3")]
    publications = {tid: {"task": "t", "task_id": tid} for tid in ("t1", "t2", "t3")}
    found = dict.fromkeys(publications, ("SUCCESS", None))
    assert check(recs, found, publications, startup_runs=0) == ([], 3, 2)


def _append_many(path: str, writer: int) -> None:
    for index in range(300):
        records.append(Path(path), {"writer": writer, "index": index, "pad": "x" * (index * 7 % 5000)})


def test_records_appends_from_many_processes_stay_whole(tmp_path: Path) -> None:
    """Concurrent appends from several processes give one whole JSON record per line, none lost."""
    path = tmp_path / "runs.jsonl"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_many, args=(str(path), n)) for n in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0, 0]
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    got = records.read(path)
    assert len(got) == len(lines) - 1 == 1200
    assert sorted((r["writer"], r["index"]) for r in got) == [(w, i) for w in range(4) for i in range(300)]


@pytest.mark.celery
def test_demo_runs_with_no_server(data_dir: Path) -> None:
    """The default demo (SQLite locks, file broker) passes its check with skips, retries and a rerun."""
    result = run_demo(data_dir)
    assert_demo_passed(result)
    assert "lock store : sqlite:///" in result.stdout
    assert (data_dir / "runs.jsonl").is_file()


@pytest.mark.celery
def test_demo_fails_its_check_when_the_store_excludes_nothing(data_dir: Path) -> None:
    """With a per-process memory store the runs overlap, and the demo says CHECK FAILED and exits 1."""
    result = run_demo(data_dir, EXAMPLE_LOCK_URL="memory://")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("CHECK FAILED: "), result.stdout
    assert "overlapped" in last
    assert not CHECK.search(result.stdout)


@pytest.mark.celery
@pytest.mark.skipif(not LONG, reason="the short mode runs the server demo on Redis only (CE_LONG=1 adds it)")
def test_demo_on_postgres(data_dir: Path) -> None:
    """``--backend postgres`` passes its check against the PostgreSQL server."""
    require_server(POSTGRES_URL)
    table = f"ce_demo_{uuid.uuid4().hex[:10]}"
    try:
        result = run_demo(
            data_dir, "--backend", "postgres", EXAMPLE_POSTGRES_URL=with_option(POSTGRES_URL, "table", table)
        )
        assert_demo_passed(result)
        assert "lock store : postgresql" in result.stdout
    finally:
        drop_lock_table(POSTGRES_URL, table)


@pytest.mark.celery
def test_demo_on_redis(data_dir: Path) -> None:
    """``--backend redis`` passes its check against the Redis server and deletes its keys."""
    require_server(REDIS_URL)
    import redis

    prefix = new_prefix()
    result = run_demo(data_dir, "--backend", "redis", prefix=prefix, EXAMPLE_REDIS_URL=REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        left = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if left:
            client.delete(*left)
    finally:
        client.close()
    assert_demo_passed(result)
    assert "lock store : redis://" in result.stdout
    assert not left, f"the demo left lock keys behind: {left[:5]}"


@pytest.mark.celery
def test_demo_stops_its_workers_on_ctrl_c(data_dir: Path) -> None:
    """Ctrl-C while the demo runs stops every worker and beat process it started, and exits 130."""
    demo = subprocess.Popen(
        [str(DEMO), "--short", "--data-dir", str(data_dir)],
        cwd=ROOT,
        env=demo_env(new_prefix()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert demo.stdout is not None
        seen = []
        for line in demo.stdout:
            seen.append(line)
            if "] sent:" in line:
                break
        assert len(processes_using(data_dir)) >= 4, "".join(seen)  # 2 workers, 2+ pool children, beat
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, "".join(seen) + output
    assert "interrupted: stopping workers and beat" in output
    deadline = time.monotonic() + 5
    while processes_using(data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_using(data_dir) == []
