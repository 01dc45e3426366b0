"""Fixtures of the fault-injection suite: private servers, proxies, holder processes, figures.

Every server a fault test restarts, terminates, stalls or flushes is its own (see
``servers.py``); the machine's shared servers are never touched. A server that cannot be
started (binary missing) skips its tests locally with the reason and fails them under
``CI=true``. ``CE_LONG=1`` makes each test inject more faults, for longer.

All timing is measured with this process's ``time.monotonic``; holder processes report
events over a pipe and are timed when their line arrives (which is never early).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from celery_exclusive import BackendError, Lease, LockService, signals
from tests.conftest import POSTGRES_URL, TIME_SLACK, drop_lock_table, require_server
from tests.faults.servers import PrivatePostgres, PrivateRedis, ServerUnavailable, TcpProxy, postgres_bindir
from tests.fork_safe_redis import SOCKET_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"
#: Long mode: more faults per test, longer holds. Short mode is what CI runs.
LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")
#: Scheduling slack allowed on top of a bound that the design promises, in seconds (0.75 s
#: on a noisy 2-core CI machine; scales with the suite's TIME_SLACK, CE_TIME_SLACK).
SLACK = 0.375 * TIME_SLACK

#: The commands a Redis lock release needs that nothing else a worker does on lock keys
#: uses (the release script HDELs a lease's fields where records keep its hash, else DELs
#: the hash): ``ACL SETUSER <user> -hdel -del`` makes every release fail while acquire,
#: refresh and peek go on (:func:`refuse_redis_releases`).
RELEASE_COMMANDS = ("hdel", "del")


def broker_client(redis_server: PrivateRedis) -> Any:
    """A client of the private Redis's db 3, the fault workers' broker (:func:`app_worker`),
    where the tasks record their runs; :data:`SOCKET_TIMEOUT` bounds its blocking reads."""
    import redis

    return redis.Redis(port=redis_server.port, db=3, socket_timeout=SOCKET_TIMEOUT)


def refuse_redis_releases(admin: Any, user: str, *, except_keys: str | None = None) -> None:
    """Take :data:`RELEASE_COMMANDS` away from ``user``: the store refuses its releases from
    now on, except on the keys matching the pattern ``except_keys`` (an ACL selector)."""
    allowed = [f"(~{except_keys} {' '.join('+' + c for c in RELEASE_COMMANDS)})"] if except_keys else []
    admin.execute_command("ACL", "SETUSER", user, *(f"-{c}" for c in RELEASE_COMMANDS), *allowed)


def unavailable(reason: str) -> None:
    """Skip (locally) or fail (under CI=true) because a private server cannot run."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def start_worker(
    app: str, queue: str, env: dict[str, str], log: Path, *, concurrency: int = 1
) -> subprocess.Popen[bytes]:
    """A real prefork Celery worker of the app module ``app`` consuming ``queue``, its output
    in ``log``, in a session of its own (so that the whole process group can be signalled);
    the caller waits for " ready." in the log and stops it."""
    celery = str(Path(sys.executable).with_name("celery"))
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(celery, "-A", app, "worker", "-P", "prefork", "-c", str(concurrency)),
                *("-Q", queue, "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextlib.contextmanager
def acl_user(admin: Any, name: str) -> Iterator[tuple[str, str]]:
    """(user, password) of a new Redis ACL user ``name-<random>`` with every command, made
    with ``admin`` (a redis client on the private server). A client logged in as it is made
    to fail by taking its commands away (``-@all``) and healed by giving them back
    (``+@all``); at the end it gets them back, then is deleted."""
    user, password = f"{name}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    try:
        yield user, password
    finally:
        admin.execute_command("ACL", "SETUSER", user, "+@all")
        admin.execute_command("ACL", "DELUSER", user)


@dataclass
class AppWorker:
    """A prefork worker of ``tests.faults._celery_app`` (see :func:`app_worker`)."""

    queue: str
    log: Path
    #: The test side's ``tests.faults._celery_app`` module, its app sending to ``queue``.
    app: Any
    #: A service on the worker's store prefix, straight to the private Redis.
    store: LockService

    #: Where in the log :meth:`pending` starts reading: a worker shared by several tests
    #: (:func:`shared_worker`) starts each test's view at the log's end then, so that a
    #: delivery of an earlier test that ended unlogged (terminated, say) is not waited for.
    since = 0  # not annotated: no dataclass field

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pending(self, tag: str) -> set[str]:
        """The task ids of the deliveries of ``tag`` (a test's tag among the task's
        arguments) not over: messages the broker holds for the worker's queue (queued, or
        taken by the worker and not acknowledged: waiting for their eta or a pool
        process), and deliveries the worker logged as received (since :attr:`since`) and
        not yet as ended (succeeded, retried, ignored, failed; another test's message
        waiting for its eta aside)."""
        import redis

        client = redis.Redis.from_url(self.app.app.conf.broker_url)
        try:
            queues = client.scan_iter(match=f"{self.queue}*")  # the queue, and its priority lists
            queued = [json.loads(each) for key in queues for each in client.lrange(key, 0, -1)]
            held = [json.loads(each) for each in client.hvals("unacked")]
        finally:
            client.close()
        messages = queued + [message for message, _, queue in held if queue == self.queue]
        ours, others = set(), set()
        for message in messages:
            headers = message.get("headers") or {}
            (ours if tag in str(headers.get("argsrepr")) else others).add(headers.get("id"))
        text = self.text()[self.since :]
        received = collections.Counter(_RECEIVED.findall(text))
        ended = collections.Counter(_ENDED.findall(text) + _KILLED.findall(text))
        running = {each for each, count in received.items() if count > ended[each]}
        return ours | (running - others)

    def settled(self, tag: str) -> None:
        """Wait until no further run of ``tag`` can start from a message already sent (its
        retries, copies and reruns: every message naming it among its arguments):
        :meth:`pending` is empty, and still is :data:`QUIET` s later (a hang guard of
        :data:`SETTLE_GUARD` s). A run that starts after this was sent after it."""
        deadline = time.monotonic() + SETTLE_GUARD
        while True:
            remaining = deadline - time.monotonic()
            assert wait_until(lambda: not self.pending(tag), remaining, 0.05), (
                f"still pending: {self.pending(tag)}\n{self.text()[-6000:]}"
            )
            time.sleep(QUIET)
            if not self.pending(tag):
                return


#: How Celery's worker logs a delivery's arrival, and its end, around the task's id
#: (celery.app.trace: succeeded, retried, ignored, failed; celery.worker.request: killed
#: at its hard time limit).
_RECEIVED = re.compile(r"\[([^\]]+)\] received$", re.MULTILINE)
_ENDED = re.compile(r"\[([^\]]+)\] (?:succeeded in|retry:|ignored$|raised)", re.MULTILINE)
_KILLED = re.compile(r"Hard time limit \([^)]*\) exceeded for [\w.]+\[([^\]]+)\]")
#: The hang guard of :meth:`AppWorker.settled`, in seconds.
SETTLE_GUARD = 30.0
#: How long :meth:`AppWorker.settled` watches on once nothing is pending, in seconds: a
#: message the worker took off the queue just as the broker was read (in neither the queue
#: nor the unacknowledged set for an instant) has been logged as received by then.
QUIET = 0.5


@contextlib.contextmanager
def app_worker(
    redis_server: PrivateRedis,
    store_url: str,
    name: str,
    log: Path,
    *,
    concurrency: int = 1,
    admin_url: str | None = None,
) -> Iterator[AppWorker]:
    """A prefork worker of ``tests.faults._celery_app`` whose lock store is ``store_url``
    (the private Redis, directly, through a proxy or as an ACL user; or the private
    PostgreSQL as a role of its own) under a prefix of its own, on a queue of its own; the
    broker is the private Redis's db 3, shared by every user of that app (it is configured
    once per session). ``admin_url``: the same store as its administrator, for the test's
    ``store`` (default: the private Redis). Killed with its pool at the end."""
    broker = f"redis://127.0.0.1:{redis_server.port}/3"
    queue = f"cefaults-{name}-{uuid.uuid4().hex[:8]}"
    prefix = f"{name[0]}{uuid.uuid4().hex[:10]}:"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CE_FAULT_BROKER": broker,
        "CE_FAULT_QUEUE": queue,
        "CELERY_EXCLUSIVE_URL": store_url,
        "CELERY_EXCLUSIVE_PREFIX": prefix,
    }
    process = start_worker("tests.faults._celery_app", queue, env, log, concurrency=concurrency)
    store = LockService(admin_url or redis_server.url, prefix=prefix)
    try:
        assert wait_until(lambda: " ready." in log.read_text(errors="replace"), 60), log.read_text()
        os.environ["CE_FAULT_BROKER"], os.environ["CE_FAULT_QUEUE"] = broker, queue
        from tests.faults import _celery_app

        _celery_app.app.conf.broker_url = _celery_app.app.conf.result_backend = broker
        yield AppWorker(queue, log, _celery_app, store)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its own process group: the pool too
        process.wait(10)
        store.close()


