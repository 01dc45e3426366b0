"""What ``dedupe`` costs the producer: deduplicated ``delay()`` against plain ``delay()``.

Section ``dedupe`` of ``python -m benchmarks`` (target: deduplicated sends >= 0.7x plain on
Redis, judged on the per-round ratios); also standalone:
``python -m benchmarks.dedupe_send [--sends 300] [--rounds 6]``. It publishes, per lock store
(Redis, PostgreSQL), rounds of ``delay()`` calls on a Redis broker, alternating a plain
exclusive task and the same task with ``dedupe=True`` (each call a new key, so every
deduplicated send takes a marker and publishes: one lock-store round trip on top of the
publish), and a third kind: a duplicate send (its key queued already: one failed mark that
names the queued task, nothing published). Prints the median rate of each kind and the ratio to plain
(the issue's target: >= 0.7x plain on Redis). Then ``dedupe="until_done"`` sends, whose
marker is taken only while the execution key is free, alternated in the same rounds two
ways: through the store's one operation (``AcquiresUnless``: a Lua script, one SQL statement)
and in steps (take the marker, look at the execution key: what a store without the operation
does, and every SQL store did before it had one), each as a new key (marker taken, then the
publish) and as a duplicate. Nothing consumes the queue; the run's queue,
broker keys, lock keys and table carry the run id and are deleted at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from celery import Celery

from benchmarks.harness import (
    CELERY_BROKER,
    POSTGRES_URL,
    REDIS_PREFIX,
    REDIS_URL,
    TABLE,
    Cleanup,
    Plan,
    Report,
    delete_redis_keys,
    drop_pg_tables,
    glob_escape,
    reachable,
    with_table,
)
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import close_lock_services

#: The target: deduplicated sends at least this fraction of plain sends' rate, on Redis.
TARGET = 0.7
SECTION = "dedupe"
STORES = ("redis", "postgres")
TARGET_REDIS = "redis: deduped delay() vs plain delay() (rate ratio)"


def _names(store: str) -> tuple[str, str, str]:
    return (
        f"{store}: plain delay()/s (exclusive task, Redis broker)",
        f"{store}: deduped delay()/s (marker taken, then the publish)",
        f"{store}: duplicate delay()/s (key queued: nothing published)",
    )


#: The until_done kinds: (kind in measure_rounds, row name suffix).
UNTIL_DONE = (
    ("done_one", "until_done delay()/s, one store operation (marker unless the run's key)"),
    ("done_steps", "until_done delay()/s, in steps (take, look; as a store without the operation)"),
    ("done_dup_one", "until_done duplicate/s, one store operation"),
    ("done_dup_steps", "until_done duplicate/s, in steps"),
)


def _done_names(store: str) -> list[str]:
    return [f"{store}: {suffix}" for _, suffix in UNTIL_DONE]


ROWS = [name for store in STORES for name in (*_names(store), *_done_names(store))]
TARGETS: list[tuple[str, float, str, str]] = [(TARGET_REDIS, TARGET, ">=", "x")]


def make_app(store: str, url: str, name: str = "") -> tuple[Any, Any, Any, Any]:
    """An app on the benchmark broker and lock store ``url``, with a plain, a deduped
    (until_start) and an until_done task."""
    app = Celery(f"bench-dedupe-{store}{name}", broker=CELERY_BROKER, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": REDIS_PREFIX},
        task_default_queue=f"{REDIS_PREFIX}dedupe-{store}",
        task_ignore_result=True,
        exclusive_url=url,
        exclusive_prefix=f"{REDIS_PREFIX}lock:",
    )

    def job(n: int) -> int:
        return n

    plain = exclusive_task(app=app, key="plain:{n}", name=f"bench.plain.{store}")(job)
    deduped = exclusive_task(app=app, key="dedupe:{n}", dedupe=True, name=f"bench.dedupe.{store}")(job)
    done = exclusive_task(
        app=app, key=f"done{name}:{{n}}", dedupe="until_done", name=f"bench.done.{store}{name}"
    )(job)
    return app, plain, deduped, done


def rate(send: Any, keys: range) -> float:
    """Sends per second of ``send(n)`` over ``keys``."""
    start = time.perf_counter()
    for n in keys:
        send(n)
    return len(keys) / (time.perf_counter() - start)


def run(report: Report, plan: Plan, cleanup: Cleanup) -> None:
    """The section: per store, interleaved rounds of the three kinds of send; the Redis target."""
    sends, rounds = (20, 2) if plan.quick else (200, min(plan.rounds, 9))
    urls = {"redis": REDIS_URL, "postgres": with_table(POSTGRES_URL, TABLE)}
    broker_down = reachable(CELERY_BROKER)
    for store in STORES:
        names = _names(store)
        why = broker_down or reachable(urls[store])
        if why:
            report.unavailable(SECTION, names, TARGETS if store == "redis" else [], why)
            continue
        series = measure_rounds(store, urls[store], sends, rounds)
        ratios = [d / p for p, d in zip(series["plain"], series["dedupe"], strict=True) if p > 0]
        plain, deduped, duplicate = (statistics.median(series[k]) for k in ("plain", "dedupe", "duplicate"))
        extra_us = 1e6 / deduped - 1e6 / plain
        report.row(SECTION, names[0], rate=plain, unit="sends/s", note=f"median of {rounds} rounds")
        report.row(
            SECTION,
            names[1],
            rate=deduped,
            unit="sends/s",
            note=f"{statistics.median(ratios):.2f}x plain; +{extra_us:.0f} us a send (one store round trip)",
        )
        report.row(SECTION, names[2], rate=duplicate, unit="sends/s", note=f"{duplicate / plain:.2f}x plain")
        _until_done_rows(report, store, series, rounds)
        if store == "redis":
            report.target(TARGET_REDIS, statistics.median(ratios), TARGET, rounds=ratios)


def _until_done_rows(report: Report, store: str, series: dict[str, list[float]], rounds: int) -> None:
    """The until_done rows: each kind's median rate, the one-operation kinds against the
    in-steps ones by the median of their per-round ratios."""
    for (kind, _), name in zip(UNTIL_DONE, _done_names(store), strict=True):
        note = f"median of {rounds} rounds"
        if kind.endswith("_one"):
            steps = series[kind.replace("_one", "_steps")]
            per_round = [a / b for a, b in zip(series[kind], steps, strict=True) if b > 0]
            spread = f"rounds {min(per_round):.2f}-{max(per_round):.2f}"
            note += f"; {statistics.median(per_round):.2f}x in steps ({spread})"
        report.row(SECTION, name, rate=statistics.median(series[kind]), unit="sends/s", note=note)


def measure(store: str, url: str, sends: int, rounds: int) -> dict[str, float]:
    """Median rates (sends/s) of plain, deduplicated and duplicate sends, alternated per round."""
    return {
        kind: statistics.median(values) for kind, values in measure_rounds(store, url, sends, rounds).items()
    }


def measure_rounds(store: str, url: str, sends: int, rounds: int) -> dict[str, list[float]]:
    """Each round's rates (sends/s) of plain, deduplicated and duplicate sends, alternated."""
    app, plain, deduped, done = make_app(store, url)
    stepping_app, _, _, stepping = make_app(store, url, "-steps")
    stepping.lock_service._checks_unless = False  # try_mark(unless=) as for a store without it
    stepping.lock_service._marks_later = False  # nor its two-half form (Redis: begin_mark)
    rates: dict[str, list[float]] = {kind: [] for kind in ("plain", "dedupe", "duplicate")}
    rates.update({kind: [] for kind, _ in UNTIL_DONE})
    with app.connection_for_write() as connection, connection.Producer() as producer:

        def sender(task: Any) -> Any:
            return lambda n: task.apply_async((n,), producer=producer)

        send_plain, send_deduped = sender(plain), sender(deduped)
        one, steps = sender(done), sender(stepping)
        for send in (send_plain, send_deduped, one, steps):
            send(-1)  # connections, the scripts, the table
        for index in range(rounds):
            keys = range((index + 1) * sends, (index + 2) * sends)
            rates["plain"].append(rate(send_plain, keys))
            rates["dedupe"].append(rate(send_deduped, keys))
            rates["duplicate"].append(rate(send_deduped, keys))  # all queued now
            first, second = (("one", one), ("steps", steps))[:: 1 if index % 2 == 0 else -1]
            for kind, send in (first, second):
                rates["done_" + kind].append(rate(send, keys))
            for kind, send in (second, first):
                rates["done_dup_" + kind].append(rate(send, keys))  # all queued now
    stepping_app.close()
    close_lock_services()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sends", type=int, default=300, help="sends per kind per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (kinds alternate each round)")
    options = parser.parse_args()
    stores = {"redis": REDIS_URL, "postgres": with_table(POSTGRES_URL, TABLE)}
    try:
        why = reachable(CELERY_BROKER)
        if why:
            print(f"broker {CELERY_BROKER}: {why}")
            return
        print("store     plain/s  dedupe/s  ratio  duplicate/s  ratio   (median of rounds)")
        for store, url in stores.items():
            why = reachable(url)
            if why:
                print(f"{store:8} n/a ({why})")
                continue
            m = measure(store, url, options.sends, options.rounds)
            verdict = (" PASS" if m["dedupe"] >= TARGET * m["plain"] else " MISS") if store == "redis" else ""
            print(
                f"{store:8} {m['plain']:8.0f} {m['dedupe']:9.0f} {m['dedupe'] / m['plain']:5.2f}x"
                f" {m['duplicate']:11.0f} {m['duplicate'] / m['plain']:5.2f}x{verdict}",
                flush=True,
            )
            print(
                f"{'':8} until_done new key: {m['done_one']:.0f}/s one operation, {m['done_steps']:.0f}/s"
                f" in steps; duplicate: {m['done_dup_one']:.0f}/s one operation,"
                f" {m['done_dup_steps']:.0f}/s in steps",
                flush=True,
            )
    finally:
        delete_redis_keys(CELERY_BROKER, glob_escape(REDIS_PREFIX) + "*")
        delete_redis_keys(REDIS_URL, glob_escape(REDIS_PREFIX) + "*")
        if not reachable(POSTGRES_URL):
            drop_pg_tables(TABLE)


if __name__ == "__main__":
    main()
