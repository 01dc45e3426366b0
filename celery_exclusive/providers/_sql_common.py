"""What the two SQL lock stores share: the schema, the engine, error text, the common plumbing.

Private to :mod:`celery_exclusive.providers.postgres` (PostgreSQL) and
:mod:`celery_exclusive.providers.sql` (SQLite, MariaDB/MySQL).

Leases are rows of one table (``cache_entries`` by default) that may be shared with other
application rows; only the row of the exact key being operated on is ever touched. Fences
come from a counter that survives row deletion: the sequence ``<table>_fence_seq`` on
PostgreSQL, the one-row table ``<table>_fence`` elsewhere. Completion records
(``release(..., completion)``) live in ``<table>_done``, keyed by lock key and task id,
created with the lock table; expired records are pruned by later releases.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import random
import re
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Dialect, Engine, make_url
from sqlalchemy.pool import QueuePool, StaticPool

from celery_exclusive.errors import BackendError, ConfigurationError, InvalidArgumentError, MissingDriverError
from celery_exclusive.providers import _deadline
from celery_exclusive.providers._sql_params import check_params, pymysql_args, unconvertible
from celery_exclusive.providers.base import Completion, CompletionInfo, Diagnosis, LockInfo, decode_holder
from celery_exclusive.urls import known_secrets, mask_error, mask_url, split_options, url_secrets
from celery_exclusive.validation import MAX_LIFETIME_CAP

logger = logging.getLogger("celery_exclusive.providers.sql")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_MAX_NAME = 63 - len("_fence_seq")  # derived names must fit PostgreSQL's and MySQL's limits
#: SQLAlchemy backend -> (its default driver module, the pip extra that installs it): the
#: backends the SQL stores serve (``postgres`` is read as ``postgresql``).
DRIVERS = {
    "postgresql": ("psycopg", "postgres"),
    "sqlite": ("sqlite3", "sqlite"),  # in Python itself: no such extra (see _missing_driver)
    "mysql": ("pymysql", "mysql"),
    "mariadb": ("pymysql", "mysql"),
}
#: pip names of SQLAlchemy drivers the extras do not install.
_PIP_NAMES = {
    "psycopg2": "psycopg2-binary",
    "mysqldb": "mysqlclient",
    "mysqlconnector": "mysql-connector-python",
}
#: libpq options for engines built from a URL: give up on an unanswered connect after 10 s,
#: on unacknowledged data after 30 s, and on a silent peer after 10 + 3 x 5 s of keepalives.
_PG_NETWORK_DEFAULTS = {
    "connect_timeout": 10,
    "tcp_user_timeout": 30_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
#: The ``ce_`` options of an SQL store URL.
OPTIONS = ("table", "create_table", "pgbouncer")
#: In a forked child, the parent's kept connections (and SQLite pools): never used, never
#: closed (that would end the parent's sessions, or drop this process's SQLite file locks)
#: and never collected (psycopg would warn they were left open).
INHERITED: list[Any] = []
# The origin's staleness threshold: a row older than the 24 h cap is dead whatever it says.
# Never the requester's max_lifetime, or a caller with a short one could steal a long lease.
STALE = int(MAX_LIFETIME_CAP)
#: One record-writing release in this many (by task id) also prunes up to PRUNE_BATCH
#: expired records, so pruning keeps up with far more writes than it costs.
_PRUNE_EVERY = 8
PRUNE_BATCH = 32
Rows = list[tuple[Any, ...]]
#: The MySQL protocol's CLIENT_MULTI_STATEMENTS capability flag (pymysql's ``client_flag``).
MYSQL_MULTI_STATEMENTS = 1 << 16


def prune_suffix(completion: Completion) -> str:
    """``"_prune"`` for the one release in _PRUNE_EVERY (by task id) that prunes expired records."""
    return "_prune" if zlib.crc32(completion.task_id.encode()) % _PRUNE_EVERY == 0 else ""


def record_params(completion: Completion) -> dict[str, Any]:
    """The bind parameters of a release that writes ``completion``'s record."""
    return {
        "task_id": completion.task_id,
        "outcome": completion.outcome,
        "attempt": int(completion.attempt),
        "retain": float(completion.retain),
    }


