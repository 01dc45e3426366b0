"""Redis lock store; needs redis-py and Redis >= 6.

URLs (query parameters are redis-py's, e.g. ``socket_timeout=2.5``, except the ``ce_``
options below):

* ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS),
  ``unix:///path/redis.sock?db=0``: one server, the primary.
* ``redis+cluster://[[user]:password@]host:port[,host:port...][/0]`` (``rediss+cluster://``):
  Redis Cluster; the hosts are startup nodes, the rest of the cluster is discovered. The
  client is built (and the cluster contacted) on first use.
* ``redis+sentinel://[[user]:password@]host[:26379][,host[:26379]...]/service[/db]``
  (``rediss+sentinel://``): the primary that the sentinels name ``service``. The password
  is the primary's; the sentinels are asked without one (pass ``client=`` for that).

Replica acknowledgement (opt-in, not on Redis Cluster): ``?ce_wait_replicas=N`` sends
``WAIT N timeout`` pipelined right after each acquire and refresh script (one round trip;
Redis does not allow ``WAIT`` inside a script), and ``ce_wait_timeout=S`` (seconds,
default 0.5) bounds it. A grant or refresh that fewer than N replicas acknowledged within
the timeout is a BackendError, not a lease: it may exist on the primary only, which a
failover would lose. A contended acquire wrote nothing and is answered as usual.

Each lock is one hash at exactly the key given, with fields ``token``, ``fence``,
``created``, ``expires`` and ``deadline`` (milliseconds on the Redis server's clock,
``expires <= deadline``) and ``holder`` (JSON). The scripts report times in microseconds
from ``TIME``: a lease stored as ending at ``expires`` ms is dead from ``expires * 1000`` µs,
and the holder is told exactly that much, never the whole ms it would round to.
A lease is live while ``token`` is set and
``expires`` is in the future; every operation is a Lua script that reads the clock with
``TIME``, so expiry is decided by Redis alone. Every script touches one key, or (refresh,
peek) several keys of one hash slot, so all of it works on Redis Cluster.

Retention. Acquiring sets the hash's TTL to the lease's hard deadline plus ``RETAIN_MS``
(24 h, the max-lifetime cap); releasing clears the lease fields, keeps ``fence`` and sets
the TTL to ``RETAIN_MS``. A lock key therefore costs memory for at most 24 h after its
lease ends, however many distinct keys (one per work item, say) are ever used.

Completion records (``release(..., completion)``) are fields ``done:<task id>`` of the
same hash, valued ``expires|recorded|attempt|outcome`` (server milliseconds): no key of
their own, so they never collide with a lock key and stay in the lock's hash slot. A record
past its expiry counts as absent; expired ones are pruned by a later release on that key.
The hash then lives as long as its longest-kept record (field ``done_max``), if longer.

Fences. A grant's fence is ``max(previous fence + 1, TIME in microseconds)``. While the
hash exists the previous fence makes the new one larger; once it has expired, at least
24 h have passed since the last fence of that key was issued (each fence is the server's
microsecond clock at its grant, or barely above it), so the clock alone is larger. Fences
are thus strictly increasing per key unless Redis's clock steps back by more than 24 h
(or a failover lands on a server whose clock is that far behind) while the key is unused.
When Redis *loses* the hash (restart without persistence, ``FLUSHALL``, failover to a
replica without it), the clock alone decides: a clock s seconds behind where it was gives
a smaller fence to a key last granted within s seconds (docs/faults.md).
They are large (about 1.7e15, exact in Lua's doubles below 2**53) and not consecutive.
Why no separate counter key: a script's keys must share one hash slot on Redis Cluster,
and a counter key derived from an arbitrary lock key cannot always share its slot (a name
with ``}`` but no valid hash tag defeats every hash-tag trick) and could collide with a
user's own key; a global counter would send every acquire to one slot; and a counter that
must never expire is the unbounded memory this design avoids. Keys written by versions
before this design carry no TTL until they are next acquired or released; deleting such
an idle ``{fence: N}`` hash is safe (the next fence comes from the clock).

Keys now carry TTLs, so a ``volatile-*`` (or ``allkeys-*``) ``maxmemory-policy`` may evict
live locks: use ``noeviction`` (``diagnose()`` fails otherwise).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from celery_exclusive.errors import BackendError, ConfigurationError, MissingDriverError
from celery_exclusive.providers.base import (
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
    decode_holder,
)
from celery_exclusive.urls import mask_url, sentinel_url, split_options
from celery_exclusive.validation import MAX_LIFETIME_CAP

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

#: Seconds a kept connection may sit idle before it is checked for a server-side close;
#: under Redis's smallest idle ``timeout`` (1 s) so no live connection goes unchecked.
_POLL_AFTER = 0.5

#: Milliseconds a lock hash outlives its lease's hard deadline, or its release.
RETAIN_MS = int(MAX_LIFETIME_CAP * 1000)

# ``now`` is the stored unit (ms, rounded down); every time a script *returns* is in µs,
# measured from ``us``, so a holder is never told its lease lasts longer than it does:
# a lease stored as ending at ``expires`` ms is dead from ``expires * 1000`` µs on.
_NOW = (
    "local t = redis.call('TIME')\n"
    "local us = t[1] * 1000000 + t[2]\n"
    "local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
    # Numbers are written as plain integers: Redis 7.2+ would format 1.7e15 as "1.7e+15".
    "local function int(n) return string.format('%.0f', n) end\n"
)

ACQUIRE = (
    """-- KEYS[1]  the lock hash
