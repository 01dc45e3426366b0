"""The driver parameters of an SQL store URL, checked when its engine is built.

A value the driver would reject only when it connects (or, worse, misread) is a
:class:`ConfigurationError` naming the parameter, raised before any connect; the value is
shown unless the parameter's name marks a secret, and the URL only masked. The drivers
are asked where they can say: PyMySQL validates its arguments in ``Connection(...,
defer_connect=True)`` without connecting; psycopg's ``make_conninfo`` and psycopg2's
``parse_dsn`` reject names libpq does not know; libpq judges its enumerated values
(``sslmode``, ``target_session_attrs``...) and their combinations when a connection
starts, before it looks for a server, so the store starts one (``PQconnectStart``)
towards a Unix socket path too long for any system, which libpq refuses before it makes a
socket: a refusal that does not name that path is the parameters'. libpq types its
integer values only once connected and lists no types (``PQconndefaults``), hence the
short lists of its integer and 0/1 parameters below; the values an error lists as
allowed are a kept list too (libpq exposes none).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.util import asbool

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.urls import SECRET_NAME, mask_url, url_secrets

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
#: libpq's enumerated parameters and the values they take, as libpq 18 documents them
#: (checked with 18.6, psycopg-binary 3.3's): only shown in an error, libpq judges the value.
LIBPQ_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
    "sslcertmode": ("disable", "allow", "require"),
    "ssl_min_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "ssl_max_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "min_protocol_version": ("3.0", "3.2", "latest"),
    "max_protocol_version": ("3.0", "3.2", "latest"),
    "require_auth": ("password", "md5", "gss", "sspi", "scram-sha-256", "oauth", "none"),
}
#: ``replication`` values that keep a connection ordinary. libpq passes the parameter to
#: the server unread; any other value opens a replication connection (or is refused by
#: the server), where the store's statements cannot run (no extended query protocol).
_NOT_REPLICATION = frozenset({"0", "off", "false", "no"})
#: A Unix socket directory longer than any system's socket path (108 bytes at most).
_NOWHERE = "/" + "x" * 200
#: PyMySQL 1.2's int arguments SQLAlchemy passes on as text (it converts connect_timeout,
#: read_timeout, write_timeout and client_flag itself).
_PYMYSQL_INTS = frozenset({"max_allowed_packet"})
#: PyMySQL 1.2's arguments it reads as truth values with ``bool()``, which SQLAlchemy passes
#: on as text: ``ssl_disabled=false`` would turn TLS off, ``ssl_verify_identity=0`` on.
_PYMYSQL_TRUTHS = frozenset({"ssl_disabled", "ssl_verify_identity", "binary_prefix", "autocommit"})
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
        if name == "replication" and value.strip().lower() not in _NOT_REPLICATION:
            raise bad_option(name, raw, f"the lock store needs an ordinary connection, got {value!r}")
    driver = url.get_driver_name()
    if driver == "psycopg":
        from psycopg import Connection, ProgrammingError
        from psycopg.conninfo import make_conninfo

        own = set(inspect.signature(Connection.connect).parameters)  # psycopg's, not libpq's
        params = {name: value for name, value in url.query.items() if name not in own}
        _check_names(params, lambda name: make_conninfo("", **{name: "1"}), ProgrammingError, raw)
        _check_values(params, _psycopg_start, raw)
    elif driver == "psycopg2":
        psycopg2 = importlib.import_module("psycopg2")
        extensions = importlib.import_module("psycopg2.extensions")
        own = {"dsn", "connection_factory", "cursor_factory", "async", "async_"}
        params = {name: value for name, value in url.query.items() if name not in own}

        def parse(name: str) -> None:
            extensions.parse_dsn(extensions.make_dsn(**{name: "1"}))

        _check_names(params, parse, psycopg2.ProgrammingError, raw)
        _check_values(params, _psycopg2_start, raw)


def _check_names(
    params: Mapping[str, object], parse: Callable[[str], object], error: type[Exception], raw: str
) -> None:
    """Raise naming the first of ``params`` libpq's conninfo parser does not know."""
    for name in params:
        try:
            parse(name)
        except error as exc:  # libpq: invalid connection option "<name>"
            raise ConfigurationError(
                f"unknown URL option {name!r} in lock store URL {mask_url(raw)!r}: "
                f"libpq says {str(exc).strip()}"
            ) from None


