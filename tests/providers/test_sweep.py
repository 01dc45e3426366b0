"""Sweeping dead rows (issue 16) on real PostgreSQL, SQLite and MariaDB.

A lease whose holder was SIGKILLed and whose key is never used again is deleted by another
process's heartbeat within its ttl plus the sweep interval; a live lease is never deleted,
whatever the sweep races (acquires, takeovers, refreshes); fences keep growing after a
key's row was swept; ``celery-exclusive sweep`` and ``celery exclusive sweep`` print the
rows removed. Each test gets its own table, dropped afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from celery_exclusive import LockService
from celery_exclusive.cli import cli
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import Completion, Grant, RefreshRequest, Sweeps
from celery_exclusive.providers.memory import MemoryLockProvider
from tests.conftest import REDIS_URL, TIME_SLACK, require_server, with_option
from tests.providers.test_sql_provider import BACKENDS, Db, _database

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LONG = os.environ.get("CE_LONG") == "1"

# Takes N leases (one process, unique keys) with a short ttl, prints "ready", then waits
# to be SIGKILLed; its heartbeat keeps them alive until then, and never sweeps.
HOLDER = r"""
import sys
from celery_exclusive import LockService

url, prefix, count, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
service = LockService(url, prefix=prefix, ttl=ttl, sweep_interval=None)
leases = [service.lock(f"job-{i}-{i * 7919 % 1000}") for i in range(count)]
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    yield from _database(request.param, tmp_path)


def _url(db: Db) -> str:
    return with_option(db.url, "table", db.table)


