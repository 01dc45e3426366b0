"""The Celery app the end-to-end benchmark's workers run (``celery -A benchmarks.celery_app worker``).

Configured by the environment the benchmark sets: ``CE_BENCH_BROKER`` (a Redis URL: a
dedicated DB), ``CE_BENCH_KEYPREFIX`` (every broker key's prefix, for isolation and
cleanup), ``CE_BENCH_QUEUE`` (the worker's default queue), ``CELERY_EXCLUSIVE_URL`` and
``CELERY_EXCLUSIVE_PREFIX`` (the lock store).

Throughput tasks do nothing but note, in memory, when they ran; a thread in each pool
process writes those notes to Redis every 20 ms, so measuring costs the tasks no I/O.
Each pool process also times every throughput task's whole run by Celery's tracer (its
``__trace__``, wrapped when the process starts: the same frame and two clock reads for every
variant, no signal receiver, which would make Celery send signals for every task) and notes
the count, the sum and a histogram: the in-process cost of a task, without the broker, the pool's
dispatch and the waits between tasks, which are the same for every variant.
The floor task is the plain one plus the lock's own floor: one provider acquire + release on
the store the exclusive tasks use, with no service or task layer around them; the
``floor_once`` task sends what the exclusive task's run sends to the store: the acquire that
checks the task id's completion record and the release that writes it (redelivery safety,
:mod:`celery_exclusive.redelivery`), still straight through the provider. The rerun
task records its start, and a ``lock_released`` receiver records the release.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import exclusive_task, redelivery, signals
from celery_exclusive.providers.base import Completion, Grant, encode_holder
from celery_exclusive.worker import get_lock_service

BROKER = os.environ.get("CE_BENCH_BROKER", "redis://127.0.0.1:6379/12")
KEYPREFIX = os.environ.get("CE_BENCH_KEYPREFIX", "cebench-local:")
#: Hash per tag: field = pool process id, value = JSON [count, first end, last end, runs
#: timed, their summed seconds, their histogram] (the last three: see :func:`_timed`).
STATS = KEYPREFIX + "stats:"
#: List of rerun events (JSON).
EVENTS = KEYPREFIX + "events"

app = Celery("cebench", broker=BROKER)
app.conf.update(
    # The rerun a holder sends is routed by the routing key its first request came with; a
    # request sent with ``queue=`` arrives through the default exchange (recorded as ""), so
    # the rerun must find its queue as the default one.
    task_default_queue=os.environ.get("CE_BENCH_QUEUE", "cebench"),
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": KEYPREFIX},
    task_ignore_result=True,
    worker_hijack_root_logger=False,
)

_notes: dict[str, list[float]] = {}
#: Per tag, the timed runs' histogram: bucket (``int(log(seconds) * BUCKETS)``, 2 % wide) -> runs.
_spread: dict[str, dict[int, int]] = {}
BUCKETS = 1 / math.log(1.02)
_flusher: tuple[int, threading.Thread] | None = None
_client: tuple[int, redis.Redis] | None = None


def client() -> redis.Redis:
    """This process's Redis client for stats and events (never shared across fork)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(BROKER))
    return _client[1]


def _flush_forever() -> None:
    sent: dict[str, list[Any]] = {}
    while True:
        time.sleep(0.02)
        for tag, note in list(_notes.items()):
            snapshot: list[Any] = [*note, dict(_spread.get(tag, {}))]
            if sent.get(tag) != snapshot:
                client().hset(STATS + tag, str(os.getpid()), json.dumps(snapshot))
                sent[tag] = snapshot


def note(tag: str) -> None:
    """Count one run of ``tag`` in this process (no I/O)."""
    global _flusher
    now = time.time()
    entry = _notes.get(tag)
    if entry is None:
        _notes[tag] = [1, now, now, 0, 0.0]
    else:
        entry[0] += 1
        entry[2] = now
    if _flusher is None or _flusher[0] != os.getpid():
        thread = threading.Thread(target=_flush_forever, name="bench-flusher", daemon=True)
        thread.start()
        _flusher = (os.getpid(), thread)


#: The throughput tasks whose runs are timed in the pool processes.
TIMED = ("cebench.plain", "cebench.exclusive", "cebench.floor", "cebench.floor_once")


