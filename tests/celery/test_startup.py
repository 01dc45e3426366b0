"""Worker start-up: a missing lock store is reported (or fatal), and pool processes connect early.

Real ``celery worker`` subprocesses of the integration app, real Redis broker, real PostgreSQL.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from celery_exclusive.worker import EX_CONFIG, STARTUP_CHECK_ENV, STARTUP_CHECK_SETTING
from tests.celery.conftest import BROKER_URL, Process, spawn, wait_for, wait_ready
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server, with_option

WORKER = ["worker", "-P", "prefork", "-c", "1", "-l", "INFO", "--without-gossip", "--without-mingle"]


def start(logdir: Path, env: dict[str, str]) -> Process:
    name = f"startup-{uuid.uuid4().hex[:6]}"
    queue = f"cetest-{name}"
    return spawn(name, [*WORKER, "-n", f"{name}@%h", "-Q", queue], {"CE_CELERY_QUEUE": queue, **env}, logdir)


def test_missing_store_is_an_error_line_naming_the_setting(celery_logdir: Path) -> None:
    require_server(BROKER_URL)
    worker = start(celery_logdir, {"CELERY_EXCLUSIVE_URL": ""})
    try:
        wait_ready([worker])
        log = worker.text()
    finally:
        worker.stop(timeout=1)  # nothing to finish: no task was sent
    errors = [line for line in log.splitlines() if "ERROR/MainProcess" in line and "celery-exclusive" in line]
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
