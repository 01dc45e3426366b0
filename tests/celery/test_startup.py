"""Worker start-up: a missing lock store is reported (or fatal), and pool processes connect early.

Real ``celery worker`` subprocesses of the integration app, real Redis broker, real PostgreSQL.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, inspect

from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import (
    EX_CONFIG,
    STARTUP_CHECK_ENV,
    STARTUP_CHECK_SETTING,
    WARM_UP_TIMEOUT,
    get_lock_service,
    warm_up,
)
from tests.celery.conftest import BROKER_URL, Process, spawn, wait_for, wait_ready
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server, with_option
from tests.faults.servers import _children
from tests.silent import silent_server

WORKER = ["worker", "-P", "prefork", "-c", "1", "-l", "INFO", "--without-gossip", "--without-mingle"]


def start(logdir: Path, env: dict[str, str]) -> Process:
    name = f"startup-{uuid.uuid4().hex[:6]}"
    queue = f"cetest-{name}"
    return spawn(name, [*WORKER, "-n", f"{name}@%h", "-Q", queue], {"CE_CELERY_QUEUE": queue, **env}, logdir)


def error_lines_at_start(logdir: Path, env: dict[str, str]) -> tuple[str, list[str]]:
    """Start a worker with ``env``, wait until it is ready and stop it: its log, and the
    ERROR lines celery-exclusive wrote in its main process."""
    worker = start(logdir, env)
    try:
        wait_ready([worker])
        log = worker.text()
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
    errors = [line for line in log.splitlines() if "ERROR/MainProcess" in line and "celery-exclusive" in line]
    return log, errors


def test_missing_store_is_an_error_line_naming_the_setting(celery_logdir: Path) -> None:
    require_server(BROKER_URL)
    log, errors = error_lines_at_start(celery_logdir, {"CELERY_EXCLUSIVE_URL": ""})
    assert len(errors) == 1, log[-3000:]
    assert "exclusive task(s) (tests.celery.app." in errors[0]
    assert "app.conf.exclusive_url" in errors[0]
    assert "CELERY_EXCLUSIVE_URL" in errors[0]
    assert f"{STARTUP_CHECK_SETTING}='fatal'" in errors[0]
    # Already said once at start: the pool processes do not repeat it.
    assert "could not open the lock store" not in log


def test_fatal_startup_check_stops_the_worker(celery_logdir: Path) -> None:
    require_server(BROKER_URL)
    worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": "", STARTUP_CHECK_ENV: "fatal"})
    try:
        assert worker.popen.wait(60) == EX_CONFIG, worker.text()[-3000:]
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
    log = worker.text()
    assert "CRITICAL/MainProcess" in log
    assert "no lock store configured" in log
    assert " ready." not in log


STARTUP_SECRET = "Zq8STARTUPpw"


def test_an_unusable_store_url_stops_a_fatal_start(celery_logdir: Path) -> None:
    """A URL no store can be built from (here an unknown scheme) is a configuration error
    like a missing one: CRITICAL and exit 78 under "fatal", its password masked. It used to
    be a WARNING from the driver preload, and the worker became ready to fail every task."""
    require_server(BROKER_URL)
    url = f"postgresqll://app:{STARTUP_SECRET}@127.0.0.1/test"
    worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": url, STARTUP_CHECK_ENV: "fatal"})
    try:
        assert worker.popen.wait(60) == EX_CONFIG, worker.text()[-3000:]
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
    log = worker.text()
    critical = [line for line in log.splitlines() if "CRITICAL/MainProcess" in line]
    assert len(critical) == 1, log[-3000:]
    assert "unknown lock store scheme 'postgresqll'" in critical[0]
    assert "CELERY_EXCLUSIVE_URL" in critical[0]
    assert STARTUP_SECRET not in log
    assert " ready." not in log


def test_an_unusable_store_url_is_an_error_line_at_start(celery_logdir: Path) -> None:
    """The same under "log": one ERROR line naming the problem (here a query parameter
    redis-py's connection refuses), not a WARNING per process, and no password."""
    require_server(BROKER_URL)
    url = f"redis://:{STARTUP_SECRET}@127.0.0.1:6379/0?sockettimeout=2"
    log, errors = error_lines_at_start(celery_logdir, {"CELERY_EXCLUSIVE_URL": url})
    assert len(errors) == 1, log[-3000:]
    assert "unknown URL option 'sockettimeout'" in errors[0]
    assert f"{STARTUP_CHECK_SETTING}='fatal'" in errors[0]
    assert "could not load the lock store's driver" not in log
    assert "could not open the lock store" not in log  # said once, at start
    assert STARTUP_SECRET not in log


def test_pool_processes_open_the_store_before_the_first_task(celery_logdir: Path) -> None:
    """The lock table of a fresh table name appears with no task sent: a pool process connected."""
    require_server(BROKER_URL)
    require_server(POSTGRES_URL)
    table = f"ce_warm_{uuid.uuid4().hex[:8]}"
    worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": with_option(POSTGRES_URL, "table", table)})
    engine = create_engine(POSTGRES_URL)
    try:
        wait_ready([worker])
        wait_for(lambda: inspect(engine).has_table(table), 20, what=f"table {table}")
        assert "could not open the lock store" not in worker.text()
        assert "ERROR" not in worker.text()
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
        engine.dispose()
        drop_lock_table(POSTGRES_URL, table)


@pytest.mark.parametrize("value", ["loud", "FATAL"])
def test_unknown_startup_check_value_is_a_configuration_error(value: str) -> None:
    from celery_exclusive.errors import ConfigurationError
    from celery_exclusive.worker import startup_check_mode

    with pytest.raises(ConfigurationError, match=STARTUP_CHECK_SETTING):
        startup_check_mode({STARTUP_CHECK_SETTING: value})


def test_an_unknown_startup_check_value_is_one_error_line_at_worker_start(celery_logdir: Path) -> None:
    """A misspelt ``exclusive_startup_check`` is one ERROR line naming the setting, and the
    worker goes on with the default check (``"log"``: here, the missing store's line); it
    used to raise out of the signal receiver (Celery logged a traceback, checked nothing)."""
    require_server(BROKER_URL)
    log, errors = error_lines_at_start(celery_logdir, {"CELERY_EXCLUSIVE_URL": "", STARTUP_CHECK_ENV: "loud"})
    assert "check_at_worker_start" not in log, log[-3000:]  # Celery's "Signal handler ... raised"
    assert len(errors) == 2, log[-3000:]
    assert STARTUP_CHECK_SETTING in errors[0]
    assert "'loud'" in errors[0]
    assert "CELERY_EXCLUSIVE_URL" in errors[1]


def _body() -> None:
    pass


@pytest.mark.parametrize("scheme", ["redis", "postgresql+psycopg"])
def test_warm_up_on_a_silent_store_gives_up_at_its_deadline(
    scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that accepts connections and never answers holds a process start for at most
    WARM_UP_TIMEOUT (not the driver's 10-40 s): a WARNING, and the process goes on."""
    with silent_server() as port:
        app = Celery(f"silent-{uuid.uuid4().hex[:6]}", set_as_current=False)
        database = "0" if scheme == "redis" else "test"  # a Redis path is a database number
        app.conf.exclusive_url = f"{scheme}://u:pw@127.0.0.1:{port}/{database}"
        exclusive_task(app=app, name=f"silent.t{uuid.uuid4().hex[:6]}")(_body)
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
                warm_up(app)
            took = time.monotonic() - started
        finally:
            get_lock_service(app).close(release=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"gave no answer during warm-up within {WARM_UP_TIMEOUT:g} s" in m for m in warnings), warnings
    assert WARM_UP_TIMEOUT - 0.5 <= took < WARM_UP_TIMEOUT + 2, took
    assert "pw" not in " ".join(warnings)


def test_a_solo_worker_on_a_silent_store_starts_after_the_warm_up_deadline(celery_logdir: Path) -> None:
    """A solo worker warms up in its main process before ``ready.``: on a silent store it logs
    the deadline's WARNING and becomes ready instead of waiting out the driver's timeouts."""
    require_server(BROKER_URL)
    with silent_server() as port:
        name = f"silent-{uuid.uuid4().hex[:6]}"
        args = ["worker", "-P", "solo", "-l", "INFO", "--without-gossip", "--without-mingle"]
        worker = spawn(
            name,
            [*args, "-n", f"{name}@%h", "-Q", f"cetest-{name}"],
            {"CE_CELERY_QUEUE": f"cetest-{name}", "CELERY_EXCLUSIVE_URL": f"redis://127.0.0.1:{port}/0"},
            celery_logdir,
        )
        try:
            wait_ready([worker])
            log = worker.text()
        finally:
            worker.stop(timeout=1)  # nothing to finish: no task was sent
    warned = [line for line in log.splitlines() if "could not open the lock store at process start" in line]
    assert len(warned) == 1, log[-3000:]
    assert f"gave no answer during warm-up within {WARM_UP_TIMEOUT:g} s" in warned[0]
    assert log.index(warned[0]) < log.index(" ready.")


def test_a_prefork_child_on_a_silent_store_is_not_killed_for_a_late_up(celery_logdir: Path) -> None:
    """A prefork child warms up in ``worker_process_init``, before it tells the pool it is up,
    and the pool SIGKILLs a child that is not up within ``worker_proc_alive_timeout`` (4 s by
    default). On a silent store a replacement child (here: for one we killed) must therefore
    give up its warm-up before that, and then stay: one replacement, one warning. (Before:
    a 5 s warm-up, killed at 4 s, replaced, killed again, as long as the store is silent.)"""
    require_server(BROKER_URL)
    with silent_server() as port:
        worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": f"redis://127.0.0.1:{port}/0"})
        try:
            wait_ready([worker])
            wait_for(lambda: "could not open the lock store" in worker.text(), 20, what="first warm-up")
            wait_for(lambda: _children(worker.popen.pid), 10, what="the pool child")
            # The first child was started before the event loop ran (no UP deadline then);
            # its replacement is started by the running loop, which enforces it.
            first = _children(worker.popen.pid)
            for pid in first:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: set(_children(worker.popen.pid)) - set(first), 10, what="a replacement")
            time.sleep(6)  # past the UP deadline (4 s) of the replacement, and its warm-up (2 s)
            log = worker.text()
            replacements = set(_children(worker.popen.pid)) - set(first)
        finally:
            worker.stop(timeout=1)  # nothing to finish: no task was sent
    assert "Timed out waiting for UP message" not in log, log[-3000:]
    warned = [line for line in log.splitlines() if "could not open the lock store at process start" in line]
    assert len(warned) == 2, log[-3000:]  # the first child's, and its one replacement's
    assert len(replacements) == 1, replacements


def test_a_task_option_at_odds_with_the_app_settings_stops_a_fatal_start(celery_logdir: Path) -> None:
    """A task's own option that only the app's settings make invalid (``ttl=60`` under a
    ``max_lifetime`` of 30 s) is reported at start, naming the task and the conflict, as a
    missing store is: it used to pass the start and fail every run of that task."""
    require_server(BROKER_URL)
    conflicting = {"CELERY_EXCLUSIVE_MAX_LIFETIME": "30", STARTUP_CHECK_ENV: "fatal"}
    worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": "memory://", **conflicting})
    try:
        assert worker.popen.wait(60) == EX_CONFIG, worker.text()[-3000:]
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
    critical = [line for line in worker.text().splitlines() if "CRITICAL/MainProcess" in line]
    assert len(critical) == 1, worker.text()[-3000:]
    assert "tests.celery.app.hold_long_ttl" in critical[0]
    assert "ttl (60 s) must not exceed max_lifetime (30 s)" in critical[0]
    assert "tests.celery.app.hold_short_ttl" not in critical[0], "a task whose options agree is not named"
    assert " ready." not in worker.text()


def test_a_task_option_at_odds_with_the_app_settings_is_an_error_line_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same in the default mode ("log"): one ERROR line at start naming the task, and
    the worker goes on (the task's runs fail, saying the same)."""
    from celery_exclusive.worker import check_at_worker_start

    app = Celery(f"ce_start_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(exclusive_url="memory://", exclusive_max_lifetime=60)

    @exclusive_task(app=app, key="k:{n}", ttl=120, name=f"{app.main}.long", shared=False)
    def long(n: int) -> None: ...

    @exclusive_task(app=app, key="k:{n}", ttl=30, name=f"{app.main}.fine", shared=False)
    def fine(n: int) -> None: ...

    @exclusive_task(app=app, key=["a:{n}", "b:{n}"], name=f"{app.main}.several", shared=False)
    def several(n: int) -> None: ...

    app.conf.exclusive_on_locked = "rerun"  # what a task of several keys cannot do
    worker = type("Worker", (), {"app": app, "pool_cls": "solo", "task_events": False})()
    with caplog.at_level(logging.ERROR, logger="celery_exclusive"):
        check_at_worker_start(instance=worker)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert f"{app.main}.long: ttl (120 s) must not exceed max_lifetime (60 s)" in errors[0]
    assert f"{app.main}.several: {app.main}.several has several lock keys" in errors[0]
    assert "on_locked='rerun'" in errors[0]
    assert f"{app.main}.fine" not in errors[0]


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"exclusive_default_ttl": "300"}, "app.conf.exclusive_default_ttl: ttl must be seconds"),
        ({"exclusive_on_lost": "die"}, "app.conf.exclusive_on_lost: on_lost must be one of"),
        # A misspelt setting was ignored, here as at every run: nothing was logged.
        ({"exclusive_ttl": 300}, "app.conf.exclusive_ttl; did you mean exclusive_default_ttl?"),
    ],
)
def test_a_bad_setting_other_than_the_url_is_not_blamed_on_the_url(
    conf: dict[str, Any], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up line for a bad setting names that setting, not ``exclusive_url``: it
    used to say "until app.conf.exclusive_url (or CELERY_EXCLUSIVE_URL) is right: " before
    the error of, say, ``exclusive_default_ttl = "300"``, with the URL fine."""
    from celery_exclusive.worker import check_at_worker_start

    app = Celery(f"ce_start_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(exclusive_url="memory://", **conf)

    @exclusive_task(app=app, key="k:{n}", name=f"{app.main}.t", shared=False)
    def t(n: int) -> None: ...

    worker = type("Worker", (), {"app": app, "pool_cls": "solo", "task_events": False})()
    with caplog.at_level(logging.ERROR, logger="celery_exclusive"):
        check_at_worker_start(instance=worker)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert named in errors[0]
    assert "exclusive_url" not in errors[0]
    assert "CELERY_EXCLUSIVE_URL" not in errors[0]
    assert f"{app.main}.t" in errors[0]
