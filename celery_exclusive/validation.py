"""Argument checks shared by every public entry point; all raise InvalidArgumentError."""

from __future__ import annotations

import hashlib
import inspect
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta

from celery_exclusive.errors import InvalidArgumentError

Duration = float | int | timedelta

#: The origin design's hard cap on a lease's lifetime, also its staleness threshold.
MAX_LIFETIME_CAP = 24 * 60 * 60.0

_PREFIX = re.compile(r"^[\x21-\x7e]{0,64}$")


def shown(value: object) -> str:
    """``repr(value)`` for an error message; an int too long to print in full (Python
    refuses ints of more than 4300 digits: ValueError) is described instead."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def as_seconds(name: str, value: object) -> float:
    """``value`` (seconds as int/float, or a timedelta) as float seconds, unbounded (an int
    beyond any float is infinity); InvalidArgumentError naming ``name`` for another type."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond any float (10**400): the caller refuses it
            return math.inf
    raise InvalidArgumentError(
        f"{name} must be seconds (int or float) or a timedelta, got {type(value).__name__}"
    )


def seconds(name: str, value: object) -> float:
    """``value`` (seconds as int/float, or a timedelta) as positive finite float seconds."""
    result = as_seconds(name, value)
    if not math.isfinite(result) or result <= 0:
        raise InvalidArgumentError(f"{name} must be a positive, finite number of seconds, got {shown(value)}")
    return result


def refused_call(function: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """Why ``function`` cannot be called with ``args`` and ``kwargs`` (its signature and
    the binding error), or None if it can or Python cannot read its signature (taken on
    trust): a callback that cannot take what it will be given is refused when it is given,
    not when it is first called (a key found held, a duplicate sent)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"{getattr(function, '__qualname__', repr(function))}{signature} cannot ({exc})"
    return None


def check_key(key: object, *, prefix: str = "", max_length: int | None = None) -> str:
    """A usable lock key: a non-empty str, UTF-8 encodable, without NUL, within the store's limit."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"lock key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidArgumentError("lock key must not be empty")
    if "\x00" in key:
        raise InvalidArgumentError("lock key must not contain NUL characters")
    if not key.isascii():  # ASCII is UTF-8 already: no encoded copy made for the usual key
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("lock key must be valid Unicode text (no lone surrogates)") from None
    if max_length is not None and len(prefix) + len(key) > max_length:
        raise InvalidArgumentError(
            f"lock key is {len(key)} characters; with the prefix {prefix!r} this store accepts "
            f"at most {max_length - len(prefix)}"
        )
    return key


#: The suffixes of the Celery layer's marker keys (:func:`derived_key` of a lock key): a
#: queued (dedupe) marker, a pending rerun, and (followed by the task id) a semaphore run's
#: lease on its own task id. Defined here, below every layer that names or lists them.
QUEUED_SUFFIX = "#queued"
RERUN_SUFFIX = "#rerun"
GUARD_INFIX = "#id:"
#: Hex digits of a long key's SHA-256 in the keys derived from it (:func:`derived_key`): 128 bits.
#: Hex digits of SHA-256 a :func:`shortened` key ends with.
DIGEST_LENGTH = _DIGEST = 32


def derived_key(key: str, suffix: str, *, prefix: str, max_length: int | None) -> str:
    """The key of a lease derived from ``key`` (a marker's: ``key + suffix``), made to fit the
    store (``max_length`` characters with ``prefix``): where ``key + suffix`` would not, the
    :func:`shortened` ``key`` and ``suffix``, exactly the longest key the store takes. The
    same text in every process for the same store limit and prefix; it still ends with
    ``suffix``. A ``key`` that does not fit itself is refused (InvalidArgumentError naming
    the store's limit), as its lock would be.

    A plain ``other + suffix`` equals a hashed key only if ``other`` was made to: the start
    of ``key``, ``~`` and those 32 hex digits."""
    if max_length is None or len(prefix) + len(key) + len(suffix) <= max_length:
        return key + suffix
    check_key(key, prefix=prefix, max_length=max_length)
    return shortened(key, max_length - len(prefix) - len(suffix)) + suffix


def shortened(key: str, length: int) -> str:
    """``key`` in ``length`` characters where it is longer: its start, ``~`` and 32 hex digits
    of its SHA-256 (:func:`derived_key`); ``key`` itself where it fits, or where ``length``
    has no room for the digest (the caller's check then refuses what it builds)."""
    head = length - 1 - _DIGEST
    if len(key) <= length or head < 0:
        return key
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:_DIGEST]
    return f"{key[:head]}~{digest}"


def marker_scan(start: str, *, prefix: str, max_length: int | None, longest_suffix: int) -> str | None:
    """The text every marker key (:func:`derived_key` with a suffix of at most
    ``longest_suffix`` characters) of every key starting with ``start`` starts with, where
    some of them may not start with ``start`` itself (a shortened key keeps less of its
    key than ``start`` is long); None where they all do (a scan by ``start`` finds them)."""
    if max_length is None:
        return None
    kept = max(max_length - len(prefix) - longest_suffix - 1 - _DIGEST, 0)
    return None if len(start) <= kept else start[:kept]


