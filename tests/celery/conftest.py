"""Fixtures of the Celery suite: broker isolation, subprocess workers and beat, lock stores.

The integration app (tests/celery/app.py) reads its configuration from the environment,
set here once per session before it is imported: a dedicated Redis DB for broker and
results (``CE_TEST_CELERY_BROKER``, default DB 11 of ``CE_TEST_REDIS_URL``'s server), a
session-unique global key prefix and queue. Everything under that prefix, the lock keys
and the SQL table are deleted at the end. Worker logs go to temp files, printed when a
test fails; workers are always terminated (their whole process group) in teardown.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from celery_exclusive import LockService
from tests.conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, drop_lock_table, require_server, with_option

ROOT = Path(__file__).resolve().parents[2]
CELERY_BIN = str(Path(sys.executable).with_name("celery"))
SESSION = uuid.uuid4().hex[:10]


def _broker_url() -> str:
    explicit = os.environ.get("CE_TEST_CELERY_BROKER")
    if explicit:
        return explicit
    parts = urlsplit(REDIS_URL)
    return urlunsplit(parts._replace(path="/11"))


BROKER_URL = _broker_url()
os.environ["CE_CELERY_BROKER"] = BROKER_URL
os.environ["CE_CELERY_KEYPREFIX"] = f"cetest-{SESSION}:"
os.environ["CE_CELERY_QUEUE"] = f"cetest-{SESSION}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can tell whether the test failed."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the test owning ``request`` failed in setup or call."""
    return any(
        getattr(getattr(request.node, f"rep_{when}", None), "failed", False) for when in ("setup", "call")
    )


def delete_redis_prefix(url: str, prefix: str) -> None:
    """Delete every key starting with ``prefix`` on the Redis server and DB of ``url``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


drop_sql_table = drop_lock_table


@dataclass
class Process:
    """One subprocess we started (a worker or beat), in its own process group, with its log."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    _terminated: bool = field(default=False, init=False, repr=False)

    def text(self) -> str:
        """The log so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def terminate(self) -> None:
        """Start a warm shutdown (SIGTERM, sent once) without waiting for it."""
        if not self._terminated and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then kill the whole process group; always reaps."""
        if self.popen.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # pool children too; the group is ours
        if self.popen.poll() is None:
            self.popen.wait(10)


