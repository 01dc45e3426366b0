"""The ``django://<alias>`` lock store: an SQL store on a ``DATABASES`` alias's connection settings.

``django://default`` reads ``ENGINE`` (by the backend's vendor: PostgreSQL, MySQL/MariaDB or
SQLite), ``HOST``, ``PORT``, ``NAME``, ``USER``, ``PASSWORD`` and ``OPTIONS`` of that alias
and builds the same :class:`~celery_exclusive.providers.sql.SqlLockProvider` an explicit
``postgresql+psycopg://``, ``mysql+pymysql://`` or ``sqlite:///`` URL would: its own
connections (not Django's), with celery-exclusive's drivers and timeouts.

Query options: ``ce_table`` (default: the ``CELERY_EXCLUSIVE_TABLE`` setting, else
``cache_entries``), ``ce_create_table`` (default ``false`` when
``celery_exclusive.contrib.django`` is in ``INSTALLED_APPS``, whose migration owns the
table, else ``true``) and ``ce_pgbouncer``. Driver parameters come from ``OPTIONS``, never
from this URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import sqlalchemy as sa

from celery_exclusive.errors import ConfigurationError, MissingDriverError
from celery_exclusive.providers._sql_common import OPTIONS, parse_bool
from celery_exclusive.providers.sql import SqlLockProvider
from celery_exclusive.urls import mask_error, mask_url, split_options, url_secrets

APP = "celery_exclusive.contrib.django"
TABLE_SETTING = "CELERY_EXCLUSIVE_TABLE"
DEFAULT_TABLE = "cache_entries"
_OPTIONS = OPTIONS
#: OPTIONS keys Django itself reads; they are not libpq / PyMySQL connection parameters.
_DJANGO_ONLY = {
    "postgresql": {"isolation_level", "server_side_binding", "pool", "assume_role"},
    "mysql": {"isolation_level"},
}
#: Django's MySQL ``OPTIONS["ssl"]`` keys -> the URL query parameters SQLAlchemy's MySQL dialect reads.
_MYSQL_SSL = {
    "ca": "ssl_ca",
    "cert": "ssl_cert",
    "key": "ssl_key",
    "capath": "ssl_capath",
    "cipher": "ssl_cipher",
}


def provider_from_django_url(url: str) -> SqlLockProvider:
    """The SQL lock store of the ``DATABASES`` alias named by ``django://<alias>``."""
    alias, options = _parse(url)
    settings = _django_settings()
    databases = _databases(settings)
    if alias not in databases:
        known = ", ".join(repr(a) for a in databases) or "none"
        raise ConfigurationError(
            f"{mask_url(url)!r}: no DATABASES alias {alias!r} in the Django settings (known: {known})"
        )
    sa_url = sqlalchemy_url(alias, _vendor(alias), _settings_dict(alias))
    installed = _app_installed(settings)
    table = options.get("table") or getattr(settings, TABLE_SETTING, None) or DEFAULT_TABLE
    create = parse_bool("create_table", options.get("create_table", "false" if installed else "true"))
    pgbouncer = parse_bool("pgbouncer", options.get("pgbouncer", "false"))
    return SqlLockProvider(
        sa_url.render_as_string(hide_password=False), table=table, create_table=create, pgbouncer=pgbouncer
    )


def _parse(url: str) -> tuple[str, dict[str, str]]:
    """``(alias, ce_ options)`` of a ``django://`` URL, refusing anything else in it."""
    base, options = split_options(url, _OPTIONS)
    try:
        parts = urlsplit(base)
    except ValueError as exc:
        secrets = url_secrets(url)
        mask_error(exc, secrets)  # still the error's __context__
        raise ConfigurationError(
            f"malformed lock store URL {mask_url(url)!r}: {mask_url(str(exc), secrets)}"
        ) from None
    alias = unquote(parts.netloc)
    if parts.scheme.lower() != "django" or not alias:
        raise ConfigurationError(
            f"expected django://<DATABASES alias>, e.g. django://default, got {mask_url(url)!r}"
        )
    if "@" in parts.netloc or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigurationError(
            f"{mask_url(url)!r}: a django:// URL names only a DATABASES alias (and ce_ options); the "
            "connection settings, credentials and driver options come from that alias"
        )
    return alias, options


