"""Measurement plumbing: interleaved rounds, statistics, the report table, servers, cleanup."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

POSTGRES_URL = os.environ.get(
    "CE_BENCH_POSTGRES_URL",
    os.environ.get("CE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
REDIS_URL = os.environ.get(
    "CE_BENCH_REDIS_URL", os.environ.get("CE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
)
#: Broker of the Celery section: a dedicated DB number, and every key under a run-unique prefix.
CELERY_BROKER = os.environ.get("CE_BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/12")
#: Unique per run: every table, key and queue the benchmark creates carries it. Kept in the
#: environment so that the processes the run spawns use the same names.
RUN_ID = os.environ.setdefault("CE_BENCH_RUN_ID", uuid.uuid4().hex[:8])
TABLE = f"ce_bench_{RUN_ID}"
ORIGIN_TABLE = f"{TABLE}_origin"
UPSERT_TABLE = f"{TABLE}_upsert"
REDIS_PREFIX = f"cebench-{RUN_ID}:"


def psycopg_dsn(url: str = POSTGRES_URL) -> str:
    """The libpq form of an SQLAlchemy PostgreSQL URL (``postgresql+psycopg://`` -> ``postgresql://``)."""
    scheme, rest = url.split("://", 1)
    return "postgresql://" + rest.split("?", 1)[0] if scheme.startswith("postgres") else url


def with_table(url: str, table: str) -> str:
    """``url`` with the celery-exclusive table option."""
    return f"{url}{'&' if '?' in url else '?'}ce_table={table}"


def reachable(url: str) -> str | None:
    """None if the server behind ``url`` accepts TCP connections, else why not."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    if port is None:
        port = 5432 if parts.scheme.startswith("postgres") else 6379
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        return f"{parts.scheme.split('+')[0]} at {host}:{port} unreachable ({exc})"
    return None


# -- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest-rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else math.nan


@dataclass
class Series:
    """What one approach measured: its rate per round and every operation's latency."""

    name: str
    rates: list[float] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Median rate over rounds (operations per second)."""
        return median(self.rates)

    def p(self, q: float) -> float:
        """Latency quantile in microseconds."""
        return percentile(self.latencies_ns, q) / 1000


@dataclass(frozen=True)
class Batch:
    """An approach that times its own batches (an external program): ``run(n)`` performs
    ``n`` operations and returns (the batch's elapsed ns, each operation's ns)."""

    run: Callable[[int], tuple[int, list[int]]]


#: One operation of an approach, given its sequence number; or a self-timed :class:`Batch`.
Op = Callable[[int], object] | Batch


def interleave(approaches: Mapping[str, Op], *, rounds: int, ops: int, warmup: int) -> dict[str, Series]:
    """Run each approach ``ops`` times per round, the approaches taking turns in every round.

    The approach that goes first rotates from round to round (round-robin), so a drift of
    the machine's speed over the run hits every approach alike. Each operation is timed on
    its own (for p50/p99); the round's rate is ``ops`` over the whole batch's time. A
    :class:`Batch` approach does its own timing, the same way, inside its program.
    """
    names = list(approaches)
    series = {name: Series(name) for name in names}
    for name in names:
        op = approaches[name]
        if isinstance(op, Batch):
            op.run(warmup)
            continue
        for i in range(warmup):
            op(i)
    clock = time.perf_counter_ns
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            op = approaches[name]
            if isinstance(op, Batch):
                gc.collect()
                batch_ns, lat = op.run(ops)
                series[name].rates.append(ops / (batch_ns / 1e9))
                series[name].latencies_ns.extend(lat)
                continue
            lat = []
            append = lat.append
            gc.collect()
            start = clock()
            for i in range(ops):
                t0 = clock()
                op(i)
                append(clock() - t0)
            elapsed = clock() - start
            series[name].rates.append(ops / (elapsed / 1e9))
            series[name].latencies_ns.extend(lat)
    return series


def round_ratios(a: Series, b: Series) -> list[float]:
    """Per-round ratios of ``a``'s rate to ``b``'s (both measured in the same round)."""
    return [x / y for x, y in zip(a.rates, b.rates, strict=True) if y > 0]


# -- the report ------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the rates table."""

    section: str
    name: str
    rate: float = math.nan
    unit: str = "ops/s"
    p50_us: float = math.nan
    p99_us: float = math.nan
    note: str = ""


@dataclass
class Target:
    """One target of the issue: a measured value checked against a bound."""

    name: str
    value: float = math.nan
    bound: float = math.nan
    op: str = ">="  # ">=", "<=" or "==" (exact count)
    unit: str = "x"
    note: str = ""
    rounds: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """PASS, MISS, or n/a when it could not be measured."""
        if math.isnan(self.value):
            return "n/a"
        ok = {
            ">=": self.value >= self.bound,
            "<=": self.value <= self.bound,
            "==": self.value == self.bound,
        }[self.op]
        return "PASS" if ok else "MISS"


def _num(value: float, digits: int = 0) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if digits == 0 and abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.{digits}f}"
    return f"{value:.{max(digits, 2) if abs(value) < 10 else max(digits, 1)}f}"


