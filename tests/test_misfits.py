"""Small misfits with the ecosystem (issue 14, item 5), each pinned by a test.

* a ``postgresql+psycopg2://`` URL without psycopg2 names psycopg2's own pip line;
* the CLI's usage errors and a ``release`` prompt without a terminal are one ``error:``
  line, as docs/cli.md promises, not click's usage block or ``Aborted!``;
* on PostgreSQL, a contender that loses a race for a free key names the winner;
* ``on_locked="raise"`` contention is an expected outcome for Celery (``Task.throws``):
  logged at INFO without a traceback, and the LockedError carries no chained context;
* kombu-style ``;``-separated Sentinel URLs are accepted next to the comma form.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from celery_exclusive import LockedError, LockService, MissingDriverError
from celery_exclusive.cli import cli, exclusive
from celery_exclusive.providers.redis import RedisLockProvider
from celery_exclusive.task import exclusive_task
from celery_exclusive.urls import provider_from_url
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server, with_option

ENV = {"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None}

# -- the pip line of a driver the URL names --------------------------------------------------------


def test_psycopg2_url_without_psycopg2_names_psycopg2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The postgres extra installs psycopg 3, which cannot help a psycopg2 URL: say what can."""
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # import psycopg2 -> ImportError
    with pytest.raises(MissingDriverError) as raised:
        provider_from_url("postgresql+psycopg2://app@127.0.0.1:1/app")
    message = str(raised.value)
    assert "pip install psycopg2-binary" in message
    assert "postgresql+psycopg://" in message  # the alternative the extra does serve
    assert raised.value.module == "psycopg2"


def test_default_postgres_driver_still_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """postgresql:// (psycopg 3) without psycopg still points at celery-exclusive[postgres]."""
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(MissingDriverError, match=r"pip install 'celery-exclusive\[postgres\]'"):
        provider_from_url("postgresql://app@127.0.0.1:1/app")


# -- one-line CLI errors ---------------------------------------------------------------------------


def _both(args: list[str], **kwargs: Any) -> list[Any]:
    """The standalone and the Celery front end run with ``args``."""
    app = Celery("misfit_cli", broker="memory://", set_as_current=False)
    return [
        CliRunner().invoke(cli, args, env=ENV, **kwargs),
        CliRunner().invoke(exclusive, args, env=ENV, obj=SimpleNamespace(app=app), **kwargs),
    ]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--bogus", "list"], "--bogus"),
        (["list", "--bogus"], "--bogus"),
        (["show"], "Missing argument 'KEY'"),
        (["release", "k", "--token"], "Option '--token' requires an argument"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["show", "a", "b"], "unexpected extra argument"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], fragment: str) -> None:
    """Bad options and arguments print one ``error:`` line and exit 2, never click's usage block."""
    for result in _both(["--url", "memory://", *args]):
        assert result.exit_code == 2, result.output
        lines = result.output.splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith("error: "), result.output
        assert fragment in lines[0]
        assert "Usage:" not in result.output
        assert "Try '" not in result.output