-- ARGV[1]  token, ARGV[2] ttl ms, ARGV[3] max lifetime ms, ARGV[4] holder JSON,
--          ARGV[5] (optional) a task id whose completion record refuses the grant
-- returns  {1, fence, µs left} if granted (or already held by ARGV[1]),
--          {2, record, now in ms} if ARGV[5] has a live completion record, else
--          {0, token, fence, created, expires, deadline, holder, now in µs} of the live holder
-- A grant's fence is max(previous fence + 1, TIME in microseconds); the hash then lives
-- until RETAIN ms after the lease's hard deadline.
"""
    + _NOW
    + f"local RETAIN = {RETAIN_MS}\n"
    + """if ARGV[5] then
  local d = redis.call('HGET', KEYS[1], 'done:' .. ARGV[5])
  if d and (tonumber(string.match(d, '^(%d+)|')) or 0) > now then return {2, d, now} end
end
local r = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires', 'created', 'deadline', 'holder',
                     'done_max')
local expires = tonumber(r[3]) or 0
if r[1] and expires > now then
  if r[1] == ARGV[1] then return {1, tonumber(r[2]), expires * 1000 - us} end
  return {0, r[1], r[2], r[4], r[3], r[5], r[6] or '', us}
end
local life = tonumber(ARGV[3])
local ttl = math.min(tonumber(ARGV[2]), life)
local fence = math.max((tonumber(r[2]) or 0) + 1, us)
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', int(fence), 'created', int(now),
           'expires', int(now + ttl), 'deadline', int(now + life), 'holder', ARGV[4])
-- Completion records kept longer than that keep the hash alive as long.
redis.call('PEXPIRE', KEYS[1], int(math.max(life + RETAIN, (tonumber(r[7]) or 0) - now)))
return {1, fence, (now + ttl) * 1000 - us}
"""
)

REFRESH = (
    """-- KEYS[i]  lock hashes (n of them, one hash slot)
-- ARGV[i]  token expected on KEYS[i]; ARGV[n + i] ttl ms for KEYS[i]
-- returns  one integer per key: µs the lease now has left, or -1 if not owned (unchanged)
-- The hash's TTL already covers the hard deadline, which a refresh never passes.
"""
    + _NOW
    + """local n = #KEYS
local out = {}
for i = 1, n do
  local r = redis.call('HMGET', KEYS[i], 'token', 'expires', 'deadline')
  out[i] = -1
  if r[1] == ARGV[i] and (tonumber(r[2]) or 0) > now then
    local expires = math.min(now + tonumber(ARGV[n + i]), tonumber(r[3]))
    if expires > now then
      redis.call('HSET', KEYS[i], 'expires', int(expires))
      out[i] = expires * 1000 - us
    end
  end
end
return out
"""
)

RELEASE = (
    """-- KEYS[1]  the lock hash
-- ARGV[1]  token; optionally a completion record: ARGV[2] task id, ARGV[3] its stored
--          value 'expires|recorded|attempt|outcome' without the times, ARGV[4] retain ms
-- returns  1 if ARGV[1] held a live lease and it was deleted, else 0 (a dead lease is
--          cleared either way); the fence field stays, for RETAIN ms (or as long as the
--          longest-kept completion record, field 'done_max')
-- A record is field 'done:<task id>' of the same hash (no key of its own, so one slot);
-- expired records are pruned when the hash has doubled since the last pruning.
"""
    + _NOW
    + f"local RETAIN = {RETAIN_MS}\n"
    + """local r = redis.call('HMGET', KEYS[1], 'token', 'expires', 'done_max')