class Report:
    """Collects rows and targets; prints them as Markdown tables (terminal-readable too)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.targets: list[Target] = []
        self.notes: list[str] = []

    def row(self, section: str, name: str, **fields: Any) -> Row:
        """Add (and return) a row; printed at once so a long run shows progress."""
        row = Row(section, name, **fields)
        self.rows.append(row)
        print(
            f"  [{section}] {name}: {_num(row.rate)} {row.unit}"
            + (
                f"  p50 {_num(row.p50_us, 1)} us  p99 {_num(row.p99_us, 1)} us"
                if not math.isnan(row.p50_us)
                else ""
            )
            + (f"  ({row.note})" if row.note else ""),
            flush=True,
        )
        return row

    def series_rows(
        self, section: str, series: dict[str, Series], notes: dict[str, str] | None = None
    ) -> None:
        """One row per approach of an interleaved run."""
        for name, s in series.items():
            self.row(
                section,
                name,
                rate=s.rate,
                p50_us=s.p(0.5),
                p99_us=s.p(0.99),
                note=(notes or {}).get(name, ""),
            )

    def target(
        self,
        name: str,
        value: float,
        bound: float,
        *,
        op: str = ">=",
        unit: str = "x",
        note: str = "",
        rounds: Sequence[float] = (),
    ) -> Target:
        """Add (and return) a target check."""
        target = Target(name, value, bound, op, unit, note, list(rounds))
        self.targets.append(target)
        print(
            f"  -> {target.verdict}: {name} = {_num(value, 2)}{unit} (target {op} {_num(bound, 2)}{unit})"
            + (f"  ({note})" if note else ""),
            flush=True,
        )
        return target

    def unavailable(
        self, section: str, names: Sequence[str], targets: Sequence[tuple[str, float, str, str]], reason: str
    ) -> None:
        """Rows and targets of a section that could not run, printed as n/a with the reason."""
        for name in names:
            self.row(section, name, note=f"n/a: {reason}")
        for name, bound, op, unit in targets:
            self.target(name, math.nan, bound, op=op, unit=unit, note=f"n/a: {reason}")

    def markdown(self) -> str:
        """The rates table, then the targets table, as Markdown."""
        lines = [
            "| section | approach | rate | p50 µs | p99 µs | note |",
            "|---|---|---:|---:|---:|---|",
        ]
        for r in self.rows:
            rate = f"{_num(r.rate)} {r.unit}" if not math.isnan(r.rate) else "-"
            lines.append(
                f"| {r.section} | {r.name} | {rate} | {_num(r.p50_us, 1)} | {_num(r.p99_us, 1)} | {r.note} |"
            )
        lines += [
            "",
            "| target | measured | bound | verdict | per-round values / note |",
            "|---|---:|---:|---|---|",
        ]
        for t in self.targets:
            per_round = ", ".join(_num(v, 2) for v in t.rounds)
            detail = "; ".join(x for x in (f"rounds: {per_round}" if per_round else "", t.note) if x)
            measured, bound = f"{_num(t.value, 2)}{t.unit}", f"{t.op} {_num(t.bound, 2)}{t.unit}"
            lines.append(f"| {t.name} | {measured} | {bound} | **{t.verdict}** | {detail} |")
        return "\n".join(lines)


# -- cleanup ---------------------------------------------------------------------------------


class Cleanup:
    """Everything the run created, removed at the end even if a section failed."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], object]]] = []

    def add(self, what: str, action: Callable[[], object]) -> None:
        """Register ``action`` to run at the end (last registered runs first)."""
        self._actions.append((what, action))

    def run(self) -> None:
        """Run every registered action once; report but survive failures."""
        while self._actions:
            what, action = self._actions.pop()
            try:
                action()
            except Exception as exc:
                print(f"  cleanup of {what} failed: {type(exc).__name__}: {exc}", flush=True)


def drop_pg_tables(*tables: str) -> None:
    """Drop benchmark tables, their completion-record tables, fence sequences and marker functions."""
    import psycopg

    with psycopg.connect(psycopg_dsn(), autocommit=True, connect_timeout=10) as conn:
        for table in tables:
            conn.execute(f'DROP TABLE IF EXISTS "{table}_done"')
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            conn.execute(f'DROP TABLE IF EXISTS "{table}_fence"')
            conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fence_seq"')
            conn.execute(f'DROP FUNCTION IF EXISTS "{table}_unless"(varchar, varchar)')


def delete_redis_keys(url: str, pattern: str) -> int:
    """Delete every key matching ``pattern`` on the server and DB of ``url``; how many."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        deleted = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.delete(*batch))
                batch = []
        if batch:
            deleted += int(client.delete(*batch))
        return deleted
    finally:
        client.close()


def glob_escape(text: str) -> str:
    """``text`` with Redis glob metacharacters escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    """Print how long a section took."""
    start = time.perf_counter()
    print(f"== {label}", flush=True)
    try:
        yield
    finally:
        print(f"   ({label}: {time.perf_counter() - start:.1f} s)", flush=True)


@dataclass(frozen=True)
class Plan:
    """How much to measure: the full run, or the quick run CI uses to keep the suite working."""

    quick: bool
    rounds: int
    redis_ops: int
    pg_ops: int
    origin_ops: int
    contention_seconds: float
    contention_rounds: int
    heartbeat_leases: int
    heartbeat_rounds: int
    many_leases: int
    capacity_seconds: float
    celery_tasks: int
    celery_rounds: int
    rerun_trials: int

    @classmethod
    def make(cls, quick: bool, rounds: int | None = None) -> Plan:
        """The quick or the full plan; ``rounds`` overrides the number of interleaved rounds."""
        if quick:
            # Sizes of a smoke test (every row printed, nothing judged): 300 heartbeat
            # leases and 500 "many" leases (not 1,000 and 2,000: on PostgreSQL each is a
            # durable acquire), one Celery round per store after the warm-up, one rerun trial.
            return cls(True, rounds or 2, 200, 60, 30, 0.25, 2, 300, 2, 500, 0.25, 60, 1, 1)
        return cls(False, rounds or 15, 2000, 600, 250, 2.0, 9, 1000, 15, 10_000, 3.0, 1000, 9, 15)
