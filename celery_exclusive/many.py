"""Several keys at once: ``LockService.lock_many([k1, k2, ...])``, all or none.

* Canonical order: keys are taken one by one in the order of their store keys (sorted), so
  two callers asking for overlapping sets in any order never hold-and-wait on each other in
  a cycle: whoever takes the lowest shared key first gets the rest too, or is refused.
* Rollback: when a key is refused (or the store fails, or anything raises), the keys
  already taken in this attempt are released before the call answers or raises.
* Each key is its own lease (own token, fence, heartbeat, state): a :class:`LeaseSet` holds
  them and releases them together. On Redis Cluster keys in different slots are simply
  separate leases taken in that order; nothing needs a multi-key script.
* With ``wait``: a refused attempt releases everything, waits on the refused key (its
  release signal or the poll backoff of :mod:`celery_exclusive.waiting`), then retries the
  whole set from the first key. Holding the keys already won while waiting for the
  refused one would be hold-and-wait: with ttl-bounded leases it cannot deadlock forever,
  but two waiters could each block the other for their whole wait; releasing first means
  a waiting caller never holds anything, so it never blocks anyone.
* At most :data:`MAX_KEYS` keys per call; an empty or duplicated list is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TypeVar

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.lease import Lease, ReleaseOutcome
from celery_exclusive.providers.base import Held
from celery_exclusive.waiting import Waiter

_Outcome = TypeVar("_Outcome")

#: Most keys one ``lock_many`` call takes (each is a round trip to the store).
MAX_KEYS = 64


def check_keys(keys: object) -> list[str]:
    """``keys`` as a list of distinct str (each key is checked further by the service)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise InvalidArgumentError(f"keys must be a list or tuple of str, got {type(keys).__name__}")
    # At most one key past the limit is read: a huge or endless iterable is refused, not
    # read into memory.
    found = list(itertools.islice(keys, MAX_KEYS + 1))
    if not found:
        raise InvalidArgumentError("keys must not be empty")
    if len(found) > MAX_KEYS:
        raise InvalidArgumentError(f"at most {MAX_KEYS} keys can be locked together, got more than that")
    if not all(isinstance(key, str) for key in found):
        raise InvalidArgumentError("every key must be a str")
    if len(set(found)) != len(found):
        duplicates = sorted({key for key in found if found.count(key) > 1})
        raise InvalidArgumentError(f"keys must be distinct; repeated: {duplicates!r}")
    return found


class LeaseSet:
    """The leases of one ``lock_many`` call, in the order they were taken (canonical order).

    A context manager releasing every lease on exit; ``release()`` releases them all (in
    reverse order) and returns each key's outcome.
    """

    def __init__(self, leases: list[Lease]) -> None:
        self._leases = tuple(leases)

    def __repr__(self) -> str:
        return f"<LeaseSet {[lease.key for lease in self._leases]!r}>"

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    def __getitem__(self, key: str) -> Lease:
        for lease in self._leases:
            if lease.key == key:
                return lease
        raise KeyError(key)

    @property
    def leases(self) -> tuple[Lease, ...]:
        return self._leases

    @property
    def keys(self) -> list[str]:
        return [lease.key for lease in self._leases]

    @property
    def fences(self) -> dict[str, int]:
        """Each key's own fence number."""
        return {lease.key: lease.fence for lease in self._leases}

    @property
    def held(self) -> bool:
        """True while every lease is held (HELD or JEOPARDY)."""
        return all(lease.held for lease in self._leases)

    def check(self) -> None:
        """Raise :class:`LockLost` if any lease is no longer held."""
        for lease in self._leases:
            lease.check()

    def release(self) -> dict[str, ReleaseOutcome]:
        """Release every lease (never raises for an outage; see ``Lease.release``). An
        exception that is not the store's (a signal handler's) is raised after the others
        are released too (see :func:`release_each`)."""
        return release_each(reversed(self._leases), Lease.release)

    def __enter__(self) -> LeaseSet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def take_all(
    keys: list[str],
    attempt: Callable[[str, bool], Lease | Held],
    store_key: Callable[[str], str],
    provider: object,
    wait: float | None,
) -> LeaseSet | tuple[str, Held]:
    """Take every key in canonical order with ``attempt(key, final)``: a LeaseSet, or the
    refused key and its Held once ``wait`` (None: no waiting) has run out."""
    order = sorted(keys, key=store_key)
    waiter = None if wait is None else Waiter(provider, wait)
    try:
        while True:
            final = waiter is None or waiter.remaining() <= 0
            refused = _attempt_once(order, attempt, final)
            if isinstance(refused, LeaseSet):
                return refused
            if final:
                return refused
            assert waiter is not None
            waiter.watch(store_key(refused[0]))
            waiter.pause()  # returns at once when the time is up: the next attempt is the last
    finally:
        if waiter is not None:
            waiter.close()


def _attempt_once(
    order: list[str], attempt: Callable[[str, bool], Lease | Held], final: bool
) -> LeaseSet | tuple[str, Held]:
    taken: list[Lease] = []
    try:
        for key in order:
            answer = attempt(key, final)
            if isinstance(answer, Held):
                _roll_back(taken)
                return key, answer
            taken.append(answer)
    except BaseException:
        _roll_back(taken)
        raise
    return LeaseSet(taken)


def _roll_back(taken: list[Lease]) -> None:
    release_each(reversed(taken), Lease.release)


def release_each(leases: Iterable[Lease], release: Callable[[Lease], _Outcome]) -> dict[str, _Outcome]:
    """``release(lease)`` for each of ``leases`` in turn, each key's outcome; an exception a
    release raises (Celery's SoftTimeLimitExceeded, KeyboardInterrupt: the heartbeat
    finishes that release) is raised again once every other lease is released, else those
    would stay held, kept alive by the heartbeat until their max lifetime, with nothing
    left to release them."""
    outcomes: dict[str, _Outcome] = {}
    raised: BaseException | None = None
    for lease in leases:
        try:
            outcomes[lease.key] = release(lease)
        except BaseException as exc:
            if raised is None:
                raised = exc
    if raised is not None:
        raise raised
    return outcomes


__all__ = ["MAX_KEYS", "LeaseSet", "check_keys", "release_each", "take_all"]
