"""Instructions per task of the Celery layer, and per bare lock cycle, counted by callgrind
(issue #16).

``python -m benchmarks.instructions [--store memory|redis|postgres] [--variant NAME ...]``
runs each variant in a process of its own under ``valgrind --tool=callgrind``: ``--warm``
runs uninstrumented, then ``--count`` runs counted between two client requests, and prints
the instructions per run (start-up, imports and warm-up left out). The variants of
:func:`benchmarks.profiling.celery_layer` (a plain no-op, the floor: plain plus one provider
acquire + release, plain plus ``LockService.lock + release``, an exclusive no-op) run
through Celery's own tracer, one task per run; the bare cycles run no Celery at all:
``provider_cycle`` is one provider ``acquire + release`` with the deadlines the service
passes (``call_timeout``, and at most 5 s for the release), ``provider_cycle_once`` the same
with an exclusive run's completion record (the acquire checks a task id's record, the
release writes it, as Celery's ``floor_once`` does: a new task id per cycle, kept a day;
the records made before counting), so that its excess over ``provider_cycle`` is what the
provider spends on the record,
``lock_cycle`` one ``LockService.lock(key).release()``, each over 256 keys with a new token
per cycle.

The PostgreSQL store runs on ``CE_BENCH_POSTGRES_URL`` (default: the shared server's
``test`` database) in a table of this run's own, dropped at the end; the counts do not
depend on the server's load (only the client process is counted). Instruction counts do not
move with the machine's load (two runs of the same code differ by well under 1 %; a
heartbeat pass falling into the counted window adds up to ~0.6k per cycle), which wall-clock
rates on a shared machine cannot say. ``PYTHONHASHSEED=0``; with ``--package DIR`` the
package is imported from ``DIR`` (a frozen copy of another commit, e.g. ``git archive``),
for before/after rows. ``--callgrind-out FILE`` keeps the last variant's profile for
``callgrind_annotate`` (per C function; Python frames show as ``_PyEval_EvalFrameDefault``);
``--itemise`` names the package's Python functions too (:mod:`benchmarks.itemise`: inclusive
and own instructions and calls per run of each, ``--itemise-only REGEX`` to wrap fewer).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "floor", "floor_once", "service", "service_once", "exclusive")
#: Cycles counted outside Celery (see the module docstring).
BARE = ("provider_cycle", "provider_cycle_once", "lock_cycle")
STORES = ("memory", "redis", "postgres")
_TOTALS = re.compile(r"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


def _url(store: str) -> str:
    """The lock store URL of ``store`` (PostgreSQL: in ``CE_INSTR_TABLE``, the driver's table)."""
    if store == "memory":
        return "memory://"
    if store == "redis":
        return os.environ.get("CE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
    from benchmarks.harness import POSTGRES_URL, with_table

    return with_table(POSTGRES_URL, os.environ["CE_INSTR_TABLE"])


def _bare(variant: str, store: str, warm: int, count: int, control: Any) -> None:
    """``warm`` then ``count`` bare cycles (``BARE``) of a LockService on ``store``, counted
    between ``control``'s client requests."""
    import secrets
    import uuid

    from celery_exclusive import LockService
    from celery_exclusive.providers.base import Completion, encode_holder

    service = LockService(_url(store), prefix=f"ceinstr-{os.getpid()}:")
    provider: Any = service.provider
    holder = encode_holder({"host": "instr-host", "pid": os.getpid()})
    ttl, life = service.ttl, service.max_lifetime
    acquire_timeout, release_timeout = service.call_timeout, min(service.call_timeout, 5.0)
    keys = [f"{service.prefix}k{i}" for i in range(256)]
    # Celery's task ids (uuid4 text) and their records, made before counting: a task is given
    # its id, and the record is the caller's (the Celery layer makes it without the frozen
    # dataclass's __init__), so the row over provider_cycle is what the provider adds.
    once = variant == "provider_cycle_once"
    records = [
        Completion(str(uuid.uuid4()), "success", 0, 86400.0) for _ in range(warm + count if once else 0)
    ]
    lock = service.lock
    try:
        for i in range(warm + count):
            if i == warm and control is not None:
                control.cg_start()
            if variant == "lock_cycle":
                lock(f"k{i % 256}").release()
            elif variant == "provider_cycle_once":
                key, token, record = keys[i % 256], secrets.token_hex(16), records[i]
                provider.acquire(
                    key, token, ttl, life, holder, task_id=record.task_id, timeout=acquire_timeout
                )
                provider.release(key, token, record, timeout=release_timeout)
            else:
                key, token = keys[i % 256], secrets.token_hex(16)
                provider.acquire(key, token, ttl, life, holder, timeout=acquire_timeout)
                provider.release(key, token, timeout=release_timeout)
        if control is not None:
            control.cg_stop()
    finally:
        service.close()


def _child(variant: str, store: str, warm: int, count: int) -> None:
    """Run ``warm`` then ``count`` tasks of ``variant`` on ``store`` through Celery's tracer
    (this process), callgrind counting only the ``count`` tasks (its client requests, from
    a small C library built by the driver: ``CE_CALLGRIND_LIB``). ``CE_INSTR_BALLAST`` long-lived
    lists stand in for a worker's heap, so the garbage collector's full collections (which
    walk every live object) cost what they would in a worker."""
    import ctypes
    import gc

    control = ctypes.CDLL(os.environ["CE_CALLGRIND_LIB"]) if os.environ.get("CE_CALLGRIND_LIB") else None
    if os.environ.get("CE_ITEMISE_NAMES"):  # --itemise: every package function its own C symbol
        from benchmarks import itemise

        itemise.write_names(itemise.install())
    if variant in BARE:
        _bare(variant, store, warm, count, control)
        import celery_exclusive

        print(f"package: {celery_exclusive.__file__}", file=sys.stderr)
        return

    from celery import Celery
    from celery.app.trace import build_tracer

    from benchmarks.profiling import layer_tasks
    from celery_exclusive.worker import close_lock_services

    url = _url(store)
    prefix = f"ceinstr-{os.getpid()}:"
    app = Celery("ce-instructions", broker="memory://", set_as_current=False)
    app.conf.update(exclusive_url=url, exclusive_prefix=prefix, task_ignore_result=True)

    made = layer_tasks(app, "instr")[variant]
    app.finalize()
    tracer = build_tracer(made.name, app.tasks[made.name], eager=False, hostname="instr@bench", app=app)
    tag = f"{os.getpid()}"
    ballast = [[] for _ in range(int(os.environ.get("CE_INSTR_BALLAST", "0")))]
    gc.collect()  # the ballast in the oldest generation, as a worker's long-lived objects are
    try:
        for i in range(warm + count):
            if i == warm and control is not None:
                control.cg_start()
            task_id = f"{tag}-{i}"
            request = {"id": task_id, "args": (i, tag), "kwargs": {}, "hostname": "instr@bench", "retries": 0}
            if i == warm - 1 and os.environ.get("CE_ITEMISE_NAMES"):  # the call tree of one run
                from benchmarks import itemise

                itemise.trace(lambda: tracer(task_id, (i, tag), {}, request))  # noqa: B023 - called here
                continue
            tracer(task_id, (i, tag), {}, request)
        if control is not None:
            control.cg_stop()
        del ballast
    finally:
        close_lock_services()
    import celery_exclusive

    print(f"package: {celery_exclusive.__file__}", file=sys.stderr)


_CONTROL = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT("measured"); }
"""


def _count(
    variant: str, store: str, warm: int, count: int, package: str | None, *, keep: str | None = None
) -> int:
    """Instructions of ``count`` runs after ``warm`` in one child process under callgrind
    (start-up and warm-up run uninstrumented, so a run takes seconds, not minutes); ``keep``:
    a path to copy the counted profile to."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if package:
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as out:
        source = Path(out, "control.c")
        source.write_text(_CONTROL)
        library = Path(out, "libcontrol.so")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        env["CE_CALLGRIND_LIB"] = str(library)
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={out}/callgrind.out",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            variant,
            store,
            str(warm),
            str(count),
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        dumps = [p for p in Path(out).glob("callgrind.out*") if "measured" in p.read_text(errors="replace")]
        totals = [_TOTALS.search(p.read_text(errors="replace")) for p in dumps]
        if keep and dumps:
            shutil.copyfile(dumps[0], keep)
    found = [int(m.group(1)) for m in totals if m is not None]
    if done.returncode != 0 or not found:
        raise SystemExit(f"{variant} on {store} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if package and package not in done.stderr:
        raise SystemExit(f"the child did not import celery_exclusive from {package}:\n{done.stderr[-1000:]}")
    return sum(found)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=STORES, default="memory")
    parser.add_argument("--variant", action="append", choices=VARIANTS + BARE)
    parser.add_argument("--warm", type=int, default=300)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--package", help="import celery_exclusive from this directory")
    parser.add_argument(
        "--ballast", type=int, default=0, help="long-lived objects in the heap (a worker's: 1000000)"
    )
    parser.add_argument("--callgrind-out", help="copy the last variant's counted profile here")
    parser.add_argument(
        "--itemise",
        action="store_true",
        help="give every package function a C symbol of its own (benchmarks.itemise) and print "
        "each one's inclusive instructions and calls per run (adds ~1k per wrapped call to its caller)",
    )
    parser.add_argument("--itemise-only", help="with --itemise: only the functions matching this regex")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))
        return
    if args.ballast:
        os.environ["CE_INSTR_BALLAST"] = str(args.ballast)
    if args.store == "postgres":
        from benchmarks.harness import drop_pg_tables

        table = os.environ["CE_INSTR_TABLE"] = f"ce_instr_{os.getpid()}"
    per_task: dict[str, float] = {}
    scratch = tempfile.mkdtemp(prefix="ce-instr-") if args.itemise else None
    if scratch and args.itemise_only:
        os.environ["CE_ITEMISE_ONLY"] = args.itemise_only
    try:
        for variant in args.variant or VARIANTS:
            keep = os.path.join(scratch, f"{variant}.out") if scratch else args.callgrind_out
            if scratch:
                os.environ["CE_ITEMISE_NAMES"] = os.path.join(scratch, f"{variant}.names")
            counted = _count(variant, args.store, args.warm, args.count, args.package, keep=keep)
            per_task[variant] = counted / args.count
            plain = per_task.get("plain")
            over = (
                ""
                if plain is None or variant == "plain" or variant in BARE
                else f"  (+{per_task[variant] - plain:,.0f} over plain)"
            )
            unit = "cycle" if variant in BARE else "task"
            print(f"{variant:14} {per_task[variant]:10,.0f} instructions per {unit}{over}", flush=True)
            if scratch:
                from benchmarks import itemise

                # What the stubs add per wrapped call: the same variant counted unwrapped.
                names = os.environ.pop("CE_ITEMISE_NAMES")
                bare = _count(variant, args.store, args.warm, args.count, args.package) / args.count
                os.environ["CE_ITEMISE_NAMES"] = names
                overhead = (per_task[variant] - bare) / itemise.wrapped_calls(keep, args.count)
                print(
                    f"    unwrapped {bare:,.0f} per {unit}; {overhead:,.0f} per wrapped call taken off below"
                )
                print(f"    {'inclusive':>10} {'own':>8} {'calls':>6}  function (per {unit})")
                for name, cost, calls, own in itemise.table(keep, names, args.count, overhead):
                    print(f"    {cost:10,.0f} {own:8,.0f} {calls:6.2f}  {name}", flush=True)
                if args.callgrind_out:
                    shutil.copyfile(keep, args.callgrind_out)
    finally:
        if args.store == "postgres":
            drop_pg_tables(table)


if __name__ == "__main__":
    # The benchmarks package from this checkout; celery_exclusive from PYTHONPATH if given.
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    main()
