"""Shared fixtures: real servers by URL, isolated per test, and the skip-or-fail rule.

Servers come from the environment (defaults are this project's CI machine):
``CE_TEST_POSTGRES_URL``, ``CE_TEST_REDIS_URL``, ``CE_TEST_MYSQL_URL``. A test whose
server is unreachable skips locally with the reason, and fails when ``CI=true``.
``CE_TIME_SLACK`` scales the durations a loaded machine can stretch (:data:`TIME_SLACK`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_exclusive import LockService
from celery_exclusive.testing.contract import OUTAGE_SECRET, Store, time_slack
from tests.contract._processes import process_context

POSTGRES_URL = os.environ.get("CE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MYSQL_URL = os.environ.get("CE_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() == "true"
#: The one timing slack factor of the suite (``CE_TIME_SLACK``, default 2, the exported
#: contract's too): tests multiply the leases, windows and bounds a busy neighbour can
#: stretch by it, keeping what they prove (in ttls) the same. 1 suits a quiet machine.
TIME_SLACK = time_slack()
#: ``CE_LONG=1``: the long mode of the slow suites (CONTRIBUTING.md, "Slow suites").
LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
#: The contract's acquire/release cycles per store (``ContractStore.cycles``): 200 in the
#: short mode (each is two durable commits, ~20-50 ms on a SQL store under CI load), the
#: contract's default 1,000 with ``CE_LONG=1``. Leaking anything once is visible in 200.
CONTRACT_CYCLES = 1000 if LONG else 200
#: A user's project that tests/test_plugin.py runs in its own pytest (pytester), never here.
collect_ignore = ["plugin_example"]


#: Files whose tests measure time (deadlines, wake-up latency) or inject faults with private
#: servers and network namespaces: scripts/test runs them after the rest, one at a time, so
#: a neighbour's load cannot stretch what they time. Paths under tests/. Not the quick
#: benchmark (test_benchmarks_quick.py): it asserts no speed, so it runs in the parallel part.
SERIAL = (
    "faults/",
    "scale/",
    "stress/",
    "test_deadlines.py",
    "contract/test_waiting.py",
)
#: Files and tests under :data:`SERIAL` that time nothing a neighbour's load could stretch
#: (they count, compare fences and rows, or bound only a hang), so they run in the parallel
#: part: a path, or ``path::test`` for one test of a serial file. Each asserts no duration
#: beyond a hang guard (>= 5 s, or a ttl the store's clock expires): the PostgreSQL races
#: stall a statement on an advisory lock and check what it wrote; test_sql_faults' stalls and
#: durability checks, SQLite across fork and clock steps; the prefork SQLite worker's kills
#: (60 s per result); the dedupe markers and completion records a store failure must not
#: strand (each waits for what the store holds, bounded only by a hang guard); the reruns
#: handed on after a lost lease, behind an 8 s lease, or across a 14 s stall (each waits
#: for the rerun's run; the file's soft-time-limit and 3 s-lease tests stay serial); the
#: close() stress (rounds for a set time, each checked for crashes, leaks and words, not
#: durations); the sockets a failed connect leaves and the statement timeouts a MariaDB
#: connection keeps (counted and compared; the silent server is the test's own); the
#: completion records on the Cluster (tests/contract/
#: test_completion_records.py already runs them in the parallel part on every store); the
#: Cluster and Sentinel over TLS (a lock taken, and waiters woken by releases within a 10 s
#: wait whose polling is slowed to 60 s: bounded only by that hang guard); the two
#: 8-process waiting tests, which check no overlap, no deadlock and a turn for every process
#: (counted in turns, so load lengthens the run instead of failing it), not latencies; the
#: waiting file's refusals of bad arguments, its outage errors and its lock_many all-or-none
#: and rollback checks (each an exception or the keys held, never a duration); the
#: Celery stress (enqueues for a set time, then checks the log for overlaps, fence order and
#: lost tasks; its 6 s leases are refreshed every 2 s, its drain bounded only by a hang guard).
UNTIMED = (
    "faults/test_pg_semaphore_races.py",
    "faults/test_pg_takeover_races.py",
    "faults/test_sql_faults.py",
    "faults/test_sqlite_prefork.py",
    "faults/test_dedupe_faults.py",
    "faults/test_record_faults.py",
    "faults/test_close_race.py",
    "faults/test_connection_deadlines.py::test_a_connect_that_gives_up_leaves_no_socket_open",
    "faults/test_connection_deadlines.py::test_mariadb_connections_made_without_a_deadline_keep_the_configured_statement_timeouts",
    "faults/test_rerun_hand_on.py::test_a_rerun_waits_out_its_senders_lease_past_lock_max_retries",
    "faults/test_rerun_hand_on.py::test_a_hand_on_the_store_does_not_answer_is_retried_in_the_background",
    "faults/test_rerun_hand_on.py::test_a_run_interrupted_by_the_loss_of_its_lease_hands_on_the_rerun",
    "scale/test_redis_cluster_records.py",
    "scale/test_redis_tls.py",
    "contract/test_waiting.py::test_overlapping_random_key_sets_never_deadlock_or_overlap",
    "contract/test_waiting.py::test_no_waiting_process_is_starved",
    "contract/test_waiting.py::test_an_outage_during_a_wait_is_an_error",
    "contract/test_waiting.py::test_a_bad_wait_is_refused_before_the_store_is_touched",
    "contract/test_waiting.py::test_bad_arguments_with_wait_are_refused_before_the_store_is_touched",
    "contract/test_waiting.py::test_a_bad_key_list_is_refused_before_the_store_is_touched",
    "contract/test_waiting.py::test_lock_many_is_all_or_none",
    "contract/test_waiting.py::test_lock_many_rolls_back_when_a_later_key_fails",
    "stress/test_fence_order.py",
    "stress/test_stress.py",
)
#: Modules whose tests the parallel part runs on every store already (the lock contract, the
#: semaphore contract), their few bounds sized for its load (``TIME_SLACK``): collected
#: again in a :data:`SERIAL` file (on the private Redis Cluster, through PgBouncer, through
#: Sentinel), they run in the parallel part too. That file's own tests stay serial.
CONTRACT_MODULES = ("celery_exclusive.testing.contract", "tests.contract.test_semaphore")
#: The parallel part's longest files (summed durations under ``CI=true``, 20-110 s each),
#: longest first. scripts/test hands whole files to its four pytest processes in the order
#: collected (``--no-loadscope-reorder``); these are put first so that the short files fill
#: in at the end. pytest-xdist's own order (most tests first) left the one-test benchmark,
#: the docs build and the demo for last, one worker running them while the others idled.
#: Paths under tests/; the other files follow, most tests first.
PARALLEL_FIRST = (
    "contract/test_lock_contract.py",
    "celery/test_dedupe.py",
    "test_benchmarks_quick.py",
    "test_cli.py",
    "faults/test_close_race.py",
    "faults/test_connection_deadlines.py::test_a_connect_that_gives_up_leaves_no_socket_open",
    "faults/test_connection_deadlines.py::test_mariadb_connections_made_without_a_deadline_keep_the_configured_statement_timeouts",
    "celery/test_long_keys.py",
    "celery/test_integration.py",
    "test_model.py",
    "test_demo.py",
    "stress/test_stress.py",
    "celery/test_wait_workers.py",
    "celery/test_startup.py",
    "django/test_django_contract.py",
    "celery/test_multikey.py",
    "celery/test_redelivery.py",
    "providers/test_sweep.py",
    "contract/test_semaphore.py",
    "providers/test_sql_prune.py",
    "contract/test_third_party.py",
    "test_docs_build.py",
)
TESTS = Path(__file__).resolve().parent


def _path(item: pytest.Item) -> str:
    """``item``'s file, relative to tests/ ("" outside it)."""
    return item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m serial`` (scripts/test's serial part) only test files under the
    :data:`SERIAL` paths, where alone tests are marked ``serial``, are collected: the same
    tests, without importing and collecting 2,500 others only to deselect them (about 5 s
    of the serial part on two busy cores)."""
    if config.getoption("markexpr") != "serial" or not collection_path.is_relative_to(TESTS):
        return None
    path = collection_path.relative_to(TESTS).as_posix()
    if collection_path.is_dir():
        folder = f"{path}/"
        inside = path == "." or any(folder.startswith(each) or each.startswith(folder) for each in SERIAL)
        return None if inside else True
    if not collection_path.name.startswith("test_") or path.startswith(SERIAL):
        return None
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of the :data:`SERIAL` files ``serial``, but for the :data:`UNTIMED` ones
    and those of the :data:`CONTRACT_MODULES`;
    in a pytest-xdist worker, order the files :data:`PARALLEL_FIRST` first, the others by
    their number of tests (a file's tests keep their order)."""
    for item in items:
        path = _path(item)
        test = f"{path}::{item.originalname}" if isinstance(item, pytest.Function) else path
        contract = isinstance(item, pytest.Function) and item.function.__module__ in CONTRACT_MODULES
        if path.startswith(SERIAL) and path not in UNTIMED and test not in UNTIMED and not contract:
            item.add_marker(pytest.mark.serial)
    if hasattr(config, "workerinput"):
        counts = collections.Counter(_path(item) for item in items)
        first = {path: rank for rank, path in enumerate(PARALLEL_FIRST)}
        items.sort(key=lambda item: (first.get(_path(item), len(first)), -counts[_path(item)]))


#: Seconds spent per test file (setup, call and teardown of its tests), summed as reports
#: arrive; with pytest-xdist the controller receives every worker's reports.
FILE_SECONDS: dict[str, float] = {}
#: How many files the terminal summary lists, slowest first.
FILE_SECONDS_SHOWN = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add ``report``'s duration to its file's sum (:data:`FILE_SECONDS`)."""
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The slowest files by summed duration: under ``--dist loadfile`` a file runs on one
    worker, so the largest sum bounds the parallel part's critical path from below."""
    if len(FILE_SECONDS) < 2:
        return
    slowest = sorted(FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)[:FILE_SECONDS_SHOWN]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} files (summed durations)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.2f}s {path}")
    terminalreporter.write_line(f"{sum(FILE_SECONDS.values()):8.2f}s in all {len(FILE_SECONDS)} files")


