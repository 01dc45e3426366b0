"""Redis URLs and clients: the client a URL (or a client passed in) stands for.

Cluster, Sentinel and multi-host URL parsing, the ``ce_`` options and their checks; the
provider (providers/redis.py) only reads the :class:`Target` built here. Nothing is
contacted: a cluster client is built on first use, a Sentinel one asks on first command.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers._redis_query import checked_query, without
from celery_exclusive.providers._redis_sentinel import sentinels
from celery_exclusive.urls import (
    SECRET_NAME,
    known_secrets,
    mask_error,
    mask_url,
    sentinel_url,
    split_options,
    url_secrets,
)

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

_CLUSTER = ("redis+cluster", "rediss+cluster")
_SENTINEL = ("redis+sentinel", "rediss+sentinel")
_TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
_OPTIONS = ("wait_replicas", "wait_timeout")
_DB_PATH = re.compile(r"/?(?:[0-9]+/?)?")
_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


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
    #: Every secret the store was given (:func:`store_secrets`): the URL's, the clients'
    #: passwords, the sentinels' own: what a driver's message must not show.
    secrets: list[str] = field(default_factory=list, repr=False)  # reprs never show a secret
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
        secrets = store_secrets(client)
        return Target(f"<client cluster {names}>", client, secrets=secrets, wait=wait)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    manager = getattr(pool, "sentinel_manager", None)
    db = kw.get("db", 0)
    if manager is not None:  # a Sentinel client: its pool knows no address until it asks
        role = "primary" if getattr(pool, "is_master", True) else "replica"
        service = getattr(pool, "service_name", "?")
        where = f"sentinel {service} {role} via {_sentinel_hosts(manager)}, db {db}"
    else:
        where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}/{db}"
    return Target(f"<client {where}>", client, secrets=store_secrets(client), pool=pool, wait=wait)


def _sentinel_hosts(manager: Any) -> str:
    """``host:port,...`` of a redis-py ``Sentinel``'s sentinels, as given."""
    found = []
    for sentinel in manager.sentinels:
        kw = sentinel.connection_pool.connection_kwargs
        found.append(f"{kw.get('host', '?')}:{kw.get('port', '?')}")
    return ",".join(found)


def store_secrets(client: Any, url: str = "") -> list[str]:
    """Every secret a Redis store was given (:func:`~celery_exclusive.urls.known_secrets`):
    ``url``'s, and each password (or other value named as a secret: ``ssl_password``...)
    in the connection options of ``client``, of its sentinels (``sentinel_kwargs``) and of
    its credential provider's ``password``."""
    found = url_secrets(url) if url else []
    options = []
    if client is not None:
        nodes = getattr(client, "nodes_manager", None)  # a cluster client
        if nodes is not None:
            options.append(nodes.connection_kwargs)
        else:
            pool = client.connection_pool
            options.append(pool.connection_kwargs)
            for sentinel in getattr(getattr(pool, "sentinel_manager", None), "sentinels", ()):
                options.append(sentinel.connection_pool.connection_kwargs)
    for kw in options:
        provider = kw.get("credential_provider")
        values = [getattr(provider, "password", None)]
        values += [value for name, value in kw.items() if SECRET_NAME.fullmatch(name)]
        for value in values:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if isinstance(text, str) and text:
                found.append(text)
    return known_secrets(found)