@dataclass
class AclWorker(AppWorker):
    """An :func:`app_worker` whose store logs in as a Redis ACL user of its own, ``user``
    (see :func:`acl_app_worker`); ``admin``: the broker's db as the default user, which
    changes that user's commands and holds what the tasks record."""

    admin: Any
    user: str

    def answer(self) -> None:
        """The store answers the worker's user again: every command, no selector left."""
        self.admin.execute_command("ACL", "SETUSER", self.user, "clearselectors", "+@all")


_Worker = TypeVar("_Worker", bound=AclWorker)


@contextlib.contextmanager
def acl_app_worker(
    redis_server: PrivateRedis,
    name: str,
    log_dir: Path,
    kind: type[_Worker],
    *extra: Any,
    concurrency: int = 1,
    store_port: int | None = None,
) -> Iterator[_Worker]:
    """:func:`app_worker` whose store is the private Redis as a new ACL user ``ce-<name>-…``
    (:func:`acl_user`), reached at ``store_port`` (a proxy's; default the server's), as a
    ``kind`` (its fields after :class:`AclWorker`'s: ``extra``); its log in ``log_dir``.
    Everything is stopped and deleted at the end."""
    admin = broker_client(redis_server)
    try:
        with acl_user(admin, f"ce-{name}") as (user, password):
            url = f"redis://{user}:{password}@127.0.0.1:{store_port or redis_server.port}/0"
            with app_worker(redis_server, url, name, log_dir / "worker.log", concurrency=concurrency) as base:
                yield kind(base.queue, base.log, base.app, base.store, admin, user, *extra)
    finally:
        admin.close()


