"""Who this process is (holder metadata, owner tokens) and the key-prefix helpers of the lock service.

Part of the lock core: :mod:`celery_exclusive.service` and its collaborators share these.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import LockInfo, encode_holder

HOST = socket.gethostname()[:64]

# One encoder, built once: json.dumps with any non-default argument builds a JSONEncoder per
# call (about a microsecond of an acquire). The same settings as providers.base.encode_holder.
_encode = json.JSONEncoder(separators=(",", ":"), sort_keys=True, default=str).encode
#: How that encoder writes a str (ensure_ascii, the default): the C function it calls.
_encode_str = json.encoder.encode_basestring_ascii


class _ThisProcess:
    """Who this process is, as holder metadata and a token prefix; rebuilt in a forked child
    (so the hot path neither asks the kernel for its pid nor encodes the same JSON again)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        pid = os.getpid()
        self.meta: dict[str, Any] = {"host": HOST, "pid": pid}
        self.holder = encode_holder(self.meta)
        self.token_prefix = f"{HOST}:{pid}:"


this = _ThisProcess()


#: Tokens' random parts drawn per refill of the pool: one ``getrandom`` system call per this
#: many tokens instead of one per token.
TOKENS_PER_DRAW = 256
_TOKEN_HEX = 32  # 128 random bits, as hex digits


class _RandomPool:
    """:data:`TOKENS_PER_DRAW` random parts of tokens, each handed out once (``itertools.count``'s
    ``next`` is atomic, so two threads never get the same index)."""

    __slots__ = ("hex", "next")

    def __init__(self) -> None:
        self.hex = os.urandom(TOKENS_PER_DRAW * _TOKEN_HEX // 2).hex()
        self.next = itertools.count().__next__


class _Tokens:
    """This process's pool of random parts and the lock of its refill; rebuilt in a forked
    child before any code runs there (an ``os.register_at_fork`` hook): the child must never
    hand out the parts its parent may use next, and a parent's thread may have held the
    lock at the fork."""

    __slots__ = ("pool", "refilling")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pool = _RandomPool()
        self.refilling = threading.Lock()


_tokens = _Tokens()
os.register_at_fork(after_in_child=_tokens.reset)


def new_token() -> str:
    """A fresh owner token: host, pid, wall time (for people) and 128 random bits.

    The random bits come from ``os.urandom`` (the same source as ``secrets``), drawn
    :data:`TOKENS_PER_DRAW` tokens' worth at a time; each part is used once, and a forked
    child starts a pool of its own."""
    pool = _tokens.pool
    i = pool.next()
    if i >= TOKENS_PER_DRAW:
        return _token_after_refill(pool)
    start = i * _TOKEN_HEX
    return f"{this.token_prefix}{time.time_ns() // 1_000_000}:{pool.hex[start : start + _TOKEN_HEX]}"


def _token_after_refill(used_up: _RandomPool) -> str:
    with _tokens.refilling:
        if _tokens.pool is used_up:  # not refilled by another thread meanwhile
            _tokens.pool = _RandomPool()
    return new_token()


#: Longest stored holder JSON, in characters (bytes too: it is ASCII): MariaDB's ``TEXT``
#: column, the smallest of the stores'.
MAX_HOLDER_LENGTH = 65535


def holder_json(holder: Mapping[str, Any] | None) -> str:
    """The stored JSON of a lease's holder: this process's ``host`` and ``pid``, then
    ``holder`` (checked: InvalidArgumentError unless a mapping with str keys whose JSON
    takes at most :data:`MAX_HOLDER_LENGTH` characters)."""
    if holder is None:
        return this.holder
    if type(holder) is EncodedHolder and holder.made_for is this.holder:
        return holder.json  # a HolderTemplate's, checked and encoded as below, in this process
    encoded = _encode({**this.meta, **check_holder(holder)})
    if len(encoded) > MAX_HOLDER_LENGTH:
        raise InvalidArgumentError(
            f"holder is {len(encoded)} characters as JSON; a store takes at most {MAX_HOLDER_LENGTH}"
        )
    return encoded


class EncodedHolder(dict[str, Any]):
    """Holder metadata that carries its stored JSON, as :func:`holder_json` makes it, for
    this process (``made_for``: ``this.holder`` when it was encoded); made by
    :class:`HolderTemplate` only, and not to be changed after."""

    __slots__ = ("json", "made_for")
    json: str
    made_for: str


#: Stands for the variable field while a HolderTemplate encodes the rest.
_SLOT = "\x00celery-exclusive-holder-slot\x00"


class HolderTemplate:
    """Holders that differ in one str field only (a task's runs: ``task_id``), their JSON
    encoded once (around the field) and completed per holder: the same text
    :func:`holder_json` makes of the same mapping, at a fraction of the cost."""

    def __init__(self, fields: Mapping[str, Any], variable: str) -> None:
        self._fields = dict(check_holder(fields))
        self._variable = variable
        self._made_for = ""
        self._around: tuple[str, str] | None = None

    def holder(self, value: object) -> Mapping[str, Any]:
        """``fields`` with ``variable`` set to ``value``, its JSON attached (a plain dict when
        ``value`` is not a str, or the fields' text got in the way: holder_json encodes it)."""
        around = self._made()
        if around is None or type(value) is not str:
            return {**self._fields, self._variable: value}
        holder = EncodedHolder(self._fields)
        holder[self._variable] = value
        holder.json = around[0] + _encode_str(value) + around[1]
        holder.made_for = self._made_for
        return holder

    def text(self, value: object) -> str | None:
        """The stored JSON of :meth:`holder`'s answer for ``value`` in this process (what
        ``holder_json`` makes of it), without the mapping; None where :meth:`holder` answers
        a plain dict."""
        around = self._around if self._made_for is this.holder else self._made()  # made: the usual
        return (
            None if around is None or type(value) is not str else around[0] + _encode_str(value) + around[1]
        )

    def _made(self) -> tuple[str, str] | None:
        """The text around the variable's value for this process (made on its first use, and
        again in a forked child); None when the fields' text got in the way."""
        made_for = this.holder
        if made_for is not self._made_for:  # the first use, or a forked child's
            parts = _encode({**this.meta, **self._fields, self._variable: _SLOT}).split(_encode(_SLOT))
            self._around = (parts[0], parts[1]) if len(parts) == 2 else None
            self._made_for = made_for
        return self._around


def check_holder(holder: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if holder is None:
        return {}
    if type(holder) is dict:  # the usual holder: no Mapping ABC check, no generator
        for k in holder:
            if not isinstance(k, str):
                break
        else:
            return holder
    if not isinstance(holder, Mapping) or not all(isinstance(k, str) for k in holder):
        raise InvalidArgumentError("holder must be a mapping with str keys")
    return holder


def check_filter(prefix: object, *, text: bool = True) -> str:
    """A key filter: a str without NUL (and, with ``text``, valid Unicode)."""
    if not isinstance(prefix, str) or "\x00" in prefix:
        raise InvalidArgumentError("prefix must be a str without NUL characters")
    if text:
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("prefix must be valid Unicode text (no lone surrogates)") from None
    return prefix


def unprefix(key: str, prefix: str) -> str:
    return key[len(prefix) :] if key.startswith(prefix) else key


def unprefixed(info: LockInfo, prefix: str) -> LockInfo:
    return LockInfo(
        unprefix(info.key, prefix),
        info.token,
        info.fence,
        info.age,
        info.expires_in,
        info.hard_expires_in,
        info.holder,
    )