def _count(db: Db, prefix: str, table: str | None = None) -> int:
    engine = sa.create_engine(db.url)
    try:
        with engine.connect() as conn:
            name = table or db.table
            return int(
                conn.execute(
                    sa.text(f"SELECT count(*) FROM {name} WHERE substr({_key(db)}, 1, :n) = :p"),
                    {"n": len(prefix), "p": prefix},
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _key(db: Db) -> str:
    return "`key`" if db.name == "mariadb" else '"key"'


def test_sigkilled_holders_rows_are_swept_by_another_process_heartbeat(db: Db) -> None:
    """1,000 leases of a SIGKILLed process with unique keys are gone within ttl + the sweep
    interval, removed by another process's heartbeat, which keeps its own lease; records too."""
    prefix = f"sw{uuid.uuid4().hex[:8]}:"
    ttl, interval, count = 2.0, 1.0, 1000
    # Create the table first, so the holder and the sweeper do not race to create it.
    setup = db.provider()
    setup.acquire("warmup", "t", 1, 1, "{}")
    setup.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, _url(db), prefix, str(count), str(ttl)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # a loaded machine may make it log refresh overruns
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        assert _count(db, prefix) == count
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        killed = time.monotonic()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
    service = LockService(_url(db), prefix=prefix, ttl=30, sweep_interval=interval)
    try:
        live = service.lock("live")  # the heartbeat runs while this process uses the service
        # Expired completion records under the prefix go in the same sweeps.
        for i in range(20):
            service.provider.release(f"{prefix}done-{i}", "t", Completion(f"id{i}", "success", 0, 0.2))
        deadline = killed + ttl + interval + 20  # 20 s of slack for a loaded 2-core machine
        left = count
        while time.monotonic() < deadline:
            left = _count(db, prefix) - 1  # the live lease stays
            if left == 0 and _count(db, prefix, db.table + "_done") == 0:
                break
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert left == 0, f"{left} dead rows left {took:.1f} s after the SIGKILL"
        assert _count(db, prefix, db.table + "_done") == 0
        print(f"{db.name}: {count} dead rows swept {took:.2f} s after SIGKILL (ttl {ttl}, every {interval})")
        assert service.peek("live") is not None
        assert live.held
        # A swept key's next fence is still larger than every earlier one.
        again = service.provider.acquire(f"{prefix}job-1-7919", "new", 5, 10, "{}")
        assert isinstance(again, Grant)
        assert again.fence > live.fence
        service.release(live)
    finally:
        service.close()


def test_a_live_lease_is_never_swept_while_sweeps_race_acquires_takeovers_and_refreshes(db: Db) -> None:
    """Sweeps in a loop against acquirers that take keys (free, or taking over a dead row),
    refresh and let some expire: every lease refreshed within its ttl is still owned, and
    each key's fences grow strictly in the order the store granted them (see
    _fences_grow_with_real_time). The race lasts at least 3 s (10 s with CE_LONG=1) and
    until it counted what it must (rows swept, live leases checked), which a loaded machine
    only delays: at most 30 s x TIME_SLACK."""
    provider, sweeper = db.provider(), db.provider()
    prefix = f"race{uuid.uuid4().hex[:6]}:"
    keys = [f"{prefix}{i}" for i in range(12)]
    stop = threading.Event()
    swept: list[int] = []
    errors: list[BaseException] = []
    grants: dict[str, list[tuple[float, float, int]]] = {key: [] for key in keys}
    checked = [0]

    def sweep() -> None:
        while not stop.is_set():
            try:
                swept.append(sweeper.sweep(prefix, 5))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return

    def work(index: int) -> None:
        try:
            n = 0
            while not stop.is_set():
                n += 1
                key = keys[(index + n) % len(keys)]
                token = f"{index}-{n}"
                sent = time.monotonic()
                got = provider.acquire(key, token, 0.3, 10, "{}")
                returned = time.monotonic()
                if not isinstance(got, Grant):
                    continue
                grants[key].append((sent, returned, got.fence))
                answer = provider.refresh([RefreshRequest(key, token, 0.3)])[0]
                if time.monotonic() - sent < 0.2:  # still well inside its ttl: must be owned
                    assert answer is not None, f"live lease {key} was swept"
                    found = provider.peek(key)
                    if time.monotonic() - sent < 0.25:
                        assert found is not None, f"live lease {key} was swept"
                        assert found.token == token, f"live lease {key} was taken"
                    checked[0] += 1
                if n % 3:
                    provider.release(key, token)  # the others expire: swept or taken over
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweep)] + [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    least, most = (10 if LONG else 3), 30 * TIME_SLACK
    while time.monotonic() - started < most and not errors:
        if time.monotonic() - started >= least and sum(swept) >= 5 and checked[0] > 20:
            break
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(30)
    provider.close()
    sweeper.close()
    assert not errors, errors
    assert checked[0] > 20, checked[0]
    assert sum(swept) > 0  # the sweeps really deleted dead rows meanwhile
    for key, drawn in grants.items():
        _fences_grow_with_real_time(key, drawn)


def _fences_grow_with_real_time(key: str, grants: list[tuple[float, float, int]]) -> None:
    """Each of ``key``'s grants, ``(sent, returned, fence)`` on the monotonic clock, has a
    larger fence than every grant of the key that returned before it was asked for, and no
    two share a fence. Grants whose calls overlap are not ordered: with 0.3 s leases a
    caller descheduled between its grant and reading the clock may see the next holder's
    grant return first, so the order the callers record is not the store's."""
    fences = [fence for _, _, fence in grants]
    assert len(set(fences)) == len(fences), f"fences of {key} reused: {fences}"
    for sent, _, fence in grants:
        earlier = [(f, returned) for _, returned, f in grants if returned < sent and f >= fence]
        assert not earlier, f"{key}: fence {fence} asked for at {sent:.3f} after grants {earlier} returned"


def test_sweep_touches_only_dead_rows_under_the_prefix(db: Db) -> None:
    """Live leases, other prefixes and unexpired records stay; the limit bounds each batch."""
    provider = db.provider()
    prefix, other = f"p{uuid.uuid4().hex[:6]}:", f"q{uuid.uuid4().hex[:6]}:"
    try:
        for i in range(7):
            provider.acquire(f"{prefix}dead{i}", "t", 0.2, 10, "{}")
        provider.acquire(f"{other}dead", "t", 0.2, 10, "{}")
        provider.acquire(f"{prefix}live", "t", 30, 60, "{}")
        provider.release(f"{prefix}r", "t", Completion("kept", "success", 0, 60))
        provider.release(f"{prefix}r", "t", Completion("gone", "success", 0, 0.2))
        time.sleep(0.4)
        assert provider.sweep(prefix, 3) == 4  # 3 leases + 1 record
        assert provider.sweep(prefix) == 4
        assert provider.sweep(prefix) == 0
        assert provider.peek(f"{prefix}live") is not None
        assert provider.completion(f"{prefix}r", "kept") is not None
        assert _count(db, other) == 1
        with pytest.raises(InvalidArgumentError):
            provider.sweep(prefix, 0)
    finally:
        provider.close()


def test_cli_sweep_prints_the_rows_removed(db: Db) -> None:
    """``celery-exclusive sweep`` (in-process) and ``celery -A app exclusive sweep`` (a real
    subprocess) delete the dead rows under the prefix and say how many."""
    prefix = f"cli{uuid.uuid4().hex[:6]}:"
    provider = db.provider()
    try:
        for i in range(5):
            provider.acquire(f"{prefix}a{i}", "t", 0.2, 10, "{}")
        provider.acquire(f"{prefix}b0", "t", 0.2, 10, "{}")
        provider.acquire(f"{prefix}live", "t", 30, 60, "{}")
        time.sleep(0.4)
        result = CliRunner().invoke(
            cli, ["--url", _url(db), "--prefix", prefix, "sweep", "--prefix", "a", "--limit", "2", "--all"]
        )
        assert result.exit_code == 0, result.output
        assert f"removed 5 dead row(s) under '{prefix}a'" in result.output
        env = {**os.environ, "CE_TEST_CLI_URL": _url(db), "CE_TEST_CLI_PREFIX": prefix}
        ran = subprocess.run(
            [str(BIN / "celery"), "-A", "tests.cli_app:app", "exclusive", "sweep", "--json"],
            check=False,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        assert '"removed": 1' in ran.stdout
        assert provider.peek(f"{prefix}live") is not None
    finally:
        provider.close()


def test_memory_sweeps_and_redis_needs_none() -> None:
    """memory:// sweeps its dead entries; Redis has no sweep (keys expire by themselves)."""
    now = [0.0]
    memory = MemoryLockProvider(clock=lambda: now[0])
    assert isinstance(memory, Sweeps)
    memory.acquire("p:a", "t", 1, 10, "{}")
    memory.acquire("p:b", "t", 100, 100, "{}")
    first = memory.acquire("p:c", "t", 1, 10, "{}")
    now[0] = 5.0
    assert memory.sweep("p:") == 2
    again = memory.acquire("p:c", "u", 1, 10, "{}")
    assert isinstance(first, Grant)
    assert isinstance(again, Grant)
    assert again.fence > first.fence
    require_server(REDIS_URL)
    service = LockService(REDIS_URL, prefix=f"sw{uuid.uuid4().hex[:6]}:")
    try:
        assert not service.sweeps
        assert service.sweep() == 0
        assert service.heartbeat._sweep is None
    finally:
        service.close()


def test_sweep_options_are_checked() -> None:
    """Bad sweep intervals and limits are refused before any store is touched; 0/None/env off."""
    for bad in (-1, "60", float("inf")):
        with pytest.raises(InvalidArgumentError):
            LockService("memory://", sweep_interval=bad)  # type: ignore[arg-type]
    assert LockService("memory://", sweep_interval=None).heartbeat._sweep is None
    assert LockService("memory://", sweep_interval=0).heartbeat._sweep is None
    assert LockService("memory://", prefix="").heartbeat._sweep is None  # no prefix: never automatic
    service = LockService("memory://")
    assert service.sweep_interval == 60.0
    assert service.heartbeat._sweep is not None
    with pytest.raises(InvalidArgumentError):
        service.sweep(limit=0)
    with pytest.raises(InvalidArgumentError):
        LockService("memory://", prefix="").sweep()
    os.environ["CELERY_EXCLUSIVE_SWEEP_INTERVAL"] = "off"
    try:
        assert LockService("memory://").sweep_interval is None
        os.environ["CELERY_EXCLUSIVE_SWEEP_INTERVAL"] = "5"
        assert LockService("memory://").sweep_interval == 5.0
        os.environ["CELERY_EXCLUSIVE_SWEEP_INTERVAL"] = "soon"
        with pytest.raises(InvalidArgumentError):
            LockService("memory://")
    finally:
        del os.environ["CELERY_EXCLUSIVE_SWEEP_INTERVAL"]
