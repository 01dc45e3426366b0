"""The lock table's DDL for a Django connection: exactly what the SQL store creates itself.

The statements are compiled from :func:`celery_exclusive.providers.sql.lock_table` and the
store's own fence-counter DDL, for the connection's dialect (and, on MySQL/MariaDB, its
server version, which picks the key's collation), and run through Django's schema editor,
inside the migration's transaction where the database has transactional DDL.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers._sql_common import (
    create_counter,
    lock_table,
    unless_function,
    unless_function_ddl,
)

from .store import DEFAULT_TABLE, TABLE_SETTING


def table_name() -> str:
    """The lock table's name: the ``CELERY_EXCLUSIVE_TABLE`` setting, else ``cache_entries``."""
    from django.conf import settings

    return str(getattr(settings, TABLE_SETTING, None) or DEFAULT_TABLE)


def dialect_for(connection: Any) -> Dialect:
    """The SQLAlchemy dialect matching a Django connection (vendor and server version)."""
    vendor = connection.vendor
    if vendor == "postgresql":
        return postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]
    if vendor == "sqlite":
        return sqlite.pysqlite.dialect()
    if vendor == "mysql":
        dialect = mysql.pymysql.dialect()
        dialect.is_mariadb = bool(connection.mysql_is_mariadb)
        dialect.server_version_info = tuple(connection.mysql_version)
        return dialect
    raise ConfigurationError(
        f"the lock table migration supports PostgreSQL, MySQL/MariaDB and SQLite, not {vendor!r}"
    )


class _Recorder:
    """Stands in for the SQLAlchemy connection the fence DDL is written for; runs it via Django."""

    def __init__(self, dialect: Dialect, schema_editor: Any) -> None:
        self.dialect = dialect
        self._editor = schema_editor

    def exec_driver_sql(self, statement: str) -> None:
        self._editor.execute(statement, params=None)


def create(schema_editor: Any, name: str) -> None:
    """Create the lock table ``name``, its completion-record table and its fence counter on
    the schema editor's database."""
    dialect = dialect_for(schema_editor.connection)
    table = lock_table(sa.MetaData(), name)
    done: sa.Table = table.info["done"]
    statements: list[sa.schema.ExecutableDDLElement] = [
        sa.schema.CreateTable(table),
        sa.schema.CreateTable(done),
        *(sa.schema.CreateIndex(index) for index in sorted(done.indexes, key=lambda i: str(i.name))),
    ]
    for ddl in statements:
        schema_editor.execute(str(ddl.compile(dialect=dialect)).strip(), params=None)
    create_counter(table, _Recorder(dialect, schema_editor))  # type: ignore[arg-type]


def drop(schema_editor: Any, name: str) -> None:
    """Drop the lock table ``name``, its completion-record table and its fence counter."""
    dialect = dialect_for(schema_editor.connection)
    q = dialect.identifier_preparer.quote
    schema_editor.execute(f"DROP TABLE IF EXISTS {q(name + '_done')}", params=None)
    schema_editor.execute(f"DROP TABLE IF EXISTS {q(name)}", params=None)
    if dialect.name == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {q(name + '_fence_seq')}", params=None)
        drop_unless_function(schema_editor, name)
    else:
        schema_editor.execute(f"DROP TABLE IF EXISTS {q(name + '_fence')}", params=None)


def create_unless_function(schema_editor: Any, name: str) -> None:
    """PostgreSQL: create (or bring up to date) lock table ``name``'s marker function, which
    ``create`` makes with the table (migration 0002: for tables migrated before it existed)."""
    dialect = dialect_for(schema_editor.connection)
    if dialect.name == "postgresql":
        schema_editor.execute(unless_function_ddl(dialect, name), params=None)


def drop_unless_function(schema_editor: Any, name: str) -> None:
    """PostgreSQL: drop lock table ``name``'s marker function, if there."""
    dialect = dialect_for(schema_editor.connection)
    if dialect.name == "postgresql":
        q = dialect.identifier_preparer.quote
        schema_editor.execute(
            f"DROP FUNCTION IF EXISTS {q(unless_function(name))}(varchar, varchar)", params=None
        )