def _timed(trace: Any) -> Any:
    """``trace`` (a task's ``__trace__``), timing each run and noting it under its tag."""
    clock, log = time.perf_counter, math.log

    def timed(uuid: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        started = clock()
        out = trace(uuid, args, kwargs, request)
        spent = clock() - started
        entry = _notes.get(args[1])
        if entry is not None:  # the body noted it (a run that raised is not counted)
            entry[3] += 1
            entry[4] += spent
            spread = _spread.setdefault(args[1], {})
            bucket = int(log(spent) * BUCKETS)
            spread[bucket] = spread.get(bucket, 0) + 1
        return out

    return timed


@celery_signals.worker_process_init.connect(weak=False)
def _time_runs(**_: Any) -> None:
    """Wrap the throughput tasks' tracers in this pool process (built just before this signal)."""
    for name in TIMED:
        task = app.tasks[name]
        if task.__trace__ is not None:
            task.__trace__ = _timed(task.__trace__)


@app.task(name="cebench.plain")  # type: ignore[untyped-decorator]
def plain(i: int, tag: str) -> None:
    """A no-op task."""
    note(tag)


class _Floor:
    """What the floor tasks need, looked up once per pool process (as an exclusive task's
    plan is once per task): the store, its durations and prefix, the holder JSON, the token
    prefix and the completion records' retention. A lookup per run (``get_lock_service``
    takes a mutex) would be Python work the floor pays and the exclusive task does not."""

    def __init__(self) -> None:
        service = get_lock_service(app)
        host = socket.gethostname()
        self.pid = os.getpid()
        self.provider: Any = service.provider  # a CompletionStore: every built-in store is one
        self.prefix, self.ttl, self.life = service.prefix, service.ttl, service.max_lifetime
        self.holder = encode_holder({"host": host, "pid": self.pid})
        self.token = f"{host}:{self.pid}:"
        registered: Any = app.tasks["cebench.exclusive"]
        self.retain = redelivery.retention(registered) or 86400.0


_floors: _Floor | None = None


def _floor() -> _Floor:
    global _floors
    if _floors is None or _floors.pid != os.getpid():
        _floors = _Floor()
    return _floors


@app.task(name="cebench.floor")  # type: ignore[untyped-decorator]
def floor(i: int, tag: str) -> None:
    """The no-op plus one acquire + release of its own key, straight through the provider."""
    f = _floor()
    key = f"{f.prefix}f:{tag}:{i}"
    token = f"{f.token}{int(time.time() * 1000)}:{os.urandom(8).hex()}"  # as the service's new_token
    if not isinstance(f.provider.acquire(key, token, f.ttl, f.life, f.holder), Grant):
        raise RuntimeError(f"floor: {key} unexpectedly held")
    f.provider.release(key, token)
    note(tag)


@app.task(name="cebench.floor_once")  # type: ignore[untyped-decorator]
def floor_once(i: int, tag: str) -> None:
    """The floor with the exclusive run's statements: the acquire checks the task id's
    completion record, the release writes one (kept as long as the exclusive task's)."""
    f = _floor()
    key, task_id = f"{f.prefix}o:{tag}:{i}", f"{tag}-{i}"
    token = f"{f.token}{int(time.time() * 1000)}:{os.urandom(8).hex()}"
    if not isinstance(f.provider.acquire(key, token, f.ttl, f.life, f.holder, task_id=task_id), Grant):
        raise RuntimeError(f"floor_once: {key} unexpectedly held or done")
    f.provider.release(key, token, Completion(task_id, "success", 0, f.retain))
    note(tag)


@exclusive_task(app=app, name="cebench.exclusive", key="e:{tag}:{i}")  # type: ignore[untyped-decorator]
def exclusive(i: int, tag: str) -> None:
    """The same no-op, holding a lock on a key of its own."""
    note(tag)


_receiver_connected: list[int] = []


def _released(sender: Any = None, key: str = "", **_: Any) -> None:
    if key.startswith("r:"):
        client().rpush(EVENTS, json.dumps({"kind": "released", "key": key, "at": time.time()}))


@exclusive_task(app=app, name="cebench.rerun", key="r:{k}", on_locked="rerun", bind=True)  # type: ignore[untyped-decorator]
def rerun(self: Any, k: str, hold: float) -> None:
    """Hold ``r:{k}`` for ``hold`` s; requests meanwhile coalesce into one rerun after it."""
    start = time.time()
    if os.getpid() not in _receiver_connected:  # only now: the throughput tasks send no signal
        signals.lock_released.connect(_released, weak=False, dispatch_uid="cebench-released")
        _receiver_connected.append(os.getpid())
    client().rpush(EVENTS, json.dumps({"kind": "start", "key": f"r:{k}", "at": start, "id": self.request.id}))
    time.sleep(hold)
