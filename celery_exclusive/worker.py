"""Worker hooks and the per-process lock service of the Celery integration.

:func:`get_lock_service` gives each process one :class:`LockService` per app, created on
first use and never shared across ``fork``. The signal receivers below are connected when
this module is imported (``celery_exclusive.task`` imports it):

* ``celeryd_after_setup`` (worker start, before the pool starts): if any registered task is
  exclusive and the lock store is not configured (or its settings are invalid, or no store
  can be built from its URL: the store is built, connecting nothing), an ERROR line names
  the setting; ``exclusive_startup_check = "fatal"`` (or
  ``CELERY_EXCLUSIVE_STARTUP_CHECK=fatal``) stops the worker instead, ``"off"`` says
  nothing (another value: an ERROR line naming it, then the ``"log"`` check). Also notes
  whether the worker sends task events (``-E``), for :mod:`celery_exclusive.observe`.
* ``worker_process_init`` (each prefork child; the main process for other pools, at start):
  the lock store's connection is opened, so the first task does not pay for importing
  its driver and connecting (a prefork worker imports the driver once, in the main
  process before it forks). A failure there is a WARNING; the first task retries it. It
  waits at most ``WARM_UP_TIMEOUT`` (5 s; a prefork child half its
  ``worker_proc_alive_timeout``, 2 s by default, or the pool kills it before it is up): a
  silent store does not hold the start longer.
* ``worker_process_shutdown`` / ``worker_shutdown``: leases still held are released.
* ``task_revoked`` (``terminated=True``) and ``task_failure`` with ``TimeLimitExceeded``:
  both fire in the worker's *main* process, the first right after the pool child was sent
  its signal, the second just *before* billiard kills the child for its hard time limit.
  The hook recomputes the task's key from the request, peeks it (a semaphore's every slot,
  and its run's task-id lease), and once the process named in the holder metadata is gone
  it force-releases exactly that lease (same task id, same
  host, token-bound); a store that fails meanwhile is asked again until it answers or the
  lease's ttl has passed (see :func:`release_killed`). Celery reports a hard time limit
  twice (``Request.on_failure``, then ``on_timeout``): the second report of one run is
  ignored. A child SIGKILLed from outside (``WorkerLostError``) is left to the ttl: its lock
  is taken by the next task only after the lease expires.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from celery import signals as celery_signals
from celery.app import app_or_default
from celery.exceptions import TimeLimitExceeded, WorkerShutdown

from celery_exclusive import observe, redelivery
from celery_exclusive._releasing import release_later
from celery_exclusive._store import StoreCalls
from celery_exclusive.errors import BackendError, ConfigurationError, ExclusiveError
from celery_exclusive.providers.base import Completion, LockInfo
from celery_exclusive.semaphore import slot_keys
from celery_exclusive.service import LockService
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.urls import ENV_VAR, SETTING, resolve_url
from celery_exclusive.validation import GUARD_INFIX

logger = logging.getLogger("celery_exclusive")

#: Host name as lease holder metadata records it (the same truncation as the service's).
HOST = socket.gethostname()[:64]
#: Longest a kill hook waits for the killed process to disappear, in seconds.
KILL_RELEASE_WAIT = 30.0
#: How long a kill hook looks for the killed run's lease, which it may be acquiring just now.
KILL_LOOKUP_WINDOW = 1.0
_POLL = 0.05
#: Pause between a kill hook's lookups of the killed run's lease while the store fails, in seconds.
LOOKUP_RETRY = 1.0
#: The token of a release that only writes a completion record: no lease ever has it (a
#: lease's token is random hex), so the release deletes nothing.
RECORD_ONLY_TOKEN = "celery-exclusive:record-only"  # noqa: S105 - a marker, no secret
#: Longest the main process waits for the record of a run killed at its hard time limit
#: (it blocks the worker's loop meanwhile; the release thread writes the record again).
RECORD_TIMEOUT = 2.0
#: ``app.conf`` setting / environment variable: what a worker does at start when exclusive
#: tasks cannot get a lock store: ``"log"`` (an ERROR line, the default), ``"fatal"``, ``"off"``.
STARTUP_CHECK_SETTING = "exclusive_startup_check"
STARTUP_CHECK_ENV = "CELERY_EXCLUSIVE_STARTUP_CHECK"
STARTUP_CHECKS = ("log", "fatal", "off")
#: The worker's exit status when the fatal start-up check fails (sysexits' EX_CONFIG).
EX_CONFIG = 78
#: Key peeked to open the store's connection in a new pool process.
WARM_UP_KEY = "celery-exclusive-warm-up"
#: Longest the warm-up at process start waits for the store, in seconds (a silent store
#: would otherwise hold the process start for the driver's own timeouts, 10-40 s).
WARM_UP_TIMEOUT = 5.0
#: Share of ``worker_proc_alive_timeout`` a prefork child's warm-up may use: the pool kills
#: a child that has not reported UP by then, and the warm-up comes before that report.
UP_SHARE = 0.5
#: Celery's default ``worker_proc_alive_timeout``, in seconds.
PROC_ALIVE_TIMEOUT = 4.0
#: The warm-up bound of this process's pool children (set at worker start for prefork).
_child_warm_up = [WARM_UP_TIMEOUT]


class _ProcessState:
    """This process's services and settings, per app; replaced wholesale after ``fork``."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.mutex = threading.Lock()
        self.services: weakref.WeakKeyDictionary[Any, LockService] = weakref.WeakKeyDictionary()
        self.settings: weakref.WeakKeyDictionary[Any, ExclusiveSettings] = weakref.WeakKeyDictionary()
        #: Apps whose store this process has warmed up (or tried to): once is enough.
        self.warmed: weakref.WeakSet[Any] = weakref.WeakSet()


