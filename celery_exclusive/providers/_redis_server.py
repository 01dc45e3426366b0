"""How the Redis provider reaches its server: the client, the wire, errors, routing, SCAN.

:class:`RedisServer` is built once per provider from its :class:`~._redis_urls.Target`. It
owns what every operation needs and none decides: the redis-py client (a cluster client
from a URL built on first use), the fast-path :class:`~._redis_wire.Wire` (a one-server
client the provider built; on a cluster the provider built, one Wire per node, for calls
with a per-call timeout), the translation of driver errors into a BackendError that
names the server without its password, the :class:`~._redis_scripts.ScriptRunner`, and the
cluster's routing (hash slots, fence keys, script groups, the node owning a key, SCAN on
every primary). The provider (providers/redis.py) keeps the lock operations.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_exclusive.errors import BackendError
from celery_exclusive.providers._redis_scripts import FENCES, ScriptRunner, Translating, fence_key
from celery_exclusive.providers._redis_urls import Target, wait_settings
from celery_exclusive.providers._redis_wire import Wire, as_text, left
from celery_exclusive.urls import mask_error, mask_url

_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})


class RedisServer:
    """One provider's way to its Redis (standalone, Sentinel's primary, or a cluster).

    Thread-safe. ``translated`` (``with server.translated:``) raises a driver error as
    :meth:`fail`'s BackendError and nothing else; ``scripts`` runs the Lua scripts.
    """

    def __init__(self, target: Target) -> None:
        import redis
        from redis.crc import key_slot
        from redis.exceptions import RedisClusterException

        self.target = target
        self.display = target.display
        self.cluster = target.cluster
        #: A key's hash slot, as the cluster computes it (UTF-8 keys, hash tags honoured).
        self._slot_of = key_slot
        self.wait_replicas, self.wait_ms = wait_settings(target)
        self._connecting = threading.Lock()
        #: The cluster client being built, or the last build (see :meth:`client_by`).
        self._build: _Build | None = None
        # RedisClusterException (no reachable node, say) is not a RedisError.
        self.errors: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
        self.response_error = redis.ResponseError
        self.redirects = (redis.exceptions.MovedError, redis.exceptions.AskError)
        self.translated = Translating(self.errors, self.fail)
        self.wire: Wire | None = None
        #: On a cluster the provider built: one Wire per node name, made on first use.
        self._node_wires: dict[str, Wire] = {}
        #: Set by :meth:`close`: a node's Wire made after it keeps no connection either.
        self._closed = False
        execute: Callable[..., Any]
        if target.built and not self.cluster:
            self.wire = Wire(target.pool, redis.ResponseError, (*self.errors, OSError))
            execute = self.wire.send
        elif target.factory is not None:
            execute = self._via_client
        else:
            execute = target.client.execute_command
        self.scripts = ScriptRunner(
            lambda: self.client,
            execute,
            self.wire,
            translated=self.translated,
            noscript=redis.exceptions.NoScriptError,
            wait=(self.wait_replicas, self.wait_ms),
            node_of=self._node_client if self.cluster else None,
            moved=(self.redirects, self._remap),
            wire_of=self._node_wire if self.cluster and target.built else None,
            wire_at=self._wire_at if self.cluster and target.built else None,
        )

    @property
    def client(self) -> Any:
        """The redis-py client; a cluster client from a URL is built on first use."""
        return self.client_by(None)

    def client_by(self, deadline: float | None) -> Any:
        """:attr:`client`, waiting for a cluster client being built until ``deadline``
        (monotonic; None: as long as it takes), then BackendError.

        Building one asks the startup nodes for the slot map on sockets with the client's
        own timeouts (10 s), which no call's deadline reaches, so it runs in a thread of its
        own, one at a time (the next caller after a failure starts another, and a forked
        child its own): a cold client on an unreachable cluster made each call wait 10 s,
        and calls queued behind the heartbeat's retried releases, each building in turn,
        for minutes."""
        target = self.target
        client = target.client
        if client is not None or target.factory is None:
            return client
        with self._connecting:
            if target.client is not None:
                return target.client
            build = self._build
            # None yet, the last one failed, or a copy by fork (its thread stayed in the parent).
            if build is None or build.done.is_set() or build.pid != os.getpid():
                build = self._build = _Build()
                threading.Thread(
                    target=self._make, args=(build,), name="celery-exclusive-redis-cluster", daemon=True
                ).start()
        if not build.done.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
            raise BackendError(f"redis {self.display}: the cluster gave no slot map by the call's deadline")
        if build.error is not None:
            if isinstance(build.error, self.errors):
                raise self.fail(build.error) from build.error
            raise build.error
        return target.client

    def _make(self, build: _Build) -> None:
        """Build the cluster client (in its own thread, see :meth:`client_by`)."""
        target = self.target
        assert target.factory is not None  # client_by's test
        try:
            made = target.factory()
            with self._connecting:
                target.client = made
        except Exception as exc:  # handed to the callers waiting for it
            build.error = exc
        finally:
            build.done.set()

    def _node_client(self, key: str, deadline: float | None = None) -> tuple[str, Any]:
        """The cluster node owning ``key``: its name and its own one-node client."""
        node = self.client_by(deadline).get_node_from_key(key)
        return node.name, node.redis_connection

    def _node_wire(self, key: str, deadline: float | None) -> tuple[str, Wire]:
        """The cluster node owning ``key``: its name and the Wire to it (its kept
        connections, a per-call timeout enforced on their sockets); the client waited for
        until ``deadline``."""
        name, node = self._node_client(key, deadline)
        return name, self._wire_to(name, node)

    def _wire_at(self, host: str, port: int) -> Wire | None:
        """The Wire to the cluster node at ``host:port`` (None: not a node the client knows)."""
        node = self.client.get_node(host=host, port=port)
        if node is None or node.redis_connection is None:
            return None
        return self._wire_to(node.name, node.redis_connection)

    def _wire_to(self, name: str, node: Any) -> Wire:
        """The Wire to the cluster node ``name`` (``node``: its one-node client), made once."""
        wire = self._node_wires.get(name)
        if wire is None:
            with self._connecting:
                wire = self._node_wires.get(name)
                if wire is None:
                    wire = Wire(node.connection_pool, self.response_error, (*self.errors, OSError))
                    self._node_wires[name] = wire
                    if self._closed:  # made after close(), or during it, after its snapshot
                        wire.close()
        return wire

    @property
    def on_wires(self) -> bool:
        """Whether calls can go on Wires, within deadlines: not through a client you passed."""
        return self.wire is not None or (self.cluster and self.target.built)

    def primary_wires(self, deadline: float) -> list[tuple[str, Wire]]:
        """The Wire to each primary (with its node's name, "" for one server), for calls
        within ``deadline`` (monotonic); only :attr:`on_wires`."""
        if self.wire is not None:
            return [("", self.wire)]
        nodes = self.client_by(deadline).get_primaries()
        return [(node.name, self._wire_to(node.name, node.redis_connection)) for node in nodes]

    def _remap(self) -> None:
        """Ask the cluster for its slot map again (a node answered MOVED or ASK)."""
        if self.cluster:
            with self.translated:
                self.client.nodes_manager.initialize()

    def _via_client(self, *command: Any) -> Any:
        return self.client.execute_command(*command)

    def fail(self, exc: Exception) -> BackendError:
        """``exc`` (a driver error, or what the provider found malformed) as a BackendError
        naming the server, every secret the store was given masked in it, and in ``exc``
        and its chain (in place: ``exc`` is chained to it)."""
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, self.redirects):  # redis-py strips the MOVED/ASK word
            reason = f"{type(exc).__name__[:-5].upper()} {reason}: the slot is served elsewhere now"
        if type(exc).__name__ == "MasterNotFoundError":  # drop its repr of every sentinel client
            reason = reason.split(" : ", 1)[0] + " (no sentinel reachable, or none monitors it)"
        secrets = self.target.secrets
        mask_error(exc, secrets)
        return BackendError(f"redis {self.display}: {mask_url(reason, secrets)}")

    def unacknowledged(self, what: str, acks: int) -> BackendError:
        """A write fewer than ``ce_wait_replicas`` replicas acknowledged."""
        return BackendError(
            f"redis {self.display}: the {what} reached {acks} of {self.wait_replicas} replica(s) "
            f"within {self.wait_ms} ms (ce_wait_replicas): a failover now could lose it"
        )

    # -- routing ---------------------------------------------------------------------------

    def fences_of(self, key: str) -> str:
        """The fence high-water key for lock ``key``: one per server, or per slot on a cluster."""
        return fence_key(self._slot_of(key.encode())) if self.cluster else FENCES

    def same_slot(self, *keys: str) -> bool:
        """Whether one script may touch all of ``keys`` (always, but on a cluster)."""
        return not self.cluster or len({self._slot_of(k.encode()) for k in keys}) == 1

    def groups(self, keys: Sequence[str]) -> list[range | list[int]]:
        """Indices of ``keys`` in groups for one script call each (``ScriptRunner.groups``)."""
        return self.scripts.groups(keys, self.cluster)

    def route(self, key: str) -> tuple[str, Callable[[], Any]]:
        """The server owning ``key`` and a factory of unconnected connections to it."""
        if self.cluster:
            node = self.client.get_node_from_key(key)
            pool = node.redis_connection.connection_pool
            name = node.name
        else:
            pool = self.target.pool if self.target.pool is not None else self.client.connection_pool
            name = "primary"
        return name, lambda: pool.connection_class(**pool.connection_kwargs)

    def hashes(self, prefix: str, deadline: float | None) -> tuple[list[str], list[range | list[int]]]:
        """The hash keys starting with ``prefix``, sorted, and their groups for script calls;
        with a ``deadline`` (monotonic) on the fast path's connection (on a cluster the
        provider built, each primary's Wire), each SCAN round trip within what is left of it."""
        pattern = prefix.translate(_GLOB) + "*"
        with self.translated:
            if deadline is not None and self.wire is not None:
                names = _scan_wire(self.wire, pattern, deadline)
            elif deadline is not None and self.cluster and self.target.built:
                names = set()  # each primary in turn, on its Wire, all within the deadline
                for node in self.client_by(deadline).get_primaries():
                    names |= _scan_wire(self._wire_to(node.name, node.redis_connection), pattern, deadline)
            else:
                client = self.client
                where = {"target_nodes": client.PRIMARIES} if self.cluster else {}
                found = client.scan_iter(match=pattern, count=1000, _type="hash", **where)
                names = {as_text(k) for k in found}
        keys = sorted(k for k in names if k.startswith(prefix))
        return keys, self.groups(keys)

    def close(self) -> None:
        """Close the wire and a client the provider built, with its connections to the
        sentinels (a client you passed stays open). The wires keep no connection from then
        on, a node's wire made later included."""
        self._closed = True  # before the snapshot: a wire added after it sees the flag
        for wire in (self.wire, *list(self._node_wires.values())):
            if wire is not None:
                wire.close()
        if self.target.built and self.target.client is not None:
            self.target.client.close()
        if self.target.sentinels is not None:
            self.target.sentinels.close()


class _Build:
    """One build of a cluster client: ``done`` once it ended, ``error`` if it failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.pid = os.getpid()
        self.error: Exception | None = None


def _scan_wire(wire: Wire, pattern: str, deadline: float) -> set[str]:
    """``SCAN ... TYPE hash`` to the end on the fast path, each call within ``deadline``."""
    names: set[str] = set()
    cursor: Any = 0
    while True:
        command = ("SCAN", cursor, "MATCH", pattern, "COUNT", 1000, "TYPE", "hash")
        cursor, batch = wire.send(*command, timeout=left(deadline))
        names.update(as_text(k) for k in batch)
        if int(cursor) == 0:
            return names