def stop_all(processes: list[Process], timeout: float = 15.0) -> None:
    """``stop()`` each process, their warm shutdowns overlapping (an idle worker's takes ~2.5 s)."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop(timeout)


def spawn(
    name: str, args: list[str], env: dict[str, str], logdir: Path, app: str = "tests.celery.app"
) -> Process:
    """Start ``celery -A <app> <args>`` from the repository root in a new process group."""
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [CELERY_BIN, "-A", app, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Process(name, popen, log)


def wait_ready(processes: list[Process], timeout: float = 60.0) -> None:
    """Wait until every worker logged "ready."; fail with their logs otherwise."""
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        pending = [p for p in pending if " ready." not in p.text()]
        dead = [p for p in pending if p.popen.poll() is not None]
        if dead or (pending and time.monotonic() > deadline):
            logs = "\n".join(f"--- {p.name} ---\n{p.text()[-4000:]}" for p in pending)
            pytest.fail(f"workers did not start: {[p.name for p in pending]}\n{logs}")
        time.sleep(0.1)


@dataclass
class WorkerGroup:
    """Subprocess workers on one queue and one lock store, plus a client-side lock service."""

    store: str
    url: str
    prefix: str
    queue: str
    logdir: Path
    env: dict[str, str]
    workers: list[Process] = field(default_factory=list)
    _service: LockService | None = None

    @property
    def service(self) -> LockService:
        """A lock service on the workers' store and prefix, for peeking and holding keys."""
        if self._service is None:
            self._service = LockService(self.url, prefix=self.prefix)
        return self._service

    def send(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        """Enqueue ``task(*args, **kwargs)`` on this group's queue."""
        options = kwargs.pop("_options", {})
        return task.apply_async(args, kwargs, queue=self.queue, **options)

    def dump(self) -> str:
        """Every worker's log, for a failure report."""
        return "\n".join(f"===== {p.name} ({p.log}) =====\n{p.text()[-20000:]}" for p in self.workers)

    def close(self) -> None:
        """Stop the workers (all at once) and close the client service."""
        stop_all(self.workers)
        if self._service is not None:
            self._service.close()


def _store_url(store: str, logdir: Path, tag: str) -> str:
    """The lock store URL of a new worker group on ``store`` (its server checked first)."""
    if store == "redis":
        require_server(REDIS_URL)
        return REDIS_URL
    if store == "postgres":
        require_server(POSTGRES_URL)
        return with_option(POSTGRES_URL, "table", f"ce_celery_{SESSION}")
    if store == "mariadb":
        require_server(MYSQL_URL)
        return with_option(MYSQL_URL, "table", f"ce_celery_{SESSION}")
    if store == "sqlite":  # a file every process of the group opens (workers, producers, tests)
        return f"sqlite:///{logdir / f'locks-{tag}.sqlite3'}"
    raise ValueError(store)


def spawn_group(
    store: str,
    logdir: Path,
    *,
    workers: int = 2,
    concurrency: int = 2,
    pool: str = "prefork",
    extra: tuple[str, ...] = (),
) -> WorkerGroup:
    """Spawn ``workers`` celery workers of ``concurrency`` processes on a fresh queue and
    prefix, without waiting for them to be ready (:func:`wait_ready` their ``workers``)."""
    require_server(BROKER_URL)
    tag = uuid.uuid4().hex[:6]
    url = _store_url(store, logdir, tag)
    group = WorkerGroup(
        store=store,
        url=url,
        prefix=f"ce{SESSION}{tag}:",
        queue=f"cetest-{SESSION}-{tag}",
        logdir=logdir,
        env={},
    )
    group.env = {
        "CELERY_EXCLUSIVE_URL": url,
        "CELERY_EXCLUSIVE_PREFIX": group.prefix,
        "CE_CELERY_QUEUE": group.queue,
    }
    for index in range(workers):
        name = f"{store}{index}-{tag}"
        group.workers.append(
            spawn(
                name,
                [
                    "worker",
                    "-P",
                    pool,
                    "-c",
                    str(concurrency),
                    "-n",
                    f"{name}@%h",
                    "-Q",
                    group.queue,
                    "-l",
                    "INFO",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                    *extra,
                ],
                group.env,
                logdir,
            )
        )
    return group


def start_group(store: str, logdir: Path, **options: Any) -> WorkerGroup:
    """:func:`spawn_group`, returned once its workers are ready."""
    group = spawn_group(store, logdir, **options)
    try:
        wait_ready(group.workers)
    except BaseException:
        group.close()
        raise
    return group


def cleanup_group(group: WorkerGroup) -> None:
    """Delete the group's lock keys (Redis), table (PostgreSQL, MariaDB) or file (SQLite)."""
    if group.store == "redis":
        delete_redis_prefix(REDIS_URL, group.prefix)
    elif group.store == "postgres":
        drop_sql_table(POSTGRES_URL, f"ce_celery_{SESSION}")
    elif group.store == "mariadb":
        drop_sql_table(MYSQL_URL, f"ce_celery_{SESSION}")
    elif group.store == "sqlite":
        path = Path(urlsplit(group.url).path[1:])
        for leftover in path.parent.glob(path.name + "*"):  # -wal, -shm, -waiters
            leftover.unlink(missing_ok=True)


def module_group(store: str, logdir: Path, **options: Any) -> Iterator[WorkerGroup]:
    """The body of a module-scoped worker-group fixture: ``start_group(store, logdir,
    **options)`` yielded, then stopped and its keys or table deleted."""
    workers = start_group(store, logdir, **options)
    try:
        yield workers
    finally:
        workers.close()
        cleanup_group(workers)


def module_groups(stores: list[str], logdir: Path, **options: Any) -> Iterator[dict[str, WorkerGroup]]:
    """:func:`module_group` for several stores at once: their workers start together (their
    start-ups overlap) and stop together; yields the groups by store (none for a store
    whose server is unreachable, which skips locally and fails in CI)."""
    groups: dict[str, WorkerGroup] = {}
    try:
        for store in stores:
            with contextlib.suppress(pytest.skip.Exception):  # its server is down (not in CI)
                groups[store] = spawn_group(store, logdir, **options)
        wait_ready([worker for group in groups.values() for worker in group.workers])
        yield groups
    finally:
        stop_all([worker for group in groups.values() for worker in group.workers])
        for group in groups.values():
            group.close()
            cleanup_group(group)


@pytest.fixture
def logs_on_failure(request: pytest.FixtureRequest, group: WorkerGroup) -> Iterator[None]:
    """Print the module's ``group`` workers' logs when the test fails (``usefixtures`` it)."""
    yield
    if failed(request):
        print(group.dump())


def uid() -> str:
    """A fresh tag / key id, so tests never see each other's keys or records."""
    return uuid.uuid4().hex[:8]


def embedded_app(name: str, queue: str, **conf: Any) -> Any:
    """A Celery app for Celery's embedded test worker: in-memory broker, results and lock
    store (so a test holds the tasks' keys through ``get_lock_service(app)``), ``conf`` on top."""
    from celery import Celery

    app = Celery(name, broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        exclusive_url="memory://",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": 0.01},
        task_default_queue=queue,
        worker_hijack_root_logger=False,
        **conf,
    )
    return app


def embedded_worker(app: Any, concurrency: int) -> Iterator[Any]:
    """The body of a module-scoped fixture: one embedded threads-pool worker of ``app``."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False, shutdown_timeout=30
    ) as worker:
        yield worker


@pytest.fixture(scope="session")
def celery_logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where subprocess logs go."""
    return tmp_path_factory.mktemp("celery-logs")


@pytest.fixture(scope="session", autouse=True)
def _clean_broker_keys() -> Iterator[None]:
    """Delete the session's broker, result and record keys at the end."""
    yield
    # An unreachable server was already reported by the tests that needed it.
    with contextlib.suppress(Exception):
        delete_redis_prefix(BROKER_URL, os.environ["CE_CELERY_KEYPREFIX"])


def records(tag: str) -> list[dict[str, Any]]:
    """The events recorded by task bodies under ``tag``, in order."""
    from tests.celery.app import RECORDS, records_client

    raw = records_client().lrange(RECORDS, 0, -1)
    events = [json.loads(item) for item in raw]
    return [event for event in events if event["tag"] == tag]


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate()`` until truthy and return it; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def assert_no_overlap(runs: list[dict[str, Any]]) -> None:
    """Recorded run intervals of one key never overlap, and fences grow with start times."""
    ordered = sorted(runs, key=lambda run: run["start"])
    for before, after in itertools.pairwise(ordered):
        assert before["end"] <= after["start"], f"overlapping runs: {before} and {after}"
        assert before["fence"] < after["fence"], f"fence did not grow: {before} then {after}"