#: The worker :func:`acl_worker` shares, while a module that uses it is running or to come.
_shared_acl_worker: dict[str, Any] = {}


@pytest.fixture(scope="module")
def acl_worker(
    request: pytest.FixtureRequest, redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AclWorker]:
    """One prefork worker (two processes) whose store is the private Redis as an ACL user of
    its own (:func:`acl_app_worker`), shared by the modules whose tests take commands away
    from that user and give them back (in ``finally``) and tell their runs by a tag of
    their own: ``test_retry_lingering_lease.py``, ``test_replace_lingering_lease.py``,
    ``test_rerun_retry.py``, ``test_rerun_stale_lease.py`` (each views it as its own kind,
    :func:`shared_worker`). Started by the first of them (about 3 s), stopped after the
    last one the session runs, so that no other module meets it on the private Redis
    (``test_redis_wake_faults.py`` counts that server's subscribers)."""
    if not _shared_acl_worker:
        stack = contextlib.ExitStack()
        log_dir = tmp_path_factory.mktemp("celery-acl")
        _shared_acl_worker["worker"] = stack.enter_context(
            acl_app_worker(redis_server, "acl", log_dir, AclWorker, concurrency=2)
        )
        _shared_acl_worker["stop"] = stack.close
        request.config.add_cleanup(stack.close)  # a session that ends early
    yield _shared_acl_worker["worker"]
    items = request.session.items
    last = max(index for index, item in enumerate(items) if getattr(item, "module", None) is request.module)
    if not any("acl_worker" in getattr(item, "fixturenames", ()) for item in items[last + 1 :]):
        _shared_acl_worker.pop("stop")()
        _shared_acl_worker.clear()


