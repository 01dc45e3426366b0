"""The benchmark suite keeps working: its quick mode runs end to end and prints every row.

Speeds are not asserted here (the quick mode measures too little for that, and CI machines
are noisy); ``python -m benchmarks`` without ``--quick`` is where targets are judged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.celery
def test_quick_benchmark_completes_and_prints_every_row() -> None:
    """``python -m benchmarks --quick`` exits 0 and prints every row and target.

    No time bound beyond a hang guard: it takes ~50 s on a quiet 2-core machine and went
    past 80 s under load, and speeds are judged by the full benchmark only."""
    from benchmarks.__main__ import all_rows

    env = {k: v for k, v in os.environ.items() if k != "CE_BENCH_RUN_ID"}  # a run id of its own
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    missing = [name for name in all_rows() if f"| {name} |" not in done.stdout]
    assert not missing, f"rows not printed: {missing}\n{output[-6000:]}"
    assert "benchmark complete" in done.stdout


def test_import_loads_no_driver() -> None:
    """A fresh ``import celery_exclusive`` leaves redis, psycopg and pymysql unimported."""
    probe = (
        "import sys, celery_exclusive\n"
        "print(sorted(m for m in ('redis', 'psycopg', 'pymysql') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_c_floor_sees_the_two_commands_of_a_redis_lock_cycle() -> None:
    """The C floor replays the two commands ``lock() + release()`` sends, however the wire
    gets them (command tuples, or one command packed already): not an n/a row."""
    from benchmarks.floors import capture_redis_commands
    from celery_exclusive import LockService
    from tests.conftest import REDIS_URL, require_server

    require_server(REDIS_URL)
    service = LockService(REDIS_URL, prefix="ce-test-floor-probe:")
    try:
        captured = capture_redis_commands(service)
    finally:
        service.close()
    assert not isinstance(captured, str), captured
    acquire, release = captured
    assert acquire[0] == release[0] == "EVALSHA"
    assert acquire[3:6] == ["{key}", "celery-exclusive:fences", "{token}"]
    assert release[3:] == ["{key}", "{token}"]
