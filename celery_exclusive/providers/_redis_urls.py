"""Redis URLs and clients: the client a URL (or a client passed in) stands for.

Cluster, Sentinel and multi-host URL parsing, the ``ce_`` options and their checks; the
provider (providers/redis.py) only reads the :class:`Target` built here. Nothing is
contacted: a cluster client is built on first use, a Sentinel one asks on first command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers._redis_sentinel import sentinels
from celery_exclusive.urls import mask_url, sentinel_url, split_options

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

_CLUSTER = ("redis+cluster", "rediss+cluster")
_SENTINEL = ("redis+sentinel", "rediss+sentinel")
_TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
_OPTIONS = ("wait_replicas", "wait_timeout")


def whole_ms(seconds: float) -> int:
    """``seconds`` in whole ms, rounded down (float noise aside), at least 1."""
    return max(1, int(seconds * 1000 + 1e-6))


@dataclass
class Target:
    """What the provider talks to, and how it may.

    ``client`` is None until ``factory`` builds it (a cluster from a URL). ``pool`` is the
    connection pool of a one-server client (None on a cluster); ``built`` says the provider
    made the client, so it may send on connections of its own and closes it. ``wait`` is
    ``(replicas, timeout s)`` as given, checked by :func:`wait_settings`. ``sentinels`` is
    the redis-py ``Sentinel`` of a Sentinel client the provider built (closed with it).
    """

    display: str
    client: Any = None
    factory: Callable[[], Any] | None = None
    password: Any = None
    pool: Any = None
    wait: tuple[object, object] = (0, 0.5)
    built: bool = False
    sentinels: Any = None

    @property
    def cluster(self) -> bool:
        from redis.cluster import RedisCluster

        return self.factory is not None or isinstance(self.client, RedisCluster)

    @property
    def socket_timeout(self) -> object:
        return None if self.pool is None else self.pool.connection_kwargs.get("socket_timeout")


def target_of_client(client: redis.Redis | RedisCluster, wait: tuple[object, object]) -> Target:
    """The target of a client you built (used as configured, never closed by the provider)."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        names = ",".join(sorted(n.name for n in client.startup_nodes))
        password = client.nodes_manager.connection_kwargs.get("password")
        return Target(f"<client cluster {names}>", client, password=password, wait=wait)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
    return Target(f"<client {where}>", client, password=kw.get("password"), pool=pool, wait=wait)


