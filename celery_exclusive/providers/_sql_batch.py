"""MariaDB/MySQL statement batches: several of the store's statements in one round trip.

Private to :mod:`celery_exclusive.providers.sql`. On pymysql with ``CLIENT_MULTI_STATEMENTS``
(as engines built from a URL are, see ``_sql_common.engine_from_url``) the statements of
one step of an operation go to the server as one ``;``-joined batch, inside the caller's
transaction; driver errors surface as SQLAlchemy's ``DBAPIError``, as from ``execute``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from celery_exclusive.providers._libpq import PLACEHOLDER
from celery_exclusive.providers._sql_common import MYSQL_MULTI_STATEMENTS

__all__ = ["Batches"]


class Batches:
    """Runs named statements of ``sql`` as one batch on ``engine``'s connections; each
    batch's text is built once, on first use."""

    def __init__(self, engine: Engine, sql: dict[str, sa.TextClause]) -> None:
        self._engine = engine
        self._sql = sql
        self._pymysql = engine.dialect.name != "sqlite" and engine.dialect.driver == "pymysql"
        self._texts: dict[tuple[str, ...], str] = {}

    def usable(self, conn: Connection) -> bool:
        """Whether ``conn`` (pymysql with multi-statements, as engines built from a URL are)
        can send a batch."""
        if not self._pymysql:
            return False
        flag = getattr(conn.connection.driver_connection, "client_flag", 0)
        return bool(flag & MYSQL_MULTI_STATEMENTS)

    def run(
        self, conn: Connection, names: tuple[str, ...], params: dict[str, Any]
    ) -> list[tuple[int, list[Any]]]:
        """The statements ``names`` in one round trip, as one batch in ``conn``'s transaction
        (:meth:`usable` must hold); each one's ``(rowcount, rows)``."""
        errors = self._engine.dialect.loaded_dbapi.Error
        batch = self._texts.get(names)
        if batch is None:
            batch = "; ".join(PLACEHOLDER.sub(r"%(\1)s", self._sql[n].text) for n in names)
            self._texts[names] = batch
        if not conn.in_transaction():
            conn.begin()  # so that the caller's commit() commits (pymysql sends nothing here)
        dbapi: Any = conn.connection.driver_connection
        cursor = dbapi.cursor()
        results: list[tuple[int, list[Any]]] = []
        try:
            cursor.execute(batch, params)
            while True:
                results.append((cursor.rowcount, list(cursor.fetchall() or ())))
                if not cursor.nextset():  # an error in a later statement is raised here
                    break
        except errors as exc:
            raise sa_exc.DBAPIError.instance(batch, params, exc, errors) from exc
        finally:
            cursor.close()
        return results