def test_usage_errors_under_a_real_celery_parent_are_one_line() -> None:
    """Under ``celery -A proj exclusive`` Celery's own group parses first; still one line."""
    env = {**os.environ, "CE_TEST_CLI_URL": "memory://"}
    for args in (["exclusive", "--bogus", "list"],):
        done = subprocess.run(
            [str(Path(sys.executable).parent / "celery"), "-A", "tests.cli_app:app", *args],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: "), done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert "Usage:" not in done.stdout + done.stderr


def test_help_and_version_still_work() -> None:
    """--help and --version are not errors."""
    for result in _both(["--help"]):
        assert result.exit_code == 0
        assert "Usage:" in result.output
    assert CliRunner().invoke(cli, ["--version"], env=ENV).exit_code == 0


def test_release_without_a_terminal_is_one_error_line(tmp_path: Path) -> None:
    """No answer to the prompt (stdin closed) releases nothing: one line naming --yes, exit 2."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    with LockService(url, prefix="rel:") as service, service.lock("k") as lease:
        for result in _both(["--url", url, "--prefix", "rel:", "release", "k"], input=""):
            assert result.exit_code == 2, result.output
            assert "Aborted" not in result.output
            error = [line for line in result.output.splitlines() if line.startswith("error: ")]
            assert len(error) == 1, result.output
            assert "--yes" in error[0]
        info = service.peek("k")
        assert info is not None
        assert info.token == lease.token


# -- PostgreSQL: the winner of a race is named -----------------------------------------------------


def test_postgres_contender_losing_a_race_names_the_winner() -> None:
    """A contender whose insert waited for a racing winner's commit reports that winner, not 'unknown'."""
    require_server(POSTGRES_URL)
    table = f"ce_race_{uuid.uuid4().hex[:10]}"
    prefix = f"race{uuid.uuid4().hex[:6]}:"
    engine = sa.create_engine(POSTGRES_URL)
    service = LockService(with_option(POSTGRES_URL, "table", table), prefix=prefix)
    try:
        service.lock("warm-up").release()  # creates the table
        outcome: dict[str, Any] = {}

        def contend() -> None:
            try:
                service.lock("k")
            except LockedError as exc:
                outcome["error"] = exc

        with engine.connect() as winner:
            winner.execute(
                sa.text(
                    f"INSERT INTO {table} (key, value, expires_at, created_at, deadline, fence, holder) "
                    "VALUES (:key, 'winner-token', now() + interval '30 s', now(), now() + interval '60 s', "
                    f"nextval('{table}_fence_seq'), :holder)"
                ),
                {"key": prefix + "k", "holder": '{"task_name": "tests.winner", "host": "w"}'},
            )
            contender = threading.Thread(target=contend)
            contender.start()
            time.sleep(0.5)  # the contender's insert now waits for this uncommitted row
            assert contender.is_alive()
            winner.commit()
            contender.join(10)
        locked = outcome["error"]
        assert locked.holder is not None, "the winner of the race was reported as unknown"
        assert locked.holder.token == "winner-token"
        assert locked.holder.holder["task_name"] == "tests.winner"
        assert locked.holder.key == "k"
    finally:
        service.close()
        engine.dispose()
        drop_lock_table(POSTGRES_URL, table)


# -- on_locked="raise" is an expected outcome ------------------------------------------------------


def test_raise_contention_is_logged_as_expected_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery logs a LockedError under on_locked='raise' at INFO, no traceback, no chained error."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    app = Celery("misfit_raise", broker="memory://", set_as_current=False)
    app.conf.exclusive_url = url
    app.conf.exclusive_prefix = "raise:"

    @exclusive_task(app=app, key="k", on_locked="raise", throws=(KeyError,), shared=False)
    def guarded() -> str:
        return "ran"

    @exclusive_task(app=app, key="k", on_locked="retry", lock_max_retries=0, shared=False)
    def retried() -> str:
        return "ran"

    assert KeyError in guarded.throws  # the task's own expected errors are kept
    caplog.set_level(logging.DEBUG)
    with LockService(url, prefix="raise:") as service, service.lock("k"):
        result = guarded.apply()
        exhausted = retried.apply()
    assert isinstance(result.result, LockedError)
    assert result.result.__context__ is None or result.result.__suppress_context__
    assert "During handling of the above exception" not in (result.traceback or "")
    records = [r for r in caplog.records if r.name == "celery.app.trace" and guarded.name in r.getMessage()]
    assert records, caplog.text
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records), records
    # Running out of lock retries is still an error worth an ERROR line.
    assert exhausted.state == "FAILURE"
    errors = [r for r in caplog.records if r.name == "celery.app.trace" and retried.name in r.getMessage()]
    assert any(r.levelno == logging.ERROR for r in errors), caplog.text


# -- kombu-style Sentinel URLs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "sentinel://:pw@h1:26379/mymaster/2;sentinel://:pw@h2:26380;sentinel://:pw@h3:26381",
        "sentinel://:pw@h1:26379/mymaster/2;sentinel://h2:26380;sentinel://h3:26381",
        "redis+sentinel://:pw@h1:26379/mymaster/2;redis+sentinel://h2:26380;redis+sentinel://h3:26381",
        "redis+sentinel://:pw@h1:26379,h2:26380,h3:26381/mymaster/2",
    ],
)
def test_kombu_style_sentinel_urls_are_accepted(url: str) -> None:
    """``sentinel://h1;sentinel://h2`` (kombu's form) parses like the comma form, offline."""
    provider = provider_from_url(url)
    assert isinstance(provider, RedisLockProvider)
    pool = provider._server.target.pool
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in pool.sentinel_manager.sentinels
    ] == [("h1", 26379), ("h2", 26380), ("h3", 26381)]
    assert pool.service_name == "mymaster"
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["password"] == "pw"
    assert "pw" not in repr(provider)
    provider.close()


def test_kombu_style_sentinel_urls_must_agree() -> None:
    """Parts naming different services or schemes are rejected rather than guessed."""
    from celery_exclusive import ConfigurationError

    for url, fragment in (
        ("sentinel://h1:26379/a;sentinel://h2:26379/b", "different paths"),
        ("sentinel://:x@h1:26379/a;sentinel://:y@h2:26379", "different userinfos"),
        ("sentinel://h1:26379/a;redis://h2:6379/0", "of one scheme"),
    ):
        with pytest.raises(ConfigurationError, match=fragment) as raised:
            provider_from_url(url)
        assert ":x@" not in str(raised.value)
