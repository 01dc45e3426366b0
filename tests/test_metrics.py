"""Prometheus metrics driven by real lock events on memory:// and a real Redis.

A heartbeat failure needs a real outage: the Redis service talks through a local TCP
proxy that the test shuts down (the shared Redis server itself is never touched).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_exclusive import LockService, MissingDriverError, signals
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.metrics import Metrics, install, installed, uninstall
from tests.conftest import REDIS_URL, delete_redis_keys, require_server


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Values:
    """Reads samples of the celery_exclusive metrics from one registry (0 when absent)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def __call__(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(f"celery_exclusive_{name}", labels)
        return 0.0 if value is None else value


class TcpProxy:
    """Forwards local connections to a server until :meth:`stop` cuts every connection."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.mutex = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.mutex:
                self.sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (a store outage as clients see it)."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.mutex:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A fresh registry; metrics are uninstalled after the test."""
    yield CollectorRegistry()
    uninstall()


@pytest.fixture(params=["memory", "redis"])
def service(request: pytest.FixtureRequest) -> Iterator[LockService]:
    """A LockService on memory:// or on Redis with a unique prefix, closed and cleaned up after."""
    prefix = f"met{uuid.uuid4().hex[:10]}:"
    if request.param == "redis":
        require_server(REDIS_URL)
    service = LockService("memory://" if request.param == "memory" else REDIS_URL, prefix=prefix)
    yield service
    service.close()
    if request.param == "redis":
        delete_redis_keys(prefix)


def test_importing_without_prometheus_client_raises_missing_driver_error() -> None:
    """Without prometheus-client, importing the module raises MissingDriverError naming the extra."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from celery_exclusive.errors import MissingDriverError\n"
        "try:\n    import celery_exclusive.metrics\n"
        "except MissingDriverError as exc:\n    print(exc.extra, exc.module)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["metrics", "prometheus_client"]
    assert issubclass(MissingDriverError, ImportError)


def test_lock_events_change_the_documented_metrics(registry: CollectorRegistry, service: LockService) -> None:
    """Acquire, contend, refresh, release, loss and a skip each move their documented metric."""
    install(registry)
    value = Values(registry)
    assert value("acquisitions_total", outcome="acquired") == 0  # series exist before any event

    lease = service.lock("job", ttl=1.0, refresh_interval=0.1)
    assert service.try_lock("job") is None
    assert value("acquisitions_total", outcome="acquired") == 1
    assert value("acquisitions_total", outcome="contended") == 1

    assert wait_until(lambda: value("heartbeat_duration_seconds_count") >= 2, timeout=5)
    beats = value("heartbeat_leases_count")
    assert beats >= 2
    assert value("heartbeat_leases_sum") == beats  # one lease confirmed per round trip
    assert value("heartbeat_duration_seconds_sum") > 0

    time.sleep(0.2)
    assert lease.release().value == "released"
    assert value("releases_total", outcome="released") == 1
    assert value("hold_seconds_count") == 1
    assert value("hold_seconds_sum") >= 0.2

    doomed = service.lock("doomed", ttl=1.0, refresh_interval=0.1)
    assert service.force_release("doomed", doomed.token)  # the heartbeat then finds it gone
    assert wait_until(lambda: value("leases_lost_total") == 1, timeout=5)
    assert doomed.release().value == "not_owned"
    assert value("releases_total", outcome="not_owned") == 1
    assert value("hold_seconds_count") == 2
    assert value("heartbeat_failures_total") == 0

    app = Celery("metrics_test", set_as_current=False)

    # shared=False: a shared task would be added to every app finalized later in the session.
    @app.task(name="tests.metrics.report", shared=False)  # type: ignore[untyped-decorator]
    def report() -> None:
        """A task for the skip counter."""

    signals.send(signals.task_skipped, report, key="job", task=report, holder=None)
    assert value("task_skips_total", task="tests.metrics.report") == 1


def test_a_store_outage_counts_heartbeat_failures_and_the_lost_lease(registry: CollectorRegistry) -> None:
    """When Redis becomes unreachable, failed refreshes and the resulting lost lease are counted."""
    require_server(REDIS_URL)
    install(registry)
    value = Values(registry)
    proxy = TcpProxy("127.0.0.1", int(REDIS_URL.split(":")[2].split("/")[0]))
    prefix = f"met{uuid.uuid4().hex[:10]}:"
    service = LockService(f"redis://127.0.0.1:{proxy.port}/0", prefix=prefix)
    try:
        lease = service.lock("outage", ttl=1.5, refresh_interval=0.2)
        assert wait_until(lambda: value("heartbeat_duration_seconds_count") >= 1, timeout=5)
        proxy.stop()
        assert wait_until(lambda: value("heartbeat_failures_total") >= 1, timeout=5)
        assert wait_until(lambda: value("leases_lost_total") == 1, timeout=5)
        assert not lease.held
    finally:
        proxy.stop()
        service.close()
        delete_redis_keys(prefix)


def test_installing_twice_does_not_double_count(registry: CollectorRegistry) -> None:
    """A second install() on the same registry returns the same Metrics and each event counts once."""
    receivers = len(signals.lock_acquired.receivers)
    first = install(registry)
    second = install(registry)
    assert first is second is installed()
    assert isinstance(first, Metrics)
    assert len(signals.lock_acquired.receivers) == receivers + 1
    with LockService("memory://") as service, service.lock("once"):
        pass
    value = Values(registry)
    assert value("acquisitions_total", outcome="acquired") == 1
    assert value("releases_total", outcome="released") == 1


def test_uninstall_stops_counting_and_reinstalling_resumes(registry: CollectorRegistry) -> None:
    """After uninstall() nothing is counted; installing on the same registry again resumes the same series."""
    metrics = install(registry)
    value = Values(registry)
    with LockService("memory://") as service:
        service.lock("a").release()
        uninstall()
        assert installed() is None
        service.lock("a").release()
        assert value("acquisitions_total", outcome="acquired") == 1
        assert install(registry) is metrics
        service.lock("a").release()
    assert value("acquisitions_total", outcome="acquired") == 2
    uninstall()
    uninstall()  # idempotent


def test_installing_on_another_registry_while_installed_is_refused(registry: CollectorRegistry) -> None:
    """Metrics count on one registry at a time: a second registry needs uninstall() first."""
    install(registry)
    with pytest.raises(InvalidArgumentError):
        install(CollectorRegistry())
    uninstall()
    other = CollectorRegistry()
    assert install(other).registry is other


@pytest.mark.parametrize("registry_arg", ["prod", 0, object()])
def test_install_rejects_what_is_no_registry_and_installs_nothing(registry_arg: object) -> None:
    """``install(registry=...)`` takes a prometheus_client registry: anything else is an
    InvalidArgumentError naming what it got, and nothing is installed (on main: an
    AttributeError from inside prometheus_client, 'str' object has no attribute 'register')."""
    uninstall()
    with pytest.raises(InvalidArgumentError, match="registry"):
        install(registry_arg)  # type: ignore[arg-type]
    assert installed() is None


def test_metric_names_are_prefixed_and_never_labelled_by_key(registry: CollectorRegistry) -> None:
    """Every metric is named celery_exclusive_* and no metric has a key label."""
    install(registry)
    families = list(registry.collect())
    assert {f.name for f in families} == {
        "celery_exclusive_acquisitions",
        "celery_exclusive_task_skips",
        "celery_exclusive_hold_seconds",
        "celery_exclusive_releases",
        "celery_exclusive_heartbeat_duration_seconds",
        "celery_exclusive_heartbeat_leases",
        "celery_exclusive_heartbeat_failures",
        "celery_exclusive_leases_lost",
    }
    for family in families:
        for sample in family.samples:
            assert "key" not in sample.labels