_state = _ProcessState()


def _current() -> _ProcessState:
    global _state  # noqa: PLW0603 - one state object per process, swapped after fork
    if _state.pid != os.getpid():
        # Inherited services keep the parent's connections: drop them unclosed (closing could
        # disturb the parent's sockets); the core already stopped their leases in this child.
        _state = _ProcessState()
    return _state


os.register_at_fork(after_in_child=_current)


def _resolve_app(app: Any) -> Any:
    app = app_or_default(app)
    # ``celery.current_app`` is a proxy: key caches by the app object itself.
    resolve = getattr(app, "_get_current_object", None)
    return resolve() if resolve is not None else app


def app_settings(app: Any = None) -> ExclusiveSettings:
    """The app's settings (``app.conf`` > environment > defaults), read once per process."""
    app = _resolve_app(app)
    state = _current()
    with state.mutex:
        settings = state.settings.get(app)
        if settings is None:
            settings = ExclusiveSettings.from_conf(app.conf)
            state.settings[app] = settings
        return settings


def get_lock_service(app: Any = None) -> LockService:
    """This process's LockService for ``app`` (default: the current app), created on first use.

    Configured from the app's settings (URL, prefix, default ttl, max lifetime, sweep
    interval); usable
    from your own signal handlers, e.g. a once-per-cluster job on ``worker_ready`` with
    ``get_lock_service(app).run_exclusive("startup", job)``. Never shared across fork.
    """
    app = _resolve_app(app)
    settings = app_settings(app)
    state = _current()
    with state.mutex:
        service = state.services.get(app)
        if service is None:
            service = LockService(
                resolve_url(settings.url, app.conf),
                prefix=settings.prefix,
                ttl=settings.lease_ttl,
                max_lifetime=settings.max_lifetime,
                refresh_interval=settings.refresh_interval,
                sweep_interval=settings.sweep_interval,
            )
            state.services[app] = service
        return service


def lock_service_of(task: Any) -> LockService:
    """``get_lock_service(task.app)``, remembered on ``task`` until that service is closed,
    the task's app changes or the process forks (an exclusive run's lookup: one dict read)."""
    app = task.app
    cached = task.__dict__.get("_lock_service_cache")
    if cached is not None and cached[0] is _state and cached[1] is app and not cached[2]._closed:
        return cached[2]  # type: ignore[no-any-return]
    service = get_lock_service(app)
    task.__dict__["_lock_service_cache"] = (_current(), app, service)
    return service


def _forget_cached_services(app: Any) -> None:
    """Make every task of ``app`` look its service up again at its next run: the service
    :func:`get_lock_service` gives for ``app`` was replaced (``celery_exclusive.testing``'s
    ``install`` and ``close``). A task keeps the service it looked up (see
    :func:`lock_service_of`) while that one is open, so without this a task that ran before
    the replacement would go on using the old service."""
    for task in list(app.tasks.values()):
        own = getattr(task, "__dict__", {})
        own.pop("_lock_service_cache", None)
        own.pop("_lock_plan_cache", None)