def target_of_url(url: str, wait: tuple[object, object]) -> Target:
    """The target ``url`` describes (its ``ce_`` options win over ``wait``); the client is
    built here, or for a cluster prepared to be built. ConfigurationError if malformed."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    base, options = split_options(sentinel_url(url), _OPTIONS)  # kombu's "sentinel://h1;..." too
    target = Target(mask_url(url), built=True)
    target.wait = (
        _number(options.get("wait_replicas"), int, wait[0]),
        _number(options.get("wait_timeout"), float, wait[1]),
    )
    scheme = base.partition("://")[0].lower()
    retry = Retry(NoBackoff(), 0)
    try:
        if scheme in _CLUSTER:
            target.factory, target.password = _cluster_factory(base, retry)
            return target
        if scheme in _SENTINEL:
            target.sentinels, target.client = _sentinel_client(base, retry)
        else:
            target.client = redis.Redis.from_url(base, retry=retry, **_TIMEOUTS)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"bad redis URL {mask_url(url)!r}: {exc}") from exc
    target.pool = target.client.connection_pool
    target.password = target.pool.connection_kwargs.get("password")
    return target


def _multi_host(url: str, default_port: int) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """Hosts, path (no leading ``/``) and redis-py connection kwargs of a multi-host URL.

    ``scheme://[userinfo@]host[:port][,host[:port]...][/path][?query]``; the query and
    userinfo are parsed by redis-py's own URL parser. Raises ValueError when malformed.
    """
    from redis import connection

    parse_url: Callable[[str], dict[str, Any]] = connection.parse_url  # untyped in redis-py
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hostlist = authority.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        parts = urlsplit("//" + item)
        if not parts.hostname:
            raise ValueError(f"no host in {item!r}")
        hosts.append((parts.hostname, parts.port or default_port))  # .port raises on a bad port
    single = "rediss" if scheme.lower().startswith("rediss") else "redis"
    kwargs = parse_url(f"{single}://{userinfo}{at}{hostlist.split(',')[0]}" + (f"?{query}" if query else ""))
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    for name, value in _TIMEOUTS.items():
        kwargs.setdefault(name, value)
    return hosts, path, kwargs


def _cluster_factory(url: str, retry: Any) -> tuple[Callable[[], RedisCluster], Any]:
    """A function building the RedisCluster client for ``url`` (contacts it), and its password."""
    from redis import cluster
    from redis.cluster import RedisCluster

    node: Callable[[str, int], Any] = cluster.ClusterNode  # untyped in redis-py
    hosts, path, kwargs = _multi_host(url, 6379)
    db = kwargs.pop("db", 0)
    if path.strip("/") not in ("", "0") or db != 0:
        raise ValueError("Redis Cluster has only database 0")
    nodes = [node(host, port) for host, port in hosts]
    return (lambda: RedisCluster(startup_nodes=nodes, retry=retry, **kwargs)), kwargs.get("password")


def _sentinel_client(url: str, retry: Any) -> tuple[Any, redis.Redis]:
    """The URL's sentinels (a redis-py ``Sentinel``, see providers/_redis_sentinel.py) and a
    client of the primary they name ``service`` (nothing is contacted yet)."""
    hosts, path, kwargs = _multi_host(url, 26379)
    service, _, db_text = path.strip("/").partition("/")
    if not service:
        raise ValueError("name the Sentinel service in the path: /<service>[/<db>]")
    db = int(db_text) if db_text else kwargs.pop("db", 0)
    kwargs.pop("db", None)
    tls = kwargs.pop("connection_class", None) is not None  # rediss: SSLConnection
    if tls:
        kwargs["ssl"] = True  # SentinelConnectionPool then uses its own TLS connection class
    sentinel_kwargs = {
        k: v for k, v in kwargs.items() if k.startswith("socket_") or (tls and k.startswith("ssl"))
    }
    sentinel_kwargs["retry"] = retry  # each sentinel is asked once; the next one is the retry
    manager = sentinels(hosts, sentinel_kwargs, **kwargs)
    client: redis.Redis = manager.master_for(service, db=db, retry=retry)
    return manager, client


def _number(text: str | None, kind: Callable[[str], object], default: object) -> object:
    """A URL option's value as ``kind`` (the text itself if it is not one, for the error)."""
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        return text


def _within(value: object, kind: Any, low: float, high: float, rule: str) -> Any:
    """``value`` if it is a ``kind`` (never a bool) from ``low`` to ``high``; else
    ConfigurationError saying ``rule``."""
    if not isinstance(value, kind) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigurationError(f"{rule}, got {value!r}")
    return value


def wait_settings(target: Target) -> tuple[int, int]:
    """``(replicas, timeout in ms)`` for ``WAIT``, checked; ConfigurationError if out of range.

    The timeout must end before the socket's, or a slow acknowledgement would read as a
    broken connection instead of a clear answer.
    """
    replicas: int = _within(
        target.wait[0], int, 0, 100, "ce_wait_replicas must be a whole number from 0 to 100"
    )
    timeout: float = _within(
        target.wait[1], int | float, 0.001, 60, "ce_wait_timeout must be seconds from 0.001 to 60"
    )
    socket_timeout = target.socket_timeout
    if replicas and isinstance(socket_timeout, int | float) and timeout >= socket_timeout:
        raise ConfigurationError(
            f"ce_wait_timeout ({timeout:g} s) must be shorter than the socket timeout ({socket_timeout:g} s)"
        )
    return replicas, whole_ms(timeout)