def shared_worker(kind: type[AclWorker]) -> Any:
    """A module's ``worker`` fixture: :func:`acl_worker` as a ``kind`` (an
    :class:`AclWorker` subclass adding methods, no fields)."""

    @pytest.fixture
    def worker(acl_worker: AclWorker) -> AclWorker:
        view = kind(**{each.name: getattr(acl_worker, each.name) for each in dataclasses.fields(AclWorker)})
        view.since = len(acl_worker.text())  # this test's deliveries are logged after
        return view

    return worker


@dataclass
class PgRoleWorker(AclWorker):
    """An :func:`app_worker` whose store is the private PostgreSQL as a login role of its
    own, ``user``, on the lock table ``table`` that ``pg`` (the superuser) made (see
    :func:`pg_role_app_worker`); ``admin`` as :class:`AclWorker`'s."""

    pg: PrivatePostgres
    table: str

    def refuse_releases(self) -> None:
        """The store refuses every release of a lock from now on: the role may no longer
        ``DELETE`` the table's rows (every release statement deletes one; acquire, refresh
        and peek keep working), for every statement that starts after this one."""
        self.pg.admin(f'REVOKE DELETE ON "{self.table}" FROM "{self.user}"')

    def answer(self) -> None:
        """The store answers the worker's role again: ``DELETE`` given back."""
        self.pg.admin(f'GRANT DELETE ON "{self.table}" TO "{self.user}"')


_PgWorker = TypeVar("_PgWorker", bound=PgRoleWorker)


@contextlib.contextmanager
def pg_role_app_worker(
    redis_server: PrivateRedis,
    pg_server: PrivatePostgres,
    name: str,
    log_dir: Path,
    kind: type[_PgWorker],
    *,
    concurrency: int = 1,
) -> Iterator[_PgWorker]:
    """:func:`app_worker` whose store is the private PostgreSQL as a new login role
    ``ce_<name>_…`` on a lock table of its own, ``ce_<name>_…``, which the superuser makes
    (with its records' table, fence sequence and marker function) and on which the role may
    select, insert, update and delete, not create (``ce_create_table=false``), as a
    ``kind``; its log in ``log_dir``. The worker, then the table and the role are dropped at
    the end."""
    suffix = uuid.uuid4().hex[:8]
    role = table = f"ce_{name}_{suffix}"
    admin_url = f"{pg_server.url}&ce_table={table}"
    maker = LockService(admin_url)
    admin = broker_client(redis_server)
    try:
        maker.provider.set_up()
        pg_server.admin(f'CREATE ROLE "{role}" LOGIN')
        pg_server.admin(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}", "{table}_done" TO "{role}"')
        pg_server.admin(f'GRANT USAGE, SELECT ON SEQUENCE "{table}_fence_seq" TO "{role}"')
        url = (
            f"postgresql+psycopg://{role}@127.0.0.1:{pg_server.port}/postgres"
            f"?application_name={role}&ce_table={table}&ce_create_table=false"
        )
        log = log_dir / "worker.log"
        with app_worker(redis_server, url, name, log, concurrency=concurrency, admin_url=admin_url) as base:
            yield kind(base.queue, base.log, base.app, base.store, admin, role, pg_server, table)
    finally:
        admin.close()
        maker.close()
        drop_lock_table(pg_server.url, table)
        pg_server.admin(f'DROP ROLE IF EXISTS "{role}"')


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PrivatePostgres]:
    """This suite's own PostgreSQL cluster (initdb'd in a temp dir), stopped at session end."""
    bindir = postgres_bindir()
    if bindir is None:
        unavailable("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; set CE_TEST_PG_BIN")
    assert bindir is not None
    try:
        server = PrivatePostgres(bindir).start()
    except ServerUnavailable as exc:
        unavailable(f"private PostgreSQL could not start: {exc}")
        raise
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_table() -> Iterator[str]:
    """A fresh lock table name on the shared PostgreSQL (dropped, with its stall function
    from tests/faults/_pg_stall.py, after)."""
    import sqlalchemy as sa

    require_server(POSTGRES_URL)
    table = f"ce_fault_{uuid.uuid4().hex[:10]}"
    yield table
    drop_lock_table(POSTGRES_URL, table)
    engine = sa.create_engine(POSTGRES_URL)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {table}_stall() CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    """This suite's own redis-server without persistence, stopped at session end."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server not found on PATH")
    assert binary is not None
    try:
        server = PrivateRedis(binary).start()
    except ServerUnavailable as exc:
        unavailable(f"private Redis could not start: {exc}")
        raise
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Backend:
    """One private server as a lock store: its URL directly, or through a proxy port."""

    name: str
    server: PrivatePostgres | PrivateRedis

    @property
    def port(self) -> int:
        return self.server.port

    def url(self, port: int | None = None, application_name: str = "ce-faults") -> str:
        """The store URL, to the server itself or to ``port`` (a proxy in front of it)."""
        port = self.server.port if port is None else port
        if isinstance(self.server, PrivatePostgres):
            return PrivatePostgres.url_for(port, application_name)
        return f"redis://127.0.0.1:{port}/0"


@pytest.fixture(params=["postgres", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each private store in turn."""
    name: str = request.param
    fixture = "pg_server" if name == "postgres" else "redis_server"
    return Backend(name, request.getfixturevalue(fixture))


