"""What ``RedisLockProvider.diagnose()`` finds on one Redis primary.

Server version and role, replicas, clock skew, eviction and persistence settings; every
detail starts with ``where`` (a cluster node's name, or nothing for one server).
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

from celery_exclusive.providers._redis_wire import as_text
from celery_exclusive.providers.base import Diagnosis

if TYPE_CHECKING:
    from celery_exclusive.providers._redis_server import RedisServer


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


def diagnose_servers(server: RedisServer) -> list[Diagnosis]:
    """The findings of every primary ``server`` reaches (details name the node on a cluster)."""
    found: list[Diagnosis] = []
    findings = partial(
        server_findings,
        cluster=server.cluster,
        wait_replicas=server.wait_replicas,
        refused=server.response_error,
    )
    with server.translated:
        client = server.client
        if server.cluster:
            primaries = client.get_primaries()
            detail = f"Redis Cluster, {len(primaries)} primaries; locks are per slot"
            found.append(Diagnosis("cluster", "ok", detail))
            for node in primaries:
                found.extend(findings(client.get_redis_connection(node), f"{node.name}: "))
        else:
            found.extend(findings(client, ""))
    return found
