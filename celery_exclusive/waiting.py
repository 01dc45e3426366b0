"""Waiting for a held lock: ``LockService.lock(key, wait=seconds)`` and ``try_lock(..., wait=)``.

The waiter retries its acquire until it wins or ``wait`` seconds have passed; it then
answers exactly as a call without ``wait`` would (a lease, or LockedError / None). Between
attempts it pauses for a jittered, doubling interval (:data:`POLL_MIN` to :data:`POLL_MAX`
seconds, each pause a random 50-100 % of the step, so waiters that started together spread
out), cut short by a release signal where the store gives one. Guarantees:

* never past the timeout by more than one store round trip: a pause never runs beyond the
  deadline, and the last attempt is made at the deadline;
* a lost signal only costs latency: with or without signals, a release is seen within
  :data:`POLL_MAX` seconds (plus one attempt);
* an outage is an error: an attempt that cannot reach the store raises BackendError as it
  would without ``wait`` (no "not acquired" after a wait spent failing);
* ``AlreadyDone`` (``task_id``) ends the wait at once;
* each refused attempt is one refused acquisition: with ``lock_contended`` receivers (the
  metrics) connected, each sends the signal, so contention counts attempts, not waits;
* fairness is statistical: no queue, but jitter and the wake-all signal give every waiter
  the same chance at each release (measured by ``benchmarks/waiting.py``, asserted by
  ``tests/contract/test_waiting.py``); except on SQLite, where waiting processes can starve:
  each attempt is a ``BEGIN IMMEDIATE`` whose busy handler backs off while others write.

Wake-up, by store (the :class:`~celery_exclusive.providers.base.WakesWaiters` protocol):

* memory: a ``threading.Condition`` notified by ``release`` (implemented).
* PostgreSQL (implemented, providers/_pg_listen.py): ``LISTEN`` on a channel derived from
  the table and store key (``ce_`` + 24 hex of a SHA-256: channel names are identifiers of
  at most 63 bytes), and the release statement itself calls ``pg_notify(channel, '')`` when
  it frees a live lease and a waiter is registered (a shared advisory lock per channel,
  held by the waiters' listener connection), so the releaser pays no extra round trip;
  NOTIFY is delivered at commit, so a waiter woken by it sees the row gone, and a release
  rolled back sends nothing. The listener needs its own session-level connection (one per
  provider and process, shared by its waiters), so behind PgBouncer in transaction mode
  (``ce_pgbouncer=true``: LISTEN does not work there) and with drivers other than psycopg 3
  ``subscribe`` refuses and waiters poll; so they do on SQLite and MariaDB (no such
  mechanism, no ``subscribe``).
* Redis (implemented, providers/_redis_wake.py): sharded pub/sub, ``release.lua`` ending
  with ``SPUBLISH`` on the key itself when it freed a live lease (on Cluster the channel is
  in the script's own slot, and the message goes to the key's shard instead of being
  broadcast to every node as ``PUBLISH`` would; standalone and Sentinel use the same
  command, so one script serves all three; Redis < 7 has none and its waiters poll). A
  waiter subscribes on one connection per server (per primary on Cluster) per provider and
  process, read by a daemon thread, and returns from ``subscribe`` once the server
  confirmed it. A lost connection breaks its subscriptions: the waiter polls. Chosen over a
  per-key signal list (python-redis-lock's ``BLPOP``): a list needs a write per release
  even when nobody waits, its entries must expire, one waiter consumes the signal meant
  for all (the others then poll), and a blocking pop holds a pooled connection per waiter;
  pub/sub costs nothing when nobody listens and wakes every waiter. A message missed
  during a failover (Sentinel promotes a replica, the subscriber reconnects) only costs
  the poll interval.

A waiter on a semaphore (``limit=N``) listens to the releases of all N slot keys in one
subscription where the store has ``subscribe_any``
(:class:`~celery_exclusive.providers.base.WakesOnAny`: memory, PostgreSQL, one channel per
slot; Redis, one sharded channel per slot, on Cluster on each slot key's shard), so any
holder's release wakes it.

Nothing here holds the store while waiting: the waiter owns no lease between attempts.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import Held, ReleaseSubscription, WakesOnAny, WakesWaiters

logger = logging.getLogger("celery_exclusive")

T = TypeVar("T")

#: First pause between attempts, in seconds; it doubles up to :data:`POLL_MAX`.
POLL_MIN = 0.01
#: Longest pause between attempts (the bound on a release nobody signalled), in seconds. 0.1 s
#: gave 8 processes on one key shares of 1.7-28 % (Redis), 0.04 s 4.6-23 %: a shorter bound
#: is fairer (see benchmarks/waiting.py) at up to 20 attempts/s per polling waiter.
POLL_MAX = 0.05
#: Longest ``wait`` accepted, in seconds (the hard cap on a lease's lifetime: 24 h).
MAX_WAIT = 24 * 60 * 60.0


def check_wait(wait: object) -> float:
    """``wait`` as finite seconds ``0 <= wait <= MAX_WAIT``; InvalidArgumentError otherwise.

    Infinity is refused: a wait must end, so a caller stuck behind a leaked lock learns it.
    """
    if not isinstance(wait, (int, float)) or isinstance(wait, bool):
        raise InvalidArgumentError(f"wait must be seconds as an int or float, got {type(wait).__name__}")
    value = float(wait)
    if not math.isfinite(value) or value < 0 or value > MAX_WAIT:
        raise InvalidArgumentError(f"wait must be finite seconds between 0 and {MAX_WAIT:g}, got {wait!r}")
    return value


class Waiter:
    """The pauses of one wait: a deadline, a backoff step and at most one subscription."""

    def __init__(
        self,
        provider: object,
        wait: float,
        *,
        step: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._provider = provider if isinstance(provider, WakesWaiters) else None
        self._clock = clock
        self.deadline = clock() + wait
        #: The backoff step of the next pause (a caller resuming a wait passes it back in;
        #: :data:`POLL_MIN` for a new wait).
        self.step = POLL_MIN if step is None else step
        self._watching: tuple[str, ...] | None = None
        self._subscription: ReleaseSubscription | None = None

    def remaining(self) -> float:
        return self.deadline - self._clock()

    def watch(self, store_key: str, more: Sequence[str] = ()) -> None:
        """Listen for releases of ``store_key`` and of the keys ``more`` (a semaphore's other
        slots, where the store offers ``subscribe_any``; else their releases are polled for),
        dropping any other key listened to."""
        if self._provider is None or self._watching == (store_key, *more):
            return
        self.close()
        try:
            if more and isinstance(self._provider, WakesOnAny):
                self._subscription = self._provider.subscribe_any([store_key, *more])
            else:
                self._subscription = self._provider.subscribe(store_key)
            self._watching = (store_key, *more)
        except Exception as exc:  # no signals: poll (the next attempt reports an outage)
            logger.debug("cannot listen for releases of %r (%s); polling", store_key, type(exc).__name__)

    def pause(self) -> bool:
        """Pause before the next attempt; False (without pausing) if the time is up."""
        remaining = self.remaining()
        if remaining <= 0:
            return False
        pause = min(remaining, self.step * random.uniform(0.5, 1.0))
        self.step = min(self.step * 2, POLL_MAX)
        if self._subscription is not None:
            try:
                if self._subscription.wait(pause):
                    self.step = POLL_MIN  # the key changed hands: watch closely again
                return True
            except Exception as exc:
                logger.debug("release signal failed (%s); polling", type(exc).__name__)
                self.close()
        time.sleep(max(0.0, min(pause, self.remaining())))
        return True

    def close(self) -> None:
        if self._subscription is not None:
            subscription, self._subscription, self._watching = self._subscription, None, None
            try:
                subscription.close()
            except Exception as exc:
                logger.debug("closing a release subscription failed (%s)", type(exc).__name__)


def take_waiting(
    attempt: Callable[[bool], T | Held],
    provider: object,
    store_key: str,
    wait: float,
    *,
    more: Sequence[str] = (),
) -> T | Held:
    """Call ``attempt(final)`` until it returns something other than :class:`Held` or ``wait``
    seconds pass; ``final`` is True for the last attempt (made at the deadline), whose answer
    is returned whatever it is. Woken by releases of ``store_key`` and ``more`` (see
    :meth:`Waiter.watch`). Exceptions (an outage, AlreadyDone) propagate at once."""
    waiter = Waiter(provider, wait)
    try:
        waiter.watch(store_key, more)  # before the first attempt: a release right after it still wakes us
        while True:
            if waiter.remaining() <= 0:
                return attempt(True)
            answer = attempt(False)
            if not isinstance(answer, Held):
                return answer
            if not waiter.pause():
                return attempt(True)
    finally:
        waiter.close()
