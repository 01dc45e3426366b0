"""What ``RedisLockProvider.diagnose()`` finds on one Redis primary.

Server version and role, replicas, clock skew, eviction and persistence settings; every
detail starts with ``where`` (a cluster node's name, or nothing for one server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from celery_exclusive.errors import BackendError
from celery_exclusive.providers._redis_wire import as_text, left
from celery_exclusive.providers.base import Diagnosis

if TYPE_CHECKING:
    from celery_exclusive.providers._redis_server import RedisServer
    from celery_exclusive.providers._redis_wire import Wire


def server_findings(
    server: Any, where: str, *, cluster: bool, wait_replicas: int, refused: type[Exception]
) -> list[Diagnosis]:
    """The findings for one server (a primary), asked with ``server`` (a redis-py client);
    ``refused`` is the error a proxy or ACL answers ``CONFIG GET`` with."""
    info = server.info()
    sec, usec = server.time()
    skew = sec + usec / 1e6 - time.time()
    try:
        config = server.config_get("maxmemory*") | server.config_get("appendonly")
    except refused:
        config = {}
    found = [_version(str(info.get("redis_version", "?")), where)]
    if info.get("cluster_enabled") and not cluster:
        found.append(Diagnosis("cluster", "fail", f"{where}a Redis Cluster node: use a redis+cluster:// URL"))
    found.extend(_replication(info, where, wait_replicas))
    found.append(
        Diagnosis("clock", "ok" if abs(skew) < 1 else "warn", f"{where}server - local = {skew:+.3f} s")
    )
    found.extend(_settings({as_text(k): as_text(v) for k, v in config.items()}, where))
    return found


def _version(version: str, where: str) -> Diagnosis:
    major = int(version.split(".", maxsplit=1)[0]) if version[:1].isdigit() else 0
    old = major < 6
    return Diagnosis(
        "server", "fail" if old else "ok", f"{where}Redis {version}" + (": 6.0+ needed" if old else "")
    )


def _replication(info: dict[str, Any], where: str, wait_replicas: int) -> list[Diagnosis]:
    role, replicas = info.get("role"), int(info.get("connected_slaves", 0))
    if role != "master":
        return [Diagnosis("replica", "fail", f"{where}connected to a {role}: point the URL at the primary")]
    if wait_replicas:
        enough = replicas >= wait_replicas
        detail = (
            f"{where}{replicas} replica(s) connected; grants and refreshes wait for "
            f"{wait_replicas} (ce_wait_replicas)" + ("" if enough else ", so every one fails")
        )
        return [Diagnosis("replica", "ok" if enough else "fail", detail)]
    if replicas:
        return [
            Diagnosis("replica", "warn", f"{where}{replicas} async replica(s): a failover can lose leases")
        ]
    return []


def _settings(conf: dict[str, str], where: str) -> list[Diagnosis]:
    policy = conf.get("maxmemory-policy", "")
    if not conf:
        return [Diagnosis("settings", "warn", f"{where}CONFIG GET refused: check maxmemory-policy yourself")]
    if conf.get("maxmemory", "0") != "0" and policy != "noeviction":
        detail = f"{where}maxmemory-policy {policy} may evict locks (they carry TTLs): use noeviction"
        return [Diagnosis("eviction", "fail", detail)]
    if conf.get("appendonly") == "no":
        return [
            Diagnosis("persistence", "warn", f"{where}appendonly no: a restart can lose leases and fences")
        ]
    return []


def diagnose_servers(server: RedisServer, deadline: float | None = None) -> list[Diagnosis]:
    """The findings of every primary ``server`` reaches (details name the node on a cluster),
    each question within ``deadline`` (monotonic; None: the client's own timeouts) on the
    connections the provider built (:attr:`~.RedisServer.on_wires`; without them the
    deadline is not looked at: see :func:`within`)."""
    findings = partial(
        server_findings,
        cluster=server.cluster,
        wait_replicas=server.wait_replicas,
        refused=server.response_error,
    )
    with server.translated:
        asked: list[tuple[Any, str]]
        if deadline is not None and server.on_wires:
            asked = [(_Questions(wire, deadline), name) for name, wire in server.primary_wires(deadline)]
        elif server.cluster:
            client = server.client
            asked = [(client.get_redis_connection(node), node.name) for node in client.get_primaries()]
        else:
            asked = [(server.client, "")]
        found: list[Diagnosis] = []
        if server.cluster:
            found.append(
                Diagnosis("cluster", "ok", f"Redis Cluster, {len(asked)} primaries; locks are per slot")
            )
        for each, name in asked:
            found.extend(findings(each, f"{name}: " if server.cluster else ""))
    return found


class _Questions:
    """What :func:`server_findings` asks a redis-py client, asked on a Wire, each command
    within what is left until ``deadline``."""

    def __init__(self, wire: Wire, deadline: float) -> None:
        self._wire = wire
        self._deadline = deadline

    def _send(self, *command: str) -> Any:
        return self._wire.send(*command, timeout=left(self._deadline))

    def info(self) -> dict[str, Any]:
        """``INFO``'s ``field:value`` lines (integers as int), as redis-py's ``info()``."""
        fields: dict[str, Any] = {}
        for line in as_text(self._send("INFO")).splitlines():
            name, colon, value = line.partition(":")
            if colon and not line.startswith("#"):
                fields[name] = int(value) if value.isdigit() else value
        return fields

    def time(self) -> tuple[int, int]:
        sec, usec = self._send("TIME")
        return int(sec), int(usec)

    def config_get(self, pattern: str) -> dict[Any, Any]:
        reply = self._send("CONFIG", "GET", pattern)
        if isinstance(reply, dict):  # RESP3
            return reply
        return dict(zip(reply[::2], reply[1::2], strict=True))


def within(deadline: float, server: RedisServer, ask: Callable[[], list[Diagnosis]]) -> list[Diagnosis]:
    """``ask()`` in a thread of its own, waited for until ``deadline`` (then BackendError; the
    thread goes on until the client's own timeouts end it): a diagnose through a client you
    passed, whose calls take no deadline."""
    outcome: list[list[Diagnosis] | BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(ask())
        except BaseException as exc:  # handed to the caller
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="celery-exclusive-redis-diagnose", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise BackendError(f"redis {server.display}: no answer to diagnose by the call's deadline")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
