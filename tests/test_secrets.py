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

import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_exclusive.urls import mask_url, url_secrets

PW = "Zq8SECRETpw"
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
    ("plain-text-untouched", "lock 'report:42' is held by task x", "lock 'report:42' is held by task x"),
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