local owned, cleared = 0, false
if r[1] then
  local live = (tonumber(r[2]) or 0) > now
  if not (live and r[1] ~= ARGV[1]) then
    redis.call('HDEL', KEYS[1], 'token', 'created', 'expires', 'deadline', 'holder')
    cleared = true
    if live then owned = 1 end
  end
end
local keep = (tonumber(r[3]) or 0) - now
if ARGV[2] then
  local until_ms = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'done:' .. ARGV[2], int(until_ms) .. '|' .. int(now) .. '|' .. ARGV[3])
  if until_ms - now > keep then
    keep = until_ms - now
    redis.call('HSET', KEYS[1], 'done_max', int(until_ms))
  end
  local n = redis.call('HLEN', KEYS[1])
  if n > 2 * (tonumber(redis.call('HGET', KEYS[1], 'done_scan')) or 0) + 16 then
    local all = redis.call('HGETALL', KEYS[1])
    for i = 1, #all, 2 do
      local gone = (tonumber(string.match(all[i + 1], '^(%d+)|')) or 0) <= now
      if string.sub(all[i], 1, 5) == 'done:' and gone then
        redis.call('HDEL', KEYS[1], all[i])
      end
    end
    redis.call('HSET', KEYS[1], 'done_scan', redis.call('HLEN', KEYS[1]))
  end
  if not cleared and redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIRE', KEYS[1], int(keep)) end
end
if cleared then redis.call('PEXPIRE', KEYS[1], int(math.max(RETAIN, keep))) end
return owned
"""
)

DONE = (
    """-- KEYS[i]  lock hashes (one hash slot)
-- ARGV[1]  a task id, or '' for every record
-- returns  {now, {i, field, value}...}: the completion records stored on KEYS[i]
--          (live or not: the caller compares their expiry with now)
"""
    + _NOW
    + """local out = {now}
