"""The Redis hot path's two commands, ``EVALSHA`` of acquire.lua and release.lua, packed as
RESP in Python.

hiredis's ``pack_command`` formats every argument's length with libc ``sprintf`` (about
0.7k instructions each, ~14.5k of a ~106k lock + release cycle). Here each command's fixed
head (``EVALSHA``, the script's SHA, the key count) is packed once at import, the
durations' pieces once per value, the length headers of short arguments (``$<len>\r\n``) once
at import (an ``int`` formatted in an f-string is about 0.45k instructions: six per lock +
release), and a call formats the rest in one f-string encoded once.

The bytes are those ``pack_command`` makes (tests compare them): UTF-8 text, an ``int`` in
decimal. Only exact ``str`` values are packed here, and only ASCII text (where a length in
characters is the length in bytes); anything else answers None and the caller sends the
command as before, packed by hiredis.
"""

from __future__ import annotations

from celery_exclusive.providers._redis_scripts import ACQUIRE, FENCES, RELEASE, SHA

#: The durations' pieces (``$<len>\r\n<ms>\r\n``) by value: a process uses few.
_NUMBERS: dict[int, str] = {}
_MAX_NUMBERS = 64
#: Arguments shorter than this (characters) take their length header from :data:`_LENGTHS`;
#: a longer one (a long holder, say) has it formatted per call, as before.
SHORT = 512
#: ``$<n>\r\n`` by ``n``, for ``n < SHORT`` (about 28 KB per process).
_LENGTHS = tuple(f"${n}\r\n" for n in range(SHORT))


def head(script: str, numkeys: int, count: int) -> str:
    """RESP of ``EVALSHA <sha> <numkeys>`` as the start of a command with ``count`` more
    arguments."""
    return f"*{count + 3}\r\n$7\r\nEVALSHA\r\n$40\r\n{SHA[script]}\r\n${len(str(numkeys))}\r\n{numkeys}\r\n"


_ACQUIRE = head(ACQUIRE, 2, 6)
_ACQUIRE_ONCE = head(ACQUIRE, 2, 7)
_RELEASE = head(RELEASE, 1, 2)
_RELEASE_DONE = head(RELEASE, 1, 5)
#: The single server's fences key as an argument (a cluster's per-slot ones are formatted).
_FENCES = f"${len(FENCES)}\r\n{FENCES}\r\n"


def _number(value: int) -> str:
    """``value``'s piece, kept for the next call while few are kept."""
    text = str(value)
    piece = f"${len(text)}\r\n{text}\r\n"
    if len(_NUMBERS) < _MAX_NUMBERS:
        _NUMBERS[value] = piece
    return piece


def acquire(  # noqa: PLR0917 - acquire.lua's arguments, in its order
    key: str, fences: str, token: str, ttl_ms: int, life_ms: int, holder: str, task_id: str | None
) -> bytes | None:
    """acquire.lua's ``EVALSHA`` (``task_id`` its last argument unless None); None if an
    argument is not ASCII text. ``fences`` and the durations are the provider's own (a str,
    ints)."""
    if type(key) is not str or type(token) is not str or type(holder) is not str:
        return None
    ttl = _NUMBERS.get(ttl_ms) or _number(ttl_ms)
    life = _NUMBERS.get(life_ms) or _number(life_ms)
    lengths, k, t, h = _LENGTHS, len(key), len(token), len(holder)
    if fences == FENCES and k < SHORT and t < SHORT and h < SHORT:
        # The usual call: every length header from the table (the same bytes).
        if task_id is None:
            text = (
                f"{_ACQUIRE}{lengths[k]}{key}\r\n{_FENCES}"
                f"{lengths[t]}{token}\r\n{ttl}{life}{lengths[h]}{holder}\r\n"
            )
        elif type(task_id) is str and len(task_id) < SHORT:
            text = (
                f"{_ACQUIRE_ONCE}{lengths[k]}{key}\r\n{_FENCES}"
                f"{lengths[t]}{token}\r\n{ttl}{life}{lengths[h]}{holder}\r\n"
                f"{lengths[len(task_id)]}{task_id}\r\n"
            )
        elif type(task_id) is str:
            text = (
                f"{_ACQUIRE_ONCE}{lengths[k]}{key}\r\n{_FENCES}"
                f"{lengths[t]}{token}\r\n{ttl}{life}{lengths[h]}{holder}\r\n"
                f"${len(task_id)}\r\n{task_id}\r\n"
            )
        else:
            return None
    elif task_id is None:
        text = (
            f"{_ACQUIRE}${k}\r\n{key}\r\n${len(fences)}\r\n{fences}\r\n"
            f"${t}\r\n{token}\r\n{ttl}{life}${h}\r\n{holder}\r\n"
        )
    elif type(task_id) is str:
        text = (
            f"{_ACQUIRE_ONCE}${k}\r\n{key}\r\n${len(fences)}\r\n{fences}\r\n"
            f"${t}\r\n{token}\r\n{ttl}{life}${h}\r\n{holder}\r\n"
            f"${len(task_id)}\r\n{task_id}\r\n"
        )
    else:
        return None
    return text.encode() if text.isascii() else None


def release(key: str, token: str) -> bytes | None:
    """release.lua's ``EVALSHA`` without a completion record; None if not ASCII text."""
    if type(key) is not str or type(token) is not str:
        return None
    lengths, k, t = _LENGTHS, len(key), len(token)
    if k < SHORT and t < SHORT:
        text = f"{_RELEASE}{lengths[k]}{key}\r\n{lengths[t]}{token}\r\n"
    else:
        text = f"{_RELEASE}${k}\r\n{key}\r\n${t}\r\n{token}\r\n"
    return text.encode() if text.isascii() else None


def record(result: str, retain_ms: int) -> str:
    """release.lua's last two arguments, a completion record's ``attempt|outcome`` and its
    retain ms (an int), as RESP: the tail of :func:`release_done` (made once per kind of
    record by the provider, which writes few)."""
    return f"${len(result)}\r\n{result}\r\n" + (_NUMBERS.get(retain_ms) or _number(retain_ms))


def release_done(key: str, token: str, task_id: str, tail: str) -> bytes | None:
    """release.lua's ``EVALSHA`` writing a completion record (``tail``: :func:`record`'s);
    None if not ASCII text."""
    if type(key) is not str or type(token) is not str or type(task_id) is not str:
        return None
    lengths, k, t, i = _LENGTHS, len(key), len(token), len(task_id)
    if k < SHORT and t < SHORT and i < SHORT:
        text = f"{_RELEASE_DONE}{lengths[k]}{key}\r\n{lengths[t]}{token}\r\n{lengths[i]}{task_id}\r\n{tail}"
    else:
        text = f"{_RELEASE_DONE}${k}\r\n{key}\r\n${t}\r\n{token}\r\n${i}\r\n{task_id}\r\n{tail}"
    return text.encode() if text.isascii() else None