@pytest.fixture
def pg_backend(pg_server: PrivatePostgres) -> Backend:
    """The private PostgreSQL as a lock store."""
    return Backend("postgres", pg_server)


@pytest.fixture
def redis_backend(redis_server: PrivateRedis) -> Backend:
    """The private Redis as a lock store."""
    return Backend("redis", redis_server)


class HolderProcess:
    """A ``tests.faults._holder`` process: one lease held, commands over a pipe."""

    def __init__(self, config: dict[str, Any], wrapper: list[str], log: Path) -> None:
        self.log = log
        self._stderr = log.open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "tests.faults._holder", json.dumps(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            start_new_session=True,  # signals go to the group: a wrapper (faketime) and its child
        )
        self.pid = self.proc.pid
        self._events: queue.Queue[tuple[float, dict[str, Any]]] = queue.Queue()
        self._seen: list[tuple[float, dict[str, Any]]] = []
        self._reader = threading.Thread(target=self._read, name="ce-fault-holder-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._events.put((time.monotonic(), json.loads(line)))

    def wait(self, event: str, timeout: float) -> tuple[float, dict[str, Any]]:
        """The next ``event`` line and when it arrived; fails the test after ``timeout``."""
        for index, (_at, message) in enumerate(self._seen):
            if message["event"] == event:
                return self._seen.pop(index)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                at, message = self._events.get(timeout=max(left, 0.001))
            except queue.Empty:
                pytest.fail(
                    f"holder {self.pid} sent no {event!r} within {timeout} s; stderr:\n{self.stderr()}"
                )
            if message["event"] == event:
                return at, message
            self._seen.append((at, message))

    def ask(self, command: str, reply: str, timeout: float = 15.0) -> dict[str, Any]:
        """Send ``command`` and return its ``reply`` event."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.wait(reply, timeout)[1]

    def signal(self, sig: signal.Signals) -> float:
        """Send ``sig`` to the holder's process group; returns when it was sent."""
        os.killpg(self.pid, sig)
        return time.monotonic()

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        """Kill its process group (after SIGCONT, in case it is stopped), reap, close every pipe."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(15)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._reader.join(5)
        self._stderr.close()


@dataclass
class Attempt:
    """One competitor try: when it was sent and answered, and what came of it."""

    sent: float
    answered: float
    outcome: str  # "granted", "held" or "error"
    lease: Lease | None = None


@dataclass
class Competitor:
    """A thread that keeps trying to take ``key`` and records every attempt.

    It holds what it gets until ``stop()``; ``first_grant`` is its first success.
    """

    service: LockService
    key: str
    interval: float = 0.02
    attempts: list[Attempt] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Competitor:
        self._thread = threading.Thread(target=self._run, name="ce-fault-competitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                lease = self.service.try_lock(self.key)
            except BackendError:
                self.attempts.append(Attempt(sent, time.monotonic(), "error"))
            else:
                answered = time.monotonic()
                if lease is not None:
                    self.attempts.append(Attempt(sent, answered, "granted", lease))
                    return
                self.attempts.append(Attempt(sent, answered, "held"))
            self._stop.wait(self.interval)

    @property
    def first_grant(self) -> Attempt | None:
        return next((a for a in self.attempts if a.outcome == "granted"), None)

    def wait_grant(self, timeout: float) -> Attempt | None:
        """Wait until the competitor got the key (or ``timeout``); its winning attempt."""
        assert self._thread is not None
        self._thread.join(timeout)
        return self.first_grant

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def count(self, outcome: str) -> int:
        return sum(1 for a in self.attempts if a.outcome == outcome)


class Faults:
    """Per-test harness: services, proxies, holder processes and competitors, all torn down."""

    def __init__(self, tmp: Path, figures: list[dict[str, Any]], test: str) -> None:
        self.prefix = f"f{uuid.uuid4().hex[:10]}:"
        self.tmp = tmp
        self.test = test
        self._figures = figures
        self._services: list[LockService] = []
        self._proxies: list[TcpProxy] = []
        self._holders: list[HolderProcess] = []
        self._competitors: list[Competitor] = []
        self._logs: list[RefreshLog] = []

    def service(self, url: str, **kwargs: Any) -> LockService:
        """A LockService on ``url`` with this test's prefix, closed in teardown."""
        kwargs.setdefault("prefix", self.prefix)
        service = LockService(url, **kwargs)
        self._services.append(service)
        return service

    def proxy(self, upstream_port: int) -> TcpProxy:
        """A stall/resume/cut proxy in front of ``upstream_port``, closed in teardown."""
        proxy = TcpProxy(upstream_port)
        self._proxies.append(proxy)
        return proxy

    def holder(
        self,
        url: str,
        key: str,
        *,
        ttl: float,
        refresh_interval: float | None = None,
        wrapper: list[str] | None = None,
        skew: float = 0.0,
    ) -> HolderProcess:
        """Start a holder process for ``key`` (see ``_holder.py``), killed in teardown."""
        config = {
            "url": url,
            "prefix": self.prefix,
            "key": key,
            "ttl": ttl,
            "refresh_interval": refresh_interval,
            "skew": skew,
        }
        log = self.tmp / f"holder-{len(self._holders)}.log"
        holder = HolderProcess(config, wrapper or [], log)
        self._holders.append(holder)
        return holder

    def competitor(self, service: LockService, key: str, interval: float = 0.02) -> Competitor:
        """A started competitor thread for ``key``; stopped in teardown."""
        competitor = Competitor(service, key, interval).start()
        self._competitors.append(competitor)
        return competitor

    def refresh_log(self, service: LockService) -> RefreshLog:
        """Record ``service``'s refreshes (signals disconnected in teardown)."""
        log = RefreshLog(service)
        self._logs.append(log)
        return log

    def record(self, **figures: Any) -> None:
        """Keep measured figures for the summary printed after the run (and docs/faults.md)."""
        self._figures.append({"test": self.test, **figures})

    def teardown(self) -> None:
        for proxy in self._proxies:
            with contextlib.suppress(Exception):
                proxy.resume()  # nothing may stay blocked behind a stalled proxy
        for competitor in self._competitors:
            competitor.stop()
        for holder in self._holders:
            holder.close()
        for log in self._logs:
            log.close()
        for service in self._services:
            with contextlib.suppress(Exception):
                service.close(release=True)
        for proxy in self._proxies:
            proxy.close()


_FIGURES: list[dict[str, Any]] = []


@pytest.fixture
def faults(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Faults]:
    """The per-test fault harness; everything it started is stopped afterwards."""
    harness = Faults(tmp_path, _FIGURES, request.node.name)
    try:
        yield harness
    finally:
        harness.teardown()


def holder_and_waiter(url: str, tag: str) -> Iterator[tuple[LockService, LockService]]:
    """Two services on ``url`` under one fresh prefix (``tag`` + 8 hex): a holder and a
    waiter, closed afterwards. For fixtures: ``yield from holder_and_waiter(...)``."""
    prefix = f"{tag}{uuid.uuid4().hex[:8]}:"
    holder = LockService(url, prefix=prefix)
    waiter = LockService(url, prefix=prefix)
    try:
        yield holder, waiter
    finally:
        holder.close()
        waiter.close()


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@dataclass
class RefreshLog:
    """Every refresh the heartbeat of ``service`` confirmed or failed, timed on our clock."""

    service: LockService
    confirmed: list[tuple[float, int]] = field(default_factory=list)  # (when, leases confirmed)
    failed: list[tuple[float, str]] = field(default_factory=list)  # (when, error)

    def __post_init__(self) -> None:
        signals.lock_refreshed.connect(self._refreshed, sender=self.service, weak=False)
        signals.refresh_failed.connect(self._failed, sender=self.service, weak=False)

    def _refreshed(self, sender: object = None, leases: list[Lease] = (), **_: Any) -> None:  # type: ignore[assignment]
        self.confirmed.append((time.monotonic(), len(leases)))

    def _failed(self, sender: object = None, error: object = None, **_: Any) -> None:
        self.failed.append((time.monotonic(), f"{type(error).__name__}: {error}"))

    def confirmed_since(self, since: float, leases: int) -> bool:
        """True once one refresh after ``since`` confirmed ``leases`` leases (or more)."""
        return any(at > since and n >= leases for at, n in self.confirmed)

    def close(self) -> None:
        signals.lock_refreshed.disconnect(self._refreshed, sender=self.service)
        signals.refresh_failed.disconnect(self._failed, sender=self.service)


def cpu_wait(thread: threading.Thread | None) -> float | None:
    """Seconds ``thread`` (of this process) has spent runnable but waiting for a CPU since it
    started (Linux ``schedstat``); None where that is not known. A loaded machine's share in
    a lateness, not the library's."""
    tid = None if thread is None else thread.native_id
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def loss_timing(
    deadline: float,
    lost: float | None,
    grant: Attempt,
    margin: float,
    waits: tuple[float | None, float | None],
) -> str:
    """Where the loss and the grant fell from a lease's local ``deadline``, for a failure's
    message: when the holder declared LOST (``lost``, None if it had not), when the winning
    ``grant`` was sent and answered, and how long the holder's heartbeat thread waited for a
    CPU between two :func:`cpu_wait` readings ``waits`` (a loaded machine's share in a
    lateness, not the library's)."""
    before, after = waits
    starved = "unknown" if before is None or after is None else f"{after - before:.3f} s"
    declared = "not declared" if lost is None else f"{lost - deadline:+.3f} s"
    return (
        f"from the holder's local deadline: LOST declared {declared}, the competitor's winning "
        f"attempt sent {grant.sent - deadline:+.3f} s and answered {grant.answered - deadline:+.3f} s "
        f"(margin {margin:.3f} s); its heartbeat thread waited for a CPU for {starved} in the fault"
    )


def warm_pool(service: LockService, connections: int = 4) -> None:
    """Fill an SQL provider's pool with ``connections`` open connections (no-op for Redis),
    so that a fault leaves several stale ones behind."""
    engine = getattr(service.provider, "_engine", None)
    if engine is None:
        return
    held = [engine.raw_connection() for _ in range(connections)]
    for conn in held:
        conn.close()


def failures_before_success(call: Callable[[], object], attempts: int = 100) -> int:
    """Call ``call`` until it does not raise BackendError; how many times it did."""
    for failures in range(attempts):
        try:
            call()
        except BackendError:
            time.sleep(0.05)
            continue
        return failures
    pytest.fail(f"still failing after {attempts} attempts")


def faketime_wrapper(offset: str) -> list[str] | None:
    """The command prefix that runs a program with its wall clock shifted by ``offset``
    (libfaketime syntax, e.g. ``+1h``), monotonic clock untouched; None if not installed."""
    binary = shutil.which("faketime")
    return None if binary is None else [binary, "--exclude-monotonic", "-f", offset]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the figures the fault tests measured (CE_FAULTS_REPORT=path also saves them)."""
    if not _FIGURES:
        return
    terminalreporter.section("fault-injection figures")
    for row in _FIGURES:
        terminalreporter.write_line(json.dumps(row, default=str))
    target = os.environ.get("CE_FAULTS_REPORT")
    if target:
        Path(target).write_text("".join(json.dumps(row, default=str) + "\n" for row in _FIGURES))
