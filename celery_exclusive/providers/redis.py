"""Redis lock store (``redis://``, ``rediss://``, ``unix://``); needs redis-py and Redis >= 6.

Each lock is one hash at exactly the key given, with fields ``token``, ``fence``,
``created``, ``expires`` and ``deadline`` (milliseconds on the Redis server's clock,
``expires <= deadline``) and ``holder`` (JSON). A lease is live while ``token`` is set and
``expires`` is in the future; every operation is a Lua script that reads the clock with
``TIME``, so expiry is decided by Redis alone.

Why no PEXPIRE and no separate fence counter key: the fence must outlive the lease, and
on Redis Cluster every key a script touches must hash to one slot. A counter key derived
from an arbitrary lock key cannot always share its slot (a name with ``}`` but no valid
hash tag defeats every hash-tag trick) and could collide with a user's own key. Keeping
the counter as the ``fence`` field of the lock's own hash avoids both. The cost: one small
hash (``{fence: N}`` after release) stays in Redis per lock key name ever used, exactly as
a never-deleted counter key would, and ``TTL key`` shows -1 (read ``expires`` instead).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery_exclusive.errors import BackendError, ConfigurationError, MissingDriverError
from celery_exclusive.providers.base import Diagnosis, Grant, Held, LockInfo, RefreshRequest, decode_holder
from celery_exclusive.urls import mask_url, split_options

if TYPE_CHECKING:
    import redis

_NOW = "local t = redis.call('TIME')\nlocal now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

ACQUIRE = (
    """-- KEYS[1]  the lock hash
-- ARGV[1]  token, ARGV[2] ttl ms, ARGV[3] max lifetime ms, ARGV[4] holder JSON
-- returns  {1, fence, ms left} if granted (or already held by ARGV[1]), else
--          {0, token, fence, created, expires, deadline, holder, now} of the live holder
"""
    + _NOW
    + """local r = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires', 'created', 'deadline', 'holder')
local expires = tonumber(r[3]) or 0
if r[1] and expires > now then
  if r[1] == ARGV[1] then return {1, tonumber(r[2]), expires - now} end
  return {0, r[1], r[2], r[4], r[3], r[5], r[6] or '', now}
end
local life = tonumber(ARGV[3])
local ttl = math.min(tonumber(ARGV[2]), life)
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'created', now, 'expires', now + ttl,
           'deadline', now + life, 'holder', ARGV[4])
return {1, fence, ttl}
"""
)

REFRESH = (
    """-- KEYS[i]  lock hashes (n of them)
-- ARGV[i]  token expected on KEYS[i]; ARGV[n + i] ttl ms for KEYS[i]
-- returns  one integer per key: ms the lease now has left, or -1 if not owned (unchanged)
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
      redis.call('HSET', KEYS[i], 'expires', expires)
      out[i] = expires - now
    end
  end
end
return out
"""
)

RELEASE = (
    """-- KEYS[1]  the lock hash
-- ARGV[1]  token
-- returns  1 if ARGV[1] held a live lease and it was deleted, else 0 (a dead lease is
--          cleared either way; the fence field always stays)
"""
    + _NOW
    + """local r = redis.call('HMGET', KEYS[1], 'token', 'expires')
if not r[1] then return 0 end
local live = (tonumber(r[2]) or 0) > now
if live and r[1] ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'token', 'created', 'expires', 'deadline', 'holder')
if live then return 1 end
return 0
"""
)

PEEK = (
    """-- KEYS[i]  lock hashes
