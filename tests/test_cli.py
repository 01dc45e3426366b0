"""The operator CLI against real PostgreSQL and Redis, with leases held by another process.

Both front ends are exercised: the standalone ``celery-exclusive`` command (in-process
through click's CliRunner, and as a real console-script subprocess) and the Celery
sub-command (a real ``celery -A tests.cli_app:app exclusive`` subprocess).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from celery_exclusive import LockService
from celery_exclusive.cli import cli, human_duration
from celery_exclusive.diagnostics import doctor
from tests.conftest import (
    POSTGRES_URL,
    REDIS_URL,
    TIME_SLACK,
    delete_redis_keys,
    drop_lock_table,
    require_server,
    with_option,
)
from tests.silent import silent_server

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOST = socket.gethostname()[:64]
SECRET = "SECRETPW"
DEAD_URLS = {
    "postgres": f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/test",
    "redis": f"redis://:{SECRET}@127.0.0.1:1/0",
}
LOCK_FIELDS = {"key", "token", "fence", "age", "expires_in", "hard_expires_in", "holder", "state"}

# Holds one lease per key (given on the command line) until stdin closes; prints the
# tokens and fences as JSON, then "ready", and one JSON line per lease it later loses.
HOLDER = r"""
import json, sys
from celery_exclusive import LockService

url, prefix, *keys = sys.argv[1:]
service = LockService(url, prefix=prefix, ttl=20, refresh_interval=0.3)
leases = {}
for key in keys:
    lease = service.lock(key, holder={"task_id": "tid-" + key, "task_name": "tests.hold"})
    lease.on_lost(lambda lease, reason: print(json.dumps({"lost": lease.key}), flush=True))
    leases[key] = lease
print(json.dumps({k: {"token": v.token, "fence": v.fence} for k, v in leases.items()}), flush=True)
print("ready", flush=True)
sys.stdin.read()
service.close()
"""


@dataclass
class Store:
    """One real store for this module: URL and a key prefix no other test uses."""

    name: str
    url: str
    prefix: str

    def service(self) -> LockService:
        """A LockService on this store and prefix (the caller closes it)."""
        return LockService(self.url, prefix=self.prefix)


@dataclass
class Holder:
    """A subprocess holding leases: its pid, each key's token and fence, and its output lines."""

    process: subprocess.Popen[str]
    leases: dict[str, dict[str, Any]]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def lost(self, timeout: float) -> set[str]:
        """Keys the holder reported lost within ``timeout`` seconds of waiting for the next line."""
        found: set[str] = set()
        try:
            while True:
                line = self.lines.get(timeout=timeout)
                found.add(json.loads(line)["lost"])
                timeout = 0.5
        except queue.Empty:
            return found