for i = 1, #KEYS do
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    if ARGV[1] ~= '' then
      local v = redis.call('HGET', KEYS[i], 'done:' .. ARGV[1])
      if v then out[#out + 1] = {i, 'done:' .. ARGV[1], v} end
    else
      local all = redis.call('HGETALL', KEYS[i])
      for j = 1, #all, 2 do
        if string.sub(all[j], 1, 5) == 'done:' then out[#out + 1] = {i, all[j], all[j + 1]} end
      end
    end
  end
end
return out
"""
)

FORGET = (
    """-- KEYS[1]  the lock hash; ARGV[1] a task id
-- returns  1 if a live completion record of ARGV[1] was deleted, else 0
"""
    + _NOW
    + """local v = redis.call('HGET', KEYS[1], 'done:' .. ARGV[1])
if not v then return 0 end
redis.call('HDEL', KEYS[1], 'done:' .. ARGV[1])
if (tonumber(string.match(v, '^(%d+)|')) or 0) > now then return 1 end
return 0
"""
)

PEEK = (
    """-- KEYS[i]  lock hashes (one hash slot)
-- returns  {now in µs, row_1, ..., row_n}; row_i is {token, fence, created, expires, deadline,
--          holder} for a live lease, or 0 if KEYS[i] is free or not a hash
"""
    + _NOW
    + """local out = {us}
for i = 1, #KEYS do
  out[i + 1] = 0
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    local r = redis.call('HMGET', KEYS[i], 'token', 'fence', 'created', 'expires', 'deadline', 'holder')
    if r[1] and (tonumber(r[4]) or 0) > now then
      r[6] = r[6] or ''
      out[i + 1] = r
    end
  end
end
return out
"""
)

_SHA = {
    src: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
    for src in (ACQUIRE, REFRESH, RELEASE, PEEK, DONE, FORGET)
}
_CHUNK = 1000  # keys per script call: bounds how long one script blocks Redis
_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})
_CLUSTER = ("redis+cluster", "rediss+cluster")
_SENTINEL = ("redis+sentinel", "rediss+sentinel")
_TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
_OPTIONS = ("wait_replicas", "wait_timeout")
#: ``ce_wait_timeout`` unless the URL sets it, in seconds.
DEFAULT_WAIT_TIMEOUT = 0.5


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000 + 1e-6))  # whole ms, rounded down (float noise aside)


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least 1 ms: a socket timeout of 0 would
    make the socket non-blocking instead of failing at once."""
    return max(deadline - time.monotonic(), 0.001)


def _connect_within(conn: Any, timeout: float) -> None:
    """Connect ``conn`` (TCP, TLS and the AUTH/HELLO/SELECT handshake) within ``timeout`` s."""
    connect_timeout, socket_timeout = conn.socket_connect_timeout, conn.socket_timeout
    conn.socket_connect_timeout = min(connect_timeout or timeout, timeout)
    conn.socket_timeout = min(socket_timeout or timeout, timeout)
    try:
        conn.connect()
    finally:
        conn.socket_connect_timeout, conn.socket_timeout = connect_timeout, socket_timeout


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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


def _number(text: str | None, kind: Callable[[str], object], default: object) -> object:
    """A URL option's value as ``kind`` (the text itself if it is not one, for the error)."""
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        return text


def _wait_settings(replicas: object, timeout: object, socket_timeout: object) -> tuple[int, int]:
    """``(replicas, timeout in ms)`` for ``WAIT``, checked; ConfigurationError if out of range.

    The timeout must end before the socket's, or a slow acknowledgement would read as a
    broken connection instead of a clear answer.
    """
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= 100:
        raise ConfigurationError(f"ce_wait_replicas must be a whole number from 0 to 100, got {replicas!r}")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0.001 <= timeout <= 60:
        raise ConfigurationError(f"ce_wait_timeout must be seconds from 0.001 to 60, got {timeout!r}")
    if replicas and isinstance(socket_timeout, int | float) and timeout >= socket_timeout:
        raise ConfigurationError(
            f"ce_wait_timeout ({timeout:g} s) must be shorter than the socket timeout ({socket_timeout:g} s)"
        )
    return replicas, _ms(timeout)


def _sentinel_client(url: str, retry: Any) -> redis.Redis:
    """A client of the primary the URL's sentinels name (nothing is contacted yet)."""
    from redis import sentinel

    make: Callable[..., Any] = sentinel.Sentinel  # untyped in redis-py
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
    client: redis.Redis = make(hosts, sentinel_kwargs=sentinel_kwargs, **kwargs).master_for(
        service, db=db, retry=retry
    )
    return client


class RedisLockProvider:
    """Leases in Redis hashes; exclusion holds on one primary (a failover may lose leases).

    With ``url`` the client is built here: socket timeouts 10 s / connect 5 s unless the URL
    sets them, and no automatic command retries (a cluster client still follows MOVED and
    ASK redirections, which are safe). A ``client`` you pass (``redis.Redis``, a Sentinel
    ``master_for()`` client or ``redis.cluster.RedisCluster``) is used as configured and
    not closed by :meth:`close`. ``wait_replicas`` and ``wait_timeout`` (the URL's
    ``ce_wait_replicas`` and ``ce_wait_timeout`` win) turn on replica acknowledgement, see
    the module docstring.
    """

    #: Redis takes far longer keys; 1024 bounds memory per lock and matches the other stores.
    max_key_length = 1024

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | RedisCluster | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        try:
            import redis
            from redis.cluster import RedisCluster
            from redis.exceptions import RedisClusterException
        except ImportError as exc:
            raise MissingDriverError("redis", "redis") from exc
        # RedisClusterException (no reachable node, say) is not a RedisError.
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
        self._broken: tuple[type[Exception], ...] = (*self._errors, OSError)
        self._noscript = redis.exceptions.NoScriptError
        self._response_error = redis.ResponseError
        self._owns_client = client is None
        self._conn: Any = client
        self._factory: Callable[[], Any] | None = None
        self._connecting = threading.Lock()
        self._password: Any = None
        self._pool: Any = None
        self._idle: list[tuple[Any, float]] = []  # (connection, monotonic time of its last use)
        self._pid = os.getpid()
        self._execute: Callable[..., Any]
        self._pack: Callable[[tuple[Any, ...]], bytes] | None = None
        self._wait: tuple[object, object] = (wait_replicas, wait_timeout)
        self._fast = False  # commands go through _send (a client this provider built)
        if client is None:
            if url is None:
                raise ConfigurationError("RedisLockProvider needs a url or a client")
            self._from_url(url)
        elif isinstance(client, RedisCluster):
            self._password = client.nodes_manager.connection_kwargs.get("password")
            self._display = "<client cluster " + ",".join(sorted(n.name for n in client.startup_nodes)) + ">"
            self._execute = client.execute_command
        else:
            self._pool = client.connection_pool
            kw = self._pool.connection_kwargs
            self._password = kw.get("password")
            where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
            self._display = f"<client {where}>"
            self._execute = client.execute_command
        self._cluster = self._factory is not None or isinstance(client, RedisCluster)
        socket_timeout = None if self._pool is None else self._pool.connection_kwargs.get("socket_timeout")
        self._wait_replicas, self._wait_ms = _wait_settings(*self._wait, socket_timeout)
        if self._wait_replicas and self._cluster:
            raise ConfigurationError("ce_wait_replicas is not supported on Redis Cluster")

    def _from_url(self, url: str) -> None:
        """Build (or, for a cluster, prepare to build) the client ``url`` describes."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._display = mask_url(url)
        base, options = split_options(sentinel_url(url), _OPTIONS)  # kombu's "sentinel://h1;..." too
        self._wait = (
            _number(options.get("wait_replicas"), int, self._wait[0]),
            _number(options.get("wait_timeout"), float, self._wait[1]),
        )
        scheme = base.partition("://")[0].lower()
        retry = Retry(NoBackoff(), 0)
        try:
            if scheme in _CLUSTER:
                self._factory, self._password = _cluster_factory(base, retry)
                self._execute = self._via_client
                return
            if scheme in _SENTINEL:
                self._conn = _sentinel_client(base, retry)
            else:
                self._conn = redis.Redis.from_url(
                    base, socket_timeout=10.0, socket_connect_timeout=5.0, retry=retry
                )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"bad redis URL {mask_url(url)!r}: {exc}") from exc
        self._pool = self._conn.connection_pool
        self._password = self._pool.connection_kwargs.get("password")
        self._execute = self._send
        self._fast = True
        try:  # redis-py packs through it too, after per-argument checks our arguments never need
            from hiredis import pack_command
        except ImportError:  # pragma: no cover - hiredis comes with the redis extra
            return
        self._pack = pack_command

    def __repr__(self) -> str:
        return f"RedisLockProvider({self._display!r})"

    @property
    def _client(self) -> Any:
        """The redis-py client; a cluster client from a URL is built on first use."""
        client = self._conn
        if client is None:
            with self._connecting:
                if self._conn is None and self._factory is not None:
                    self._conn = self._factory()
                client = self._conn
        return client

    def _fail(self, exc: Exception) -> BackendError:
        reason = str(exc) or type(exc).__name__
        if type(exc).__name__ == "MasterNotFoundError":  # drop its repr of every sentinel client
            reason = reason.split(" : ", 1)[0] + " (no sentinel reachable, or none monitors it)"
        secrets = [str(self._password)] if self._password else []
        return BackendError(f"redis {self._display}: {mask_url(reason, secrets)}")

    def _via_client(self, *command: Any) -> Any:
        return self._client.execute_command(*command)

    def _send(self, *command: Any, timeout: float | None = None) -> Any:
        """Send one command on a connection this provider keeps out of the pool.

        redis-py's pool checkout and command wrapper cost about as much Python time as the
        round trip; this fast path keeps its safety checks: fork (the pool resets itself in
        a child; the parent's sockets are dropped, never reused), and a connection idle long
        enough for the server to have closed it (Redis's ``timeout`` counts whole seconds)
        is polled and reconnected before anything is sent. A connection is never left with
        unread data: any failure mid-command disconnects it. ``timeout`` bounds the whole
        call, connecting included, on the socket; past it the connection is closed.
        """
        return self._send_many((command,), timeout)[0]

    def _send_many(self, commands: Sequence[tuple[Any, ...]], timeout: float | None) -> list[Any]:
        """Send ``commands`` pipelined on one kept connection and read every reply; an error
        reply is raised for one command, returned in its place for several."""
        if self._pid != os.getpid():
            self._idle, self._pid = [], os.getpid()
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        try:
            conn, used = self._idle.pop()
        except IndexError:
            # Made here, not by the pool: its get_connection() connects with the client's
            # own connect timeout, which no per-call deadline could then bound.
            conn, used = self._pool.connection_class(**self._pool.connection_kwargs), 0.0
        try:
            self._ready(conn, now - used, deadline)
            if self._pack is None:
                conn.send_packed_command(conn.pack_commands(commands))
            else:
                conn.send_packed_command([self._pack(command) for command in commands])
            if len(commands) == 1:
                return [conn.read_response()]
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except self._response_error as exc:
                    replies.append(exc)
            return replies
        except self._response_error:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._idle.append((conn, now))

    def _ready(self, conn: Any, idle: float, deadline: float | None) -> None:
        """Make a kept connection fit to send on: polled if it sat idle (a server-side close
        is seen and reconnected), connected within ``deadline``, socket timeout set to it."""
        if idle > _POLL_AFTER:
            try:
                if conn.is_connected and conn.can_read():
                    conn.disconnect()
            except self._broken:
                conn.disconnect()
        if not conn.is_connected:
            # connect(), not the implicit connect of sending: a Sentinel-managed connection
            # finds its primary only in connect().
            if deadline is None:
                conn.connect()
            else:
                _connect_within(conn, _left(deadline))
        conn._sock.settimeout(conn.socket_timeout if deadline is None else _left(deadline))

    def _run(self, script: str, numkeys: int, *args: Any, timeout: float | None = None) -> Any:
        """Run ``script`` by SHA; on NOSCRIPT (never executed) send its source once.

        ``timeout`` is enforced on the socket when this provider built the client (a client
        you passed keeps its own socket timeouts)."""
        execute = self._execute
        if timeout is not None and self._fast:
            deadline = time.monotonic() + timeout
            try:
                try:
                    return self._send("EVALSHA", _SHA[script], numkeys, *args, timeout=timeout)
                except self._noscript:
                    return self._send("EVAL", script, numkeys, *args, timeout=_left(deadline))
            except self._errors as exc:
                raise self._fail(exc) from exc
        try:
            try:
                return execute("EVALSHA", _SHA[script], numkeys, *args)
            except self._noscript:
                return execute("EVAL", script, numkeys, *args)
        except self._errors as exc:
            raise self._fail(exc) from exc

    def _run_many(
        self, script: str, calls: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> list[Any]:
        """Run ``script`` once per argument tuple (numkeys first), pipelined in one round trip.

        On a cluster the pipeline sends each node its share, all nodes before any reply is
        read; replies come back in ``calls`` order either way.
        """
        if len(calls) <= 1:
            return [self._run(script, *args, timeout=timeout) for args in calls]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self._fast:
                replies = self._send_many([("EVALSHA", _SHA[script], *args) for args in calls], timeout)
            else:
                pipe = self._client.pipeline(transaction=False)
                queue: Callable[..., Any] = pipe.execute_command
                for args in calls:
                    queue("EVALSHA", _SHA[script], *args)
                replies = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            raise self._fail(exc) from exc
        for i, reply in enumerate(replies):
            if isinstance(reply, self._noscript):
                left = None if deadline is None else _left(deadline)
                replies[i] = self._run(script, *calls[i], timeout=left)
            elif isinstance(reply, Exception):
                raise self._fail(reply) from reply
        return replies

    def _run_acked(
        self, script: str, calls: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> tuple[list[Any], int]:
        """Like :meth:`_run_many`, then ``WAIT`` for the replicas, all in one round trip;
        the replies and how many replicas acknowledged (one connection: never a cluster)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in (1, 2):
            try:
                if self._fast:
                    commands = [("EVALSHA", _SHA[script], *args) for args in calls]
                    commands.append(("WAIT", self._wait_replicas, self._wait_ms))
                    left = None if deadline is None else _left(deadline)
                    *replies, acks = self._send_many(commands, left)
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for args in calls:
                        pipe.execute_command("EVALSHA", _SHA[script], *args)
                    pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
                    *replies, acks = pipe.execute(raise_on_error=False)
            except self._errors as exc:
                raise self._fail(exc) from exc
            if attempt == 1 and any(isinstance(r, self._noscript) for r in replies):
                try:  # nothing ran, so nothing to undo: load the script and send it all again
                    self._execute("SCRIPT", "LOAD", script)
                except self._errors as exc:
                    raise self._fail(exc) from exc
                continue
            for reply in (*replies, acks):
                if isinstance(reply, Exception):
                    raise self._fail(reply) from reply
            return replies, int(acks)
        raise AssertionError("unreachable")  # pragma: no cover

    def _unacknowledged(self, what: str, acks: int) -> BackendError:
        return BackendError(
            f"redis {self._display}: the {what} reached {acks} of {self._wait_replicas} replica(s) "
            f"within {self._wait_ms} ms (ce_wait_replicas): a failover now could lose it"
        )

    def _groups(self, keys: Sequence[str]) -> list[range | list[int]]:
        """Indices of ``keys`` in groups for one script call each: at most ``_CHUNK`` keys,
        consecutive on one server, of one hash slot on a cluster (first-seen slot order)."""
        if not self._cluster:
            return [range(start, min(start + _CHUNK, len(keys))) for start in range(0, len(keys), _CHUNK)]
        slot_of = self._client.keyslot
        slots: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            slots.setdefault(slot_of(key), []).append(i)
        return [group[s : s + _CHUNK] for group in slots.values() for s in range(0, len(group), _CHUNK)]

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
    ) -> Grant | Held | Done:
        once = () if task_id is None else (task_id,)
        args = (1, key, token, _ms(ttl), _ms(max_lifetime), holder, *once)
        if self._wait_replicas:
            (reply,), acks = self._run_acked(ACQUIRE, [args], timeout)
            if reply[0] == 1 and acks < self._wait_replicas:
                raise self._unacknowledged("grant", acks)
        else:
            reply = self._run(ACQUIRE, *args, timeout=timeout)
        if reply[0] == 1:
            return Grant(reply[1], reply[2] / 1e6)
        if reply[0] == 2:
            return Done(self._record(key, "done:" + str(task_id), reply[1], reply[2]))
        return Held(self._info(key, reply[1:7], reply[7]))

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        try:
            groups = self._groups([r.key for r in requests])
        except self._errors as exc:
            raise self._fail(exc) from exc
        calls = []
        for group in groups:
            chunk = [requests[i] for i in group]
            calls.append(
                (len(chunk), *[r.key for r in chunk], *[r.token for r in chunk], *[_ms(r.ttl) for r in chunk])
            )
        answers: list[float | None] = [None] * len(requests)
        if self._wait_replicas:
            replies, acks = self._run_acked(REFRESH, calls, timeout)
            if acks < self._wait_replicas:
                raise self._unacknowledged("refresh", acks)
        else:
            replies = self._run_many(REFRESH, calls, timeout)
        for group, reply in zip(groups, replies, strict=True):
            for i, us in zip(group, reply, strict=True):
                answers[i] = None if us < 0 else us / 1e6
        return answers

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        if completion is None:
            return bool(self._run(RELEASE, 1, key, token, timeout=timeout))
        value = f"{completion.attempt}|{completion.outcome}"
        return bool(
            self._run(
                RELEASE, 1, key, token, completion.task_id, value, _ms(completion.retain), timeout=timeout
            )
        )

    def completion(self, key: str, task_id: str) -> CompletionInfo | None:
        now, *found = self._run(DONE, 1, key, task_id)
        records = [self._record(key, field, value, now) for _, field, value in found]
        return next((r for r in records if r.expires_in > 0), None)

    def completions(self, prefix: str) -> list[CompletionInfo]:
        keys, groups = self._hashes(prefix)
        calls = [(len(group), *[keys[i] for i in group], "") for group in groups]
        records: list[CompletionInfo] = []
        for group, (now, *found) in zip(groups, self._run_many(DONE, calls), strict=True):
            for index, field, value in found:
                record = self._record(keys[group[int(index) - 1]], field, value, now)
                if record.expires_in > 0:
                    records.append(record)
        return sorted(records, key=lambda r: (r.key, r.task_id))

    def forget(self, key: str, task_id: str) -> bool:
        return bool(self._run(FORGET, 1, key, task_id))

    def _record(self, key: str, field: Any, value: Any, now: Any) -> CompletionInfo:
        """CompletionInfo from field ``done:<task id>`` = ``expires|recorded|attempt|outcome``."""
        try:
            expires, recorded, attempt, outcome = _str(value).split("|", 3)
            t = int(now)
            return CompletionInfo(
                key,
                _str(field)[5:],
                outcome,
                int(attempt),
                (t - int(recorded)) / 1000,
                (int(expires) - t) / 1000,
            )
        except (TypeError, ValueError) as exc:
            raise self._fail(ValueError(f"malformed completion record on {key!r}: {exc}")) from exc

    def peek(self, key: str) -> LockInfo | None:
        reply = self._run(PEEK, 1, key)
        return None if reply[1] == 0 else self._info(key, reply[1], reply[0])

    def diagnose(self) -> list[Diagnosis]:
        """Server version and role, clock skew, scripting, eviction and persistence settings.

        On a cluster every primary is checked (details name the node).
        """
        found: list[Diagnosis] = []
        try:
            client = self._client
            if self._cluster:
                primaries = client.get_primaries()
                found.append(
                    Diagnosis(
                        "cluster", "ok", f"Redis Cluster, {len(primaries)} primaries; locks are per slot"
                    )
                )
                for node in primaries:
                    found.extend(self._server_findings(client.get_redis_connection(node), f"{node.name}: "))
            else:
                found.extend(self._server_findings(client, ""))
        except self._errors as exc:
            raise self._fail(exc) from exc
        self.peek("celery-exclusive:doctor")  # the scripts run (a proxy may refuse EVAL)
        found.append(Diagnosis("scripts", "ok", "Lua scripts run"))
        return found

    def _server_findings(self, server: redis.Redis, where: str) -> list[Diagnosis]:
        """The findings for one server (a primary); ``where`` prefixes every detail."""
        info = server.info()
        sec, usec = server.time()
        skew = sec + usec / 1e6 - time.time()
        try:
            config = server.config_get("maxmemory*") | server.config_get("appendonly")
        except self._response_error:
            config = {}
        version = str(info.get("redis_version", "?"))
        major = int(version.split(".", maxsplit=1)[0]) if version[:1].isdigit() else 0
        old = major < 6
        found = [
            Diagnosis(
                "server",
                "fail" if old else "ok",
                f"{where}Redis {version}" + (": 6.0+ needed" if old else ""),
            )
        ]
        if info.get("cluster_enabled") and not self._cluster:
            found.append(
                Diagnosis("cluster", "fail", f"{where}a Redis Cluster node: use a redis+cluster:// URL")
            )
        role, replicas = info.get("role"), int(info.get("connected_slaves", 0))
        if role != "master":
            found.append(
                Diagnosis("replica", "fail", f"{where}connected to a {role}: point the URL at the primary")
            )
        elif self._wait_replicas:
            enough = replicas >= self._wait_replicas
            found.append(
                Diagnosis(
                    "replica",
                    "ok" if enough else "fail",
                    f"{where}{replicas} replica(s) connected; grants and refreshes wait for "
                    f"{self._wait_replicas} (ce_wait_replicas)" + ("" if enough else ", so every one fails"),
                )
            )
        elif replicas:
            found.append(
                Diagnosis(
                    "replica", "warn", f"{where}{replicas} async replica(s): a failover can lose leases"
                )
            )
        found.append(
            Diagnosis("clock", "ok" if abs(skew) < 1 else "warn", f"{where}server - local = {skew:+.3f} s")
        )
        conf = {_str(k): _str(v) for k, v in config.items()}
        policy = conf.get("maxmemory-policy", "")
        if not conf:
            found.append(
                Diagnosis("settings", "warn", f"{where}CONFIG GET refused: check maxmemory-policy yourself")
            )
        elif conf.get("maxmemory", "0") != "0" and policy != "noeviction":
            found.append(
                Diagnosis(
                    "eviction",
                    "fail",
                    f"{where}maxmemory-policy {policy} may evict locks (they carry TTLs): use noeviction",
                )
            )
        elif conf.get("appendonly") == "no":
            found.append(
                Diagnosis(
                    "persistence", "warn", f"{where}appendonly no: a restart can lose leases and fences"
                )
            )
        return found

    def _hashes(self, prefix: str) -> tuple[list[str], list[range | list[int]]]:
        """The hash keys starting with ``prefix``, sorted, and their groups for script calls."""
        pattern = prefix.translate(_GLOB) + "*"
        try:
            client = self._client
            where = {"target_nodes": client.PRIMARIES} if self._cluster else {}
            names = {_str(k) for k in client.scan_iter(match=pattern, count=1000, _type="hash", **where)}
            keys = sorted(k for k in names if k.startswith(prefix))
            return keys, self._groups(keys)
        except self._errors as exc:
            raise self._fail(exc) from exc

    def scan(self, prefix: str) -> list[LockInfo]:
        keys, groups = self._hashes(prefix)
        calls = [(len(group), *[keys[i] for i in group]) for group in groups]
        infos: list[LockInfo] = []
        for group, (now, *rows) in zip(groups, self._run_many(PEEK, calls), strict=True):
            infos.extend(
                self._info(keys[i], row, now) for i, row in zip(group, rows, strict=True) if row != 0
            )
        if self._cluster:
            infos.sort(key=lambda info: info.key)
        return infos

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.disconnect()  # the fast path's own connections, never the pool's
        if self._owns_client and self._conn is not None:
            self._conn.close()

    def _info(self, key: str, row: Sequence[Any], now: Any) -> LockInfo:
        """LockInfo from ``{token, fence, created, expires, deadline, holder}`` (ms) at server
        ``now`` (µs)."""
        try:
            token, fence, created, expires, deadline = (_str(v) for v in row[:5])
            t = int(now)
            return LockInfo(
                key=key,
                token=token,
                fence=int(fence),
                age=(t - int(created) * 1000) / 1e6,
                expires_in=(int(expires) * 1000 - t) / 1e6,
                hard_expires_in=(int(deadline) * 1000 - t) / 1e6,
                holder=decode_holder(row[5]),
            )
        except (TypeError, ValueError) as exc:
            raise self._fail(ValueError(f"malformed lock hash {key!r}: {exc}")) from exc