class IdleThread(threading.Thread):
    """A ``thread_factory`` thread that exits at once: no heartbeat runs, so leases keep
    their first grant unless the test calls ``heartbeat.beat()`` itself."""

    def __init__(self, **_: Any) -> None:
        super().__init__(daemon=True)

    def run(self) -> None:
        return


def require_server(url: str) -> None:
    """Skip (locally) or fail (in CI) unless the server behind ``url`` accepts connections."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    if port is None:
        return
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        message = f"server for {parts.scheme} at {host}:{port} is unreachable ({exc})"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def drop_lock_table(url: str, table: str) -> None:
    """Drop a lock table with its fence counter table and fence sequence, on any dialect."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(text(f"DROP TABLE IF EXISTS {table}_fence"))
            conn.execute(text(f"DROP TABLE IF EXISTS {table}_done"))
            if engine.dialect.name == "postgresql":
                conn.execute(text(f"DROP SEQUENCE IF EXISTS {table}_fence_seq"))
                conn.execute(text(f"DROP FUNCTION IF EXISTS {table}_unless(varchar, varchar)"))
    finally:
        engine.dispose()


def with_option(url: str, name: str, value: str) -> str:
    """``url`` with a celery-exclusive query option (``ce_<name>``) added."""
    return f"{url}{'&' if '?' in url else '?'}ce_{name}={value}"


