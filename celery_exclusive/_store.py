"""The lock service's calls to its provider: each with a deadline, store failures as BackendError.

Part of the lock core (it serves :mod:`celery_exclusive.service`). A provider method that
takes the ``timeout`` keyword (see :func:`~celery_exclusive.providers.base.accepts_timeout`)
enforces the deadline itself (every method of the built-in stores does, see the provider
contract's "Deadlines"). One that does not (any method of a provider written before the
keyword existed) runs in a worker thread that the caller stops waiting for at the deadline:
the caller gets BackendError in time, and the stuck call ends when the driver gives up (its
connection is the driver's to discard). Worker threads are reused (handing a call to an
idle one costs a fraction of starting a thread) and exit after :data:`IDLE_EXIT` seconds
without work. At most :data:`MAX_STUCK` calls may be left running past their deadlines at
once; past that, calls without a timeout fail at once instead of piling up threads on a
store that stopped answering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import accepts_timeout

T = TypeVar("T")

#: Top-level packages whose exceptions are the store's failures (driver, network, pool):
#: only these, and OSError, become BackendError. Anything else, above all an exception a
#: signal handler raised into the calling thread (KeyboardInterrupt, Celery's
#: SoftTimeLimitExceeded), propagates unchanged.
_DRIVER_PACKAGES = frozenset(
    {"redis", "hiredis", "psycopg", "psycopg2", "sqlalchemy", "pymysql", "MySQLdb", "sqlite3", "_sqlite3"}
)
#: Calls past their deadline whose threads may still be running, at most.
MAX_STUCK = 16
#: Seconds an idle worker thread waits for another call before it exits.
IDLE_EXIT = 10.0


def is_store_error(exc: BaseException) -> bool:
    """True if ``exc`` came from the lock store's driver or the network (an outage)."""
    if isinstance(exc, (BackendError, OSError)):
        return True
    if not isinstance(exc, Exception):
        return False
    return any(cls.__module__.partition(".")[0] in _DRIVER_PACKAGES for cls in type(exc).__mro__)


def as_store_error(what: str, exc: BaseException) -> BaseException:
    """What :meth:`StoreCalls.call` raises for ``exc`` raised by a provider during ``what``:
    a BackendError chained from it for a driver's or the network's failure, else ``exc``
    (also for hot paths that call a provider taking ``timeout=`` themselves)."""
    if isinstance(exc, BackendError) or not is_store_error(exc):
        return exc
    error = BackendError(f"lock store failed during {what}: {type(exc).__name__}")
    error.__cause__ = exc  # as ``raise error from exc``
    error.__suppress_context__ = True
    return error


class _Outcome:
    """What a call run in a thread of its own returned or raised, once it has."""

    __slots__ = ("abandoned", "done", "error", "finished", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.finished = False  # set under StoreCalls._lock
        self.abandoned = False  # set under StoreCalls._lock: the caller stopped waiting
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Worker:
    """A thread that runs the calls it is given, one at a time, until idle for IDLE_EXIT."""

    __slots__ = ("_calls", "_job", "_ready")

    def __init__(self, calls: StoreCalls) -> None:
        self._calls = calls
        self._job: tuple[_Outcome, Callable[..., object], Any, Any] | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._loop, name="celery-exclusive-call", daemon=True).start()

    def give(self, outcome: _Outcome, method: Callable[..., object], args: Any, kwargs: Any) -> None:
        self._job = (outcome, method, args, kwargs)
        self._ready.set()

    def _loop(self) -> None:
        calls = self._calls
        while True:
            if not self._ready.wait(IDLE_EXIT):
                with calls._lock:
                    if self in calls._idle:  # not claimed meanwhile: nobody will give it a call
                        calls._idle.remove(self)
                        return
                continue  # claimed just now: its call is on the way
            self._ready.clear()
            job, self._job = self._job, None  # nothing of an old call kept alive while idle
            assert job is not None
            calls._run(self, *job)


class StoreCalls:
    """Calls one provider's methods within deadlines (thread-safe)."""

    def __init__(self) -> None:
        self._takes_timeout: dict[str, bool] = {}  # method name -> accepts_timeout(method)
        self._lock = threading.Lock()
        self._stuck = 0  # calls given up whose threads have not ended yet
        self._idle: list[_Worker] = []  # workers waiting for a call (the last one is reused first)

    @property
    def stuck(self) -> int:
        """Calls given up at their deadline whose threads are still running."""
        return self._stuck

    def call(
        self, what: str, method: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """``method(*args, **kwargs)`` within ``timeout`` seconds (None: the driver's own
        timeouts); the driver's and the network's exceptions become BackendError, any other
        exception propagates unchanged."""
        try:
            if timeout is None:
                return method(*args, **kwargs)
            if timeout < 0.001:  # noqa: PLR1730 - max(timeout, 0.001), without its call
                timeout = 0.001
            takes = self._takes_timeout.get(getattr(method, "__name__", ""))  # _accepts_timeout's cache
            if takes or (takes is None and self._accepts_timeout(method)):
                return method(*args, timeout=timeout, **kwargs)
            return self._in_thread(what, timeout, method, *args, **kwargs)
        except Exception as exc:
            error = as_store_error(what, exc)
            if error is exc:
                raise
            raise error from exc

    def _accepts_timeout(self, method: Callable[..., object]) -> bool:
        name = getattr(method, "__name__", "")
        takes = self._takes_timeout.get(name)
        if takes is None:
            takes = self._takes_timeout[name] = accepts_timeout(method)
        return takes

    def _in_thread(self, what: str, timeout: float, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run the call in a worker thread and wait for it at most ``timeout`` seconds."""
        with self._lock:
            if self._stuck >= MAX_STUCK:
                raise BackendError(
                    f"lock store failed during {what}: {self._stuck} earlier calls are still "
                    "waiting for it past their deadlines"
                )
            worker = self._idle.pop() if self._idle else None
        outcome = _Outcome()
        (worker or _Worker(self)).give(outcome, method, args, kwargs)
        if not outcome.done.wait(timeout):
            with self._lock:
                if not outcome.finished:
                    outcome.abandoned = True
                    self._stuck += 1
            if outcome.abandoned:
                raise BackendError(f"lock store gave no answer during {what} within {timeout:.3g} s")
        return outcome.result()  # type: ignore[no-any-return]

    def _run(
        self, worker: _Worker, outcome: _Outcome, method: Callable[..., object], args: Any, kwargs: Any
    ) -> None:
        try:
            outcome.value = method(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, which re-raises it
            outcome.error = exc
        finally:
            with self._lock:
                outcome.finished = True
                if outcome.abandoned:
                    self._stuck -= 1
                self._idle.append(worker)  # before the caller wakes, so its next call reuses it
            outcome.done.set()