def _django_settings() -> Any:
    try:
        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured
    except ImportError as exc:
        raise MissingDriverError("django", "django") from exc
    try:
        settings.DATABASES  # noqa: B018 - reading it is what configures settings lazily
    except ImproperlyConfigured as exc:
        raise ConfigurationError(
            f"django:// lock store needs configured Django settings (set DJANGO_SETTINGS_MODULE): {exc}"
        ) from None
    return settings


def _databases(settings: Any) -> Mapping[str, Any]:
    databases = settings.DATABASES
    if not isinstance(databases, Mapping):
        raise ConfigurationError(f"Django's DATABASES must be a dict, got {type(databases).__name__}")
    return databases


def _settings_dict(alias: str) -> Mapping[str, Any]:
    """The alias's settings as Django's connection sees them, defaults filled in.

    A test run renames ``NAME`` to the test database on this dict, so the store follows it.
    """
    from django.db import connections

    return dict(connections[alias].settings_dict)


def _vendor(alias: str) -> str:
    from django.db import connections

    try:
        return str(connections[alias].vendor)
    except Exception as exc:  # e.g. ENGINE names a backend whose driver is missing
        raise ConfigurationError(
            f"django://{alias}: cannot load the DATABASES[{alias!r}] ENGINE: {type(exc).__name__}: {exc}"
        ) from None


def _app_installed(settings: Any) -> bool:
    apps = getattr(settings, "INSTALLED_APPS", ()) or ()
    return any(str(app) == APP or str(app).startswith(APP + ".apps.") for app in apps)


def sqlalchemy_url(alias: str, vendor: str, db: Mapping[str, Any]) -> sa.URL:
    """The SQLAlchemy URL (with celery-exclusive's drivers) for one Django database's settings."""
    where = f"DATABASES[{alias!r}]"
    options = dict(db.get("OPTIONS") or {})
    if vendor == "sqlite":
        name = str(db.get("NAME") or "")
        if name in ("", ":memory:") or "mode=memory" in name:
            raise ConfigurationError(
                f"{where} is an in-memory SQLite database, which another connection cannot see; "
                "use a database file, or memory:// for a single process"
            )
        return sa.URL.create("sqlite", database=name)
    if vendor not in ("postgresql", "mysql"):
        raise ConfigurationError(
            f"{where} is a {vendor!r} database; django:// supports PostgreSQL, MySQL/MariaDB and SQLite"
        )
    query: dict[str, str] = {}
    if vendor == "mysql" and isinstance(options.get("ssl"), Mapping):
        ssl = options.pop("ssl")
        for key, value in ssl.items():
            if key not in _MYSQL_SSL:
                raise ConfigurationError(f"{where} OPTIONS['ssl'][{key!r}] is not supported by django://")
            query[_MYSQL_SSL[key]] = str(value)
    for key, value in options.items():
        if key in _DJANGO_ONLY[vendor]:
            continue
        if not isinstance(value, (str, int, float)):
            raise ConfigurationError(
                f"{where} OPTIONS[{key!r}] is a {type(value).__name__}; django:// passes only "
                "str, int and float connection options"
            )
        query[key] = str(int(value) if isinstance(value, bool) else value)
    host: str = str(db.get("HOST") or "")
    if host.startswith("/"):  # a Unix socket directory (PostgreSQL) or socket file (MySQL)
        query["host" if vendor == "postgresql" else "unix_socket"] = host
        host = ""
    port = db.get("PORT")
    try:
        port_number = int(port) if port not in (None, "") else None
    except (TypeError, ValueError):
        raise ConfigurationError(f"{where} PORT must be a number, got {port!r}") from None
    database = db.get("NAME")
    if vendor == "postgresql" and database is None:
        database = "postgres"  # what Django connects to when NAME is None
    return sa.URL.create(
        "postgresql+psycopg" if vendor == "postgresql" else "mysql+pymysql",
        username=str(db.get("USER") or "") or None,
        password=str(db.get("PASSWORD") or "") or None,
        host=host or None,
        port=port_number,
        database=str(database or "") or None,
        query=query,
    )