STORE_NAMES = ["memory", "sqlite", "postgres", "mariadb", "redis"]
#: Each server store's URL with nothing listening, its password the contract's secret.
DEAD_URLS = {
    "sqlite": "sqlite:////nonexistent-dir/for/celery-exclusive/locks.sqlite3",
    "postgres": f"postgresql+psycopg://postgres:{OUTAGE_SECRET}@127.0.0.1:1/test",
    "mariadb": f"mysql+pymysql://root:{OUTAGE_SECRET}@127.0.0.1:1/test",
    "redis": f"redis://:{OUTAGE_SECRET}@127.0.0.1:1/0",
}


@contextlib.contextmanager
def postgres_transaction() -> Iterator[Any]:
    """An open transaction on the test PostgreSQL database (for ``lease.guard``)."""
    from sqlalchemy import create_engine

    engine = create_engine(POSTGRES_URL)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def sql_tables() -> Iterator[dict[str, str]]:
    """One fresh table name per SQL server for the whole session, dropped afterwards."""
    tables = {name: f"ce_contract_{uuid.uuid4().hex[:10]}" for name in ("postgres", "mariadb")}
    yield tables
    for name, url in (("postgres", POSTGRES_URL), ("mariadb", MYSQL_URL)):
        try:
            drop_lock_table(url, tables[name])
        except Exception:  # noqa: S112 - an unreachable server was already reported by its tests
            continue


@pytest.fixture(params=STORE_NAMES)
def store(request: pytest.FixtureRequest, tmp_path: Path, sql_tables: dict[str, str]) -> Iterator[Store]:
    """Each lock store in turn, with a unique key prefix; everything created is cleaned up."""
    name: str = request.param
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    if name == "memory":
        url = "memory://"
    elif name == "sqlite":
        url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    elif name == "postgres":
        require_server(POSTGRES_URL)
        url = with_option(POSTGRES_URL, "table", sql_tables["postgres"])
    elif name == "mariadb":
        require_server(MYSQL_URL)
        url = with_option(MYSQL_URL, "table", sql_tables["mariadb"])
    else:
        require_server(REDIS_URL)
        url = REDIS_URL
    services: list[LockService] = []
    shared_memory: list[LockService] = []

    def make(**kwargs: Any) -> LockService:
        kwargs.setdefault("prefix", prefix)
        if name == "memory" and shared_memory:
            # In-process store: every service of a test must share one provider to contend.
            service = LockService(shared_memory[0].provider, **kwargs)
        else:
            service = LockService(url, **kwargs)
            if name == "memory":
                shared_memory.append(service)
        services.append(service)
        return service

    yield Store(
        name=name,
        url=url,
        cross_process=name != "memory",
        make=make,
        outage=None if name == "memory" else lambda: LockService(DEAD_URLS[name]),
        guard=postgres_transaction if name == "postgres" else None,
        slack=TIME_SLACK,
        mp_context=process_context(),
        cycles=CONTRACT_CYCLES,
    )
    for service in services:
        service.close(release=True)
    if name == "redis":
        delete_redis_keys(prefix)


def delete_redis_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = [
            k
            for pattern in (f"{prefix}*", f"*{prefix}*")
            for k in client.scan_iter(match=pattern, count=1000)
        ]
        if keys:
            client.delete(*set(keys))
    finally:
        client.close()


def in_forked_child(check: Callable[[], bool]) -> bool:
    """``check()`` run in a forked child; its answer, read back through a pipe."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process (3.12+)
        pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = check()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"