def _check_values(
    params: Mapping[str, object], start: Callable[[dict[str, str]], str | None], raw: str
) -> None:
    """Raise naming the parameter whose value libpq refuses when a connection starts (one
    of ``params`` alone, else those given); ``start`` starts one towards :data:`_NOWHERE`
    and returns libpq's message, or None if it started."""
    given = {name: value for name, value in params.items() if isinstance(value, str)}
    if not given or _libpq_refusal(start, {}) is not None:
        return  # nothing to judge, or the environment (PGSSLMODE...) fails every connection
    said = _libpq_refusal(start, given)
    if said is None:
        return
    for name, value in given.items():
        alone = _libpq_refusal(start, {name: value})
        if alone is not None:
            choices = LIBPQ_CHOICES.get(name, ())
            allowed = f"; allowed: {', '.join(choices)}" if choices and value not in choices else ""
            raise bad_option(name, raw, f"libpq says: {_said(alone, raw)}{allowed}")
    raise ConfigurationError(
        f"URL options {', '.join(map(repr, given))} of lock store URL {mask_url(raw)!r} do not go "
        f"together: libpq says: {_said(said, raw)}"
    )


def _said(message: str, raw: str) -> str:
    return mask_url(message.strip(), url_secrets(raw))


def _libpq_refusal(start: Callable[[dict[str, str]], str | None], params: dict[str, str]) -> str | None:
    """libpq's message refusing ``params``, or None if it went on to look for the server."""
    said = start(_probe(params))
    return None if said is None or _NOWHERE in said else said


def _probe(params: dict[str, str]) -> dict[str, str]:
    """``params`` towards :data:`_NOWHERE`: every address, and the credentials, replaced
    (an empty ``hostaddr`` keeps ``PGHOSTADDR`` out; a password keeps the password file unread)."""
    nowhere = {"host": _NOWHERE, "hostaddr": "", "port": "5432", "user": "x", "password": "x", "dbname": "x"}
    return {**params, **nowhere}


def _psycopg_start(params: dict[str, str]) -> str | None:
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    pgconn = pq.PGconn.connect_start(make_conninfo("", **params).encode())
    try:
        if pgconn.status != pq.ConnStatus.BAD:
            return None
        return pgconn.error_message.decode("utf-8", "replace")
    finally:
        pgconn.finish()


def _psycopg2_start(params: dict[str, str]) -> str | None:
    psycopg2 = importlib.import_module("psycopg2")
    dsn = importlib.import_module("psycopg2.extensions").make_dsn(**params)
    try:
        psycopg2.connect(dsn, async_=True).close()  # PQconnectStart; psycopg2 raises if BAD
    except psycopg2.OperationalError as exc:
        return str(exc)
    return None


def pymysql_args(url: sa.URL, raw: str) -> dict[str, Any]:
    """The PyMySQL arguments of ``url`` that SQLAlchemy passes on as text where PyMySQL needs
    an int or a truth value, converted (SQLAlchemy's own rule for truth values: ``true``,
    ``yes``, ``on``, ``1``... and ``false``, ``no``, ``off``, ``0``...), for the engine's
    ``connect_args``; raise ConfigurationError naming one that is neither."""
    typed: dict[str, Any] = {}
    for name, value in url.query.items():
        if name not in _PYMYSQL_INTS | _PYMYSQL_TRUTHS | {"ssl_verify_cert"}:
            continue
        if not isinstance(value, str):
            raise bad_option(name, raw, "given more than once")
        if name in _PYMYSQL_INTS:
            if not _DECIMAL.fullmatch(value):
                raise bad_option(name, raw, f"PyMySQL needs an integer, got {value!r}")
            typed[name] = int(value)
        elif name == "ssl_verify_cert" and value.strip().lower() == "optional":
            typed[name] = "optional"  # PyMySQL's third mode (ssl.CERT_OPTIONAL)
        else:
            try:
                typed[name] = asbool(value)
            except ValueError:
                wanted = "true, false or optional" if name == "ssl_verify_cert" else "true or false"
                raise bad_option(name, raw, f"PyMySQL needs {wanted}, got {value!r}") from None
    return typed


def _check_pymysql(dialect: Dialect, url: sa.URL, connect_args: dict[str, Any], raw: str) -> None:
    charsets = importlib.import_module("pymysql.charset")
    connection = importlib.import_module("pymysql.connections").Connection
    for name, value in _values(url):
        if name == "charset" and charsets.charset_by_name(value) is None:
            raise bad_option(name, raw, f"PyMySQL knows no charset {value!r}")
    cargs, cparams = dialect.create_connect_args(url)
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
