"""Credentials are masked once, by one function, on every channel that shows a URL.

:func:`celery_exclusive.urls.mask_url` is the only masker; every message, repr, log line and
CLI line goes through it. The unit cases pin its contract (what is hidden, what is kept);
the channel tests plant a distinctive password in PostgreSQL, Redis and MariaDB URLs (as
userinfo and as query parameters) and grep every place it could surface: logs at DEBUG,
exceptions and their ``__cause__``/``__context__`` chain, reprs, the CLI's stdout and stderr
for every command and error path, ``celery report`` / ``app.conf.humanize()``, and the
Prometheus exposition.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from celery_exclusive import ConfigurationError, ExclusiveError, LockService, metrics
from celery_exclusive.cli import Target as CliTarget
from celery_exclusive.cli import cli, exclusive
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import exclusive_task
from celery_exclusive.urls import known_secrets, mask_error, mask_url, url_secrets
from celery_exclusive.worker import get_lock_service
from tests.conftest import (
    MYSQL_URL,
    POSTGRES_URL,
    REDIS_URL,
    delete_redis_keys,
    drop_lock_table,
    require_server,
)

PW = "Zq8SECRETpw"
#: A password as the drivers take it unencoded: spaces and a quote (invalid URL syntax).
SPACED_PW = "Zq8 SEC'RET pw"
#: Raw "@"s: SQLAlchemy and libpq take the rest for the host, and the drivers name that host.
AT_PW = "Zq8@SEC@RETpw"
#: A line break (and a tab), which the drivers take too.
BROKEN_PW = "Zq8SEC\nRE\tTpw"
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

MASK_CASES: list[tuple[str, str, str]] = [
    ("userinfo", f"postgresql://app:{PW}@db/app", "postgresql://app:***@db/app"),
    ("password-only", f"redis://:{PW}@h:6379/0", "redis://:***@h:6379/0"),
    ("user-only-kept", "postgresql://app@localhost/app", "postgresql://app@localhost/app"),
    ("no-credentials", "redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("at-in-password", f"redis://u:p@{PW}@h/0", "redis://u:***@h/0"),
    ("slash-in-password", f"postgresql://u:a/{PW}@h/db", "postgresql://u:***@h/db"),
    ("percent-encoded", f"postgresql://u:{PW}%40x%3Ay@h/db", "postgresql://u:***@h/db"),
    ("query-password", f"redis://h:6399/11?password={PW}", "redis://h:6399/11?password=***"),
    (
        "query-keeps-the-rest",
        f"error: redis redis://h:6399/11?password={PW}&db=2: Connection refused",
        "error: redis redis://h:6399/11?password=***&db=2: Connection refused",
    ),
    ("ssl_password", f"rediss://h/0?ssl_password={PW}&x=1", "rediss://h/0?ssl_password=***&x=1"),
    ("sslpassword", f"postgresql://u@h/db?sslpassword={PW}", "postgresql://u@h/db?sslpassword=***"),
    ("token", f"redis://h/0?token={PW}#frag", "redis://h/0?token=***#frag"),
    ("access_token", f"redis://h/0?a=1&ACCESS_TOKEN={PW}", "redis://h/0?a=1&ACCESS_TOKEN=***"),
    (
        "multi-host",
        f"postgresql://u:{PW}@h1:5432,h2:5433/db?target_session_attrs=read-write",
        "postgresql://u:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
    ),
    (
        "semicolon-separated",
        f"sentinel://:{PW}@h1:26379/m;sentinel://:{PW}@h2:26379",
        "sentinel://:***@h1:26379/m;sentinel://:***@h2:26379",
    ),
    (
        "semicolon-separated-query",
        f"sentinel://h1:26379/m?password={PW};sentinel://h2:26379",
        "sentinel://h1:26379/m?password=***;sentinel://h2:26379",
    ),
    ("no-scheme", f"user:{PW}@host/db", "user:***@host/db"),
    ("apostrophe-in-password", f"postgresql://u:a'{PW}@h/db", "postgresql://u:***@h/db"),
    (
        "apostrophe-in-password-in-a-message",
        f"lock store 'redis://:{PW}'x@h/0': refused",
        "lock store 'redis://:***@h/0': refused",
    ),
    ("scheme-missing-its-colon", f"redis//:{PW}@h:6379/0", "redis//:***@h:6379/0"),
    (
        "scheme-relative",
        f"malformed lock store URL '//u:{PW}@h/db': expected",
        "malformed lock store URL '//u:***@h/db': expected",
    ),
    (
        "no-scheme-in-a-message",
        f"malformed lock store URL 'user:{PW}@host/db': expected scheme://...",
        "malformed lock store URL 'user:***@host/db': expected scheme://...",
    ),
    (
        "dsn-in-a-driver-message",
        f"invalid dsn: host=h password={PW} dbname=x",
        "invalid dsn: host=h password=*** dbname=x",
    ),
    (
        "two-urls-in-a-message",
        f"'redis://:{PW}@a/0' then (postgresql://u:{PW}@b/x) failed",
        "'redis://:***@a/0' then (postgresql://u:***@b/x) failed",
    ),
    ("ipv6", f"redis://:{PW}@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    (
        "already-masked-keeps-its-punctuation",
        "error: redis redis://h:6399/11?password=***: Error 111 connecting",
        "error: redis redis://h:6399/11?password=***: Error 111 connecting",
    ),
    ("plain-text-untouched", "lock 'report:42' is held by task x", "lock 'report:42' is held by task x"),
    ("line-break-in-password", "postgresql://u:Zq8SEC\nRETpw@h/db", "postgresql://u:***@h/db"),
    ("line-breaks-and-tab", "redis://:Zq8\r\nSEC\tRET\npw@h:6379/0", "redis://:***@h:6379/0"),
    ("line-break-first", "redis://:\nZq8SECRET@h:6379/0", "redis://:***@h:6379/0"),
    (
        "line-break-in-a-message",
        "could not connect to redis://:Zq8\nSECRET@h:6379/0: refused\nretrying",
        "could not connect to redis://:***@h:6379/0: refused\nretrying",
    ),
    ("line-break-and-space", "redis://:Zq8 SEC\nRET@h:1/0", "redis://:***@h:1/0"),
    ("at-then-line-break-in-one-url", "redis://u:Zq8@SEC\nRET@h:1/0", "redis://u:***@h:1/0"),
    (
        "a-line-break-after-a-url-without-one",
        "lost redis://h:6379/0\nheld by celery@w1",
        "lost redis://h:6379/0\nheld by celery@w1",
    ),
    ("space-in-password", "postgresql://user:pa ss@host/db", "postgresql://user:***@host/db"),
    ("spaces-and-quote", f"redis://:{SPACED_PW}@h:6379/0", "redis://:***@h:6379/0"),
    (
        "space-in-password-in-a-message",
        "could not connect to postgresql://u:my secret pw@h:5432/db: refused",
        "could not connect to postgresql://u:***@h:5432/db: refused",
    ),
    ("space-and-at-in-password", "redis://:ab@cd ef@h/0: refused", "redis://:***@h/0: refused"),
    (
        "spaces-in-a-list",
        "sentinel://:pa ss@h1:26379/m;sentinel://:x y@h2:26379",
        "sentinel://:***@h1:26379/m;sentinel://:***@h2:26379",
    ),
    ("no-scheme-spaced", "user:pa ss@host/db", "user:***@host/db"),
    ("scheme-relative-spaced", "//u:pa ss@h/db", "//u:***@h/db"),
    ("scheme-missing-its-colon-spaced", "redis//:pa ss@h:6379/0", "redis//:***@h:6379/0"),
    ("space-in-query-password", "redis://h/0?password=pa ss&db=1", "redis://h/0?password=***&db=1"),
    ("at-in-query-password", "redis://h/0?password=p@ss", "redis://h/0?password=***"),
    ("quoted-dsn-password", "invalid dsn: password='pa ss' host=h", "invalid dsn: password=*** host=h"),
    (
        "an-at-between-quotes-is-the-message's",
        "SQL lock store mysql://h:3306/db failed: (1045, \"Access denied for user 'root'@'h'\")",
        "SQL lock store mysql://h:3306/db failed: (1045, \"Access denied for user 'root'@'h'\")",
    ),
    (
        "masked-url-then-an-at",
        "redis://:***@h/0 is held by celery@w1",
        "redis://:***@h/0 is held by celery@w1",
    ),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in MASK_CASES], ids=[c[0] for c in MASK_CASES])
def test_mask_url_hides_every_secret_and_keeps_the_rest(text: str, expected: str) -> None:
    """The one masker hides userinfo passwords and secret query parameters, nothing else."""
    assert mask_url(text) == expected
    assert mask_url(expected) == expected  # idempotent


def test_mask_url_also_hides_known_secrets_anywhere() -> None:
    """Secrets of the configured URL are hidden wherever a driver echoes them, encoded or not."""
    url = f"postgresql://u:{PW}%21x@h/db?sslpassword=k3y{PW}"
    secrets = url_secrets(url)
    assert f"{PW}!x" in secrets
    assert f"{PW}%21x" in secrets
    assert f"k3y{PW}" in secrets
    text = f"auth failed for password {PW}!x (raw {PW}%21x), key k3y{PW}"
    masked = mask_url(text, secrets)
    assert PW not in masked
    assert masked == "auth failed for password *** (raw ***), key ***"


def test_a_short_secret_is_hidden_where_it_stands_alone() -> None:
    """A known secret of 1-3 characters is replaced where no letter, digit or ``_ . : % -``
    touches it (a host or port a driver took from it), never inside a word or number."""
    assert mask_url("Error 111 connecting to 127.0.0.1:1.", ["1"]) == "Error 111 connecting to 127.0.0.1:1."
    assert mask_url("Port could not be cast to integer value as 'b'", ["b"]) == (
        "Port could not be cast to integer value as '***'"
    )
    assert mask_url(
        "failed to resolve host 'b@127.0.0.1'", url_secrets("postgresql://u:a@b@127.0.0.1/x")
    ) == ("failed to resolve host '***@127.0.0.1'")
    assert mask_url("a connection to 'ab' as ab, refused: ab:1", ["ab"]) == (
        "a connection to '***' as ***, refused: ab:1"
    )
    assert mask_url("no host in ':Zq8', nor in h:Zq8", ["Zq8"]) == "no host in ':***', nor in h:Zq8"
    assert mask_url("indented\n  text", [" ", "\n"]) == "indented\n  text"  # whitespace: never


def test_known_secrets_are_hidden_percent_encoded_too() -> None:
    """A secret given decoded (a client's password) is hidden as a URL or a form writes it."""
    secrets = known_secrets(["p@ss w/rd"])
    for written in ("p%40ss%20w%2Frd", "p%40ss+w%2Frd", "p%40ss%20w/rd", "p@ss w/rd"):
        assert mask_url(f"refused for {written}!", secrets) == "refused for ***!", written


class _HostError(Exception):
    """A driver error that builds its message from an attribute, not from its args."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host_bytes = host.encode()

    def __str__(self) -> str:
        return f"cannot reach {self.host_bytes.decode()}"


def test_mask_error_masks_a_chain_in_place_keeping_types_and_words() -> None:
    """Each exception of a chain is masked in place, its type kept; one whose message is
    built from elsewhere shows the masked text under its own class name."""
    secrets = url_secrets("postgresql://u:Zq8@SEC@RETpw@h/db")
    host, rest = "SEC@RE" + "Tpw@h", "RE" + "Tpw"  # the traceback shows the raising lines
    try:
        try:
            raise _HostError(host)
        except _HostError as inner:
            raise OSError(2, f"no such host {host}", rest) from inner
    except OSError as exc:
        outer = exc
    mask_error(outer, secrets)
    shown = "".join(traceback.format_exception(outer))
    assert "RETpw" not in shown, shown
    assert "_HostError: cannot reach ***@h" in shown, shown
    assert "no such host ***@h" in shown, shown
    assert isinstance(outer.__cause__, _HostError)


def test_cli_error_keeps_the_reason_after_a_query_password() -> None:
    """The issue's command: the reason after ``?password=x`` is printed, the password is not."""
    url = f"redis://127.0.0.1:1/11?password={PW}"
    result = CliRunner().invoke(cli, ["--url", url, "list"], env={"CELERY_EXCLUSIVE_URL": None})
    assert result.exit_code == 3, result.output
    assert PW not in result.output
    line = result.output.strip()
    assert line.startswith("error: redis redis://127.0.0.1:1/11?password=***: "), line
    assert "onnect" in line.split("password=***: ", 1)[1]  # the driver's reason survives


@pytest.mark.parametrize(
    "args",
    [
        ["show", "k", f"redis://:{SPACED_PW}@127.0.0.1:1/0"],
        ["release", "k", f"postgresql://u:{PW}@127.0.0.1:1/x"],
        ["list", "--json", "pre", f"redis://u:{PW}@127.0.0.1:1/0?token={PW}"],
    ],
    ids=["extra-argument-spaced", "extra-argument", "extra-argument-query"],
)
def test_cli_usage_errors_mask_the_arguments_they_echo(args: list[str]) -> None:
    """A URL typed where the command takes none is echoed by click's usage error, masked."""
    env = {"CELERY_EXCLUSIVE_URL": "memory://", "CELERY_EXCLUSIVE_PREFIX": None}
    app = Celery("sec_usage", broker="memory://", set_as_current=False)
    for result in (
        CliRunner().invoke(cli, args, env=env),
        CliRunner().invoke(exclusive, args, env=env, obj=SimpleNamespace(app=app)),
    ):
        assert result.exit_code == 2, result.output
        assert "***@127.0.0.1:1" in result.output, result.output  # the rest of it is still shown
        assert not [p for p in _pieces(PW) | _pieces(SPACED_PW) if p in result.output], result.output


def test_url_secrets_keeps_a_short_password_and_adds_the_parts_a_driver_may_echo() -> None:
    """A password of any length is a secret; its parts between ``@ / ? #`` (4 characters or
    more, what a driver may take for a host, port or path) are too."""
    assert url_secrets("redis://:abc@h/0") == ["abc"]
    assert set(url_secrets("postgresql://u:Zq8@SEC@RETpw@h/db")) >= {"SEC@RETpw", "RETpw"}
    assert "SECRET" in url_secrets("redis://:ab/SECRET?x@h/0")


def test_url_secrets_of_a_url_without_any() -> None:
    """A URL without credentials (or a user only) has no secrets; nothing is replaced."""
    assert url_secrets("postgresql://app@db/app") == []
    assert url_secrets("redis://h/0") == []
    assert mask_url("app db", url_secrets("postgresql://app@db/app")) == "app db"


# -- Celery's own output: celery report, conf.humanize()/table() --------------------------------

CHANNEL_URLS = {
    "postgres": f"postgresql+psycopg://postgres:{PW}@127.0.0.1:1/x?sslpassword=k{PW}",
    "redis": f"redis://u:{PW}@127.0.0.1:1/0?token=t{PW}",
    "mariadb": f"mysql+pymysql://root:{PW}@127.0.0.1:1/x",
}


@pytest.mark.parametrize("url", list(CHANNEL_URLS.values()), ids=list(CHANNEL_URLS))
def test_celery_censoring_hides_the_lock_store_url(url: str) -> None:
    """Celery's censored views (humanize, table) hide exclusive_url as they hide its own secrets."""
    import celery_exclusive  # noqa: F401  # importing the package is what teaches Celery

    app = Celery("censor", broker="memory://", set_as_current=False)
    app.conf.exclusive_url = url
    shown = app.conf.humanize(with_defaults=False, censored=True)
    assert "exclusive_url" in shown
    assert PW not in shown
    assert PW not in repr(app.conf.table(with_defaults=True, censored=True))
    assert PW in app.conf.humanize(with_defaults=False, censored=False)  # only censoring hides it


def test_celery_report_hides_the_lock_store_url() -> None:
    """``celery -A proj report``, which users paste into public issues, never shows the password."""
    env = {**os.environ, "CE_TEST_CLI_URL": CHANNEL_URLS["postgres"], "CE_TEST_CLI_PREFIX": "rep:"}
    done = subprocess.run(
        [str(BIN / "celery"), "-A", "tests.cli_app:app", "report"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "exclusive_url" in done.stdout
    assert PW not in done.stdout + done.stderr


# -- every output channel, for PostgreSQL, Redis and MariaDB ----------------------------------------


def _texts_of(exc: BaseException) -> list[str]:
    """str, repr and traceback of an exception and of everything chained to it."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current), repr(current.args)]
        current = current.__cause__ or current.__context__
    return texts


def _channel_urls(table: str, pw: str) -> dict[str, list[str]]:
    """Per store: URLs with ``pw`` planted as userinfo and as query secrets; reachable ones first.

    PostgreSQL trusts 127.0.0.1, so its URL works (the password is ignored) and every
    success path is exercised too; a database that does not exist makes the server answer
    with an error; Redis and MariaDB refuse the password (the server answers with an error);
    the port-1 URLs are unreachable (the driver fails to connect). A raw ``@`` or line break
    is planted raw in the userinfo and percent-encoded in a query (where a raw ``@`` would
    move the rest of the URL into the host for SQLAlchemy, options included).
    """
    q = pw.replace("@", "%40").replace("\n", "%0A")
    return {
        "postgres": [
            f"postgresql+psycopg://postgres:{pw}@127.0.0.1:5432/test?sslpassword=s{q}&ce_table={table}",
            f"postgresql://postgres:{pw}@127.0.0.1:5432/ce_no_such_db",
            f"postgresql+psycopg://postgres@127.0.0.1:1/x?password={q}&application_name=ce",
        ],
        "redis": [
            f"redis://default:{pw}@127.0.0.1:6379/0",
            f"redis://127.0.0.1:6379/0?password={q}&socket_timeout=5",
            f"redis://:{pw}@127.0.0.1:1/0",
        ],
        "mariadb": [
            f"mysql+pymysql://root:{pw}@127.0.0.1:3306/test",
            f"mariadb://ce_no_such_user:{pw}@127.0.0.1:3306/test",
            f"mysql+pymysql://u:{pw}@127.0.0.1:1/x",
        ],
    }


def _pieces(pw: str) -> set[str]:
    """Every 4-character piece of a password: none may be shown."""
    return {pw[i : i + 4] for i in range(len(pw) - 3)}


def _cli_invocations() -> list[list[str]]:
    """Every sub-command the CLI has (including ones added later), with and without --json."""
    known = {
        "list": [["list"], ["list", "--json"], ["list", "pre"]],
        "show": [["show", "k"], ["show", "k", "--json"]],
        "release": [["release", "--yes", "k"], ["release", "k"], ["release", "k", "--token", "t"]],
        "doctor": [["doctor"], ["doctor", "--json"]],
    }
    calls: list[list[str]] = []
    for name in sorted(cli.commands):
        calls += known.get(name, [[name], [name, "k"], [name, "--json"], [name, "--yes", "k"]])
    return calls


def _api_texts(service: LockService) -> list[str]:
    """Reprs, and every call's outcome or error with its chain."""
    texts = [repr(service), repr(service.provider)]
    for call in (
        lambda s: s.lock("k").release(),
        lambda s: s.try_lock("k"),
        lambda s: s.run_exclusive("k", lambda: None),
        lambda s: s.peek("k"),
        lambda s: s.locks(),
        lambda s: s.force_release("k", "t"),
    ):
        try:
            texts.append(repr(call(service)))
        except ExclusiveError as exc:
            texts += _texts_of(exc)
    return texts


def _celery_texts(url: str, prefix: str, service: LockService) -> list[str]:
    """A task run through Celery's tracer and its logging, with the key held if the store works."""
    app = Celery("sec_app", broker="memory://", set_as_current=False)
    app.conf.exclusive_url = url
    app.conf.exclusive_prefix = prefix
    app.conf.task_store_eager_result = True

    # shared=False and a unique name: a shared task would be added to every app made later.
    @exclusive_task(app=app, key="k", on_locked="skip", name=f"sec.{uuid.uuid4().hex[:8]}", shared=False)
    def job() -> str:
        return "ran"

    held = None
    with contextlib.suppress(ExclusiveError):
        held = service.lock("k")
    result = job.apply()
    texts = [repr(result.result), str(result.traceback), repr(job.lock_settings)]
    texts += [repr(get_lock_service(app)), app.conf.humanize(with_defaults=False, censored=True)]
    if isinstance(result.result, BaseException):
        texts += _texts_of(result.result)
    if held is not None:
        held.release()
    get_lock_service(app).close()
    return texts


def _cli_texts(url: str, sweep: list[list[str]]) -> tuple[list[str], int]:
    """Both in-process front ends on ``sweep`` and on error paths; and how many showed ``***``."""
    texts: list[str] = []
    for args in [*sweep, ["--prefix", "bad prefix", "list"], ["list", "--bogus"], ["show", "a\x00b"]]:
        for result in _cli_both(url, args):
            texts += [result.output, result.stdout, result.stderr]
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                texts += _texts_of(result.exception)
    masked = 0
    for result in _cli_both(f"{url}{'&' if '?' in url else '?'}ce_bogus=1", ["list"]):
        assert result.exit_code == 2, result.output
        texts.append(result.output)
        masked += "***" in result.output
    return texts, masked


@pytest.mark.parametrize("pw", [PW, SPACED_PW, AT_PW, BROKEN_PW], ids=["plain", "spaced", "at", "line-break"])
@pytest.mark.parametrize("name", ["postgres", "redis", "mariadb"])
def test_a_planted_password_appears_on_no_channel(
    name: str, pw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Errors, logs at DEBUG, reprs, both CLI front ends (all commands, error paths), Celery's
    own output and the Prometheus exposition never show a piece of a password, however it
    was given, even with spaces the URL syntax has no room for (the drivers take them)."""
    require_server({"postgres": POSTGRES_URL, "redis": REDIS_URL, "mariadb": MYSQL_URL}[name])
    caplog.set_level(logging.DEBUG)
    table = f"ce_sec_{uuid.uuid4().hex[:10]}"
    prefix = f"sec{uuid.uuid4().hex[:8]}:"
    urls = _channel_urls(table, pw)[name]
    texts: list[str] = []
    refused: list[str] = []
    shown_masked = 0
    registry = CollectorRegistry()
    metrics.uninstall()
    metrics.install(registry=registry)
    try:
        for url in urls:
            texts.append(repr(ExclusiveSettings(url=url)))
            try:
                service = LockService(url, prefix=prefix)
            except ConfigurationError as exc:  # a raw "@" ends an SQL password: refused, unbuilt
                refused.append(str(exc))
                texts += _texts_of(exc)
            else:
                texts += _api_texts(service)
                texts += _celery_texts(url, prefix, service)
                service.close()
            sweep = _cli_invocations() if url == urls[0] else [["list"], ["doctor", "--json"]]
            cli_texts, masked = _cli_texts(url, sweep)
            texts += cli_texts
            shown_masked += masked
        # Real processes: the console script and the Celery sub-command.
        for command in (
            [str(BIN / "celery-exclusive"), "--url", urls[-1], "list"],
            [str(BIN / "celery"), "-A", "tests.cli_app:app", "exclusive", "doctor", "--json"],
        ):
            env = {**os.environ, "CE_TEST_CLI_URL": urls[0], "CE_TEST_CLI_PREFIX": prefix}
            env.pop("CELERY_EXCLUSIVE_URL", None)
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            texts += [done.stdout, done.stderr]
        exposition = generate_latest(registry).decode()
    finally:
        metrics.uninstall()
        if name == "postgres":
            drop_lock_table(POSTGRES_URL, table)
        elif name == "redis":
            delete_redis_keys(prefix)
    texts += [exposition, caplog.text, *(r.getMessage() for r in caplog.records)]
    texts += [repr(r.args) for r in caplog.records]
    texts += ["".join(traceback.format_exception(*r.exc_info)) for r in caplog.records if r.exc_info]
    leaks = [text for text in texts if any(piece in text for piece in _pieces(pw))]
    assert not leaks, leaks[0]
    assert bool(refused) == ("@" in pw and name != "redis"), refused
    assert all("percent-encode an '@'" in message for message in refused), refused
    assert shown_masked  # the URLs were shown, masked: the sweep looked at real output
    assert "celery_exclusive_acquisitions_total" in exposition


def _cli_both(url: str, args: list[str]) -> list[Any]:
    """The standalone front end, and for the commands both share the same way, the Celery one."""
    env = {"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None}
    results = [CliRunner().invoke(cli, ["--url", url, *args], env=env, input="")]
    if args in (["list"], ["doctor", "--json"], ["list", "--bogus"]):
        app = Celery("sec_cli", broker="memory://", set_as_current=False)
        app.conf.exclusive_url = url
        results.append(CliRunner().invoke(exclusive, args, env=env, obj=SimpleNamespace(app=app), input=""))
    return results


def _package_objects(root: object) -> list[object]:
    """Every object of this package reachable from ``root`` through attributes and containers."""
    seen: set[int] = set()
    found: list[object] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo += list(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
            continue
        if not type(obj).__module__.startswith("celery_exclusive"):
            continue
        found.append(obj)
        names = list(getattr(obj, "__dict__", {}))
        names += [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        todo += [getattr(obj, name, None) for name in names]
    return found


@pytest.mark.parametrize("pw", [PW, SPACED_PW, AT_PW, BROKEN_PW], ids=["plain", "spaced", "at", "line-break"])
@pytest.mark.parametrize("name", ["postgres", "redis", "mariadb"])
def test_no_object_of_the_package_shows_a_password_in_its_repr(name: str, pw: str) -> None:
    """The repr of every object a LockService, the CLI and the settings keep (what a debugger,
    ``pytest -l`` or an error tracker's captured locals show) hides the password."""
    require_server({"postgres": POSTGRES_URL, "redis": REDIS_URL, "mariadb": MYSQL_URL}[name])
    table = f"ce_sec_{uuid.uuid4().hex[:10]}"
    url = _channel_urls(table, pw)[name][0]
    if "@" in pw and name != "redis":  # a raw "@" ends an SQL password: no service is built
        with pytest.raises(ConfigurationError, match="percent-encode an '@'"):
            LockService(url)
        url = url.replace(pw, pw.replace("@", "%40"), 1)  # as the error says
    service = LockService(url, prefix=f"sec{uuid.uuid4().hex[:8]}:")
    target = CliTarget(url, {"exclusive_url": url}, "p:", celery=False)
    target.resolve()
    try:
        objects = [
            *_package_objects(service),
            *_package_objects(target),
            *_package_objects(ExclusiveSettings(url=url)),
        ]
        assert len(objects) > 3
        shown = [repr(obj) for obj in objects]
    finally:
        service.close()
        if name == "postgres":
            drop_lock_table(POSTGRES_URL, table)
    leaks = [text for text in shown if any(piece in text for piece in _pieces(pw))]
    assert not leaks, leaks[0]


def test_an_sql_password_with_a_question_mark_or_hash_is_read_as_sqlalchemy_reads_it() -> None:
    """SQLAlchemy takes ``?`` and ``#`` in a password as they are; the ``ce_`` options are
    read after the userinfo, so the store works (PostgreSQL trusts 127.0.0.1) and its
    table is the URL's, and nothing shows the password."""
    require_server(POSTGRES_URL)
    table = f"ce_sec_{uuid.uuid4().hex[:10]}"
    pw = "Zq8/SEC?RET#pw"
    url = f"postgresql+psycopg://postgres:{pw}@127.0.0.1:5432/test?ce_table={table}&application_name=ce"
    service = LockService(url, prefix=f"sec{uuid.uuid4().hex[:8]}:")
    try:
        lease = service.lock("k")
        assert service.peek("k") is not None
        lease.release()
        assert service.provider.table.name == table  # type: ignore[attr-defined]
        shown = [repr(service), repr(service.provider), repr(ExclusiveSettings(url=url))]
    finally:
        service.close()
        drop_lock_table(POSTGRES_URL, table)
    assert not [text for text in shown if any(piece in text for piece in _pieces(pw))], shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u:{pw}@127.0.0.1:5432/test",
        "mysql+pymysql://root:{pw}@127.0.0.1:3306/test",
    ],
    ids=["postgres", "mariadb"],
)
def test_a_password_cut_at_an_at_sign_is_refused_before_the_driver_sees_the_rest(url: str) -> None:
    """SQLAlchemy ends a password at its first ``@`` and takes the rest for the host, which
    the driver used to try to resolve (a BackendError naming it): the store is refused when
    built instead, saying how to write the password, and its error hides every piece."""
    pw = "Zq8@SEC@RETpw"
    with pytest.raises(ConfigurationError) as caught:
        LockService(url.format(pw=pw))
    texts = _texts_of(caught.value)
    assert "***@127.0.0.1" in texts[0], texts[0]  # the URL, its password hidden
    assert "percent-encode an '@' in the password (%40)" in str(caught.value)
    assert not [text for text in texts if any(piece in text for piece in _pieces(pw))], texts


@pytest.mark.parametrize(
    "url",
    ["redis://:{pw}@127.0.0.1:1/0", "unix://:{pw}@/nonexistent/ce.sock?db=0"],
    ids=["port", "socket-path"],
)
def test_a_redis_password_cut_at_a_slash_is_masked_where_redis_py_echoes_a_part(url: str) -> None:
    """redis-py ends the netloc at a raw ``/``, ``?`` or ``#`` in a password and names a part
    as the port or the socket path; the error hides every such part (the socket's
    ConnectionError, redis-py's own and chained as ``__cause__``, still names the path)."""
    require_server(REDIS_URL)
    pw = "Zq8abcd/SECRET?RETpw#x"
    texts = []
    try:
        service = LockService(url.format(pw=pw), prefix=f"sec{uuid.uuid4().hex[:8]}:")
        try:
            service.try_lock("k")
        finally:
            service.close()
    except ExclusiveError as exc:
        texts += [str(exc), repr(exc)]
        if exc.__cause__ is None:  # a malformed URL: raised from no driver error
            texts.append("".join(traceback.format_exception(exc)))
    assert texts, "the call did not fail"
    assert "***" in texts[0], texts[0]
    assert not [text for text in texts if any(piece in text for piece in _pieces(pw))], texts[-1]


#: Passwords a driver misreads: a raw "@" (the rest read as the host), "/", "?" and "#" (as a
#: port, path or query), line breaks; and short ones (1-3 characters) among them.
MISREAD_PASSWORDS = [
    "Zq8@SEC@RETpw",
    "Zq8abcd/SECRET?RETpw#x",
    "Zq8SEC\nRETpw",
    "Zq8 SE\r\nC@RETpw",
    "a@b",
    "x/y",
    "q\nr",
    "Q7",
]

MISREAD_URLS = {
    "postgres": "postgresql+psycopg://postgres:{pw}@127.0.0.1:5432/test?ce_table={table}",
    "postgres-refused": "postgresql+psycopg://postgres:{pw}@127.0.0.1:1/test",
    "mariadb": "mysql+pymysql://root:{pw}@127.0.0.1:3306/test?ce_table={table}",
    "mariadb-refused": "mysql+pymysql://root:{pw}@127.0.0.1:1/test",
    "redis-refused": "redis://:{pw}@127.0.0.1:1/0",
    "redis-socket": "unix://:{pw}@/nonexistent/ce.sock?db=0",
}


def _shows(text: str, pw: str) -> bool:
    """Whether ``text`` shows ``pw``: a 4-character piece of it, or for a short one (1-3
    characters) it or a part of it (between ``@ : / ? #`` and line breaks) standing alone,
    as mask_url hides it (no letter, digit or ``_ . % -`` next to it, no ``:`` after it
    or after a word before it: not ``127.0.0.1:1`` for a password ``1``)."""
    if len(pw) >= 4:
        return any(piece in text for piece in _pieces(pw))
    parts = {pw, *(p for p in re.split(r"[@:/?#\r\n]+", pw) if p)}
    return any(re.search(rf"(?<![\w.%-])(?<![\w.]:){re.escape(p)}(?![\w.:%-])", text) for p in parts)


@pytest.mark.parametrize("pw", MISREAD_PASSWORDS, ids=lambda pw: repr(pw)[1:-1])
@pytest.mark.parametrize("store", list(MISREAD_URLS))
def test_no_traceback_shows_a_password_the_driver_misread(store: str, pw: str) -> None:
    """A password the driver reads as a host, port, path or two lines: the store's error, its
    whole traceback (every chained driver exception, as Python prints it) and the reprs
    never show it; the chain keeps the driver's exception types and the rest of their words."""
    require_server(
        POSTGRES_URL if store.startswith("postgres") else MYSQL_URL if "mariadb" in store else REDIS_URL
    )
    table = f"ce_sec_{uuid.uuid4().hex[:10]}"
    url = MISREAD_URLS[store].format(pw=pw, table=table)
    texts: list[str] = []
    raised: BaseException | None = None
    try:
        service = LockService(url, prefix=f"sec{uuid.uuid4().hex[:8]}:")
        texts += [repr(service), repr(service.provider), repr(ExclusiveSettings(url=url))]
        try:
            service.lock("k").release()
        finally:
            service.close()
    except ExclusiveError as exc:
        raised = exc
        texts += _texts_of(exc)
    finally:
        if store == "postgres":
            drop_lock_table(POSTGRES_URL, table)
        elif store == "mariadb":
            drop_lock_table(MYSQL_URL, table)
    leaks = [text for text in texts if _shows(text, pw)]
    assert not leaks, leaks[0]
    shown = "".join(texts)
    assert "127.0.0.1" in shown or "ce.sock" in shown or "***" in shown, shown
    if raised is not None and raised.__cause__ is not None:  # a driver's error: chained, its type kept
        chain = "".join(traceback.format_exception(raised))
        assert "The above exception was the direct cause" in chain, chain
        assert re.search(r"^(psycopg|pymysql|redis|sqlalchemy)[\w.]*(Error|Exception)\b", chain, re.M), chain


#: Store URLs a driver or a URL parser misreads, each with the password planted in it.
MISCONFIGURED = [
    # SQLAlchemy ends the password at its first "@" and reads "RETpw@127.0.0.1:5432" as the port.
    ("postgresql+psycopg://postgres:{pw}@127.0.0.1:5432/test", "Zq8@SEC:RETpw"),
    # A raw "/" ends the sentinels' host list: "no host in ':Zq8'".
    ("redis+sentinel://:{pw}@127.0.0.1:1/mymaster", "Zq8/SEC:RETpw"),
    # PyMySQL is asked to connect to the host "SEC@RETpw@127.0.0.1".
    ("mysql+pymysql://root:{pw}@127.0.0.1:3306/test", "Zq8@SEC@RETpw"),
    ("redis://:{pw}@127.0.0.1:1/0", "Zq8SEC\nRE\tTpw"),
]


@pytest.mark.parametrize(
    ("template", "pw"), MISCONFIGURED, ids=["pg-port", "sentinel-hosts", "mariadb-host", "redis-lines"]
)
def test_the_cli_and_the_logs_show_no_password_a_driver_or_parser_misread(
    template: str, pw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every command of both CLI front ends (and the console script), on a store whose URL
    a driver or parser misreads, and the log at DEBUG meanwhile, show no piece of the
    password, nor a part of it (between ``@ : / ?`` ...) that a message names alone."""
    require_server(
        POSTGRES_URL if "postgres" in template else MYSQL_URL if "mysql" in template else REDIS_URL
    )
    caplog.set_level(logging.DEBUG)
    url = template.format(pw=pw)
    texts: list[str] = []
    for args in _cli_invocations():
        for result in _cli_both(url, args):
            texts += [result.output, result.stdout, result.stderr]
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                texts += _texts_of(result.exception)
    try:
        LockService(url, prefix="sec:").try_lock("k")
    except ExclusiveError as exc:
        texts += _texts_of(exc)
    env = {k: v for k, v in os.environ.items() if k != "CELERY_EXCLUSIVE_URL"}
    done = subprocess.run(
        [str(BIN / "celery-exclusive"), "--url", url, "doctor"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    texts += [done.stdout, done.stderr, caplog.text, *(r.getMessage() for r in caplog.records)]
    texts += ["".join(traceback.format_exception(*r.exc_info)) for r in caplog.records if r.exc_info]
    parts = [p for p in re.split(r"[@:/?#\s]+", pw) if p]
    leaks = [text for text in texts if _shows(text, pw) or any(_shows(text, part) for part in parts)]
    assert not leaks, leaks[0]
    assert "***" in done.stdout + done.stderr, done.stdout + done.stderr  # it was shown, masked