def target_of_url(url: str, wait: tuple[object, object]) -> Target:
    """The target ``url`` describes (its ``ce_`` options win over ``wait``); the client is
    built here, or for a cluster prepared to be built. ConfigurationError if malformed."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    base, options = split_options(sentinel_url(url), _OPTIONS)  # kombu's "sentinel://h1;..." too
    target = Target(mask_url(url, url_secrets(url)), built=True, secrets=url_secrets(url))
    target.wait = (
        _number(options.get("wait_replicas"), int, wait[0]),
        _number(options.get("wait_timeout"), float, wait[1]),
    )
    scheme = base.partition("://")[0].lower()
    retry = Retry(NoBackoff(), 0)
    cluster: dict[str, Any] | None = None  # a cluster's connection options
    ignored: Collection[str] = ()  # the URL's parameters a Sentinel pool keeps for itself
    try:
        if scheme in _CLUSTER:
            target.factory, cluster = _cluster_factory(base, retry)
        elif scheme in _SENTINEL:
            target.sentinels, target.client, ignored = _sentinel_client(base, retry)
        else:
            typed = checked_query(base)  # passed typed, not as the query's text
            _check_db_path(base)
            target.client = redis.Redis.from_url(without(base, typed), retry=retry, **_TIMEOUTS, **typed)
    except (ValueError, TypeError) as exc:  # redis-py may name a piece of a raw password
        reason = mask_url(str(exc), target.secrets)
        mask_error(exc, target.secrets)  # still the error's __context__
        raise ConfigurationError(f"bad redis URL {target.display!r}: {reason}") from None
    if cluster is not None:
        password = cluster.get("password")
        target.secrets = known_secrets([*target.secrets, *([password] if password else [])])
        _check_cluster_options(target, cluster)
        return target
    target.pool = target.client.connection_pool
    _check_connection_options(target, lambda: target.pool, ignored, "Sentinel connection pool")
    target.secrets = store_secrets(target.client, url)
    return target


def _check_db_path(url: str) -> None:
    """ValueError unless the path of a ``redis://`` URL is a database number (or empty),
    and the same as the query's ``db`` if both give one.

    redis-py reads a path that is no number as database 0 (``/x``, ``/O``) and joins the
    digits of a longer one (``/1/2`` is 12): a typo would put the locks elsewhere, silently;
    so would a ``?db=`` other than the path's (redis-py takes the query's).
    """
    if url.lower().startswith("unix://"):
        return  # the path is the socket's; the database is ``?db=``
    parts = urlsplit(url)
    if not _DB_PATH.fullmatch(parts.path):
        hint = "; percent-encode a '/' in the password (%2F)" if "@" in parts.path else ""
        raise ValueError(f"the path must be a database number (/0, /1...), got {parts.path!r}{hint}")
    _same_db(parts.path.strip("/"), dict(parse_qsl(parts.query)).get("db"))


def _same_db(path_db: str, query_db: object) -> None:
    """ValueError if a URL's path and its ``?db=`` give different databases."""
    try:
        differ = bool(path_db) and query_db is not None and int(str(query_db)) != int(path_db)
    except ValueError:
        return  # not a number: refused as such (checked_query, or the path's own check)
    if differ:
        raise ValueError(
            f"URL option 'db' ({query_db}) and the path's database (/{path_db}) differ; give it once"
        )


def _check_connection_options(
    target: Target, pool: Callable[[], Any], ignored: Collection[str] = (), client: str = ""
) -> None:
    """ConfigurationError naming a URL query parameter redis-py's connection refuses, or
    one of ``ignored``: the URL's parameters that its ``client`` would drop or read itself.

    redis-py passes unknown parameters on to its connection class, which refuses them (and
    a bad ``ssl_cert_reqs``) only when the first call makes a connection; building one
    here from the connection pool ``pool()`` returns (nothing connects) asks the same
    question at once.
    """
    from redis.exceptions import RedisError

    for name in ignored:
        raise ConfigurationError(
            f"unknown URL option {name!r} in lock store URL {target.display!r}: "
            f"redis-py's {client} takes no such parameter"
        )
    try:
        made = pool()
        made.connection_class(**made.connection_kwargs)
    except (TypeError, ValueError, RedisError) as exc:
        reason = mask_url(str(exc), target.secrets)
        mask_error(exc, target.secrets)  # still the error's __context__
        unexpected = _UNEXPECTED.search(reason) if isinstance(exc, TypeError) else None
        if unexpected is None:
            raise ConfigurationError(f"bad redis URL {target.display!r}: {reason}") from None
        raise ConfigurationError(
            f"unknown URL option {unexpected.group(1)!r} in lock store URL {target.display!r}: "
            "redis-py's connection takes no such parameter"
        ) from None


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
    kwargs.update(checked_query(url))  # what parse_url passes on as text, typed
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    for name, value in _TIMEOUTS.items():
        kwargs.setdefault(name, value)
    return hosts, path, kwargs


