"""Leased semaphores: ``LockService.lock(key, limit=N)``, at most N holders of ``key`` at once.

* Slots: slot 1 of ``key`` is ``key`` itself, so ``limit=1`` is exactly the single lock (same
  rows and keys, no migration); slot ``i > 1`` is the key ``{key}#i`` (:func:`slot_key`).
  Where that would not fit the store (a key within 3 characters of its longest with the
  prefix; within 4 for slots 10 and up) the slot's key is ``{<key's start>~<32 hex digits
  of its SHA-256>}#i``, the braced text the same for every such slot and short enough for
  two-digit slots; slot keys that fit keep their names.
  Each slot is an ordinary lease: its own token, fence, heartbeat, state machine and
  release, unchanged. Only acquiring differs: it takes the first free slot.
* One round trip where the store allows it (:class:`~celery_exclusive.providers.base.AcquiresAny`):
  memory (one mutex) and Redis (one Lua script over the slot keys; on Cluster the slots
  ``2..N`` share a hash slot, as ``{key}#i`` hashes the text between the first ``{`` and the
  next ``}``, which is the same for every ``i``, so a cluster takes at most two calls: slot 1,
  then the others), PostgreSQL (one statement: a snapshot read of every slot, then the
  single lock's advisory-locked fence draw and insert or take-over on the first free slot
  only, so a refused attempt takes no lock, no xid and writes no WAL), SQLite and MariaDB
  (one transaction reading every slot row at once; on MariaDB through pymysql, two batches
  of statements and the commit). A third-party store without ``acquire_any`` is tried slot
  by slot, one acquire each.
* A dead holder's slot is reclaimed after its ttl, as any lease's is: the slot's lease expires.
* Two acquirers picking the same free slot: on PostgreSQL the statement reads the slots in
  its snapshot, so a racer can take the picked slot before the write; the loser waits for
  the racer's commit (the slot's key lock), writes nothing (no row, fence or xid), and the
  provider tries again, at most once per slot (tests/faults/test_pg_semaphore_races.py).
  Redis has no such window (``acquire_any.lua`` runs atomically, nothing else runs between
  its reads and writes), nor do SQLite and MariaDB (the transaction first bumps the fence
  counter row, which serialises acquirers before the slots are read, and only acquirers
  create or revive a lease row).
* Changing ``limit`` while the key is held: new acquires use only slots ``1..limit``; leases
  on slots above it keep running until released or expired (nothing revokes them). Lowering
  N therefore takes effect as the higher slots' holders finish; raising it is immediate.
* Listing: ``locks()`` / ``peek`` / CLI ``list`` show each slot as its own lease, slot ``i``
  under ``{key}#i`` (sorted after ``key``); :func:`slot_of` reads a listed key back (for a
  shortened slot key, the braced text: the key's start and its hash). ``locks(start)``
  lists the higher slots of every key starting with ``start`` (:func:`slots_listed`), the
  shortened ones too: by the start they keep, or, for a longer ``start``, by the hash of
  ``start`` itself or of a listed key (slot 1 held) that starts so.
* Waiting (``wait=``) on a full semaphore subscribes to the release signals of every slot
  (``subscribe_any``, :class:`~celery_exclusive.providers.base.WakesOnAny`: memory, Redis,
  PostgreSQL), so the release of any slot wakes it; on a store with only ``subscribe`` it
  hears slot 1's, and a higher slot's release is seen by its polling (within
  :data:`~celery_exclusive.waiting.POLL_MAX`).
* A user key of the form ``{K}#i`` is slot ``i`` of ``K``: do not name plain locks that way.
* Completion records (``task_id``) are not checked or written by ``lock(limit > 1)``: a
  record lives on one store key, and a semaphore's runs are spread over several. A Celery
  run of a semaphore task also holds a lease on its own task id's key (``<key>#id:<task
  id>``, :func:`celery_exclusive.redelivery.guard_key`), which does that job.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.validation import DIGEST_LENGTH, check_key, shortened, shown

#: Largest ``limit`` accepted (slots a refused attempt may have to look at).
MAX_LIMIT = 64

#: Characters a slot key adds to the key: ``{``, ``}#`` and the slot's two digits at most.
_SLOT_ROOM = 5

_SLOT = re.compile(r"\{(.*)\}#([2-9]|[1-5][0-9]|6[0-4])", re.DOTALL)


def check_limit(limit: object) -> int:
    """``limit`` as an int ``1 <= limit <= MAX_LIMIT``; InvalidArgumentError otherwise."""
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidArgumentError(f"limit must be an int, got {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgumentError(f"limit must be between 1 and {MAX_LIMIT}, got {shown(limit)}")
    return limit


def slot_key(key: str, slot: int, *, prefix: str = "", max_length: int | None = None) -> str:
    """The key of ``slot`` (1-based) of the semaphore ``key``: ``key`` itself for slot 1, else
    ``{key}#<slot>``; where that would not fit the store (``max_length`` characters with
    ``prefix``), ``{<shortened key>}#<slot>``, the key shortened to leave room for any slot
    (:func:`~celery_exclusive.validation.shortened`: its start, ``~``, a hash of it), the same
    text for every such slot and in every process."""
    if slot == 1:
        return key
    plain = f"{{{key}}}#{slot}"
    if max_length is None or len(prefix) + len(plain) <= max_length:
        return plain
    return f"{{{shortened(key, max_length - len(prefix) - _SLOT_ROOM)}}}#{slot}"


def slot_keys(key: str, limit: int, *, prefix: str = "", max_length: int | None = None) -> list[str]:
    """The keys of slots ``1..limit`` of ``key`` (made to fit the store as :func:`slot_key` says)."""
    return [slot_key(key, slot, prefix=prefix, max_length=max_length) for slot in range(1, limit + 1)]


@functools.lru_cache(maxsize=4096)
def store_slot_keys(prefix: str, key: str, limit: int, max_length: int | None = None) -> tuple[str, ...]:
    """The store keys (``prefix`` + slot key) of slots ``1..limit`` of ``key``, cached: every
    acquire of the semaphore needs them (building them costs more than the cache lookup).
    InvalidArgumentError if one does not fit (a store whose longest key has no room for
    :func:`slot_key`'s hash)."""
    slots = slot_keys(key, limit, prefix=prefix, max_length=max_length)
    if max_length is not None:
        for slot in slots:
            check_key(slot, prefix=prefix, max_length=max_length)
    return tuple(prefix + slot for slot in slots)


def slot_of(listed: str) -> tuple[str, int]:
    """``(semaphore key, slot)`` of a listed key: ``("K", 3)`` for ``{K}#3``, ``(key, 1)`` else."""
    found = _SLOT.fullmatch(listed)
    return (found.group(1), int(found.group(2))) if found else (listed, 1)


def _kept(prefix: str, max_length: int | None) -> tuple[int, int] | None:
    """(length of a shortened slot key's braced text, characters of the key it keeps), or
    None where no slot key is shortened."""
    if max_length is None:
        return None
    length = max_length - len(prefix) - _SLOT_ROOM
    return length, length - 1 - DIGEST_LENGTH


def slot_scan(start: str, *, prefix: str = "", max_length: int | None = None) -> str:
    """The text every higher slot key of every key starting with ``start`` starts with
    (``{`` and ``start``, cut to what a shortened slot key keeps of its key)."""
    kept = _kept(prefix, max_length)
    return "{" + (start if kept is None or kept[1] < 0 else start[: kept[1]])


def slots_listed(
    start: str, keys: Iterable[str], *, prefix: str = "", max_length: int | None = None
) -> Callable[[str], tuple[str, int] | None]:
    """For a key found by :func:`slot_scan`: ``(semaphore key, slot)`` if it is a higher slot
    of a key starting with ``start``, else None. A shortened slot key (``{<start>~<hash>}#i``)
    keeps too little of its key to compare with a longer ``start``: it is one if it is the
    slot key of ``start`` itself or of one of ``keys`` (listed keys starting with ``start``),
    and its semaphore key is then that key."""
    kept = _kept(prefix, max_length)
    hashed: dict[str, str] | None = None

    def listed(key: str) -> tuple[str, int] | None:
        nonlocal hashed
        text, slot = slot_of(key)
        if slot == 1:
            return None
        if kept is None or len(start) <= kept[1] or not _is_shortened(text, *kept):
            return (text, slot) if text.startswith(start) else None
        if hashed is None:  # only a start longer than the kept text needs the hashes
            hashed = {shortened(each, kept[0]): each for each in (start, *keys) if each.startswith(start)}
        original = hashed.get(text)
        return None if original is None else (original, slot)

    return listed


def _is_shortened(text: str, length: int, head: int) -> bool:
    """Whether ``text`` (a slot key's braced text) has the form :func:`shortened` gives a key."""
    return (
        len(text) == length and head >= 0 and text[head] == "~" and _HEX.fullmatch(text, head + 1) is not None
    )


_HEX = re.compile(r"[0-9a-f]+")
