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

Replica acknowledgement (opt-in): ``?ce_wait_replicas=N`` sends ``WAIT N timeout``
pipelined right after each acquire and refresh script, on the script's own connection
(one round trip; Redis does not allow ``WAIT`` inside a script, and ``WAIT`` counts only
that connection's writes; on a cluster, one pipeline per primary written, each on that
node's own client, N replicas of each), and ``ce_wait_timeout=S`` (seconds,
default 0.5) bounds it. A grant or refresh that fewer than N replicas acknowledged within
the timeout is a BackendError, not a lease: it may exist on the primary only, which a
failover would lose. A contended acquire wrote nothing and is answered as usual.

Waiting (``LockService.lock(key, wait=)``): the release script, when it frees a live lease,
sends ``SPUBLISH`` on the key itself, and :meth:`RedisLockProvider.subscribe` listens with
``SSUBSCRIBE`` on one connection per server and process (providers/_redis_wake.py); Redis
< 7 has no sharded pub/sub and its waiters poll.

Each lock is one hash at exactly the key given, with fields ``token``, ``fence``,
``created``, ``expires`` and ``deadline`` (milliseconds on the Redis server's clock,
``expires <= deadline``) and ``holder`` (JSON). The scripts report times in microseconds
from ``TIME``: a lease stored as ending at ``expires`` ms is dead from ``expires * 1000`` µs,
and the holder is told exactly that much, never the whole ms it would round to.
A lease is live while ``token`` is set and
``expires`` is in the future; every operation is a Lua script that reads the clock with
``TIME``, so expiry is decided by Redis alone (``redis_scripts/*.lua``, each headed by its
keys, arguments and reply; providers/_redis_scripts.py loads and runs them). Every
script touches the keys of one hash slot (a lock hash, its slot's fence key, or several
lock hashes of one slot), so all of it works on Redis Cluster.

Retention. A lock hash's TTL follows its lease: acquiring sets it to the ttl, each refresh
to the new expiry (never past the hard deadline), and releasing deletes the hash. A
released key therefore leaves nothing, and a crashed holder's hash is gone when its lease
expires, however many distinct keys (one per work item, say) are ever used.

Completion records (``release(..., completion)``) are fields ``done:<task id>`` of the
same hash, valued ``expires|recorded|attempt|outcome`` (server milliseconds): no key of
their own, so they never collide with a lock key and stay in the lock's hash slot. A record
past its expiry counts as absent; expired ones are pruned by a later release writing a
record on that key, once the hash has more fields than 16 plus twice what the last pruning
left (a hash without earlier records is not counted: it cannot have that many).
The hash then lives as long as its longest-kept record (field ``done_max``), if longer:
a release clears the lease fields and keeps the hash that long.

Fences. A grant's fence is ``max(high-water + 1, previous fence + 1, TIME in µs)`` and the
high-water key is set to it, in the same script: one string key ``FENCES``
(``celery-exclusive:fences``) per standalone or Sentinel server, and on Redis Cluster one
per hash slot, ``FENCES{<tag>}`` with a three-character tag whose CRC16 is that slot
(``fence_key`` in providers/_redis_scripts.py), so at most 16,384 keys of
72 B each. The high-water mark never decreases, so fences are strictly increasing per key
(indeed per server, or per slot) **whatever the server's clock does**: a clock stepped back
by D only makes fences run ahead of ``TIME`` by up to D, until the clock catches up; the
clock term keeps fences roughly time-ordered (about 1.7e15, exact in Lua's doubles below
2**53, not consecutive). The previous-fence term adopts hashes older versions left.
Lock keys starting with ``FENCES`` are refused (InvalidArgumentError).
When Redis *loses* the high-water key (restart without persistence, ``FLUSHALL``, a
failover to a replica that had not received the last grants, or its eviction under an
``allkeys-*`` policy), the clock alone decides again: a clock s seconds behind where it was
gives a smaller fence to a key last granted within s seconds (docs/faults.md). It
replicates with the grant that set it (one script), so a failover loses it only where it
loses that grant too. On Cluster, resharding a slot moves its fence key like any other: a
grant in that slot while only one of its two keys has moved is refused (``TRYAGAIN``,
which redis-py retries for a while, then a BackendError), never made without the mark.
Why not per-key retention of the fence (the former design, 24 h after each release): it
kept 120 B per released distinct key (MEMORY USAGE; ~165-197 B in ``used_memory``), and
its guarantee ended at a clock step back of more than 24 h.

The high-water keys carry no TTL and lock hashes do, so a ``volatile-*`` (or
``allkeys-*``) ``maxmemory-policy`` may evict live locks, and an ``allkeys-*`` one the
high-water keys too: use ``noeviction`` (``diagnose()`` fails otherwise).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery_exclusive.errors import ConfigurationError, InvalidArgumentError, MissingDriverError
from celery_exclusive.providers import _redis_resp as resp
from celery_exclusive.providers._redis_diagnose import diagnose_servers, within
from celery_exclusive.providers._redis_scripts import (
    ACQUIRE,
    ACQUIRE_ANY,
    ACQUIRE_UNLESS,
    CHUNK,
    DONE,
    FENCES,
    FORGET,
    PEEK,
    REFRESH,
    RELEASE,
)
from celery_exclusive.providers._redis_server import RedisServer
from celery_exclusive.providers._redis_urls import target_of_client, target_of_url, whole_ms
from celery_exclusive.providers._redis_wake import ReleaseSignals, Subscription, Woken
from celery_exclusive.providers._redis_wire import Wire, as_text, left
from celery_exclusive.providers.base import (
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
    acquire_unless_in_steps,
    decode_holder,
)

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

#: ``Grant(fence, ttl)`` in three C calls (see acquire): its slots' descriptors set them.
_new_grant, _set_fence, _set_ttl = (
    object.__new__,
    Grant.__dict__["fence"].__set__,
    Grant.__dict__["ttl"].__set__,
)

__all__ = [
    "ACQUIRE",
    "DEFAULT_WAIT_TIMEOUT",
    "DONE",
    "FENCES",
    "FORGET",
    "PEEK",
    "REFRESH",
    "RELEASE",
    "RedisLockProvider",
]

#: ``ce_wait_timeout`` unless the URL sets it, in seconds.
DEFAULT_WAIT_TIMEOUT = 0.5


def _refresh_args(chunk: Sequence[RefreshRequest]) -> tuple[Any, ...]:
    """The refresh script's numkeys, keys and arguments for ``chunk`` (one script call)."""
    keys, tokens = [r.key for r in chunk], [r.token for r in chunk]
    return (len(chunk), *keys, *tokens, *[whole_ms(r.ttl) for r in chunk])


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline), at least 1 ms."""
    return None if deadline is None else left(deadline)


def _seconds_left(us: int) -> float | None:
    """A refresh reply for one key: seconds the lease now has, None if not owned."""
    return None if us < 0 else us / 1e6


def _lock_info(key: str, row: Sequence[Any], now: Any) -> LockInfo:
    """LockInfo from ``{token, fence, created, expires, deadline, holder}`` (ms) at server
    ``now`` (µs); ValueError or TypeError if malformed."""
    token, fence, created, expires, deadline = (as_text(v) for v in row[:5])
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


def _completion_info(key: str, field: Any, value: Any, now: Any) -> CompletionInfo:
    """CompletionInfo from field ``done:<task id>`` = ``expires|recorded|attempt|outcome`` at
    server ``now`` (ms); ValueError or TypeError if malformed."""
    expires, recorded, attempt, outcome = as_text(value).split("|", 3)
    t = int(now)
    return CompletionInfo(
        key, as_text(field)[5:], outcome, int(attempt), (t - int(recorded)) / 1000, (int(expires) - t) / 1000
    )


def _check_key(key: str) -> None:
    if key.startswith(FENCES):
        raise InvalidArgumentError(f"lock keys starting {FENCES!r} are the store's own (fences)")


class RedisLockProvider:
    """Leases in Redis hashes; exclusion holds on one primary (a failover may lose leases).

    With ``url`` the client is built here: socket timeouts 10 s / connect 5 s unless the URL
    sets them, and no automatic command retries (a cluster client still follows MOVED and
    ASK redirections, which are safe). A ``client`` you pass (``redis.Redis``, a Sentinel
    ``master_for()`` client or ``redis.cluster.RedisCluster``) is used as configured and
    not closed by :meth:`close`. ``wait_replicas`` and ``wait_timeout`` (the URL's
    ``ce_wait_replicas`` and ``ce_wait_timeout`` win) turn on replica acknowledgement, see
    the module docstring. How the server is reached (client, wire, errors, cluster routing)
    is :class:`~._redis_server.RedisServer`'s; this class keeps the lock operations.
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
            import redis  # noqa: F401 - the driver's absence is a MissingDriverError here
        except ImportError as exc:
            raise MissingDriverError("redis", "redis") from exc
        wait = (wait_replicas, wait_timeout)
        if client is not None:
            target = target_of_client(client, wait)
        elif url is not None:
            target = target_of_url(url, wait)
        else:
            raise ConfigurationError("RedisLockProvider needs a url or a client")
        self._server = server = RedisServer(target)
        self._scripts = server.scripts
        self._packs = server.scripts.packs
        self._translated = server.translated
        self._wait_replicas = server.wait_replicas
        self._cluster = server.cluster  # fixed for the provider: one fence key per server if not
        self._connecting = threading.Lock()
        self._signals: ReleaseSignals | None = None
        self._woken = Woken()
        #: ``KnowsWaiters``: whether this process's latest release of a key reached a
        #: waiter's subscription (release.lua counts its SPUBLISH's receivers); told once.
        self.had_waiters = self._woken.told
        #: The set behind ``had_waiters`` (``KnowsWaiters.had_waiters``: ``key in`` it, then
        #: discarded), which the lock service's release tests inline.
        self.woken_keys = self._woken._keys

    def __repr__(self) -> str:
        return f"RedisLockProvider({self._server.display!r})"

    @property
    def _client(self) -> Any:
        return self._server.client

    @property
    def _wire(self) -> Wire | None:
        return self._server.wire

    def _granted(self, script: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        """Run an acquiring script; with ``ce_wait_replicas``, a grant too few replicas
        acknowledged is a BackendError."""
        if not self._wait_replicas:
            return self._scripts.run(script, *args, timeout=timeout)
        (reply,), acks = self._scripts.run_acked(script, [args], timeout)
        if reply[0] == 1 and acks < self._wait_replicas:
            raise self._server.unacknowledged("grant", acks)
        return reply

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
        if key.startswith(FENCES):  # _check_key, inline (the hot path)
            _check_key(key)
        # whole_ms of both, inline: whole ms rounded down, at least 1.
        ttl_ms, life_ms = int(ttl * 1000 + 1e-6), int(max_lifetime * 1000 + 1e-6)
        if ttl_ms < 1 or life_ms < 1:
            ttl_ms, life_ms = whole_ms(ttl), whole_ms(max_lifetime)
        fences = FENCES if not self._cluster else self._server.fences_of(key)
        if self._wait_replicas:
            once = () if task_id is None else (task_id,)
            reply = self._granted(ACQUIRE, (2, key, fences, token, ttl_ms, life_ms, holder, *once), timeout)
        else:
            packed = None
            if self._packs:  # the RESP here, not hiredis's (_redis_resp)
                packed = resp.acquire(key, fences, token, ttl_ms, life_ms, holder, task_id)
            if task_id is None:
                reply = self._scripts.run(
                    ACQUIRE, 2, key, fences, token, ttl_ms, life_ms, holder, timeout=timeout, packed=packed
                )
            else:
                reply = self._scripts.run(
                    ACQUIRE,
                    2,
                    key,
                    fences,
                    token,
                    ttl_ms,
                    life_ms,
                    holder,
                    task_id,
                    timeout=timeout,
                    packed=packed,
                )
        if reply[0] == 1:
            # Grant(fence, ttl) without type.__call__'s way to its Python __init__: the same
            # object (Grant defines no __new__), its two slots set as __init__ sets them.
            grant = _new_grant(Grant)
            _set_fence(grant, reply[1])
            _set_ttl(grant, reply[2] / 1e6)
            return grant
        if reply[0] == 2:
            return Done(self._record(key, "done:" + str(task_id), reply[1], reply[2]))
        return Held(self._info(key, reply[1:7], reply[7]))

    def acquire_unless(
        self,
        key: str,
        token: str,
        ttl: float,
        holder: str,
        *,
        blocker: str,
        timeout: float | None = None,
    ) -> Grant | Held:
        """``key`` unless ``blocker`` is live (``AcquiresUnless``): one script (unless.lua
        before acquire.lua); on a cluster, keys of two hash slots are asked in steps."""
        _check_key(key)
        if not self._server.same_slot(key, blocker):
            deadline = None if timeout is None else time.monotonic() + timeout
            return acquire_unless_in_steps(
                lambda: self.acquire(key, token, ttl, ttl, holder, timeout=_left(deadline)),
                lambda: self.peek(blocker, timeout=_left(deadline)),
                lambda: self.release(key, token, timeout=_left(deadline)),
            )
        ms = whole_ms(ttl)
        args = (3, key, self._server.fences_of(key), blocker, token, ms, ms, holder)
        reply = self._granted(ACQUIRE_UNLESS, args, timeout)
        if reply[0] == 1:
            return Grant(reply[1], reply[2] / 1e6)
        return Held(self._info(blocker if reply[0] == 3 else key, reply[1:7], reply[7]))

    def acquire_later(
        self,
        key: str,
        token: str,
        ttl: float,
        holder: str,
        *,
        blocker: str | None = None,
        timeout: float | None = None,
    ) -> Callable[[], Grant | Held]:
        """``acquire`` (``acquire_unless`` with ``blocker``) sent now, read by the call returned
        (``MarksLater``); in one call, answered already, where the script cannot be split
        off: a client you passed, replica acknowledgement, two hash slots, no timeout."""
        _check_key(key)
        if (
            self._wire is None
            or timeout is None
            or self._wait_replicas
            or (blocker is not None and not self._server.same_slot(key, blocker))
        ):
            answer = (
                self.acquire_unless(key, token, ttl, holder, blocker=blocker, timeout=timeout)
                if blocker is not None
                else self.acquire(key, token, ttl, ttl, holder, timeout=timeout)
            )
            return lambda: Held(None) if isinstance(answer, Done) else answer
        ms = whole_ms(ttl)
        fences = self._server.fences_of(key)
        if blocker is None:
            reply = self._scripts.run_later(ACQUIRE, 2, key, fences, token, ms, ms, holder, timeout=timeout)
        else:
            reply = self._scripts.run_later(
                ACQUIRE_UNLESS, 3, key, fences, blocker, token, ms, ms, holder, timeout=timeout
            )

        def answer_of() -> Grant | Held:
            found = reply()
            if found[0] == 1:
                return Grant(found[1], found[2] / 1e6)
            return Held(
                self._info(key if found[0] != 3 or blocker is None else blocker, found[1:7], found[7])
            )

        return answer_of

    def acquire_any(
        self,
        keys: Sequence[str],
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Grant] | Held:
        """A semaphore's first free slot: one ``acquire_any.lua`` call over every slot key (on a
        cluster, one per hash slot in slot order: a semaphore's slots 2..N share one)."""
        for key in keys:  # a loop, not any() over a generator: the hot path
            if key.startswith(FENCES):
                raise InvalidArgumentError(f"lock keys starting {FENCES!r} are the store's own (fences)")
        if not self._cluster and len(keys) <= CHUNK:  # one group, one script call: groups() inline
            # whole_ms of both, inline (as acquire's): whole ms rounded down, at least 1.
            ttl_ms, life_ms = int(ttl * 1000 + 1e-6), int(max_lifetime * 1000 + 1e-6)
            if ttl_ms < 1 or life_ms < 1:
                ttl_ms, life_ms = whole_ms(ttl), whole_ms(max_lifetime)
            numkeys = len(keys) + 1
            if self._wait_replicas:
                reply = self._granted(
                    ACQUIRE_ANY, (numkeys, *keys, FENCES, token, ttl_ms, life_ms, holder), timeout
                )
            else:
                reply = self._scripts.run(
                    ACQUIRE_ANY, numkeys, *keys, FENCES, token, ttl_ms, life_ms, holder, timeout=timeout
                )
            if reply[0] == 1:
                return reply[1] - 1, Grant(reply[2], reply[3] / 1e6)
            return Held(self._info(keys[0], reply[1:7], reply[7]))
        deadline = None if timeout is None else time.monotonic() + timeout
        first: Held | None = None
        for group in self._server.groups(keys):
            picked = [keys[i] for i in group]
            fences = self._server.fences_of(picked[0])
            args = (len(picked) + 1, *picked, fences, token, whole_ms(ttl), whole_ms(max_lifetime), holder)
            reply = self._granted(ACQUIRE_ANY, args, _left(deadline))
            if reply[0] == 1:
                return group[reply[1] - 1], Grant(reply[2], reply[3] / 1e6)
            if first is None:
                first = Held(self._info(picked[0], reply[1:7], reply[7]))
        assert first is not None  # keys is never empty
        return first

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        groups = self._server.groups([r.key for r in requests])
        calls = [_refresh_args([requests[i] for i in group]) for group in groups]
        if self._wait_replicas:
            replies, acks = self._scripts.run_acked(REFRESH, calls, timeout)
            if acks < self._wait_replicas:
                raise self._server.unacknowledged("refresh", acks)
        else:
            replies = self._scripts.run_many(REFRESH, calls, timeout)
        answers: list[float | None] = [None] * len(requests)
        for group, reply in zip(groups, replies, strict=True):
            for i, us in zip(group, reply, strict=True):
                answers[i] = _seconds_left(us)
        return answers

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        if key.startswith(FENCES):  # _check_key, inline: force_release, a record's release
            _check_key(key)
        if completion is None:
            packed = resp.release(key, token) if self._packs else None
            reply = self._scripts.run(RELEASE, 1, key, token, timeout=timeout, packed=packed)
        else:
            task_id = completion.task_id
            result, retain_ms, tail = _record_args(completion)
            packed = resp.release_done(key, token, task_id, tail) if self._packs else None
            reply = self._scripts.run(
                RELEASE, 1, key, token, task_id, result, retain_ms, timeout=timeout, packed=packed
            )
        reached = reply == 2  # 2: its release signal reached a waiter (release.lua)
        if reached or self._woken._keys:  # Woken.note(key, False) with no key noted: nothing to do
            self._woken.note(key, reached)
        return bool(reply)

    def subscribe(self, key: str) -> Subscription:
        """Listen for releases of ``key`` (``WakesWaiters``): sharded pub/sub on the key,
        published by the release script (providers/_redis_wake.py). Raises when the server
        cannot confirm it (a BackendError for a driver error); the waiter then polls."""
        return self.subscribe_any([key])

    def subscribe_any(self, keys: Sequence[str]) -> Subscription:
        """Listen for releases of any of ``keys`` (``WakesOnAny``: a semaphore's slots), one
        sharded channel per key (on Cluster, each on its key's shard); as :meth:`subscribe`."""
        signals = self._signals
        if signals is None or signals.pid != os.getpid():  # a child never uses its parent's
            with self._connecting:
                signals = self._signals
                if signals is None or signals.pid != os.getpid():
                    signals = self._signals = ReleaseSignals(self._server.route)
        with self._translated:
            return signals.subscribe_any(keys)

    def completion(self, key: str, task_id: str, *, timeout: float | None = None) -> CompletionInfo | None:
        now, *found = self._scripts.run(DONE, 1, key, task_id, timeout=timeout)
        records = [self._record(key, field, value, now) for _, field, value in found]
        return next((r for r in records if r.expires_in > 0), None)

    def completions(self, prefix: str, *, timeout: float | None = None) -> list[CompletionInfo]:
        deadline = None if timeout is None else time.monotonic() + timeout
        keys, groups = self._server.hashes(prefix, deadline)
        calls = [(len(group), *[keys[i] for i in group], "") for group in groups]
        records: list[CompletionInfo] = []
        replies = self._scripts.run_many(DONE, calls, _left(deadline))
        for group, (now, *found) in zip(groups, replies, strict=True):
            for index, field, value in found:
                record = self._record(keys[group[int(index) - 1]], field, value, now)
                if record.expires_in > 0:
                    records.append(record)
        return sorted(records, key=lambda r: (r.key, r.task_id))

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        _check_key(key)
        return bool(self._scripts.run(FORGET, 1, key, task_id, timeout=timeout))

    def _record(self, key: str, field: Any, value: Any, now: Any) -> CompletionInfo:
        try:
            return _completion_info(key, field, value, now)
        except (TypeError, ValueError) as exc:
            raise self._server.fail(ValueError(f"malformed completion record on {key!r}: {exc}")) from exc

    def _info(self, key: str, row: Sequence[Any], now: Any) -> LockInfo:
        try:
            return _lock_info(key, row, now)
        except (TypeError, ValueError) as exc:
            raise self._server.fail(ValueError(f"malformed lock hash {key!r}: {exc}")) from exc

    def peek(self, key: str, *, timeout: float | None = None) -> LockInfo | None:
        reply = self._scripts.run(PEEK, 1, key, timeout=timeout)
        return None if reply[1] == 0 else self._info(key, reply[1], reply[0])

    def diagnose(self, *, timeout: float | None = None) -> list[Diagnosis]:
        """Server version and role, clock skew, scripting, eviction and persistence settings.

        On a cluster every primary is checked (details name the node). With ``timeout``, a
        store that does not answer by then is a BackendError by then (through a client you
        passed: a thread asking it is no longer waited for).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if deadline is not None and not self._server.on_wires:
            return within(deadline, self._server, self.diagnose)
        found = diagnose_servers(self._server, deadline)
        # The scripts run (a proxy may refuse EVAL).
        self.peek("celery-exclusive:doctor", timeout=_left(deadline))
        found.append(Diagnosis("scripts", "ok", "Lua scripts run"))
        return found

    def scan(self, prefix: str, *, timeout: float | None = None) -> list[LockInfo]:
        deadline = None if timeout is None else time.monotonic() + timeout
        keys, groups = self._server.hashes(prefix, deadline)
        calls = [(len(group), *[keys[i] for i in group]) for group in groups]
        infos: list[LockInfo] = []
        replies = self._scripts.run_many(PEEK, calls, _left(deadline))
        for group, (now, *rows) in zip(groups, replies, strict=True):
            infos.extend(
                self._info(keys[i], row, now) for i, row in zip(group, rows, strict=True) if row != 0
            )
        if self._server.cluster:
            infos.sort(key=lambda info: info.key)
        return infos

    def close(self) -> None:
        signals, self._signals = self._signals, None
        if signals is not None and signals.pid == os.getpid():
            signals.close()
        self._server.close()


#: release.lua's record arguments, by outcome, of the latest record of that outcome written
#: here: (attempt, retain, ``attempt|outcome``, retain ms, those two as RESP). A process
#: writes few kinds of record (attempt 0, one retention), so each is made once, not per
#: release (~3k instructions: an int formatted, ``whole_ms``, the RESP tail).
_RECORDS: dict[str, tuple[int, float, str, int, str]] = {}
_MAX_RECORDS = 16


def _record_args(completion: Completion) -> tuple[str, int, str]:
    """release.lua's ARGV[3:4] for a completion record, 'attempt|outcome' and retain ms, and
    their RESP (:func:`._redis_resp.record`); ARGV[2] is its task id."""
    outcome, attempt, retain = completion.outcome, completion.attempt, completion.retain
    made = _RECORDS.get(outcome) if outcome.__class__ is str else None
    # Exact types only: an int subclass (a bool) formats otherwise than the int it equals.
    if made is None or made[0] != attempt or made[1] != retain or attempt.__class__ is not int:
        result, retain_ms = f"{attempt}|{outcome}", whole_ms(retain)
        made = (attempt, retain, result, retain_ms, resp.record(result, retain_ms))
        if outcome.__class__ is str and attempt.__class__ is int and len(_RECORDS) < _MAX_RECORDS:
            _RECORDS[outcome] = made
    return made[2], made[3], made[4]