def close_lock_services(*, release: bool = True) -> None:
    """Close this process's services (releasing held leases unless ``release=False``)."""
    state = _current()
    with state.mutex:
        services = list(state.services.values())
        state.services.clear()
        state.settings.clear()
        state.warmed.clear()
    for service in services:
        try:
            service.close(release=release)
        except Exception:
            logger.exception("closing %r failed", service)


def exclusive_task_names(app: Any) -> list[str]:
    """Names of the exclusive tasks registered on ``app`` (finalizing it), sorted.

    A task is exclusive when it has ``lock_key_for`` (:func:`release_killed` uses its
    sibling ``lock_keys_for``): this module is imported by ``celery_exclusive.task`` and does not import it.
    """
    return sorted(name for name, task in app.tasks.items() if callable(getattr(task, "lock_key_for", None)))


def startup_check_mode(conf: Mapping[str, Any]) -> str:
    """The start-up check mode from ``app.conf`` or the environment; ConfigurationError if unknown."""
    value = conf.get(STARTUP_CHECK_SETTING) or os.environ.get(STARTUP_CHECK_ENV) or "log"
    if value not in STARTUP_CHECKS:
        raise ConfigurationError(
            f"{STARTUP_CHECK_SETTING} must be one of {', '.join(map(repr, STARTUP_CHECKS))}, got {value!r}"
        )
    return str(value)


