"""The Redis provider's Lua scripts (``redis_scripts/*.lua``, package data) and their runner.

Each script is ``prelude.lua`` followed by the script's own file, composed once at import
(:func:`_compose`, the one place), its SHA1 computed once. The files keep their
``KEYS/ARGV/returns`` headers; each says how to run it by hand with ``redis-cli --eval``.
:class:`ScriptRunner` runs them by SHA, sending the source once on NOSCRIPT: one call, or
several pipelined in one round trip, optionally followed by ``WAIT`` for replicas.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from importlib.resources import files
from types import TracebackType
from typing import Any

from celery_exclusive.errors import BackendError
from celery_exclusive.providers._redis_wire import Wire, left

#: The fence high-water key of a standalone or Sentinel server; on Redis Cluster, one key per
#: hash slot, ``FENCES{<tag>}`` (:func:`fence_key`). A lock key starting so is refused.
FENCES = "celery-exclusive:fences"
SLOTS = 16384
_TAG_CHARS = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

_FOLDER = files("celery_exclusive.providers").joinpath("redis_scripts")
_PRELUDE = _FOLDER.joinpath("prelude.lua").read_text(encoding="utf-8")


def _compose(*names: str) -> str:
    """The source Redis runs for ``redis_scripts/<name>.lua``: the prelude, then the script
    (several names: their files in that order, one script)."""
    return _PRELUDE + "".join(_FOLDER.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in names)


ACQUIRE = _compose("acquire")
REFRESH = _compose("refresh")
RELEASE = _compose("release")
DONE = _compose("done")
FORGET = _compose("forget")
PEEK = _compose("peek")
ACQUIRE_ANY = _compose("acquire_any")
#: acquire.lua behind a check of a blocking key (``AcquiresUnless``).
ACQUIRE_UNLESS = _compose("unless", "acquire")
SHA = {
    src: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
    for src in (ACQUIRE, REFRESH, RELEASE, PEEK, DONE, FORGET, ACQUIRE_ANY, ACQUIRE_UNLESS)
}
CHUNK = 1000  # keys per script call: bounds how long one script blocks Redis


@functools.cache
def _tag_tables() -> tuple[dict[int, bytes], list[int]]:
    """Slot bits of each two-character prefix (first in ``_TAG_CHARS`` order kept), and of
    each third character: CRC16 (init 0) is linear over messages of one length, so the slot of
    ``c1 c2 c3`` is ``crc(c1 c2 0) ^ crc(0 0 c3)``, masked."""
    pairs: dict[int, bytes] = {}
    for a in _TAG_CHARS:
        for b in _TAG_CHARS:
            pairs.setdefault(binascii.crc_hqx(bytes((a, b, 0)), 0) % SLOTS, bytes((a, b)))
    return pairs, [binascii.crc_hqx(bytes((0, 0, c)), 0) % SLOTS for c in _TAG_CHARS]


@functools.cache
def fence_key(slot: int) -> str:
    """The fence high-water key of Redis Cluster hash slot ``slot``: ``FENCES{<tag>}``, the tag
    three letters or digits whose CRC16 is ``slot`` (the first third character, in
    ``_TAG_CHARS`` order, that some prefix completes). Part of the stored format: every
    process, and every version, must name the same key for a slot (tests pin it)."""
    pairs, thirds = _tag_tables()
    for c, bits in zip(_TAG_CHARS, thirds, strict=True):
        prefix = pairs.get(slot ^ bits)
        if prefix is not None:
            return f"{FENCES}{{{(prefix + bytes((c,))).decode()}}}"
    raise ValueError(f"no hash slot {slot!r}")  # pragma: no cover - every slot has a tag


class Translating:
    """``with translating:`` raises a driver error from the block as BackendError (chained);
    nothing else is touched. Stateless, so one instance serves every call and thread."""

    __slots__ = ("errors", "fail")

    def __init__(
        self, errors: tuple[type[Exception], ...], fail: Callable[[Exception], BackendError]
    ) -> None:
        self.errors = errors
        self.fail = fail

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, self.errors):
            raise self.fail(exc) from exc


#: What :meth:`ScriptRunner._asked` answers when the redirection was not an ASK it could follow.
_NOT_ASKED = object()


class ScriptRunner:
    """Runs the scripts on one client: through ``wire`` (a client the provider built; a
    per-call ``timeout`` is then enforced on the socket), on a cluster the provider built
    through ``wire_of`` (the Wire of the key's node) when a call has a ``timeout``, or the
    client's own commands (a client you passed keeps its own socket timeouts)."""

    def __init__(
        self,
        client: Callable[[], Any],
        execute: Callable[..., Any],
        wire: Wire | None,
        *,
        translated: Translating,
        noscript: type[Exception],
        wait: tuple[int, int],
        node_of: Callable[[str], tuple[str, Any]] | None = None,
        moved: tuple[tuple[type[Exception], ...], Callable[[], None]] = ((), lambda: None),
        wire_of: Callable[[str, float], tuple[str, Wire]] | None = None,
        wire_at: Callable[[str, int], Wire | None] | None = None,
    ) -> None:
        self._client = client
        self._execute = execute
        self._wire = wire
        self._translated = translated
        self._fail = translated.fail
        self._errors = translated.errors
        self._noscript = noscript
        self._wait = wait
        #: On a cluster: the node owning a key, as (name, its own one-node client).
        self._node_of = node_of
        #: The MOVED/ASK error replies, and what to call on one (the slot map is stale).
        self._redirects, self._moved = moved
        #: On a cluster the provider built: the node owning a key, as (name, its Wire), for
        #: calls with a ``timeout`` (enforced on that node's socket, as on one server), and
        #: the call's deadline (monotonic), which waiting for the cluster client keeps too.
        self._wire_of = wire_of
        #: The same, for the node at (host, port) (an ASK redirection's target; None: unknown).
        self._wire_at = wire_at
        #: Whether :meth:`run` may send a ``packed`` command (on a Wire): else it is unused.
        self.packs = wire is not None or wire_of is not None

    def run(
        self, script: str, numkeys: int, *args: Any, timeout: float | None = None, packed: bytes | None = None
    ) -> Any:
        """Run ``script`` by SHA; on NOSCRIPT (never executed) send its source once.
        ``packed``: that ``EVALSHA`` as RESP (``_redis_resp``; worth making when
        :attr:`packs`), sent as it is on a Wire.

        The hot path, so the translation is spelt out: a ``with`` block costs two Python
        calls per command (about 0.5 µs per lock + release), the same rule as
        :class:`Translating` (its ``errors`` and ``fail``)."""
        try:
            if self._wire is not None:  # (without a timeout, _execute is this Wire's send)
                start = time.monotonic()  # the wire's too: one clock read for the call's deadline
                try:  # Wire.send's one command, without its call
                    if packed is not None:
                        return self._wire.send_many(packed, timeout, start)[0]
                    command = ("EVALSHA", SHA[script], numkeys, *args)
                    return self._wire.send_many((command,), timeout, start)[0]
                except self._noscript:
                    rest = None if timeout is None else left(start + timeout)
                    return self._wire.send("EVAL", script, numkeys, *args, timeout=rest)
            if timeout is not None and self._wire_of is not None:
                return self._run_on_node(script, numkeys, args, timeout, packed)
            try:
                return self._execute("EVALSHA", SHA[script], numkeys, *args)
            except self._noscript:
                return self._execute("EVAL", script, numkeys, *args)
        except self._errors as exc:
            raise self._fail(exc) from exc

    def _run_on_node(
        self, script: str, numkeys: int, args: tuple[Any, ...], timeout: float, packed: bytes | None
    ) -> Any:
        """``script`` on the Wire of its first key's cluster node, within ``timeout`` s.

        A cluster node answering MOVED or ASK ran nothing. MOVED: the slot map is read again
        and the call sent once more on the new owner's Wire. ASK (the slot is being migrated
        and its keys are not on the old owner): the call goes to the migration's target on its
        Wire, after ``ASKING``. Both within what is left of the deadline; only a redirection
        after that goes through the cluster client, with its own socket timeout."""
        assert self._wire_of is not None
        deadline = time.monotonic() + timeout
        for attempt in range(2):
            wire = self._wire_of(args[0], deadline)[1]
            try:
                try:
                    if packed is not None:
                        return wire.send_many(packed, left(deadline))[0]
                    return wire.send("EVALSHA", SHA[script], numkeys, *args, timeout=left(deadline))
                except self._noscript:
                    return wire.send("EVAL", script, numkeys, *args, timeout=left(deadline))
            except self._redirects as redirected:
                asked = self._asked(redirected, script, numkeys, args, deadline)
                if asked is not _NOT_ASKED:
                    return asked
                if not attempt:
                    self._moved()
        try:
            return self._execute("EVALSHA", SHA[script], numkeys, *args)
        except self._noscript:
            return self._execute("EVAL", script, numkeys, *args)

    def run_later(self, script: str, numkeys: int, *args: Any, timeout: float) -> Callable[[], Any]:
        """:meth:`run` in two halves on the wire (the provider built the client): sent now,
        the reply read by the call returned (exactly once); ``timeout`` bounds both."""
        assert self._wire is not None
        wire, deadline = self._wire, time.monotonic() + timeout
        try:
            read = wire.send_later(("EVALSHA", SHA[script], numkeys, *args), timeout)
        except self._errors as exc:
            raise self._fail(exc) from exc

        def reply() -> Any:
            try:
                try:
                    return read()
                except self._noscript:  # nothing ran: send the source, now in one go
                    return wire.send("EVAL", script, numkeys, *args, timeout=left(deadline))
            except self._errors as exc:
                raise self._fail(exc) from exc

        return reply

    def _asked(
        self, redirected: Exception, script: str, numkeys: int, args: tuple[Any, ...], deadline: float
    ) -> Any:
        """``script`` run on an ASK redirection's target after ``ASKING`` (one round trip),
        within ``deadline``; :data:`_NOT_ASKED` for a MOVED or a target without a Wire."""
        # redis-py's MovedError is an AskError: the first of the redirects is MOVED.
        moved = isinstance(redirected, self._redirects[0])
        address = None if moved else getattr(redirected, "node_addr", None)
        wire = None if address is None or self._wire_at is None else self._wire_at(*address)
        if wire is None:
            return _NOT_ASKED
        for command in (("EVALSHA", SHA[script]), ("EVAL", script)):
            reply = wire.send_many([("ASKING",), (*command, numkeys, *args)], left(deadline))[1]
            if not isinstance(reply, self._noscript):
                break
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _pipelined(self, commands: Sequence[tuple[Any, ...]], timeout: float | None) -> list[Any]:
        """Every command's reply, error replies in their place, in one round trip.

        On a cluster the pipeline sends each node its share, all nodes before any reply is
        read; replies come back in ``commands`` order either way."""
        if self._wire is not None:
            return self._wire.send_many(commands, timeout)
        if self._wire_of is not None and timeout is not None:
            return self._per_node(commands, time.monotonic() + timeout)
        pipe = self._client().pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def _per_node(self, commands: Sequence[tuple[Any, ...]], deadline: float) -> list[Any]:
        """Each node's share of ``commands`` (scripts: the first key is ``command[3]``)
        pipelined on that node's Wire, node after node, all within ``deadline``."""
        assert self._wire_of is not None
        by_node: dict[str, tuple[Wire, list[int]]] = {}
        for i, command in enumerate(commands):
            name, wire = self._wire_of(command[3], deadline)
            by_node.setdefault(name, (wire, []))[1].append(i)
        replies: list[Any] = [None] * len(commands)
        for wire, indices in by_node.values():
            try:
                got = wire.send_many([commands[i] for i in indices], left(deadline))
            except (self._noscript, *self._redirects) as exc:  # one command's error is raised
                got = [exc]
            for i, reply in zip(indices, got, strict=True):
                replies[i] = reply
        return replies

    def run_many(
        self, script: str, calls: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> list[Any]:
        """Run ``script`` once per argument tuple (numkeys first), pipelined in one round trip."""
        if len(calls) <= 1:
            return [self.run(script, *args, timeout=timeout) for args in calls]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._translated:
            replies = self._pipelined([("EVALSHA", SHA[script], *args) for args in calls], timeout)
        for i, reply in enumerate(replies):
            if isinstance(reply, self._redirects):
                self._moved()  # nothing ran there: run it on the slot's new owner
            if isinstance(reply, (self._noscript, *self._redirects)):
                replies[i] = self.run(script, *calls[i], timeout=None if deadline is None else left(deadline))
            elif isinstance(reply, Exception):
                raise self._fail(reply) from reply
        return replies

    def run_acked(
        self, script: str, calls: Sequence[tuple[Any, ...]], timeout: float | None = None
    ) -> tuple[list[Any], int]:
        """Like :meth:`run_many`, then ``WAIT`` for the replicas; the replies and how many
        replicas acknowledged (on a cluster, the fewest of any node written).

        ``WAIT`` counts the replicas that have every write of *its own connection*, so it
        goes on the connection that ran the scripts, pipelined after them (one round trip).
        On a cluster that is one pipeline per primary owning the calls' keys, on a connection
        of that node's own client, never redis-py's cluster routing: it sends a keyless
        ``WAIT`` to its default node, which for keys of any other primary is a connection
        that wrote nothing there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._node_of is None:
            return self._acked(script, calls, lambda batch: self._pipelined(batch, _left(deadline)))
        by_node: dict[str, tuple[Callable[[list[tuple[Any, ...]]], list[Any]], list[int]]] = {}
        for i, args in enumerate(calls):
            with self._translated:
                name, send = self._sender(args[1], deadline)  # args: numkeys, then the first key
            by_node.setdefault(name, (send, []))[1].append(i)
        replies: list[Any] = [None] * len(calls)
        fewest: int | None = None
        for send, indices in by_node.values():
            got, acks = self._acked(script, [calls[i] for i in indices], send)
            for i, reply in zip(indices, got, strict=True):
                replies[i] = reply
            fewest = acks if fewest is None else min(fewest, acks)
        assert fewest is not None  # calls is never empty
        return replies, fewest

    def _sender(
        self, key: str, deadline: float | None
    ) -> tuple[str, Callable[[list[tuple[Any, ...]]], list[Any]]]:
        """The cluster node owning ``key`` and a function pipelining commands on one of its
        connections: its Wire within ``deadline`` if there is one, else its own client."""
        if self._wire_of is not None and deadline is not None:
            name, wire = self._wire_of(key, deadline)
            return name, lambda batch: wire.send_many(batch, left(deadline))
        assert self._node_of is not None
        name, node = self._node_of(key)
        return name, functools.partial(_on_node, node)

    def _acked(
        self,
        script: str,
        calls: Sequence[tuple[Any, ...]],
        send: Callable[[list[tuple[Any, ...]]], list[Any]],
    ) -> tuple[list[Any], int]:
        """``calls`` of ``script`` and a ``WAIT``, all through ``send`` (one connection)."""
        commands = [("EVALSHA", SHA[script], *args) for args in calls]
        commands.append(("WAIT", *self._wait))
        for attempt in (1, 2):
            with self._translated:
                *replies, acks = send(commands)
            if attempt == 1 and any(isinstance(r, self._noscript) for r in replies):
                with self._translated:  # nothing ran, so nothing to undo: load it, send it all again
                    (loaded,) = send([("SCRIPT", "LOAD", script)])
                if isinstance(loaded, Exception):
                    raise self._fail(loaded) from loaded
                continue
            for reply in (*replies, acks):
                if isinstance(reply, Exception):
                    if isinstance(reply, self._redirects):
                        self._moved()  # the script did not run there; the caller's retry is rerouted
                    raise self._fail(reply) from reply
            return replies, int(acks)
        raise AssertionError("unreachable")  # pragma: no cover

    def groups(self, keys: Sequence[str], cluster: bool) -> list[range | list[int]]:
        """Indices of ``keys`` in groups for one script call each: at most ``CHUNK`` keys,
        consecutive on one server, of one hash slot on a cluster (first-seen slot order)."""
        if not cluster:
            return [range(start, min(start + CHUNK, len(keys))) for start in range(0, len(keys), CHUNK)]
        with self._translated:
            slot_of = self._client().keyslot
            slots: dict[int, list[int]] = {}
            for i, key in enumerate(keys):
                slots.setdefault(slot_of(key), []).append(i)
        return [group[s : s + CHUNK] for group in slots.values() for s in range(0, len(group), CHUNK)]


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else left(deadline)


def _on_node(node: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` pipelined on one connection of ``node`` (a one-node client); the replies,
    error replies in their place."""
    pipe = node.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies
