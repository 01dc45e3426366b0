"""Waiting for a held lock: ``LockService.lock(key, wait=seconds)`` and ``try_lock(..., wait=)``.

The waiter retries its acquire until it wins or ``wait`` seconds have passed; it then
answers exactly as a call without ``wait`` would (a lease, or LockedError / None). Between
attempts it pauses for a jittered, doubling interval (:data:`POLL_MIN` to :data:`POLL_MAX`
seconds, each pause a random 50-100 % of the step, so waiters that started together spread
out), cut short by a release signal where the store gives one. Guarantees:

* never past the timeout by more than one store round trip: a pause never runs beyond
  the deadline, the last attempt is made at the deadline, and no probe (SQLite's read
  before a retry) is made once the time is up;
* a lost signal only costs latency: with or without signals, a release is seen within
  :data:`POLL_MAX` seconds (plus one attempt);
* an outage is an error: an attempt that cannot reach the store raises BackendError as it
  would without ``wait`` (no "not acquired" after a wait spent failing);
* ``AlreadyDone`` (``task_id``) ends the wait at once;
* each refused attempt is one refused acquisition: with ``lock_contended`` receivers (the
  metrics) connected, each sends the signal, so contention counts attempts, not waits (a
  SQLite probe that finds the key held is a read, not an attempt, and sends none);
* fairness: a holder that releases a key others wait for gives way to them. Where the
  store tells the releaser someone waited (:class:`~celery_exclusive.providers.base.KnowsWaiters`:
  Redis, from the count of subscribers its release signal reached; PostgreSQL, from
  whether its release statement notified, which it does only while a waiter's listener
  holds the key's registration; SQLite, from the waiters' marks), the same service's
  next ``lock(key, wait=)`` within :data:`YIELD_WINDOW` of that release first pauses
  :data:`GIVE_WAY` seconds (cut short by a release signal, and then :data:`GIVE_WAY_DEFER`
  more, so that the waiters woken by that release try first), long enough for every polling
  waiter to look once, then waits like the others; it gives way once per release, so it
  is never starved itself. A call without ``wait`` never gives way. There is no queue:
  among the waiters the first to attempt wins, so the order is not FIFO and under heavy
  CPU load the processes the scheduler runs first win more turns (measured shares in
  README, *Limitations*). MariaDB/MySQL and memory do not tell, and their releasers do
  not give way (MariaDB's attempts queue in order on the fence row's lock), nor do
  PostgreSQL releasers to waiters that poll (behind PgBouncer, or not on psycopg 3: they
  register nowhere). Chosen over a ticket queue per key: a queue costs writes per waiter,
  tickets of dead waiters that stall the key until they expire, and a rule for callers
  without ``wait``; giving way costs nothing while nobody waits (one reply value on Redis
  and PostgreSQL, two ``fcntl`` calls per SQLite release). Not fair: polling waiters beside
  woken ones on one key (a process behind PgBouncer or on another driver, a Redis waiter
  whose subscription is down): the woken take the key within about a millisecond of each
  release, so a poller, looking every 25-50 ms, seldom finds it free (measured in README,
  *Limitations*); nothing tells the woken waiters or the releaser that it is there.
* SQLite waiters mark themselves (a shared ``fcntl`` lock on ``<database>-waiters``,
  dropped by the kernel when the process dies; see ``providers/_sqlite.py``), and poll
  by a deferred read (``peek``, ``waiters_peek``) before each retry, so a refused retry
  takes no write lock: each attempt used to be a ``BEGIN IMMEDIATE``, and 8 waiters
  starved each other in SQLite's busy handler (3 of 8 processes got no turn in 3 s).

Wake-up, by store (the :class:`~celery_exclusive.providers.base.WakesWaiters` protocol):

* memory: a ``threading.Condition`` notified by ``release`` (implemented).
* PostgreSQL (implemented, providers/_pg_listen.py): ``LISTEN`` on a channel derived from
  the table and store key (``ce_`` + 24 hex of a SHA-256: channel names are identifiers of
  at most 63 bytes), and the release statement itself calls ``pg_notify(channel, '')`` when
  it frees a live lease and a waiter is registered (a shared advisory lock per channel,
  held by the waiters' listener connection while they wait, and dropped when the last one
  leaves even though the channel stays LISTENed a little longer), so the releaser pays no
  extra round trip, and its reply says whether it notified (the releaser gives way then);
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
  confirmed it (or after 0.05 s, then signalled when it is, polling meanwhile). A lost
  connection breaks its subscriptions: the waiter polls. Chosen over a
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

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    Held,
    KnowsWaiters,
    MarksWaiters,
    ReleaseSubscription,
    WakesOnAny,
    WakesWaiters,
)
from celery_exclusive.validation import as_seconds, shown

logger = logging.getLogger("celery_exclusive")

T = TypeVar("T")

#: First pause between attempts, in seconds; it doubles up to :data:`POLL_MAX`.
POLL_MIN = 0.01
#: Longest pause between attempts (the bound on a release nobody signalled), in seconds. 0.1 s
#: gave 8 processes on one key shares of 1.7-28 % (Redis), 0.04 s 4.6-23 %: a shorter bound
#: is fairer (see benchmarks/waiting.py) at up to 20 attempts/s per polling waiter.
POLL_MAX = 0.05
#: About how long a service gives way to a key's waiters, in seconds (see :meth:`Waiter.give_way`).
GIVE_WAY = 1.5 * POLL_MAX
#: Seconds a service that gave way waits after the release that woke it before it tries: the
#: waiters woken by the same release try first (see :meth:`Waiter.give_way`).
GIVE_WAY_DEFER = 0.002
#: How soon after a service released a key its next wait on it gives way, in seconds.
YIELD_WINDOW = 0.5
#: Most keys one service remembers to give way on.
YIELD_KEYS = 1024
#: Longest ``wait`` accepted, in seconds (the hard cap on a lease's lifetime: 24 h).
MAX_WAIT = 24 * 60 * 60.0


def check_wait(wait: object) -> float:
    """``wait`` (seconds, or a timedelta, as every other duration) as finite seconds
    ``0 <= wait <= MAX_WAIT``; InvalidArgumentError otherwise.

    Infinity is refused: a wait must end, so a caller stuck behind a leaked lock learns it.
    """
    value = as_seconds("wait", wait)
    if not math.isfinite(value) or value < 0 or value > MAX_WAIT:
        raise InvalidArgumentError(
            f"wait must be finite seconds between 0 and {MAX_WAIT:g}, got {shown(wait)}"
        )
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
        # (not isinstance(): a runtime Protocol check costs ~15 µs, here on every wait)
        self._marks = cast("MarksWaiters", provider) if hasattr(provider, "mark_waiting") else None
        self._marked: contextlib.ExitStack | None = None

    def remaining(self) -> float:
        return self.deadline - self._clock()

    def watch(self, store_key: str, more: Sequence[str] = ()) -> None:
        """Listen for releases of ``store_key`` and of the keys ``more`` (a semaphore's other
        slots, where the store offers ``subscribe_any``; else their releases are polled for),
        dropping any other key listened to."""
        if self._marks is not None and self._watching != (store_key, *more):
            self.close()
            self._marked = contextlib.ExitStack()
            for key in (store_key, *more):
                self._marked.enter_context(self._marks.mark_waiting(key))
            self._watching = (store_key, *more)
            return
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
        if self._sleep(pause):
            self.step = POLL_MIN  # the key changed hands: watch closely again
        return True

    def give_way(self) -> None:
        """Pause :data:`GIVE_WAY` seconds (less if the time is up; until a release is
        signalled, where the store signals): every polling waiter, pausing at most
        :data:`POLL_MAX`, looks at least once meanwhile. Then poll at :data:`POLL_MAX`.

        Woken by a release, it pauses :data:`GIVE_WAY_DEFER` seconds more, so that the
        waiters woken by the same release, which waited longer, try first: a store may tell
        its newest listener first (Redis 7.0 sends a message to a channel's subscribers
        newest first, and this service subscribed after its own release), and then this
        service and the one it gave way to took every other turn between them."""
        if self._sleep(min(GIVE_WAY, max(0.0, self.remaining()))):
            time.sleep(max(0.0, min(GIVE_WAY_DEFER, self.remaining())))
        self.step = POLL_MAX

    def _sleep(self, pause: float) -> bool:
        """Sleep ``pause`` seconds or until a release is signalled (then True)."""
        if self._subscription is not None:
            try:
                return self._subscription.wait(pause)
            except Exception as exc:
                logger.debug("release signal failed (%s); polling", type(exc).__name__)
                self._unsubscribe()
        time.sleep(max(0.0, min(pause, self.remaining())))
        return False

    def close(self) -> None:
        if self._marked is not None:
            marked, self._marked, self._watching = self._marked, None, None
            marked.close()
        self._unsubscribe()

    def _unsubscribe(self) -> None:
        if self._subscription is not None:
            subscription, self._subscription, self._watching = self._subscription, None, None
            try:
                subscription.close()
            except Exception as exc:
                logger.debug("closing a release subscription failed (%s)", type(exc).__name__)


class Turns:
    """One service's memory of the keys it should give way on (fairness, see the module
    docstring), keyed by the unprefixed key: after each release the store is asked
    whether someone waited (:class:`~celery_exclusive.providers.base.KnowsWaiters`); if so
    the service's next wait on that key within :data:`YIELD_WINDOW` gives way. At most
    :data:`YIELD_KEYS` keys are remembered. Not locked: a race between threads of one
    service only changes who gives way once."""

    __slots__ = ("_clock", "_knows", "_released", "had_waiters", "told")

    def __init__(self, provider: object, clock: Callable[[], float] = time.monotonic) -> None:
        self._knows = provider if isinstance(provider, KnowsWaiters) else None
        #: Whether the store tells about waiters at all (else :meth:`released` is never needed).
        self.told = self._knows is not None
        #: The store's ``had_waiters`` (a bound method, None if it tells nothing): what
        #: :meth:`released` asks, for a caller that asks it without :meth:`released`'s frame.
        self.had_waiters: Callable[[str], bool] | None = (
            None if self._knows is None else self._knows.had_waiters
        )
        self._clock = clock
        self._released: dict[str, float] = {}  # key -> when released with waiters

    def released(self, key: str, store_key: str) -> None:
        """A lease on ``key`` (``store_key`` in the store) was released."""
        if self._knows is not None and self._knows.had_waiters(store_key):
            self.note(key)

    def note(self, key: str) -> None:
        """A release of ``key`` freed it while waiters waited (the store's ``had_waiters``
        said so): the next wait on ``key`` gives way to them. The release path asks the
        store itself (:attr:`had_waiters`) and calls this only when it did."""
        self._released.pop(key, None)  # re-inserted last: the newest
        self._released[key] = self._clock()
        if len(self._released) > YIELD_KEYS:
            del self._released[next(iter(self._released))]

    def gives_way(self, key: str) -> bool:
        """Whether a wait on ``key`` starting now should let the waiters go first (once)."""
        if not self._released:
            return False
        when = self._released.pop(key, None)
        return when is not None and self._clock() - when < YIELD_WINDOW


def take_waiting(
    attempt: Callable[[bool], T | Held],
    provider: object,
    store_key: str,
    wait: float,
    *,
    more: Sequence[str] = (),
    turns: Turns | None = None,
    key: str = "",
    probe: Callable[[], bool] | None = None,
) -> T | Held:
    """Call ``attempt(final)`` until it returns something other than :class:`Held` or ``wait``
    seconds pass; ``final`` is True for the last attempt (made at the deadline), whose answer
    is returned whatever it is. Woken by releases of ``store_key`` and ``more`` (see
    :meth:`Waiter.watch`). With ``turns``, gives way on ``key`` when :class:`Turns` says so
    (:meth:`Waiter.give_way` before the first attempt). It listens for releases from the
    first refusal on (at once when giving way), and tries again right after subscribing.
    With ``probe`` (a read: may an attempt win now?), a retry is made only once it says yes,
    or at the deadline.
    Exceptions (an outage, AlreadyDone) propagate at once."""
    waiter = Waiter(provider, wait)
    watching = turns is not None and turns.gives_way(key)
    try:
        if watching:
            waiter.watch(store_key, more)
            waiter.give_way()
        while True:
            if waiter.remaining() <= 0:
                return attempt(True)
            answer = attempt(False)
            if not isinstance(answer, Held):
                return answer
            if not watching:
                # Listen only once refused (a free key costs no subscription), then look
                # again at once: a release between the refusal and the listen is not missed.
                waiter.watch(store_key, more)
                watching = True
                continue
            if not waiter.pause():
                return attempt(True)
            # (no probe once the time is up: the attempt at the deadline is the one round trip)
            while probe is not None and waiter.remaining() > 0 and not probe():
                if not waiter.pause():
                    return attempt(True)
    finally:
        waiter.close()