def check_at_worker_start(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """At worker start: say so loudly if exclusive tasks have no usable lock store."""
    if instance is None:
        return
    app = _resolve_app(instance.app)
    observe.events.enabled = bool(getattr(instance, "task_events", False))
    redelivery.hold_back_started(app)  # a copy of a finished run must not store STARTED
    if _pool_forks(instance):  # inherited by the pool's children, read by warm_up_process
        alive = app.conf.get("worker_proc_alive_timeout") or PROC_ALIVE_TIMEOUT
        _child_warm_up[0] = min(WARM_UP_TIMEOUT, UP_SHARE * float(alive))
    try:
        mode = startup_check_mode(app.conf)
    except ConfigurationError as exc:
        logger.error("celery-exclusive: %s; checking as with 'log'.", exc)
        mode = "log"
    if mode == "off":
        return
    names = exclusive_task_names(app)
    if not names:
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    failing = f"celery-exclusive: this worker has {len(names)} exclusive task(s) ({shown}) that will all fail"
    try:
        settings = app_settings(app)
    except ConfigurationError as exc:  # the error names the setting (app.conf.* or CELERY_*)
        _startup_failure(mode, f"{failing} until this setting is right: {exc}")
        return
    try:
        url = resolve_url(settings.url, app.conf)
        preload_driver(url)  # a URL no store can be built from is as unusable as none
    except ConfigurationError as exc:
        _startup_failure(mode, f"{failing} until app.conf.{SETTING} (or {ENV_VAR}) is right: {exc}")
        return
    conflicts = task_setting_errors(app, names)
    if conflicts:
        _startup_failure(
            mode,
            f"celery-exclusive: {len(conflicts)} exclusive task(s) will fail at every run until "
            f"their lock options agree with the app's settings: {'; '.join(conflicts)}",
        )
    if not _pool_forks(instance):
        warm_up(app)


def _startup_failure(mode: str, message: str) -> None:
    """Log the start-up check's finding: ERROR, or CRITICAL and stop the worker (exit 78)
    when ``mode`` is ``"fatal"``."""
    if mode == "fatal":
        logger.critical("%s Stopping: %s='fatal'.", message, STARTUP_CHECK_SETTING)
        raise WorkerShutdown(EX_CONFIG) from None
    logger.error("%s (%s='fatal' stops the worker here.)", message, STARTUP_CHECK_SETTING)


def task_setting_errors(app: Any, names: Sequence[str]) -> list[str]:
    """``"<task>: <error>"`` for each task of ``names`` whose own lock options are invalid
    with the app's settings (``ttl`` above the app's ``max_lifetime``, an app-wide policy a
    task of several keys cannot have...): each is checked when its class is made, but the
    combination only when its settings are first read (``ExclusiveTask.check_lock_settings``)."""
    errors = []
    for name in names:
        check = getattr(app.tasks[name], "check_lock_settings", None)
        try:
            if check is not None:
                check()
        except ExclusiveError as exc:
            errors.append(f"{name}: {exc}")
    return errors


def preload_driver(url: str) -> None:
    """Import the store's driver in the main process before the pool forks, connecting nothing.

    Every pool process inherits the imported modules (SQLAlchemy and psycopg cost most of a
    cold first task), so what is left for it at ``worker_process_init`` is the connection.
    The store is built to do so: a URL it refuses (unknown scheme, malformed, a driver
    parameter the driver refuses, a driver not installed) raises its ConfigurationError.
    """
    from celery_exclusive.urls import provider_from_url

    try:
        provider_from_url(url).close()
    except ConfigurationError:
        raise
    except Exception as exc:
        logger.warning("celery-exclusive could not load the lock store's driver at worker start: %s", exc)


def _pool_forks(instance: Any) -> bool:
    """Whether the worker's pool runs tasks in child processes (prefork)."""
    pool = getattr(instance, "pool_cls", None)
    module = getattr(pool, "__module__", "") or str(pool or "")
    return "prefork" in module


def warm_up(app: Any = None, within: float = WARM_UP_TIMEOUT) -> None:
    """Open ``app``'s lock store connection now (driver import, connect, schema check).

    Once per app and process, waiting at most ``within`` seconds (:data:`WARM_UP_TIMEOUT`;
    less if the service's ``call_timeout`` is shorter): a store that does not answer by then
    is a WARNING and the process goes on starting (the connect attempt ends in the
    background). Errors are logged as a WARNING and otherwise ignored: the first task
    retries and reports them itself.
    """
    try:
        app = _resolve_app(app)
        if not exclusive_task_names(app):
            return
        state = _current()
        with state.mutex:
            if app in state.warmed:  # solo/threads pools: at worker start and at worker_process_init
                return
            state.warmed.add(app)
        service = get_lock_service(app)
        # service.peek takes no timeout: StoreCalls runs it in a thread it stops waiting for,
        # so a connect still under way at the deadline ends in the background.
        StoreCalls().call("warm-up", service.peek, WARM_UP_KEY, timeout=min(service.call_timeout, within))
    except ConfigurationError as exc:
        logger.debug("celery-exclusive: no lock store to open at process start: %s", exc)
    except Exception as exc:
        logger.warning("celery-exclusive could not open the lock store at process start: %s", exc)


def warm_up_process(**_: Any) -> None:
    """``worker_process_init``: open the current app's lock store in this new pool process.

    A prefork child runs this before it reports UP to the pool, which SIGKILLs a child not
    up within ``worker_proc_alive_timeout`` (4 s by default): there the warm-up waits at
    most half of that (:data:`UP_SHARE`), so a silent store cannot get every child killed.
    Other pools run it in the worker's main process, with the full :data:`WARM_UP_TIMEOUT`.
    """
    warm_up(within=_child_warm_up[0])


def release_on_process_shutdown(**_: Any) -> None:
    """Release the leases a pool process still holds when it exits."""
    close_lock_services()


def release_on_worker_shutdown(**_: Any) -> None:
    """Release the leases the worker's main process (solo, threads pools) still holds at shutdown."""
    close_lock_services()


def release_on_terminate(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    """Release the lock of a task killed by ``revoke(terminate=True)`` once its process is gone."""
    if terminated and request is not None:
        release_killed(sender, request.id, request.args, request.kwargs, "terminated (revoked)")


def release_on_hard_time_limit(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    traceback: Any = None,
    **_: Any,
) -> threading.Thread | None:
    """Release the lock of a task killed for its hard time limit once its process is gone
    (the thread doing it, or None). Celery reports each hard time limit twice (billiard
    ends the job through ``Request.on_failure``, then calls ``Request.on_timeout``): the
    second report of one run is a no-op (see :func:`_first_report`)."""
    if not isinstance(exception, TimeLimitExceeded) or not _first_report(sender, task_id, traceback):
        return None
    attempt = _timed_out_attempt(traceback)
    if attempt is None:
        attempt = _failing_attempt(sender, task_id)
    return release_killed(
        sender, task_id, args, kwargs, "killed at its hard time limit", record=True, attempt=attempt
    )


#: The runs (their request's Celery ``Context``, one object per run) whose hard time limit
#: was handled already; weak: a run's context goes with its request.
_reported: weakref.WeakSet[Any] = weakref.WeakSet()


def _first_report(task: Any, task_id: str | None, traceback: Any) -> bool:
    """False if the run a ``task_failure(TimeLimitExceeded)`` reports was reported already.

    Both reports of one run carry its request's context: ``on_timeout``'s traceback is of
    a frame whose ``self`` is the request (see :func:`_timed_out_attempt`), ``on_failure``
    pushes its ``_context`` on the task's request stack (see :func:`_failing_attempt`).
    The second would only repeat the first: the same record (a write the store leaves as
    it is), and a release thread that finds the lease taken care of (or gone) and ends
    after a second of lookups. A report naming no known run is always handled."""
    from celery.worker.request import Request  # the worker's main process has it imported

    frame = getattr(traceback, "tb_frame", None)
    request = None if frame is None else frame.f_locals.get("self")
    if isinstance(request, Request) and request.id == task_id:
        context = getattr(request, "_context", None)  # a cached property: the same object each time
    else:
        context = getattr(task, "request", None)
        if task_id is None or getattr(context, "id", None) != task_id:
            return True
    try:
        if context in _reported:
            return False
        _reported.add(context)
    except TypeError:  # not weakly referenceable: not Celery's Context
        return True
    return True


def _timed_out_attempt(traceback: Any) -> int | None:
    """The attempt (:func:`redelivery.attempt`) of the run whose hard time limit Celery's
    ``Request.on_timeout`` reports, or None. Its ``task_failure`` carries no request, but
    its traceback is of the ``TimeLimitExceeded`` that method raises and catches itself:
    the frame's ``self`` is that request (the same task id's retry may be queued here
    already, so the request by id could be the wrong attempt)."""
    from celery.worker.request import Request  # the worker's main process has it imported

    frame = getattr(traceback, "tb_frame", None)
    request = None if frame is None else frame.f_locals.get("self")
    if not isinstance(request, Request) or request.id is None:
        return None
    return redelivery.attempt(request.request_dict.get("retries"), request.request_dict)


def _failing_attempt(task: Any, task_id: str | None) -> int | None:
    """The attempt (:func:`redelivery.attempt`) of the run ``task_id`` whose failure
    Celery's ``Request.on_failure`` reports, or None. billiard's hard time limit first ends
    the job with the exception (``on_failure``: a traceback as text) and only then calls
    ``on_timeout``: the first ``task_failure`` must name the attempt too, since a record
    never goes back to an earlier attempt (a first one naming the highest would refuse the
    retry the run sent). ``on_failure`` pushes the failing request's context on the task's
    request stack for the signal's receivers."""
    context = getattr(task, "request", None)
    if task_id is None or getattr(context, "id", None) != task_id:
        return None
    return redelivery.attempt(getattr(context, "retries", None), getattr(context, "headers", None))


for _signal, _receiver in (
    (celery_signals.celeryd_after_setup, check_at_worker_start),
    (celery_signals.worker_process_init, warm_up_process),
    (celery_signals.worker_process_shutdown, release_on_process_shutdown),
    (celery_signals.worker_shutdown, release_on_worker_shutdown),
    (celery_signals.task_revoked, release_on_terminate),
    (celery_signals.task_failure, release_on_hard_time_limit),
):
    _signal.connect(_receiver, weak=False, dispatch_uid=f"celery_exclusive.{_receiver.__name__}")


def release_killed(
    task: Any,
    task_id: str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    why: str,
    *,
    record: bool = False,
    attempt: int | None = None,
) -> threading.Thread | None:
    """Release, in the background, the lease the killed run ``task_id`` of ``task`` held.

    Returns the thread doing it (None when ``task`` is not exclusive). Only a lease whose
    holder metadata names ``task_id``, this host and a process other than this one is
    released, and only after that process has exited; anything else is left alone.
    ``record``: the run ended for good (a hard time limit: its message is acknowledged), so
    its completion record (:func:`redelivery.killed`) is written at once, before this returns
    and billiard kills the process (which may release its lease on its way out, without a
    record), within :data:`RECORD_TIMEOUT`; the release writes it again. A copy of the
    message then ends as ``already_done`` instead of running the body again (a retry the
    run sent still runs: ``attempt`` is the run's (:func:`redelivery.attempt`), None when
    not known).

    A store that does not answer does not end this: the lease is looked for again until it
    answers, and a release (or record) that fails is handed to the service's heartbeat,
    which retries it each second (:func:`.release_later`); each gives up once the lease's
    ttl has passed, by when the store has expired it. Such a give-up, a configuration
    error or a key the run's arguments cannot make is one log line, without a traceback.
    """
    keys_for = getattr(task, "lock_keys_for", None)
    if keys_for is None or not task_id:
        return None
    try:
        keys = keys_for(tuple(args or ()), dict(kwargs or {}))
        service = get_lock_service(task.app)
        done = redelivery.killed(task, keys, task_id, attempt) if record else None
        held = _held_by(task, service, keys, task_id)
    except ExclusiveError as exc:  # the store's configuration, the key's arguments: said already
        logger.error(
            "celery-exclusive cannot release the lock of %s[%s] (%s): %s",
            getattr(task, "name", task),
            task_id,
            why,
            exc,
        )
        return None
    except Exception:
        logger.exception("cannot release the lock of %s[%s] (%s)", getattr(task, "name", task), task_id, why)
        return None
    ttl = task.lock_settings.lease_ttl
    if done is not None:
        _record_now(service, *done, f"{task.name}[{task_id}] {why}", ttl)
    thread = threading.Thread(
        target=_release_all_when_gone,
        args=(service, held, task_id, f"{task.name}[{task_id}] {why}", done),
        kwargs={"ttl": ttl},
        name="celery-exclusive-kill-release",
        daemon=True,
    )
    thread.start()
    return thread


def _held_by(task: Any, service: LockService, keys: list[str], task_id: str) -> list[list[str]]:
    """The keys a run of ``task_id`` with ``keys`` may hold, in groups of which it holds one
    lease at most: each of its keys; for a semaphore, any one of its slots (slot 1 is the
    key itself, see :mod:`celery_exclusive.semaphore`), then the lease on its own task id
    (:func:`redelivery.guard_of`)."""
    limit = task.lock_settings.limit
    if limit == 1 or len(keys) != 1:  # several keys never make a semaphore
        return [[key] for key in keys]
    guard = redelivery.guard_of(task, keys[0], task_id)
    slots = slot_keys(keys[0], limit, prefix=service.prefix, max_length=service.provider.max_key_length)
    return [slots, *([[guard]] if guard is not None else [])]


def _release_all_when_gone(
    service: LockService,
    held: list[list[str]],
    task_id: str,
    what: str,
    done: tuple[str, Completion] | None,
    *,
    ttl: float,
) -> None:
    carrier, record = done if done is not None else (None, None)
    if carrier is not None and not any(carrier in group for group in held):
        held = [*held, [carrier]]
    # The run's leases (several for a multi-key task or a semaphore), the carrier last, once
    # its process is gone.
    for group in sorted(held, key=lambda each: carrier in each):
        _release_when_gone(
            service, group, task_id, what, ttl=ttl, record=record if carrier in group else None
        )


def _release_when_gone(
    service: LockService,
    keys: list[str],
    task_id: str,
    what: str,
    *,
    ttl: float,
    record: Completion | None = None,
) -> None:
    """Release the lease run ``task_id`` holds on one of ``keys`` (writing ``record`` with it)
    once its process is gone; a lease with a cooldown is kept to the cooldown's end. A store
    that does not answer is asked again (the lookup here, the release by the heartbeat)
    until it does or ``ttl`` (the lease's) has passed."""
    key = keys[0]
    try:
        found = _lease_of(service, keys, task_id, what, ttl)
        if found is None:
            return
        key, info = found
        with _handling_mutex:  # Celery may report one hard time limit twice (task_failure)
            if (key, info.token) in _handling:
                return
            _handling.add((key, info.token))
        try:
            _release_lease_when_gone(service, key, info, what, ttl=ttl, record=record)
        finally:
            with _handling_mutex:
                _handling.discard((key, info.token))
    except ExclusiveError as exc:  # the store down past the lease's ttl: expected, said in a line
        logger.warning("%s: could not release its lock %r: %s; it expires with its ttl", what, key, exc)
    except Exception:
        logger.exception("%s: could not release its lock %r; it expires with its ttl", what, key)


#: (key, token) of the leases a kill-release thread of this process is ending.
_handling: set[tuple[str, str]] = set()
_handling_mutex = threading.Lock()


def _release_lease_when_gone(
    service: LockService, key: str, info: LockInfo, what: str, *, ttl: float, record: Completion | None
) -> None:
    pid = info.holder.get("pid")
    if info.holder.get("host") != HOST or not isinstance(pid, int) or pid == os.getpid():
        return
    if not _wait_gone(pid):
        logger.warning(
            "%s, but its process %d is still alive after %g s; lock %r is left to expire",
            what,
            pid,
            KILL_RELEASE_WAIT,
            key,
        )
        return
    cooldown = info.holder.get("cooldown")
    guard = key.endswith(f"{GUARD_INFIX}{info.holder.get('task_id')}")
    if isinstance(cooldown, (int, float)) and not guard:
        # A run with a cooldown (its holder says so) keeps the key to the cooldown's end, as
        # its own release would (not a semaphore run's task-id lease, which never cools):
        # the rest of it on the store's clock, from the lease now.
        try:
            now = service.peek(key)
            if now is None or now.token != info.token:
                return
            left = cooldown - now.age
            if left > _POLL:
                if now.expires_in - left > _POLL and service.force_release(
                    key, now.token, completion=record, keep_for=left
                ):
                    logger.warning(
                        "%s: its lock %r (fence %d) ends with its cooldown, in %.1f s",
                        what,
                        key,
                        now.fence,
                        left,
                    )
                return
        except BackendError as exc:
            # The lease then ends at its own expiry, later than its cooldown's end: only the
            # record is still owed, written by a release under a token that owns nothing.
            logger.warning("%s: could not end its lock %r with its cooldown: %s", what, key, exc)
            if record is not None:
                release_later(service, key, RECORD_ONLY_TOKEN, ttl, record)
            return
    try:
        released = service.force_release(key, info.token, completion=record)
    except BackendError as exc:
        logger.warning(
            "%s: could not release its lock %r (fence %d): %s; will retry", what, key, info.fence, exc
        )
        # The process is gone: nothing refreshes the lease, which ends within a ttl from now.
        release_later(service, key, info.token, max(ttl, info.expires_in), record)
        return
    if released:
        logger.warning("%s: released its lock %r (fence %d)", what, key, info.fence)


def _record_now(service: LockService, key: str, record: Completion, what: str, ttl: float) -> None:
    """Write ``record`` on ``key`` without touching its lease, waiting at most
    :data:`RECORD_TIMEOUT`; if the store does not answer by then, the heartbeat retries it
    for up to ``ttl`` seconds (the run's lease, which the release thread also writes it with,
    may be gone before the store answers again)."""
    try:
        StoreCalls().call(
            "record", service.force_release, key, RECORD_ONLY_TOKEN, completion=record, timeout=RECORD_TIMEOUT
        )
    except BackendError as exc:
        logger.warning("%s: could not record it as failed on lock %r yet: %s; will retry", what, key, exc)
        release_later(service, key, RECORD_ONLY_TOKEN, ttl, record)
    except Exception as exc:
        logger.warning("%s: could not record it as failed on lock %r: %s", what, key, exc)


def _lease_of(
    service: LockService, keys: list[str], task_id: str, what: str, patience: float
) -> tuple[str, LockInfo] | None:
    """The lease on one of ``keys`` held by run ``task_id``, and its key, looked for during
    :data:`KILL_LOOKUP_WINDOW`; while the store does not answer, looked for again each
    :data:`LOOKUP_RETRY` seconds, for up to ``patience`` seconds (then its BackendError is
    raised: the lease has expired by then)."""
    start = time.monotonic()
    give_up = start + KILL_LOOKUP_WINDOW
    failing = False
    while True:
        try:
            for key in keys:
                info = service.peek(key)
                if info is not None and info.holder.get("task_id") == task_id:
                    return key, info
        except BackendError as exc:
            if time.monotonic() - start >= patience:
                raise
            if not failing:
                logger.warning("%s: could not look for its lock %r: %s; will retry", what, keys[0], exc)
                failing = True
            time.sleep(LOOKUP_RETRY)
            continue
        if time.monotonic() >= give_up:
            return None
        time.sleep(_POLL)


def _wait_gone(pid: int) -> bool:
    """Whether process ``pid`` exits within :data:`KILL_RELEASE_WAIT` seconds."""
    give_up = time.monotonic() + KILL_RELEASE_WAIT
    while not process_gone(pid):
        if time.monotonic() >= give_up:
            return False
        time.sleep(_POLL)
    return True


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")