def live(info: LockInfo) -> bool:
    """Whether a row read from the store (times relative to the store's clock) is a live lease."""
    return info.expires_in > 0 and info.hard_expires_in > 0 and info.age < STALE


def check_sweep(prefix: str, limit: int) -> str:
    """``prefix`` once a sweep's arguments are checked (InvalidArgumentError otherwise)."""
    if not isinstance(prefix, str) or "\x00" in prefix:
        raise InvalidArgumentError("sweep prefix must be a str without NUL characters")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgumentError(f"sweep limit must be a positive int, got {limit!r}")
    return prefix


def like_pattern(prefix: str) -> str:
    """A ``LIKE ... ESCAPE '!'`` pattern matching the keys that start with ``prefix``."""
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def info_of(row: Sequence[Any]) -> LockInfo:
    """The lease of a ``key, value, fence, age, expires_in, hard_expires_in, holder`` row."""
    key, token, fence, age, expires_in, hard, holder = row
    return LockInfo(
        str(key),
        str(token),
        int(fence),
        float(age),
        float(expires_in),
        float(hard),
        decode_holder(holder),
    )


def record_of(row: Sequence[Any]) -> CompletionInfo:
    """The completion record of a ``key, task_id, outcome, attempt, age, seconds left`` row."""
    key, task_id, outcome, attempt, age, left = row
    return CompletionInfo(str(key), str(task_id), str(outcome), int(attempt), float(age), float(left))


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"option ce_{name} must be true or false, got {value!r}")


class _Key(sa.types.TypeDecorator[str]):
    """The key column: on MySQL/MariaDB a binary collation that also keeps trailing spaces.

    'A' and 'a', and 'a' and 'a ' are different keys. ``utf8mb4_bin`` is PAD SPACE (it
    ignores trailing spaces), so the NO PAD binary collation of the connected server is
    used where it has one: MariaDB >= 10.2 ``utf8mb4_nopad_bin``, MySQL 8 ``utf8mb4_0900_bin``.
    """

    impl = sa.String(512)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name not in ("mysql", "mariadb"):
            return dialect.type_descriptor(sa.String(512))
        version = dialect.server_version_info or ()
        if getattr(dialect, "is_mariadb", False):
            collation = "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
        else:
            collation = "utf8mb4_0900_bin" if version >= (8, 0) else "utf8mb4_bin"
        return dialect.type_descriptor(mysql.VARCHAR(512, charset="utf8mb4", collation=collation))


_KEY = _Key()
_TASK_ID = sa.String(200).with_variant(
    mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)