def markers_listed(
    start: str, keys: Iterable[str], *, prefix: str, max_length: int | None
) -> Callable[[str], str | None]:
    """For a key found by :func:`marker_scan`'s text but not starting with ``start``: the
    marker key it stands for (``<key>#queued``, ``<key>#rerun``, ``<key>#id:<task id>``) if
    it is the shortened marker key (:func:`derived_key`) of ``start`` itself or of one of
    ``keys`` (listed keys starting with ``start``), else None. A shortened key keeps too
    little of its key to tell it from another's: only the hash of a key known to start with
    ``start`` says whose it is, so the marker of a key that is neither is not listed."""
    room = None if max_length is None else max_length - len(prefix)
    known = {
        hashlib.sha256(each.encode("utf-8")).hexdigest()[:_DIGEST]: each
        for each in {start, *keys}
        if room is not None and len(each) <= room and each.startswith(start)
    }

    def listed(key: str) -> str | None:
        if room is None or len(key) != room or key.startswith(start):
            return None
        for found in _TILDE.finditer(key, 0, len(key) - _DIGEST):
            digest_end = found.end() + _DIGEST
            suffix, original = key[digest_end:], known.get(key[found.end() : digest_end])
            if original is None or not _marker_suffix(suffix):
                continue
            if derived_key(original, suffix, prefix=prefix, max_length=max_length) == key:
                return original + suffix
        return None

    return listed


_TILDE = re.compile("~")


def _marker_suffix(suffix: str) -> bool:
    return suffix in (QUEUED_SUFFIX, RERUN_SUFFIX) or (
        suffix.startswith(GUARD_INFIX) and len(suffix) > len(GUARD_INFIX)
    )


def check_token(token: object) -> str:
    """An owner token given by a caller: a non-empty str, UTF-8 encodable, without NUL (which
    PostgreSQL's text parameters end at: ``token + "\\x00…"`` would match ``token``)."""
    if not isinstance(token, str) or not token:
        raise InvalidArgumentError("token must be a non-empty str")
    if "\x00" in token:
        raise InvalidArgumentError("token must not contain NUL characters")
    if not token.isascii():  # every token new_token() makes is ASCII
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("token must be valid Unicode text (no lone surrogates)") from None
    return token


def check_prefix(prefix: object) -> str:
    """A key prefix: at most 64 printable ASCII characters without spaces."""
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise InvalidArgumentError(
            f"key prefix must be at most 64 printable ASCII characters without spaces, got {prefix!r}"
        )
    return prefix


#: The rules between two durations, applied when both are known:
#: (duration, the other, it is wrong when, what the message says).
_ORDERS: tuple[tuple[str, str, Callable[[float, float], bool], str], ...] = (
    ("ttl", "max_lifetime", operator.gt, "must not exceed"),
    ("refresh_interval", "ttl", operator.ge, "must be shorter than"),
    ("lock_retry_backoff_max", "lock_retry_backoff", operator.lt, "must not be shorter than"),
    ("cooldown", "max_lifetime", operator.gt, "must not exceed"),
)
#: Durations bounded by the hard cap on a lease's lifetime (:data:`MAX_LIFETIME_CAP`).
_CAPPED = ("max_lifetime", "dedupe_ttl", "cooldown")


def check_durations(
    given: Mapping[str, object], *, labels: Mapping[str, str] | None = None
) -> dict[str, float]:
    """The one duration check: every duration of ``given`` (None: not given) as positive finite
    seconds (:func:`seconds`, named in messages by ``labels``, else by its own name), then the
    rules between those given (:func:`_check_orders`)."""
    durations = {
        name: seconds(labels.get(name, name) if labels else name, value)
        for name, value in given.items()
        if value is not None
    }
    _check_orders(durations)
    return durations


def _check_orders(durations: Mapping[str, float | None]) -> None:
    """max_lifetime, dedupe_ttl and cooldown within the 24 h cap, ttl and cooldown at most
    max_lifetime, refresh_interval shorter than ttl, lock_retry_backoff_max not shorter than
    lock_retry_backoff (None: not known)."""
    for name in _CAPPED:
        value = durations.get(name)
        if value is not None and value > MAX_LIFETIME_CAP:
            raise InvalidArgumentError(
                f"{name} is {value:g} s; the hard cap is {MAX_LIFETIME_CAP:g} s (24 h)"
            )
    for name, other, wrong, says in _ORDERS:
        value, limit = durations.get(name), durations.get(other)
        if value is not None and limit is not None and wrong(value, limit):
            raise InvalidArgumentError(f"{name} ({value:g} s) {says} {other} ({limit:g} s)")


def lease_durations(
    ttl: float, refresh_interval: float | None, max_lifetime: float, *, ttl_explicit: bool
) -> tuple[float, float, float]:
    """Complete (ttl, refresh_interval, max_lifetime), already in seconds, and check them
    (the rules of :func:`check_durations`).

    An explicit ttl above max_lifetime is an error; the default ttl is capped by it. The
    refresh interval defaults to ttl/3: the origin's ``max(30 s, ttl/3)`` capped at ttl/3,
    so that a short lease (2 s) still gets several refreshes (every ~0.7 s) per ttl.
    """
    if ttl > max_lifetime and not ttl_explicit:
        ttl = max_lifetime  # a lifetime over the cap is still refused below
    _check_orders({"ttl": ttl, "refresh_interval": refresh_interval, "max_lifetime": max_lifetime})
    if refresh_interval is None:
        refresh_interval = min(max(30.0, ttl / 3), ttl / 3)
    return ttl, refresh_interval, max_lifetime


def check_task_id(task_id: object, max_length: int) -> str:
    """A task id for a completion record: a non-empty str without NUL, at most ``max_length``."""
    if not isinstance(task_id, str) or not task_id:
        raise InvalidArgumentError(f"task_id must be a non-empty str, got {task_id!r}")
    if "\x00" in task_id or len(task_id) > max_length:
        raise InvalidArgumentError(f"task_id must be at most {max_length} characters without NUL")
    if not task_id.isascii():  # a Celery uuid is ASCII: no encoded copy made for it
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("task_id must be valid Unicode text (no lone surrogates)") from None
    return task_id