-- returns  {now, row_1, ..., row_n}; row_i is {token, fence, created, expires, deadline,
--          holder} for a live lease, or 0 if KEYS[i] is free or not a hash
"""
    + _NOW
    + """local out = {now}
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
    for src in (ACQUIRE, REFRESH, RELEASE, PEEK)
}
_CHUNK = 1000  # keys per script call: bounds how long one script blocks Redis
_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000 + 1e-6))  # whole ms, rounded down (float noise aside)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisLockProvider:
    """Leases in Redis hashes; exclusion holds on one primary (a failover may lose leases).

    With ``url`` the client is built here: socket timeouts 10 s / connect 5 s unless the URL
    sets them, and no automatic command retries. A ``client`` you pass is used as
    configured and not closed by :meth:`close`.
    """

    #: Redis takes far longer keys; 1024 bounds memory per lock and matches the other stores.
    max_key_length = 1024

    def __init__(self, url: str | None = None, *, client: redis.Redis | None = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise MissingDriverError("redis", "redis") from exc
        self._errors = redis.RedisError
        self._noscript = redis.exceptions.NoScriptError
        self._owns_client = client is None
        if client is None:
            if url is None:
                raise ConfigurationError("RedisLockProvider needs a url or a client")
            base, _ = split_options(url, ())
            try:
                client = redis.Redis.from_url(
                    base, socket_timeout=10.0, socket_connect_timeout=5.0, retry=Retry(NoBackoff(), 0)
                )
            except ValueError as exc:
                raise ConfigurationError(f"bad redis URL {mask_url(url)!r}: {exc}") from exc
        self._client = client
        kw = client.connection_pool.connection_kwargs
        self._password = kw.get("password")
        where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
        self._display = mask_url(url) if url else f"<client {where}>"
        self._pool = client.connection_pool
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._response_error = redis.ResponseError
        self._execute: Callable[..., Any] = self._send if self._owns_client else client.execute_command

    def __repr__(self) -> str:
        return f"RedisLockProvider({self._display!r})"

    def _fail(self, exc: Exception) -> BackendError:
        reason = str(exc) or type(exc).__name__
        if self._password:
            reason = reason.replace(str(self._password), "***")
        return BackendError(f"redis {self._display}: {reason}")

    def _send(self, *command: Any) -> Any:
        """Send one command on a connection this provider keeps out of the pool.

        redis-py's pool checkout and command wrapper cost about as much Python time as the
        round trip; this fast path keeps its safety checks: fork (the pool resets itself in
        a child; the parent's sockets are dropped, never reused), and a connection the
        server closed or left unread data on is reconnected before anything is sent.
        """
        if self._pid != os.getpid():
            self._idle, self._pid = [], os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._pool.get_connection()
        try:
            try:
                if conn.is_connected and conn.can_read():
                    conn.disconnect()
            except (self._errors, OSError):
                conn.disconnect()
            conn.send_command(*command)
            return conn.read_response()
        except self._response_error:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._idle.append(conn)

    def _run(self, script: str, numkeys: int, *args: Any) -> Any:
        """Run ``script`` by SHA; on NOSCRIPT (never executed) send its source once."""
        try:
            try:
                return self._execute("EVALSHA", _SHA[script], numkeys, *args)
            except self._noscript:
                return self._execute("EVAL", script, numkeys, *args)
        except self._errors as exc:
            raise self._fail(exc) from exc

    def _run_many(self, script: str, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``script`` once per argument tuple (numkeys first), pipelined in one round trip."""
        if len(calls) <= 1:
            return [self._run(script, *args) for args in calls]
        try:
            pipe = self._client.pipeline(transaction=False)
            queue: Callable[..., Any] = pipe.execute_command
            for args in calls:
                queue("EVALSHA", _SHA[script], *args)
            replies = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            raise self._fail(exc) from exc
        for i, reply in enumerate(replies):
            if isinstance(reply, self._noscript):
                replies[i] = self._run(script, *calls[i])
            elif isinstance(reply, Exception):
                raise self._fail(reply) from reply
        return replies

    def acquire(self, key: str, token: str, ttl: float, max_lifetime: float, holder: str) -> Grant | Held:
        reply = self._run(ACQUIRE, 1, key, token, _ms(ttl), _ms(max_lifetime), holder)
        if reply[0] == 1:
            return Grant(reply[1], reply[2] / 1000)
        return Held(self._info(key, reply[1:7], reply[7]))

    def refresh(self, requests: Sequence[RefreshRequest]) -> list[float | None]:
        # Consecutive chunks, kept in order; on Redis Cluster this is where to group by slot.
        calls = []
        for start in range(0, len(requests), _CHUNK):
            chunk = requests[start : start + _CHUNK]
            calls.append(
                (len(chunk), *[r.key for r in chunk], *[r.token for r in chunk], *[_ms(r.ttl) for r in chunk])
            )
        return [None if ms < 0 else ms / 1000 for reply in self._run_many(REFRESH, calls) for ms in reply]

    def release(self, key: str, token: str) -> bool:
        return bool(self._run(RELEASE, 1, key, token))

    def peek(self, key: str) -> LockInfo | None:
        reply = self._run(PEEK, 1, key)
        return None if reply[1] == 0 else self._info(key, reply[1], reply[0])

    def diagnose(self) -> list[Diagnosis]:
        """Server version and role, clock skew, scripting, eviction and persistence settings."""
        client = self._client
        try:
            info = client.info()
            sec, usec = client.time()
            skew = sec + usec / 1e6 - time.time()
            self.peek("celery-exclusive:doctor")  # the scripts run (a proxy may refuse EVAL)
            try:
                config = client.config_get("maxmemory*") | client.config_get("appendonly")
            except self._response_error:
                config = {}
        except self._errors as exc:
            raise self._fail(exc) from exc
        version = str(info.get("redis_version", "?"))
        major = int(version.split(".", maxsplit=1)[0]) if version[:1].isdigit() else 0
        old = major < 6
        found = [
            Diagnosis(
                "server", "fail" if old else "ok", f"Redis {version}" + (": 6.0+ needed" if old else "")
            )
        ]
        if info.get("cluster_enabled"):
            found.append(Diagnosis("cluster", "fail", "Redis Cluster is not supported; use one primary"))
        role, replicas = info.get("role"), int(info.get("connected_slaves", 0))
        if role != "master":
            found.append(Diagnosis("replica", "fail", f"connected to a {role}: point the URL at the primary"))
        elif replicas:
            found.append(
                Diagnosis("replica", "warn", f"{replicas} async replica(s): a failover can lose leases")
            )
        found.append(Diagnosis("clock", "ok" if abs(skew) < 1 else "warn", f"server - local = {skew:+.3f} s"))
        found.append(Diagnosis("scripts", "ok", "Lua scripts run"))
        conf = {_str(k): _str(v) for k, v in config.items()}
        if not conf:
            found.append(Diagnosis("settings", "warn", "CONFIG GET refused: check maxmemory-policy yourself"))
        elif conf.get("maxmemory", "0") != "0" and conf.get("maxmemory-policy", "").startswith("allkeys"):
            found.append(
                Diagnosis("eviction", "fail", f"maxmemory-policy {conf['maxmemory-policy']} may evict locks")
            )
        elif conf.get("appendonly") == "no":
            found.append(
                Diagnosis("persistence", "warn", "appendonly no: a restart can lose leases and fences")
            )
        return found

    def scan(self, prefix: str) -> list[LockInfo]:
        pattern = prefix.translate(_GLOB) + "*"
        try:
            names = {_str(k) for k in self._client.scan_iter(match=pattern, count=1000, _type="hash")}
        except self._errors as exc:
            raise self._fail(exc) from exc
        keys = sorted(k for k in names if k.startswith(prefix))
        chunks = [keys[i : i + _CHUNK] for i in range(0, len(keys), _CHUNK)]
        infos: list[LockInfo] = []
        for chunk, (now, *rows) in zip(
            chunks, self._run_many(PEEK, [(len(c), *c) for c in chunks]), strict=True
        ):
            infos.extend(self._info(k, row, now) for k, row in zip(chunk, rows, strict=True) if row != 0)
        return infos

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            self._pool.release(conn)
        if self._owns_client:
            self._client.close()

    def _info(self, key: str, row: Sequence[Any], now: Any) -> LockInfo:
        """LockInfo from ``{token, fence, created, expires, deadline, holder}`` at server ``now``."""
        try:
            token, fence, created, expires, deadline = (_str(v) for v in row[:5])
            t = int(now)
            return LockInfo(
                key=key,
                token=token,
                fence=int(fence),
                age=(t - int(created)) / 1000,
                expires_in=(int(expires) - t) / 1000,
                hard_expires_in=(int(deadline) - t) / 1000,
                holder=decode_holder(row[5]),
            )
        except (TypeError, ValueError) as exc:
            raise self._fail(ValueError(f"malformed lock hash {key!r}: {exc}")) from exc