_TOKEN = sa.Text().with_variant(mysql.TEXT(charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb")
_STAMP = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def lock_table(metadata: sa.MetaData, name: str = "cache_entries") -> sa.Table:
    """The lease table ``name`` in ``metadata``, for Alembic or ``metadata.create_all``.

    Creating it also creates its fence counter and its completion-record table
    ``<name>_done`` (``after_create``), idempotently.
    """
    check_name(name)
    table = sa.Table(
        name,
        metadata,
        sa.Column("key", _KEY, primary_key=True),
        sa.Column("value", _TOKEN, nullable=False),
        sa.Column("expires_at", _STAMP, nullable=False),
        sa.Column("created_at", _STAMP, nullable=False),
        sa.Column("deadline", _STAMP, nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=True),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )
    # Completion records (task id per lock key) live in a table of their own, so they can
    # never collide with a lease or with another application's rows of a shared table.
    # Like the fence counter it is made with the lock table (after_create), not by the
    # caller's metadata, so create_all() does not try to make it twice.
    done = sa.Table(
        name + "_done",
        sa.MetaData(),
        sa.Column("key", _KEY, primary_key=True),
        sa.Column("task_id", _TASK_ID, primary_key=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", _STAMP, nullable=False),
        sa.Column("expires_at", _STAMP, nullable=False),
        sa.Index(name + "_done_x", "expires_at"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mariadb_engine="InnoDB",
        mariadb_charset="utf8mb4",
    )
    table.info["done"] = done
    event.listen(table, "after_create", create_fence)
    return table


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > _MAX_NAME:
        raise ConfigurationError(
            f"invalid lock table name {name!r}: use letters, digits and _, "
            f"not starting with a digit, at most {_MAX_NAME} characters"
        )


_SCHEMA_ATTEMPTS = 6
# MySQL/MariaDB: deadlock, lock wait timeout, "record has changed", "definition is being
# modified by concurrent DDL statement"; nothing was committed.
_SCHEMA_CONTENTION_CODES = frozenset({1213, 1205, 1020, 1684})


def schema_contention(exc: sa_exc.SQLAlchemyError) -> bool:
    """Whether setting up the schema failed only because other processes did it at the same
    time (first use by a whole fleet at once), so doing it again succeeds or finds it done."""
    if isinstance(exc, sa_exc.IntegrityError) or "already exists" in str(exc):
        return True
    if not isinstance(exc, sa_exc.DBAPIError) or exc.orig is None:
        return False
    return error_code(exc) in _SCHEMA_CONTENTION_CODES or "database is locked" in str(exc.orig)


def error_code(exc: sa_exc.DBAPIError) -> Any:
    """The driver's error code (MySQL's number), or None."""
    return getattr(exc.orig, "args", (None,))[0] if exc.orig is not None else None


def create_fence(table: sa.Table, connection: Connection, **_: Any) -> None:
    done = table.info.get("done")
    if done is not None:
        done.create(connection, checkfirst=True)
    create_counter(table, connection)


def create_counter(table: sa.Table, connection: Connection) -> None:
    """The fence counter of ``table``: a sequence on PostgreSQL (with the marker statement's
    function, :func:`unless_function_ddl`), a one-row table elsewhere."""
    dialect = connection.dialect
    q = dialect.identifier_preparer.quote
    if dialect.name == "postgresql":
        connection.exec_driver_sql(f"CREATE SEQUENCE IF NOT EXISTS {q(table.name + '_fence_seq')} CACHE 1")
        connection.exec_driver_sql(unless_function_ddl(dialect, table.name))
        return
    counter = q(table.name + "_fence")
    sqlite = dialect.name == "sqlite"
    ignore, options = ("OR IGNORE", "") if sqlite else ("IGNORE", " ENGINE=InnoDB")
    connection.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {counter} (id INTEGER PRIMARY KEY, n BIGINT NOT NULL){options}"
    )
    # Seeded from the table so a recreated counter still exceeds every stored fence.
    connection.exec_driver_sql(
        f"INSERT {ignore} INTO {counter} (id, n) SELECT 1, COALESCE(MAX(fence), 0) FROM {q(table.name)}"
    )


def unless_function(name: str) -> str:
    """The name of lock table ``name``'s marker function on PostgreSQL (see below)."""
    return name + "_unless"


def unless_function_ddl(dialect: Dialect, name: str) -> str:
    """PostgreSQL: create (or bring up to date) ``<name>_unless(key, blocker)``, whether
    neither key has a live lease in ``name`` *now*: the ``acquire_unless`` statement calls
    it once it holds ``key``'s lock, to re-read both rows with a snapshot taken after the
    lock (a VOLATILE PL/pgSQL function takes a new snapshot for each query under READ
    COMMITTED), as the statement's own snapshot may predate a whole marker-and-run cycle
    (providers/_pg_sql.py). Idempotent; writes the catalog only when the function is missing
    or its body differs (no plan invalidation on every start, no CREATE privilege needed
    once it is there). Times are ``statement_timestamp()``, the calling statement's."""
    q = dialect.identifier_preparer.quote
    now = "statement_timestamp()"

    def held(param: str) -> str:
        # One primary-key lookup per key: with "key IN ($1, $2)" the plan PL/pgSQL cached
        # while the table was small scanned it all (each grant slower as the table grew).
        return (
            f"EXISTS (SELECT 1 FROM {q(name)} AS c WHERE c.key = {param}\n"
            f"    AND c.expires_at > {now} AND c.deadline > {now}\n"
            f"    AND c.created_at > {now} - make_interval(secs => {STALE}))"
        )

    body = (
        "\nBEGIN\n  -- celery-exclusive: acquire_unless re-reads both keys after taking the key lock\n"
        f"  RETURN NOT {held('$1')}\n  AND NOT {held('$2')};\nEND\n"
    )
    fn = q(unless_function(name))
    signature = f"{fn}(varchar,varchar)".replace("'", "''")
    return f"""DO $ce_do$ BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc
               WHERE oid = to_regprocedure('{signature}') AND prosrc = $ce_fn${body}$ce_fn$) THEN
  CREATE OR REPLACE FUNCTION {fn}(varchar, varchar) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $ce_fn${body}$ce_fn$;
END IF;
END $ce_do$"""


def has_unless_function(connection: Connection, name: str) -> bool:
    """PostgreSQL: whether ``<name>_unless(varchar, varchar)`` is on the search path."""
    q = connection.dialect.identifier_preparer.quote
    signature = f"{q(unless_function(name))}(varchar,varchar)"
    found = connection.execute(
        sa.text("SELECT to_regprocedure(:s) IS NOT NULL"), {"s": signature}
    ).scalar_one()
    return bool(found)


def _host_list_as_query(rest: str) -> str:
    """PostgreSQL: libpq's ``user@h1:p1,h2:p2/db?q`` as SQLAlchemy's ``user@/db?host=h1:p1&
    host=h2:p2&q`` (psycopg tries them in order, ``target_session_attrs`` decides which fits)."""
    before_query, _, query = rest.partition("?")
    authority, _, path = before_query.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if "," not in hosts:
        return rest
    params = [f"host={host}" for host in hosts.split(",")] + ([query] if query else [])
    return f"{userinfo}{at}/{path}?{'&'.join(params)}"


def _parse_url(raw: str) -> tuple[str, str, sa.URL]:
    """``(backend, driver, SQLAlchemy URL)`` of an SQL store URL; the driver is the default
    one where the URL names none (none at all for SQLite, whose driver is built in)."""
    scheme, sep, rest = raw.partition("://")
    backend, _, driver = scheme.lower().partition("+")
    backend = "postgresql" if backend == "postgres" else backend
    if not sep or backend not in DRIVERS:
        raise ConfigurationError(f"not an SQL lock store URL: {mask_url(raw)!r}")
    if backend != "sqlite":
        driver = driver or DRIVERS[backend][0]
    if backend == "postgresql":
        rest = _host_list_as_query(rest)
    try:
        url = make_url(f"{backend}+{driver}://{rest}" if driver else f"{backend}://{rest}")
    except (sa_exc.ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise _malformed(raw, exc) from None
    if "@" in (url.host or ""):  # SQLAlchemy ends a password at its first "@": the rest is no host
        raise ConfigurationError(
            f"malformed SQL lock store URL {mask_url(raw)!r}: its host would contain '@'; "
            "percent-encode an '@' in the password (%40)"
        )
    return backend, driver, url


def _malformed(raw: str, exc: Exception) -> ConfigurationError:
    """The error for SQL store URL ``raw`` that SQLAlchemy refused with ``exc`` (masked in place)."""
    secrets = url_secrets(raw)  # a raw "@" in a password: the rest is read as host and port
    mask_error(exc, secrets)  # still the error's __context__
    reason = " ".join(mask_url(str(exc), secrets).split())  # SQLite's lists its URL forms on lines
    return ConfigurationError(f"malformed SQL lock store URL {mask_url(raw)!r}: {reason}")


class DeadlinePool(QueuePool):
    """SQLAlchemy's QueuePool (the pool of every engine a store builds from a URL, but an
    in-memory SQLite database's), whose wait for a free connection also ends by the calling
    thread's connect budget (:func:`._deadline.connect_budget`: the call's deadline), if that
    comes first: the call then raises ``sqlalchemy.exc.TimeoutError`` naming the pool and
    the deadline, as it would after the pool's own timeout (``pool_timeout``, 30 s)."""

    # SQLAlchemy names a pool's logger after its class: under our package, its DEBUG lines
    # (a failed connect's driver error, unmasked) would follow the application's log level
    # instead of the ``sqlalchemy`` logger's (WARN unless enabled), as QueuePool's do.
    _sqla_logger_namespace = "sqlalchemy.pool.impl.QueuePool"

    @property
    def _timeout(self) -> float:
        """What QueuePool reads as its timeout: the configured one, or what is left of the
        call's deadline if less."""
        return _deadline.checkout_wait(self._configured_timeout)

    @_timeout.setter
    def _timeout(self, value: float) -> None:
        self._configured_timeout = value

    def _do_get(self) -> Any:
        wait, configured = self._timeout, self._configured_timeout
        try:
            return super()._do_get()
        except sa_exc.TimeoutError:
            if wait >= configured:
                raise
        raise sa_exc.TimeoutError(
            f"QueuePool limit of size {self.size()} overflow {self._max_overflow} reached: no "
            f"connection came free by the call's deadline ({wait:.3g} s left of it; "
            f"pool_timeout {configured:g} s)",
            code="3o7r",
        )

    def recreate(self) -> QueuePool:
        with _deadline.connect_budget(None):  # the new pool gets the configured timeout
            return super().recreate()


def _postgres_options(url: sa.URL, driver: str, prepare: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    # libpq has no read timeout: without these a call on a network that went silent
    # waits for TCP to give up (about 15 minutes on Linux). The URL may override each.
    connect_args: dict[str, Any] = {k: v for k, v in _PG_NETWORK_DEFAULTS.items() if k not in url.query}
    if not prepare and driver == "psycopg":
        # Behind PgBouncer < 1.21 (transaction pooling) a statement psycopg prepared on
        # one server connection is missing, or already there, on the next one.
        connect_args["prepare_threshold"] = None
    return kwargs, connect_args


def _sqlite_options(url: sa.URL) -> tuple[dict[str, Any], dict[str, Any]]:
    kwargs: dict[str, Any] = {}
    connect_args: dict[str, Any] = {"timeout": 30}
    if url.database in (None, "", ":memory:"):
        kwargs["poolclass"] = StaticPool
        connect_args["check_same_thread"] = False
    return kwargs, connect_args


def _mysql_options(url: sa.URL, driver: str) -> tuple[dict[str, Any], dict[str, Any]]:
    kwargs: dict[str, Any] = {"isolation_level": "READ COMMITTED", "pool_recycle": 3600}
    connect_args: dict[str, Any] = {} if "connect_timeout" in url.query else {"connect_timeout": 10}
    if driver == "pymysql" and "client_flag" not in url.query:
        # Lets a release send its DELETE and its completion record in one round trip
        # (see SqlLockProvider.release); every value is still escaped by the driver.
        connect_args["client_flag"] = MYSQL_MULTI_STATEMENTS
    return kwargs, connect_args


def engine_from_url(raw: str, *, prepare: bool = True) -> Engine:
    """The engine of an SQL store URL, with the store's isolation, timeouts and pool rules.

    ``prepare=False`` (PgBouncer before 1.21) stops psycopg preparing statements.
    """
    backend, driver, url = _parse_url(raw)
    if backend == "postgresql":
        kwargs, connect_args = _postgres_options(url, driver, prepare)
    elif backend == "sqlite":
        kwargs, connect_args = _sqlite_options(url)
    else:
        kwargs, connect_args = _mysql_options(url, driver)
        if driver == "pymysql":
            connect_args.update(pymysql_args(url, raw))
    kwargs.setdefault("poolclass", DeadlinePool)
    try:
        engine = sa.create_engine(url, connect_args=connect_args, **kwargs)
    except (ImportError, sa_exc.NoSuchModuleError) as exc:
        raise _missing_driver(backend, driver) from exc
    except (ValueError, TypeError):  # a driver parameter SQLAlchemy could not convert
        raise unconvertible(url, raw) from None
    except sa_exc.ArgumentError as exc:  # sqlite://file.db: the dialect knows its URL forms
        raise _malformed(raw, exc) from None
    check_params(engine.dialect, url, connect_args, raw)
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
    return engine


def _missing_driver(backend: str, driver: str) -> MissingDriverError:
    module, extra = DRIVERS[backend]
    if backend == "sqlite":  # Python's own module, which no extra installs
        if not driver or driver == "pysqlite":
            return MissingDriverError(
                extra, module, "a Python built with its sqlite3 module (no pip package provides it)"
            )
        package = _PIP_NAMES.get(driver, driver)
        return MissingDriverError(
            extra, driver, f"pip install {package}, or use sqlite:/// (Python's own sqlite3 module)"
        )
    if not driver or driver == module:
        return MissingDriverError(extra, module)
    # The URL names a driver the extra does not install: the extra would not help.
    package = _PIP_NAMES.get(driver, driver)
    alternative = f"{backend}+{module}:// (pip install 'celery-exclusive[{extra}]')"
    return MissingDriverError(extra, driver, f"pip install {package}, or use {alternative}")


def _sqlite_begin(conn: Connection) -> None:
    """Writes begin ``IMMEDIATE`` (the write lock first, so no upgrade can fail midway);
    reads (``ce_read``) deferred: in WAL mode they neither wait for a writer nor block one."""
    conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("ce_read") else "BEGIN IMMEDIATE")


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions are begun by the "begin" event
    with contextlib.suppress(Exception):  # WAL is an optimisation; a busy or read-only file keeps its mode
        dbapi_connection.execute("PRAGMA journal_mode=WAL")


def error_text(masked: str, op: str, exc: BaseException, secrets: Sequence[str]) -> str:
    """``SQL lock store <url> failed to <op>: <driver error>``, every secret masked."""
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    reason = mask_url(lines[0] if lines else "", secrets)[:300]  # cut after masking
    return f"SQL lock store {masked} failed to {op}: {type(cause).__name__}: {reason}"


def socket_of(driver_connection: Any) -> int | None:
    """The socket descriptor of a PyMySQL or psycopg connection; None for other drivers."""
    sock = getattr(driver_connection, "_sock", None)  # PyMySQL's
    if sock is not None:
        fd = sock.fileno()
    else:
        fd = getattr(getattr(driver_connection, "pgconn", None), "socket", None)  # psycopg's
    return fd if isinstance(fd, int) and fd >= 0 else None


class Translated:
    """``with store._translated(op):``: a driver error raised inside becomes the store's
    :class:`BackendError` (chained from it, credentials masked); anything else, a
    BackendError included, passes through untouched."""

    __slots__ = ("_op", "_store")

    def __init__(self, store: SqlStore, op: str) -> None:
        self._store = store
        self._op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if exc is not None and isinstance(exc, self._store._driver_errors):
            raise self._store._error(self._op, exc) from exc


class SqlStore(metaclass=abc.ABCMeta):
    """What both SQL lock stores share: the engine (built from a URL or the caller's), the
    table and its lazy creation, the completion-record table's presence, error translation,
    and the fork hook. Thread-safe and fork-safe; see the subclasses for the statements.
    """

    max_key_length = 512
    #: The SQLAlchemy dialects the store serves.
    _DIALECTS: tuple[str, ...] = tuple(DRIVERS)
    #: Names the store in the unsupported-dialect error ("PostgreSQL "; empty: any SQL store).
    _kind = ""
    #: Driver errors that :meth:`_translated` turns into BackendError.
    _driver_errors: tuple[type[BaseException], ...] = (sa_exc.SQLAlchemyError,)

    def __init__(
        self,
        engine_or_url: Engine | str,
        *,
        table: str = "cache_entries",
        create_table: bool = True,
        pgbouncer: bool = False,
    ) -> None:
        check_name(table)
        self._engine, self._owns_engine = self._engine_of(engine_or_url, pgbouncer)
        dialect, url = self._engine.dialect, self._engine.url
        if dialect.name not in self._DIALECTS:
            raise ConfigurationError(f"unsupported SQL dialect {dialect.name!r} for a {self._kind}lock store")
        self.table = lock_table(sa.MetaData(), table)
        # The URL as given and as SQLAlchemy read it (a raw "@" in a password moves the rest).
        given = engine_or_url if isinstance(engine_or_url, str) else ""
        self._secrets = known_secrets(
            [*url_secrets(given), *url_secrets(url.render_as_string(hide_password=False))]
        )
        self._masked = mask_url(url.render_as_string(hide_password=True), self._secrets)
        self._ready = not create_table
        # Whether <table>_done exists: made with the lock table when create_table is on;
        # else looked up on first use (a schema migrated before records existed lacks it).
        self._records: bool | None = True if create_table else None
        self._schema_lock = threading.Lock()
        self._closed = False
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _after_fork(ref))
        self._setup(pgbouncer=pgbouncer)

    @abc.abstractmethod
    def _setup(self, *, pgbouncer: bool) -> None:
        """The dialect's statements and how they are sent, once the shared state is set."""

    def _engine_of(self, engine_or_url: Engine | str, pgbouncer: bool) -> tuple[Engine, bool]:
        """``(engine, whether this store built it)``."""
        if isinstance(engine_or_url, str):
            if split_options(engine_or_url, OPTIONS, sqlalchemy=True)[1]:
                raise ConfigurationError(
                    f"ce_ options in {mask_url(engine_or_url)!r} are read by "
                    f"{type(self).__name__}.from_url() (and LockService); the constructor takes "
                    "table=, create_table= and pgbouncer="
                )
            return engine_from_url(engine_or_url, prepare=not pgbouncer), True
        if isinstance(engine_or_url, Engine):
            return engine_or_url, False
        raise ConfigurationError(f"expected an SQLAlchemy Engine or URL, got {type(engine_or_url).__name__}")

    @classmethod
    def from_url(cls, url: str) -> Any:
        """A provider for ``url``; ``?ce_table=name&ce_create_table=false`` are our options.

        ``ce_pgbouncer=true`` sends every statement unprepared (the provider prepares acquire
        and release, psycopg any statement run five times), as PgBouncer before 1.21 (or
        without ``max_prepared_statements``) cannot pool prepared statements; on PostgreSQL it
        also turns the waiters' LISTEN connection off (session state): set it for any
        transaction pooling.
        """
        base, options = split_options(url, OPTIONS, sqlalchemy=True)
        create = parse_bool("create_table", options.get("create_table", "true"))
        pgbouncer = parse_bool("pgbouncer", options.get("pgbouncer", "false"))
        return cls(
            base, table=options.get("table", "cache_entries"), create_table=create, pgbouncer=pgbouncer
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._masked!r}, table={self.table.name!r})"

    # -- the reads both stores answer the same way -------------------------------------

    def completion(self, key: str, task_id: str, *, timeout: float | None = None) -> CompletionInfo | None:
        if not self._records_on(timeout):
            return None
        rows = self._read("read a record", "done_get", {"key": key, "task_id": task_id}, timeout)
        return record_of(rows[0]) if rows else None

    def completions(self, prefix: str, *, timeout: float | None = None) -> list[CompletionInfo]:
        if not self._records_on(timeout):
            return []
        params = {"prefix": prefix, "pattern": like_pattern(prefix)}
        rows = self._read("list records", "done_list", params, timeout)
        return sorted((record_of(row) for row in rows), key=lambda r: (r.key, r.task_id))

    def peek(self, key: str, *, timeout: float | None = None) -> LockInfo | None:
        rows = self._read("peek", "peek", {"key": key}, timeout)
        return info_of(rows[0]) if rows else None

    def scan(self, prefix: str, *, timeout: float | None = None) -> list[LockInfo]:
        rows = self._read("scan", "scan", {"prefix": prefix, "pattern": like_pattern(prefix)}, timeout)
        return sorted((info_of(row) for row in rows), key=lambda info: info.key)

    @abc.abstractmethod
    def _read(
        self, op: str, statement: str, params: dict[str, Any], timeout: float | None
    ) -> Sequence[Sequence[Any]]:
        """The rows of one read-only statement (``op`` names it in errors), within ``timeout``
        seconds as the store enforces deadlines (None: the driver's own timeouts)."""

    @abc.abstractmethod
    def diagnose(self) -> list[Diagnosis]:
        """The store's own health checks (see ``LockProvider.diagnose``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Dispose of the engine's connections if this store created the engine."""

    # -- shared plumbing ---------------------------------------------------------------

    def _translated(self, op: str) -> Translated:
        """The one place a driver error becomes this store's BackendError (see Translated)."""
        return Translated(self, op)

    def _error(self, op: str, exc: BaseException) -> BackendError:
        """The BackendError for driver error ``exc``; ``exc`` and its chain are masked in
        place (:func:`~celery_exclusive.urls.mask_error`), as it is chained to it."""
        error = BackendError(error_text(self._masked, op, exc, self._secrets))
        mask_error(exc, self._secrets)
        return error

    def _session(self) -> contextlib.AbstractContextManager[Any]:
        """Held around every use of a connection (SQLite's fork gate and serial lock)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _connected(self, timeout: float | None) -> Iterator[Connection]:
        """A connection of the engine for the block, all of it within ``timeout`` seconds
        (None: the driver's own timeouts): the wait for a pooled connection and the connect
        by :func:`._deadline.connect_budget`, the statements by the watchdog on its socket
        (PyMySQL's, psycopg's: shut down at the deadline, the connection then dropped) or
        SQLite's busy timeout. For the lookups and checks outside the operations' own paths
        (the record table, diagnose), so they end by their call's deadline too."""
        if timeout is None:
            with self._engine.connect() as conn:
                yield conn
            return
        end = time.monotonic() + timeout
        with _deadline.connect_budget(timeout):
            conn = self._engine.connect()
        with conn:
            self._bound_schema_call(conn, end)  # SQLite: its busy timeout
            fd = socket_of(conn.connection.driver_connection)
            if fd is None:  # SQLite, or another driver: its own timeouts
                yield conn
                return
            ticket, watch = _deadline.arm(fd, end)
            try:
                yield conn
            finally:
                _deadline.disarm(ticket)
                if watch.fired and not conn.invalidated:  # its socket shut down: never reused
                    conn.invalidate()

    def _records_on(self, timeout: float | None = None) -> bool:
        """Whether the completion-record table is there (looked up on first use, within
        ``timeout`` seconds); warns once if it is not."""
        ready = self._records
        if ready is None:
            end = None if timeout is None else time.monotonic() + timeout
            self._ensure_schema(timeout)
            name = self.table.name + "_done"
            translated = self._translated("look for the completion-record table")
            left = None if end is None else max(end - time.monotonic(), 0.001)
            with translated, self._session(), self._connected(left) as conn:
                ready = bool(sa.inspect(conn).has_table(name))
            if not ready:
                logger.warning(
                    "SQL lock store %s: table %r is missing, so no completion records are kept "
                    "(redelivered copies of finished tasks run again); create it with "
                    "lock_table(metadata, %r) and metadata.create_all(), or set done_retention=False",
                    self._masked,
                    name,
                    self.table.name,
                )
            self._records = ready
        return ready

    def set_up(self, *, timeout: float | None = None) -> None:
        """Create the tables if needed (see ``SetsUp``); nothing once done."""
        self._ensure_schema(timeout)

    def _ensure_schema(self, timeout: float | None = None) -> None:
        """Create the tables on first use; with ``timeout``, connecting for it gives up by
        then (the call's own deadline covers the set-up it triggers)."""
        if self._ready:
            return
        end = None if timeout is None else time.monotonic() + timeout
        with self._schema_lock, _deadline.connect_budget(timeout):
            for attempt in range(1, _SCHEMA_ATTEMPTS + 1):
                if self._ready:
                    return
                try:
                    self._create_schema(end)
                    self._ready = True
                except sa_exc.SQLAlchemyError as exc:
                    late = end is not None and time.monotonic() >= end
                    if attempt == _SCHEMA_ATTEMPTS or late or not schema_contention(exc):
                        raise self._error("set up the lock table", exc) from exc
                    time.sleep(random.uniform(0.01, 0.05) * attempt)

    def _create_schema(self, end: float | None = None) -> None:
        with self._session(), self._engine.connect() as conn:
            if end is not None:
                self._bound_schema_call(conn, end)
            with conn.begin():
                self.table.create(conn, checkfirst=True)
                create_fence(self.table, conn)

    def _bound_schema_call(self, conn: Connection, end: float) -> None:
        """Make the set-up's transaction (or :meth:`_connected`'s block) on ``conn`` end by
        monotonic ``end`` where the connection itself does not (SQLite: see
        ``SqlLockProvider``); nothing here."""
        return

    def _schema_findings(self, conn: Connection, findings: list[Diagnosis]) -> bool:
        """Append whether the table (and its record table) exist; True if the table does."""
        exists = sa.inspect(conn).has_table(self.table.name)
        status = "ok" if exists else ("warn" if not self._ready else "fail")
        findings.append(Diagnosis("schema", status, f"table {self.table.name!r} exists: {exists}"))
        done = self.table.name + "_done"
        if exists and not sa.inspect(conn).has_table(done):
            findings.append(
                Diagnosis("records", "warn", f"table {done!r} is missing: no completion records are kept")
            )
        return exists

    def _after_fork(self) -> None:
        self._schema_lock = threading.Lock()


def _after_fork(ref: weakref.ReferenceType[SqlStore]) -> None:
    store = ref()
    if store is not None:
        store._after_fork()
