"""Lock store URLs: which provider a URL selects, where the URL comes from, and masking.

Precedence: an explicit URL > Celery's ``exclusive_url`` setting > the
``CELERY_EXCLUSIVE_URL`` environment variable. Credentials never leave this module
unmasked: use :func:`mask_url` for anything shown to a person.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from celery_exclusive.errors import ConfigurationError

if TYPE_CHECKING:
    from celery_exclusive.providers.base import LockProvider

ENV_VAR = "CELERY_EXCLUSIVE_URL"
SETTING = "exclusive_url"

#: Scheme -> provider family. ``mysql+<driver>`` and ``postgresql+<driver>`` also match.
KNOWN_SCHEMES = (
    "memory",
    "mariadb+pymysql",
    "mysql+pymysql",
    "postgresql",
    "postgresql+psycopg",
    "redis",
    "redis+cluster",
    "redis+sentinel",
    "rediss",
    "rediss+cluster",
    "rediss+sentinel",
    "sqlite",
    "unix",
)

_REDIS_VARIANTS = ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
# Userinfo runs to the last "@" of the authority, as urlsplit reads it (an unescaped "@" in a
# password must not leave its tail visible).
_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")
_PASSWORD_PARAM = re.compile(r"(?i)([?&](?:password|passwd|pass|pwd)=)[^&#]*")


def mask_url(url: str) -> str:
    """The URL with any password (userinfo or query parameter) replaced by ``***``."""

    def _mask(match: re.Match[str]) -> str:
        userinfo = match.group("userinfo")
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        masked = f"{user}:***" if user else "***"
        return f"{match.group('scheme')}{masked}@"

    return _PASSWORD_PARAM.sub(r"\1***", _CREDENTIALS.sub(_mask, url))


def resolve_url(explicit: str | None = None, conf: Mapping[str, Any] | None = None) -> str:
    """Pick the lock store URL by precedence, or raise naming every place to set it."""
    for candidate in (explicit, (conf or {}).get(SETTING), os.environ.get(ENV_VAR)):
        if candidate is None or candidate == "":
            continue
        if not isinstance(candidate, str):
            raise ConfigurationError(f"the lock store URL must be a str, got {type(candidate).__name__}")
        return candidate
    broker = str((conf or {}).get("broker_url") or "")
    hint = ""
    if broker.startswith(("redis://", "rediss://")):
        hint = (
            " Your broker is Redis; to keep locks there too, set "
            f"app.conf.{SETTING} to a redis:// URL (it is never picked silently)."
        )
    raise ConfigurationError(
        f"no lock store configured: pass a URL, set app.conf.{SETTING}, or set the "
        f"{ENV_VAR} environment variable (schemes: {', '.join(KNOWN_SCHEMES)}).{hint}"
    )


def scheme_family(url: str) -> str:
    """``sql``, ``redis`` or ``memory`` for a URL, or ConfigurationError naming known schemes."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"malformed lock store URL {mask_url(str(url))!r}: expected scheme://..., "
            f"one of {', '.join(KNOWN_SCHEMES)}"
        )
    scheme = url.split("://", 1)[0].lower()
    base = scheme.split("+", 1)[0]
    if scheme == "memory":
        return "memory"
    if scheme in ("redis", "rediss", "unix", *_REDIS_VARIANTS):
        return "redis"
    if base in ("postgresql", "postgres", "sqlite", "mysql", "mariadb"):
        return "sql"
    raise ConfigurationError(
        f"unknown lock store scheme {scheme!r} in {mask_url(url)!r}; "
        f"known schemes: {', '.join(KNOWN_SCHEMES)}"
    )


def split_options(url: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """Remove celery-exclusive's own query options from ``url``; reject unknown ``ce_`` ones.

    Options are spelled ``ce_<name>`` (``?ce_table=locks``) so they never clash with a
    driver's own query parameters, which are passed through untouched.
    """
    try:
        query = urlsplit(url).query
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigurationError(f"malformed lock store URL {mask_url(url)!r}: {exc}") from None
    kept: list[str] = []
    options: dict[str, str] = {}
    for segment in query.split("&"):
        parsed = parse_qsl(segment, keep_blank_values=True)
        if not parsed or not parsed[0][0].startswith("ce_"):
            if segment:
                kept.append(segment)  # a driver's parameter, passed on exactly as written
            continue
        name, value = parsed[0]
        option = name[3:]
        if option not in allowed:
            raise ConfigurationError(
                f"unknown option {name!r} in lock store URL {mask_url(url)!r}; "
                f"known: {', '.join('ce_' + a for a in allowed) or 'none'}"
            )
        options[option] = value
    base = url.split("?", 1)[0].split("#", 1)[0]
    return (f"{base}?{'&'.join(kept)}" if kept else base), options


def provider_from_url(url: str) -> LockProvider:
    """Build the provider the URL's scheme selects; drivers are imported only here."""
    family = scheme_family(url)
    if family == "memory":
        from celery_exclusive.providers.memory import MemoryLockProvider

        split_options(url, ())  # no options, but a misspelt one must not pass silently
        return MemoryLockProvider()
    if family == "redis":
        from celery_exclusive.providers.redis import RedisLockProvider

        return RedisLockProvider(url)
    from celery_exclusive.providers.sql import SqlLockProvider

    return SqlLockProvider.from_url(url)
