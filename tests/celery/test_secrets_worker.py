"""A real worker whose ``exclusive_url`` has a password: what Celery itself prints of it.

``celery inspect conf`` (which Flower shows too) is answered by the worker from its
``app.conf`` censored by ``celery.app.utils.HIDDEN_SETTINGS``; the worker's banner and log
at DEBUG, ``celery report`` and a task run through the lock store must not show the
password either.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from celery_exclusive import ConfigurationError
from tests.celery.conftest import BROKER_URL, CELERY_BIN, ROOT, SESSION, spawn, stop_all, wait_ready
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server

pytestmark = [pytest.mark.celery, pytest.mark.timeout(180)]

PW = "Zq8 SEC'RET pw"
QUIET = ["--without-gossip", "--without-mingle"]  # a space and a quote: the drivers accept them unencoded


def _pieces(pw: str) -> set[str]:
    return {pw[i : i + 4] for i in range(len(pw) - 3)}


def test_celery_shows_no_piece_of_the_lock_store_password(celery_logdir: Path) -> None:
    """``inspect conf``, ``report``, the worker's banner and DEBUG log, and a task's run:
    ``exclusive_url`` is censored or masked everywhere Celery prints it."""
    require_server(BROKER_URL)
    require_server(POSTGRES_URL)
    tag = uuid.uuid4().hex[:6]
    table = f"ce_secw_{tag}"
    # PostgreSQL trusts 127.0.0.1: the store works whatever the password says.
    url = f"postgresql+psycopg://postgres:{PW}@127.0.0.1:5432/test?ce_table={table}"
    name = f"secrets-{tag}"
    env = {
        "CE_SECRETS_URL": url,
        "CE_SECRETS_PREFIX": f"cesec{tag}:",
        "CE_CELERY_QUEUE": f"cetest-{SESSION}-{tag}",
    }
    worker = spawn(
        name,
        [
            "worker",
            "-P",
            "solo",
            "-n",
            f"{name}@%h",
            "-Q",
            env["CE_CELERY_QUEUE"],
            "-l",
            "DEBUG",
            "--without-gossip",
            "--without-mingle",
        ],
        env,
        celery_logdir,
        app="tests.celery.secrets_app",
    )
    texts: list[str] = []
    try:
        wait_ready([worker])
        run_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        for args in (
            ["inspect", "conf", "-d", f"{name}@{os.uname().nodename}", "--timeout", "10"],
            ["report"],
        ):
            done = subprocess.run(
                [CELERY_BIN, "-A", "tests.celery.secrets_app", *args],
                cwd=ROOT,
                env=run_env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert "exclusive_url" in done.stdout, done.stdout
            texts += [done.stdout, done.stderr]
        os.environ.update(env)  # the in-process app reads it when imported
        try:
            from tests.celery.secrets_app import app, job

            replies = app.control.inspect(destination=[f"{name}@{os.uname().nodename}"], timeout=10).conf()
            assert replies, "the worker did not answer inspect conf"
            texts.append(repr(replies))
            result = job.apply_async(queue=env["CE_CELERY_QUEUE"])
            assert result.get(timeout=60) == "ran"
        finally:
            for key in env:
                os.environ.pop(key, None)
    finally:
        stop_all([worker])
        drop_lock_table(POSTGRES_URL, table)
    texts.append(worker.text())
    assert "exclusive_url" in texts[-2]  # the conf reply lists the setting, censored
    leaks = [text for text in texts if any(piece in text for piece in _pieces(PW))]
    assert not leaks, leaks[0][-3000:]


def test_a_worker_on_a_store_url_with_a_raw_at_in_its_password_logs_no_piece_of_it(
    celery_logdir: Path,
) -> None:
    """A raw ``@`` in the lock store's password, which SQLAlchemy and libpq would take the
    rest of for the host: the store is refused when it is built, at the worker's start (its
    ERROR line) and at the task's run (a ConfigurationError saying to percent-encode it).
    The worker's log at DEBUG (the start-up check, the task's failure with the whole
    traceback) and the failed result's traceback show no piece of the password."""
    require_server(BROKER_URL)
    require_server(POSTGRES_URL)
    pw = "Zq8@SEC@RETpw"
    tag = uuid.uuid4().hex[:6]
    name = f"secrets-misread-{tag}"
    env = {
        "CE_SECRETS_URL": f"postgresql+psycopg://postgres:{pw}@127.0.0.1:5432/test",
        "CE_SECRETS_PREFIX": f"cesec{tag}:",
        "CE_CELERY_QUEUE": f"cetest-{SESSION}-{tag}",
    }
    worker = spawn(
        name,
        ["worker", "-P", "solo", "-n", f"{name}@%h", "-Q", env["CE_CELERY_QUEUE"], "-l", "DEBUG", *QUIET],
        env,
        celery_logdir,
        app="tests.celery.secrets_app",
    )
    texts: list[str] = []
    try:
        wait_ready([worker])
        os.environ.update(env)
        try:
            from tests.celery.secrets_app import job

            result = job.apply_async(queue=env["CE_CELERY_QUEUE"])
            with pytest.raises(ConfigurationError, match="percent-encode"):
                result.get(timeout=60)
            texts += [str(result.traceback), repr(result.result)]
        finally:
            for key in env:
                os.environ.pop(key, None)
    finally:
        stop_all([worker])
    texts.append(worker.text())
    log = texts[-1]
    assert "will all fail until app.conf.exclusive_url" in log, log[-3000:]  # the start-up ERROR
    assert log.count("percent-encode an '@' in the password") >= 2, log[-3000:]  # start and run
    leaks = [text for text in texts if any(piece in text for piece in _pieces(pw))]
    assert not leaks, leaks[0][-3000:]