def _check_cluster_options(target: Target, kwargs: dict[str, Any]) -> None:
    """:func:`_check_connection_options` for a cluster URL's ``kwargs``, before the client
    is built. redis-py's cluster client keeps only the connection options among them (its
    ``cleanup_kwargs``) and drops the rest unused; one named as an argument of
    ``RedisCluster`` itself was passed to it as text (``require_full_coverage=false``:
    true). Each node's connection pool is made from the kept ones, as here."""
    import redis
    from redis import cluster

    cleanup: Callable[..., dict[str, Any]] = cluster.cleanup_kwargs  # untyped in redis-py
    kept = cleanup(**kwargs)
    ignored = [name for name in kwargs if name not in kept]
    _check_connection_options(target, lambda: redis.ConnectionPool(**kept), ignored, "cluster client")


def _cluster_factory(url: str, retry: Any) -> tuple[Callable[[], RedisCluster], dict[str, Any]]:
    """A function building the RedisCluster client for ``url`` (contacts it), and the
    connection options (the query's, the password...) it passes."""
    from redis import cluster
    from redis.cluster import RedisCluster

    node: Callable[[str, int], Any] = cluster.ClusterNode  # untyped in redis-py
    hosts, path, kwargs = _multi_host(url, 6379)
    db = kwargs.pop("db", 0)
    if path.strip("/") not in ("", "0") or db != 0:
        raise ValueError("Redis Cluster has only database 0")
    nodes = [node(host, port) for host, port in hosts]
    return (lambda: RedisCluster(startup_nodes=nodes, retry=retry, **kwargs)), kwargs


def _sentinel_client(url: str, retry: Any) -> tuple[Any, redis.Redis, list[str]]:
    """The URL's sentinels (a redis-py ``Sentinel``, see providers/_redis_sentinel.py), a
    client of the primary they name ``service`` (nothing is contacted yet), and the URL's
    parameters its pool kept for itself (``ssl``, ``check_connection``: any text is true)."""
    from redis import ConnectionPool

    hosts, path, kwargs = _multi_host(url, 26379)
    service, _, db_text = path.strip("/").partition("/")
    if not service:
        raise ValueError("name the Sentinel service in the path: /<service>[/<db>]")
    _same_db(db_text, kwargs.get("db"))
    db = int(db_text) if db_text else kwargs.pop("db", 0)
    kwargs.pop("db", None)
    tls = url.lower().startswith("rediss")  # a connection_class in the query is no TLS
    if tls:
        kwargs.pop("connection_class", None)  # parse_url's SSLConnection, for the scheme
    given = list(kwargs)
    if tls:
        kwargs["ssl"] = True  # SentinelConnectionPool then uses its own TLS connection class
    sentinel_kwargs = {
        k: v for k, v in kwargs.items() if k.startswith("socket_") or (tls and k.startswith("ssl"))
    }
    sentinel_kwargs["retry"] = retry  # each sentinel is asked once; the next one is the retry
    manager = sentinels(hosts, sentinel_kwargs, **kwargs)
    client: redis.Redis = manager.master_for(service, db=db, retry=retry)
    passed = client.connection_pool.connection_kwargs
    own = inspect.signature(ConnectionPool).parameters  # max_connections...: the pool uses them
    kept = [n for n in given if n not in passed and (n not in own or own[n].kind is own[n].VAR_KEYWORD)]
    return manager, client, kept


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
