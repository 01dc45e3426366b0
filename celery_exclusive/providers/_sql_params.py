"""The driver parameters of an SQL store URL, checked when its engine is built.

A value the driver would reject only when it connects (or, worse, misread) is a
:class:`ConfigurationError` naming the parameter, raised before any connect; the value is
shown unless the parameter's name marks a secret, and the URL only masked. The drivers
are asked where they can say: PyMySQL validates its arguments in ``Connection(...,
defer_connect=True)`` without connecting; psycopg's ``make_conninfo`` rejects names libpq
does not know. libpq types its values only while connecting and lists no types
(``PQconndefaults``), hence the short lists of its integer and 0/1 parameters below.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.urls import SECRET_NAME, mask_url

#: libpq parameters it reads as a C int (its ``parse_int_param``), some only once a TCP
#: connection is up (a bad ``keepalives_idle`` fails after the server answered).
_LIBPQ_INTS = frozenset(
    {
        "connect_timeout",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
    }
)
#: libpq parameters documented as 0 or 1; libpq reads any value starting with "1" as on and
#: any other as off (``sslsni=yes`` would silently be off), so only 0 and 1 are let through.
_LIBPQ_FLAGS = frozenset({"sslcompression", "sslsni", "gssdelegation"})
_DECIMAL = re.compile(r"\s*[+-]?[0-9]+\s*")
_INT32 = range(-(2**31), 2**31)


def bad_option(name: str, raw: str, why: str) -> ConfigurationError:
    """The error for driver parameter ``name`` of lock store URL ``raw``; ``why`` (which may
    quote the value) is left out when the name marks a secret."""
    reason = "" if SECRET_NAME.fullmatch(name) else f" ({why})"
    return ConfigurationError(
        f"bad value for URL option {name!r} in lock store URL {mask_url(raw)!r}{reason}"
    )


def check_params(dialect: Dialect, url: sa.URL, connect_args: dict[str, Any], raw: str) -> None:
    """Raise ConfigurationError for the first query parameter of ``url`` its driver rejects."""
    if url.get_backend_name() == "postgresql":
        _check_libpq(url, raw)
    elif url.get_driver_name() == "pymysql":
        _check_pymysql(dialect, url, connect_args, raw)


def _values(url: sa.URL) -> Iterator[tuple[str, str]]:
    for name, value in url.query.items():
        for one in (value,) if isinstance(value, str) else value:
            yield name, one


def _check_libpq(url: sa.URL, raw: str) -> None:
    for name, value in _values(url):
        if name in _LIBPQ_INTS and not (_DECIMAL.fullmatch(value) and int(value) in _INT32):
            raise bad_option(name, raw, f"libpq needs a decimal integer, got {value!r}")
        if name in _LIBPQ_FLAGS and value not in ("0", "1"):
            raise bad_option(name, raw, f"libpq needs 0 or 1, got {value!r}")
    if url.get_driver_name() != "psycopg":
        return
    from psycopg import Connection, ProgrammingError
    from psycopg.conninfo import make_conninfo

    own = set(inspect.signature(Connection.connect).parameters)  # psycopg's, not libpq's
    for name in url.query:
        if name in own:
            continue
        try:
            make_conninfo("", **{name: "1"})
        except ProgrammingError as exc:  # libpq: invalid connection option "<name>"
            raise ConfigurationError(
                f"unknown URL option {name!r} in lock store URL {mask_url(raw)!r}: libpq says {exc}"
            ) from None


def _check_pymysql(dialect: Dialect, url: sa.URL, connect_args: dict[str, Any], raw: str) -> None:
    charsets = importlib.import_module("pymysql.charset")
    connection = importlib.import_module("pymysql.connections").Connection
    for name, value in _values(url):
        if name == "charset" and charsets.charset_by_name(value) is None:
            raise bad_option(name, raw, f"PyMySQL knows no charset {value!r}")
    defaults = {p.name: p.default for p in inspect.signature(connection).parameters.values()}
    cargs, cparams = dialect.create_connect_args(url)
    for name in url.query:
        given, default = cparams.get(name), defaults.get(name)
        # An int argument SQLAlchemy passes on as text (max_allowed_packet): PyMySQL stores it.
        if isinstance(given, str) and type(default) is int and not _DECIMAL.fullmatch(given):
            raise bad_option(name, raw, f"PyMySQL needs an integer, got {given!r}")
    if _refused(connection, cargs, cparams, connect_args) is None:
        return  # the usual case: one Connection object judges them all
    for name in url.query:  # which one: each alone
        cargs, cparams = dialect.create_connect_args(url.set(query={name: url.query[name]}))
        refused = _refused(connection, cargs, cparams, connect_args)
        if refused is not None:
            raise bad_option(name, raw, f"PyMySQL: {refused}")


def _refused(
    connection: Any, cargs: Any, cparams: Mapping[str, Any], connect_args: Mapping[str, Any]
) -> Exception | None:
    """What PyMySQL's ``Connection(..., defer_connect=True)`` raised for these arguments, or None."""
    try:
        connection(*cargs, **{**cparams, **connect_args, "defer_connect": True})
    except (ValueError, TypeError, LookupError, OSError) as exc:  # OSError: an ssl_* file
        return exc
    return None


def unconvertible(url: sa.URL, raw: str) -> ConfigurationError:
    """The error naming the query parameter of ``url`` its dialect cannot convert (found by
    converting each alone); the value is shown unless the parameter's name marks a secret."""
    dialect = url.get_dialect()()
    for name, value in url.query.items():
        try:
            dialect.create_connect_args(url.set(query={name: value}))
        except (ValueError, TypeError) as exc:
            return bad_option(name, raw, str(exc))
    return ConfigurationError(f"bad URL options in lock store URL {mask_url(raw)!r}")