@pytest.fixture(scope="module", params=["postgres", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A real store with a unique prefix (and, on PostgreSQL, a unique table); cleaned up after."""
    prefix = f"cli{uuid.uuid4().hex[:10]}:"
    if request.param == "postgres":
        require_server(POSTGRES_URL)
        table = f"ce_cli_{uuid.uuid4().hex[:10]}"
        yield Store("postgres", with_option(POSTGRES_URL, "table", table), prefix)
        _drop_table(table)
    else:
        require_server(REDIS_URL)
        yield Store("redis", REDIS_URL, prefix)
        delete_redis_keys(prefix)


def _drop_table(table: str) -> None:
    drop_lock_table(POSTGRES_URL, table)


@pytest.fixture
def hold(store: Store) -> Iterator[Callable[..., Holder]]:
    """Start holder subprocesses on ``store``; each is stopped (its leases released) afterwards."""
    started: list[Holder] = []

    def start(*keys: str) -> Holder:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, store.url, store.prefix, *keys],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert process.stdout is not None
        leases = json.loads(process.stdout.readline() or "null")
        assert isinstance(leases, dict), "the holder process failed to acquire its leases"
        assert process.stdout.readline().strip() == "ready"
        holder = Holder(process, leases)
        threading.Thread(target=_pump, args=(process, holder.lines), daemon=True).start()
        started.append(holder)
        return holder

    yield start
    for holder in started:
        assert holder.process.stdin is not None
        holder.process.stdin.close()
        try:
            holder.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            holder.process.kill()
            holder.process.wait()


def _pump(process: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.put(line)
    process.stdout.close()


def invoke(store: Store | None, *args: str, input: str | None = None, url: str | None = None) -> Result:
    """Run the standalone CLI in-process on ``store`` (or ``url``), with no URL in the environment."""
    options: list[str] = []
    if url is not None or store is not None:
        options += ["--url", url if url is not None else store.url]  # type: ignore[union-attr]
    if store is not None:
        options += ["--prefix", store.prefix]
    runner = CliRunner()
    return runner.invoke(
        cli,
        [*options, *args],
        input=input,
        env={"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None},
    )


def run(
    command: list[str], env: Mapping[str, str | None] | None = None, input: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run a real subprocess from the project root with ``env`` changes applied."""
    environ = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return subprocess.run(
        command, cwd=ROOT, env=environ, input=input, capture_output=True, text=True, timeout=120, check=False
    )


def console_script(name: str) -> str:
    """Path of an installed console script (``pip install -e .`` creates celery-exclusive)."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run {BIN / 'pip'} install -e {ROOT}")
    return str(path)


# -- list and show ---------------------------------------------------------------------------


def test_list_shows_every_lease_held_by_another_process(store: Store, hold: Callable[..., Holder]) -> None:
    """``list`` prints one row per live lease with the holder's host, pid, task id, task name and fence."""
    holder = hold("alpha", "beta")
    result = invoke(store, "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "KEY",
        "STATE",
        "HOST",
        "PID",
        "TASK",
        "ID",
        "TASK",
        "NAME",
        "AGE",
        "EXPIRES",
        "IN",
        "FENCE",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"alpha", "beta"}
    for key in ("alpha", "beta"):
        row = rows[key]
        assert row[1:6] == ["held", HOST, str(holder.process.pid), f"tid-{key}", "tests.hold"]
        assert row[-1] == str(holder.leases[key]["fence"])
        assert row[7].endswith("s")  # expires in, human readable


def test_list_shows_queued_and_rerun_markers_and_release_frees_them(store: Store) -> None:
    """A dedupe marker (``<key>#queued``) and a rerun marker list as such; ``release`` frees one."""
    with store.service() as service:
        service.mark("job#queued", ttl=30, holder={"task_id": "t1"})
        rerun = service.mark("job#rerun", ttl=30)
        listed = json.loads(invoke(store, "list", "job", "--json").stdout)["locks"]
        assert {lock["key"]: lock["state"] for lock in listed} == {
            "job#queued": "queued",
            "job#rerun": "rerun",
        }
        text = invoke(store, "list", "job").stdout.splitlines()
        assert [line.split()[:2] for line in text[1:]] == [["job#queued", "queued"], ["job#rerun", "rerun"]]
        released = invoke(store, "release", "job#queued", "--yes")
        assert released.exit_code == 0, released.output
        assert service.peek("job#queued") is None
        assert service.peek("job#rerun") is not None
        assert rerun is not None
        assert service.force_release("job#rerun", rerun)  # the module's store is shared by its tests


def test_list_by_a_long_key_shows_its_hashed_markers(store: Store) -> None:
    """A key too long for ``<key>#queued`` and ``<key>#rerun`` has markers shortened to fit the
    store (``<start>~<hash>#queued``): ``list <key>`` shows them, with their states."""
    from celery_exclusive.validation import QUEUED_SUFFIX, RERUN_SUFFIX, derived_key

    with store.service() as service:
        limit = service.provider.max_key_length
        key = f"long-{uuid.uuid4().hex[:8]}-".ljust(limit - len(store.prefix) - 2, "k")
        markers = [
            derived_key(key, end, prefix=store.prefix, max_length=limit)
            for end in (QUEUED_SUFFIX, RERUN_SUFFIX)
        ]
        assert not any(marker.startswith(key) for marker in markers)
        tokens = [service.mark(marker, ttl=30) for marker in markers]
        try:
            listed = json.loads(invoke(store, "list", key, "--json").stdout)["locks"]
            assert [(lock["key"], lock["state"]) for lock in listed] == [
                (markers[0], "queued"),
                (markers[1], "rerun"),
            ]
        finally:
            for marker, token in zip(markers, tokens, strict=True):
                assert token is not None
                service.force_release(marker, token)


def test_list_shows_a_cooling_key_and_release_frees_it(store: Store) -> None:
    """A run's lease kept past the run by a cooldown (its holder says ``cooldown``, the release
    wrote the run's completion record) lists as ``cooling``, not ``held``; ``release`` frees
    it at once, not at the cooldown's end."""
    from celery_exclusive.providers.base import Completion

    key = f"cool-{uuid.uuid4().hex[:8]}"
    with store.service() as service:
        lease = service.lock(key, hold_at_least=60, task_id="t1", holder={"task_id": "t1", "cooldown": 60})
        states = [lock["state"] for lock in json.loads(invoke(store, "list", key, "--json").stdout)["locks"]]
        assert states == ["held"]  # the run is in progress
        lease.release(Completion("t1", "success", 0, 60.0))
        (listed,) = json.loads(invoke(store, "list", key, "--json").stdout)["locks"]
        assert (listed["key"], listed["state"]) == (key, "cooling")
        text = invoke(store, "list", key).stdout.splitlines()
        assert [line.split()[:2] for line in text[1:]] == [[key, "cooling"]]
        released = invoke(store, "release", key, "--yes")
        assert released.exit_code == 0, released.output
        assert service.peek(key) is None
        again = service.try_lock(key)
        assert again is not None
        again.release()


def test_list_json_is_machine_readable_and_complete(store: Store, hold: Callable[..., Holder]) -> None:
    """``list --json`` gives prefix, filter and each lease's documented fields, tokens included."""
    holder = hold("alpha", "beta")
    result = invoke(store, "list", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["prefix"] == store.prefix
    assert data["filter"] == ""
    assert [lock["key"] for lock in data["locks"]] == ["alpha", "beta"]
    for lock in data["locks"]:
        assert set(lock) == LOCK_FIELDS
        assert lock["token"] == holder.leases[lock["key"]]["token"]
        assert lock["fence"] == holder.leases[lock["key"]]["fence"]
        assert lock["holder"]["pid"] == holder.process.pid
        assert lock["holder"]["host"] == HOST
        assert lock["holder"]["task_id"] == f"tid-{lock['key']}"
        assert lock["holder"]["task_name"] == "tests.hold"
        assert 0 <= lock["age"] < 60
        assert 0 < lock["expires_in"] <= 20
        assert lock["expires_in"] <= lock["hard_expires_in"]


def test_list_filters_by_key_prefix(store: Store, hold: Callable[..., Holder]) -> None:
    """``list PREFIX`` shows only keys (without the lock prefix) starting with PREFIX."""
    hold("alpha", "beta")
    result = invoke(store, "list", "al", "--json")
    assert result.exit_code == 0, result.output
    assert [lock["key"] for lock in json.loads(result.stdout)["locks"]] == ["alpha"]
    empty = invoke(store, "list", "zzz")
    assert empty.exit_code == 0
    assert "no live leases" in empty.stdout


def test_list_shows_each_slot_of_a_semaphore(store: Store) -> None:
    """A limit=3 key with two holders lists one row per held slot: slot 1 under the key,
    slot 2 as ``{key}#2 (slot 2 of key)``, each with its own token in ``--json``."""
    with store.service() as service:
        leases = [service.lock("sem", limit=3, ttl=30, holder={"task_name": "tests.sem"}) for _ in range(2)]
        slots = [lease.store_key[len(store.prefix) :] for lease in leases]
        assert slots == ["sem", "{sem}#2"]
        text = invoke(store, "list", "sem")
        assert text.exit_code == 0, text.output
        rows = text.stdout.splitlines()[1:]
        assert [row.split()[0] for row in rows] == slots
        assert "slot" not in rows[0]
        assert "{sem}#2 (slot 2 of sem)" in rows[1]
        assert all("tests.sem" in row for row in rows)
        listed = json.loads(invoke(store, "list", "sem", "--json").stdout)["locks"]
        assert [(lock["key"], lock["token"]) for lock in listed] == [
            (slot, lease.token) for slot, lease in zip(slots, leases, strict=True)
        ]
        for lease in leases:
            lease.release()
    assert "no live leases" in invoke(store, "list", "sem").stdout


def test_show_one_lease_in_text_and_json(store: Store, hold: Callable[..., Holder]) -> None:
    """``show KEY`` describes that lease, with its token, and ``--json`` gives the same fields as list."""
    holder = hold("alpha", "beta")
    text = invoke(store, "show", "beta")
    assert text.exit_code == 0, text.output
    assert "task tests.hold [tid-beta]" in text.stdout
    assert holder.leases["beta"]["token"] in text.stdout
    assert f"{HOST}:{holder.process.pid}" in text.stdout
    data = json.loads(invoke(store, "show", "beta", "--json").stdout)
    assert set(data) == LOCK_FIELDS
    assert data["key"] == "beta"
    assert data["token"] == holder.leases["beta"]["token"]


def test_show_free_key_is_not_an_error(store: Store) -> None:
    """``show`` of a free key says it is free (JSON null) and exits 0."""
    text = invoke(store, "show", "nobody-holds-this")
    assert text.exit_code == 0
    assert "is free" in text.stdout
    assert json.loads(invoke(store, "show", "nobody-holds-this", "--json").stdout) is None


# -- release ---------------------------------------------------------------------------------


def test_release_yes_frees_exactly_that_lease(store: Store, hold: Callable[..., Holder]) -> None:
    """``release KEY --yes`` frees that key only: the holder loses it and keeps its other lease."""
    holder = hold("alpha", "beta")
    result = invoke(store, "release", "alpha", "--yes")
    assert result.exit_code == 0, result.output
    fence = holder.leases["alpha"]["fence"]
    assert (
        f"released lease of task tests.hold [tid-alpha] on {HOST}:{holder.process.pid} (fence {fence})"
        in (result.stdout)
    )
    with store.service() as service:
        assert service.peek("alpha") is None
        beta = service.peek("beta")
        assert beta is not None
        assert beta.token == holder.leases["beta"]["token"]
    assert holder.lost(timeout=10) == {"alpha"}


def test_release_names_a_lock_core_holder_as_a_process(store: Store) -> None:
    """A lease taken by a ``LockService`` caller (no task) is "a process on host:pid" in the
    prompt, the refusal and the result (it read "lease of on host:pid")."""
    with store.service() as service:
        lease = service.lock("core")
        who = f"a process on {HOST}:{os.getpid()} (fence {lease.fence})"
        refused = invoke(store, "release", "core", "--token", "not-the-token")
        assert refused.stdout == f"'core': held by {who} with another token; nothing released\n"
        declined = invoke(store, "release", "core", input="n\n")
        assert f"Release the lease of {who} on 'core'?" in declined.stdout
        released = invoke(store, "release", "core", "--yes")
        assert released.stdout == f"'core': released lease of {who}\n"
        lease.release()


def test_release_with_the_holders_token_releases(store: Store, hold: Callable[..., Holder]) -> None:
    """``release KEY --token T --yes`` releases when T is the current holder's token."""
    holder = hold("alpha")
    result = invoke(store, "release", "alpha", "--yes", "--token", holder.leases["alpha"]["token"])
    assert result.exit_code == 0, result.output
    assert "released lease of" in result.stdout
    with store.service() as service:
        assert service.peek("alpha") is None


def test_release_with_a_wrong_token_releases_nothing(store: Store, hold: Callable[..., Holder]) -> None:
    """A --token that does not hold the key releases nothing and exits 1."""
    holder = hold("alpha")
    result = invoke(store, "release", "alpha", "--yes", "--token", "not-the-token")
    assert result.exit_code == 1, result.output
    assert "nothing released" in result.stdout
    with store.service() as service:
        info = service.peek("alpha")
        assert info is not None
        assert info.token == holder.leases["alpha"]["token"]


def test_release_declined_at_the_prompt_does_nothing(store: Store, hold: Callable[..., Holder]) -> None:
    """Without --yes, answering 'n' to the confirmation releases nothing and exits 1."""
    holder = hold("alpha")
    result = invoke(store, "release", "alpha", input="n\n")
    assert result.exit_code == 1, result.output
    assert "tests.hold [tid-alpha]" in result.stdout  # the prompt names who would lose the lease
    assert "nothing released" in result.stdout
    with store.service() as service:
        info = service.peek("alpha")
        assert info is not None
        assert info.token == holder.leases["alpha"]["token"]


def test_release_confirmed_at_the_prompt_releases(store: Store, hold: Callable[..., Holder]) -> None:
    """Without --yes, answering 'y' releases the lease."""
    hold("alpha")
    result = invoke(store, "release", "alpha", input="y\n")
    assert result.exit_code == 0, result.output
    assert "released lease of" in result.stdout
    with store.service() as service:
        assert service.peek("alpha") is None


def test_release_of_a_free_key_reports_it(store: Store) -> None:
    """Releasing a free key says so and exits 0."""
    result = invoke(store, "release", "nobody-holds-this", "--yes")
    assert result.exit_code == 0, result.output
    assert "key is free" in result.stdout


# -- hostile keys ----------------------------------------------------------------------------

#: A key built from task arguments: terminal escapes (clear screen, colour, window title),
#: a newline and carriage return that would forge table rows, and a bidi override.
HOSTILE_KEY = "evil\x1b[2J\x1b[31mred\nFAKE  row\rx\u202etxt"
HOSTILE_HOLDER = {"task_name": "t\x1b]0;title\x07", "task_id": "id\nforged", "host": "h\x1b[0m"}
RAW_CONTROLS = ("\x1b", "\x07", "\r", "\u202e")


def test_keys_and_holders_are_shown_escaped_never_raw(store: Store) -> None:
    """list/show/release print control characters of keys and holder fields as visible escapes."""
    with store.service() as service, service.lock(HOSTILE_KEY, holder=HOSTILE_HOLDER) as lease:
        outputs = {
            "list": invoke(store, "list"),
            "show": invoke(store, "show", HOSTILE_KEY),
            "release": invoke(store, "release", HOSTILE_KEY, "--token", "not-the-token"),
            "prompt": invoke(store, "release", HOSTILE_KEY, input="n\n"),
        }
        for name, result in outputs.items():
            assert result.exit_code in (0, 1), (name, result.output)
            assert not [c for c in RAW_CONTROLS if c in result.output], (name, result.output)
            assert "\\x1b[2J" in result.output or "\\x1b" in result.output, (name, result.output)
        listing = outputs["list"].stdout.splitlines()
        assert len(listing) == 2, listing  # the header and one row: no forged row
        assert "evil\\x1b[2J\\x1b[31mred\\nFAKE  row\\rx\\u202etxt" in listing[1]
        assert "id\\nforged" in listing[1]
        shown = outputs["show"].stdout
        assert len(shown.splitlines()) == len([line for line in shown.splitlines() if "  " in line])
        assert "t\\x1b]0;title\\x07" in shown
        as_json = json.loads(invoke(store, "show", HOSTILE_KEY, "--json").stdout)
        assert (as_json["key"], as_json["holder"]["task_id"]) == (HOSTILE_KEY, "id\nforged")  # JSON: exact
        assert lease.fence > 0


# -- doctor and errors -------------------------------------------------------------------------


def test_doctor_reports_ok_on_a_good_store(store: Store) -> None:
    """``doctor`` connects, times the round trip, runs the store's checks and exits 0."""
    result = invoke(store, "doctor")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("0 failed")
    assert not any(line.startswith("fail") for line in result.stdout.splitlines())
    data = json.loads(invoke(store, "doctor", "--json").stdout)
    assert data["ok"] is True
    assert data["round_trip"] > 0
    checks = {c["check"]: c for c in data["checks"]}
    assert {"url", "connect", "round trip", "listing"} <= set(checks)
    assert all(checks[name]["status"] == "ok" for name in ("url", "connect", "round trip", "listing"))
    assert len(checks) > 4, "the provider's own diagnose() findings are missing"


@pytest.mark.parametrize("name", sorted(DEAD_URLS))
def test_doctor_on_an_unreachable_store_fails_and_masks_the_password(name: str) -> None:
    """``doctor`` on an unreachable store fails the connect check, exits 1, and never shows the password."""
    result = invoke(None, "doctor", url=DEAD_URLS[name])
    assert result.exit_code == 1, result.output
    assert SECRET not in result.stdout + result.stderr
    assert "***" in result.stdout
    assert any(line.startswith("fail") and "connect" in line for line in result.stdout.splitlines())
    data = json.loads(invoke(None, "doctor", "--json", url=DEAD_URLS[name]).stdout)
    assert data["ok"] is False
    assert SECRET not in json.dumps(data)


@pytest.mark.parametrize("name", sorted(DEAD_URLS))
@pytest.mark.parametrize("command", [["list"], ["show", "k"], ["release", "k", "--yes"]])
def test_store_errors_exit_3_with_one_masked_line(name: str, command: list[str]) -> None:
    """Commands on an unreachable store print one masked line to stderr and exit 3."""
    result = invoke(None, *command, url=DEAD_URLS[name])
    assert result.exit_code == 3, result.output
    assert SECRET not in result.stdout + result.stderr
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_missing_url_names_the_option_and_the_environment_variable() -> None:
    """Without --url or CELERY_EXCLUSIVE_URL the CLI exits 2 naming both."""
    result = invoke(None, "list")
    assert result.exit_code == 2
    assert "--url" in result.stderr
    assert "CELERY_EXCLUSIVE_URL" in result.stderr


def test_configuration_and_input_errors_exit_2_masked() -> None:
    """An unknown scheme, a bad prefix or an empty key exits 2 with one line and no password."""
    unknown = invoke(None, "list", url=f"nosuch://u:{SECRET}@host/db")
    assert unknown.exit_code == 2
    assert SECRET not in unknown.stdout + unknown.stderr
    assert "unknown lock store scheme" in unknown.stderr
    bad_prefix = CliRunner().invoke(cli, ["--url", "memory://", "--prefix", "has space", "list"])
    assert bad_prefix.exit_code == 2
    assert "prefix" in bad_prefix.stderr
    empty_key = invoke(None, "show", "", url="memory://")
    assert empty_key.exit_code == 2
    assert "must not be empty" in empty_key.stderr


@pytest.mark.parametrize("scheme", ["redis", "postgresql+psycopg", "mysql+pymysql"])
def test_doctor_on_a_silent_store_fails_at_its_call_deadline(scheme: str) -> None:
    """A store that accepts connections and never answers is a failed connect check once the
    call deadline passes (the service's call_timeout), not a doctor that waits out the driver."""
    with silent_server() as port:
        url = f"{scheme}://u:{SECRET}@127.0.0.1:{port}/{'0' if scheme == 'redis' else 'test'}"
        service = LockService(url, prefix="silent:", call_timeout=1.0)
        try:
            started = time.monotonic()
            report = doctor(service, url=url)
            took = time.monotonic() - started
        finally:
            service.close(release=False)
    assert not report.ok
    assert report.round_trip is None
    checks = {d.check: d for d in report.checks}
    assert checks["connect"].status == "fail"
    # doctor's deadline (StoreCalls'), not the service's: PostgreSQL's first call ends at
    # libpq's 2 s connect_timeout floor setting up its schema.
    assert checks["connect"].detail == "lock store gave no answer during peek within 1 s"
    # Well under the drivers' own 10 s, with room for a loaded machine's scheduling.
    assert took < 1.0 + 2.0 * TIME_SLACK, took
    assert SECRET not in repr(report)


def test_doctor_warns_that_memory_is_per_process() -> None:
    """``doctor`` on memory:// passes but warns that the store lives in one process."""
    result = invoke(None, "doctor", url="memory://")
    assert result.exit_code == 0, result.output
    assert any(line.startswith("warn") and "one process" in line for line in result.stdout.splitlines())


def test_human_durations() -> None:
    """Durations are shown compactly at every scale."""
    assert [human_duration(s) for s in (0.42, 42, 187, 7500, 97200)] == [
        "0.4s",
        "42s",
        "3m07s",
        "2h05m",
        "1d03h",
    ]


# -- real subprocesses: the console script and the Celery sub-command ------------------------


def test_console_script_lists_and_releases(store: Store, hold: Callable[..., Holder]) -> None:
    """The installed ``celery-exclusive`` script reads CELERY_EXCLUSIVE_URL, lists and releases."""
    holder = hold("alpha", "beta")
    env = {"CELERY_EXCLUSIVE_URL": store.url, "CELERY_EXCLUSIVE_PREFIX": store.prefix}
    listed = run([console_script("celery-exclusive"), "list", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    assert [lock["key"] for lock in json.loads(listed.stdout)["locks"]] == ["alpha", "beta"]
    released = run([console_script("celery-exclusive"), "release", "beta", "--yes"], env)
    assert released.returncode == 0, released.stderr
    assert "released lease of" in released.stdout
    assert holder.lost(timeout=10) == {"beta"}


@pytest.mark.parametrize("name", sorted(DEAD_URLS))
def test_console_script_never_prints_the_password(name: str) -> None:
    """The real script's doctor and list on an unreachable store exit 1 and 3 without the password."""
    env = {"CELERY_EXCLUSIVE_URL": DEAD_URLS[name], "CELERY_EXCLUSIVE_PREFIX": None}
    doctor = run([console_script("celery-exclusive"), "doctor"], env)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    listed = run([console_script("celery-exclusive"), "list"], env)
    assert listed.returncode == 3, listed.stdout + listed.stderr
    for output in (doctor.stdout, doctor.stderr, listed.stdout, listed.stderr):
        assert SECRET not in output
    assert "Traceback" not in listed.stderr


def test_celery_subcommand_lists_and_releases_with_app_settings(
    store: Store, hold: Callable[..., Holder]
) -> None:
    """``celery -A app exclusive`` uses app.conf.exclusive_url/prefix, ranked above the environment."""
    holder = hold("alpha", "beta")
    env = {
        "CE_TEST_CLI_URL": store.url,
        "CE_TEST_CLI_PREFIX": store.prefix,
        # Lower precedence than app.conf: must be ignored (and never printed).
        "CELERY_EXCLUSIVE_URL": DEAD_URLS["redis"],
        "CELERY_EXCLUSIVE_PREFIX": "wrong-prefix:",
    }
    celery = [console_script("celery"), "-A", "tests.cli_app:app", "exclusive"]
    listed = run([*celery, "list", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert data["prefix"] == store.prefix
    assert [lock["key"] for lock in data["locks"]] == ["alpha", "beta"]
    assert {lock["holder"]["pid"] for lock in data["locks"]} == {holder.process.pid}
    table = run([*celery, "list"], env)
    assert table.returncode == 0, table.stderr
    assert "tid-alpha" in table.stdout
    declined = run([*celery, "release", "alpha"], env, input="n\n")
    assert declined.returncode == 1
    released = run([*celery, "release", "alpha", "--yes"], env)
    assert released.returncode == 0, released.stderr
    assert "released lease of" in released.stdout
    assert holder.lost(timeout=10) == {"alpha"}
    assert SECRET not in listed.stdout + listed.stderr + released.stdout + released.stderr


def test_celery_subcommand_falls_back_to_the_environment(store: Store, hold: Callable[..., Holder]) -> None:
    """Without app.conf.exclusive_url the sub-command reads CELERY_EXCLUSIVE_URL; with neither, exits 2."""
    hold("alpha")
    celery = [console_script("celery"), "-A", "tests.cli_app:app", "exclusive"]
    env: dict[str, str | None] = {
        "CE_TEST_CLI_URL": None,
        "CE_TEST_CLI_PREFIX": None,
        "CELERY_EXCLUSIVE_URL": store.url,
        "CELERY_EXCLUSIVE_PREFIX": store.prefix,
    }
    listed = run([*celery, "show", "alpha", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["key"] == "alpha"
    missing = run([*celery, "list"], {**env, "CELERY_EXCLUSIVE_URL": None})
    assert missing.returncode == 2
    assert "app.conf.exclusive_url" in missing.stderr
    assert "CELERY_EXCLUSIVE_URL" in missing.stderr
