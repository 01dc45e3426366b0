"""The PostgreSQL provider's hot statements, sent through libpq directly (``psycopg.pq``).

psycopg's cursor layer (query conversion, adaptation, row making, its non-blocking wait
loop) costs about 50 µs of Python per statement: more than the statement's own execution
on the server. The lock's hot path is a few fixed statements with text parameters and a
handful of result columns, so it needs none of that: each runs as one prepared statement
(``PQsendQueryPrepared``) and its text results are converted here. Errors come back as the
psycopg exception psycopg would have raised, its diagnostics (``exc.diag``) included.

Statements are prepared once per connection under a name derived from their text.
A connection that lost them (``DISCARD ALL``, a pooler that moved the session) prepares
them again. ``prepare=False`` (for PgBouncer before 1.21) sends each as an unnamed
statement instead.

Signals: the reply is awaited in Python (``select`` on the socket), not inside libpq, so a
signal handler (Ctrl-C, Celery's soft time limit) runs at once during a statement and its
exception leaves the call there, as psycopg's own wait lets it (which looks for signals
every 0.1 s); the connection is then mid-protocol, and the caller drops it. Why this and not psycopg's
cursor API (measured side by side): BENCHMARKS.md, "The hot path: libpq runner or psycopg's
cursors".
"""

from __future__ import annotations

import hashlib
import re
import select
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

#: A ``:name`` bind parameter in the provider's SQL (not a ``::type`` cast).
PLACEHOLDER = re.compile(r"(?<![:\w]):(\w+)")
_COMMAND_OK, _TUPLES_OK = 1, 2  # psycopg.pq.ExecStatus
_SQLSTATE, _PRIMARY = ord("C"), ord("M")  # psycopg.pq.DiagnosticField
_MISSING = "26000"  # invalid_sql_statement_name: not prepared on this session
_DUPLICATE = "42P05"  # duplicate_prepared_statement: already prepared on this session


def _converters(types: str, encoding: str) -> tuple[Callable[[bytes], Any], ...]:
    """Text-format result converters: b(ool), i(nt), f(loat), t(ext in ``encoding``)."""

    def text(raw: bytes) -> str:
        return raw.decode(encoding)

    by_type: dict[str, Callable[[bytes], Any]] = {"b": b"t".__eq__, "i": int, "f": float, "t": text}
    return tuple(by_type[t] for t in types)


@dataclass(frozen=True)
class Statement:
    """One statement: ``:name`` placeholders become ``$n``; ``columns`` is one type letter
    per result column (``b`` bool, ``i`` int, ``f`` float, ``t`` text; NULL stays None)."""

    name: bytes
    sql: bytes
    params: tuple[str, ...]
    columns: str

    @classmethod
    def build(cls, sql: str, columns: str) -> Statement:
        params: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in params:
                params.append(match.group(1))
            return f"${params.index(match.group(1)) + 1}"

        text = PLACEHOLDER.sub(number, sql)
        digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]
        return cls(
            f"celery_exclusive_{digest}".encode(),
            text.encode(),
            tuple(params),
            columns,
        )


class Runner:
    """Runs :class:`Statement` objects on psycopg connections; one per provider, thread-safe
    as long as each connection is used by one thread at a time (as psycopg requires)."""

    def __init__(self, *, prepare: bool) -> None:
        import psycopg

        self._prepare = prepare
        self._errors = psycopg.errors
        # Per live connection: its client encoding and the names it has prepared.
        self._sessions: weakref.WeakKeyDictionary[Any, tuple[str, set[bytes]]] = weakref.WeakKeyDictionary()
        self._converters: dict[tuple[str, str], tuple[Callable[[bytes], Any], ...]] = {}
        #: The connection of the last statement and its session, as one tuple (swapped
        #: atomically between threads): the hot path skips the weak dictionary's lookup.
        self._last: tuple[Any, tuple[str, set[bytes]]] | None = None

    def _session(self, connection: Any) -> tuple[str, set[bytes]]:
        """``connection``'s client encoding and the names it has prepared (remembered as
        the last statement's, which :meth:`run` looks at first)."""
        session = self._sessions.get(connection)
        if session is None:
            session = self._sessions[connection] = (connection.info.encoding, set())
        self._last = (connection, session)
        return session

    def run(self, connection: Any, statement: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The statement's rows, converted; raises the psycopg error for a failure."""
        last = self._last
        session = last[1] if last is not None and last[0] is connection else self._session(connection)
        encoding, prepared = session
        values = [
            None if (v := params[name]) is None else (v if type(v) is str else str(v)).encode(encoding)
            for name in statement.params
        ]
        pgconn = connection.pgconn
        result = self._execute(pgconn, statement, values, prepared)
        if result.status != _TUPLES_OK:
            self._raise(pgconn, result)
        columns = self._converters.get((statement.columns, encoding))
        if columns is None:
            columns = _converters(statement.columns, encoding)
            self._converters[(statement.columns, encoding)] = columns
        get = result.get_value
        return [
            tuple(
                [
                    None if (raw := get(row, col)) is None else convert(raw)
                    for col, convert in enumerate(columns)
                ]
            )
            for row in range(result.ntuples)
        ]

    def _execute(
        self, pgconn: Any, statement: Statement, values: list[bytes | None], prepared: set[bytes]
    ) -> Any:
        """The statement's result: prepared on this session first if it is not (or no longer)."""
        if not self._prepare:
            pgconn.send_query_params(statement.sql, values)
            return self._result(pgconn)
        if statement.name not in prepared:
            self._prepare_on(pgconn, statement, prepared)
        pgconn.send_query_prepared(statement.name, values)
        result = self._result(pgconn)
        if result.status != _TUPLES_OK and self._sqlstate(result) == _MISSING:
            prepared.clear()  # the session lost every statement, not just this one
            self._prepare_on(pgconn, statement, prepared)
            pgconn.send_query_prepared(statement.name, values)
            result = self._result(pgconn)
        return result

    def _prepare_on(self, pgconn: Any, statement: Statement, prepared: set[bytes]) -> None:
        pgconn.send_prepare(statement.name, statement.sql)
        result = self._result(pgconn)
        if result.status != _COMMAND_OK and self._sqlstate(result) != _DUPLICATE:
            self._raise(pgconn, result)
        prepared.add(statement.name)

    def _result(self, pgconn: Any) -> Any:
        """The result of the one statement just sent, waited for on the socket here: a signal
        handler's exception interrupts ``select`` at once (PEP 475 retries only when the
        handler returns). A broken connection raises psycopg's OperationalError."""
        if pgconn.is_busy():
            fd = (pgconn.socket,)
            while True:
                select.select(fd, (), ())
                pgconn.consume_input()
                if not pgconn.is_busy():
                    break
        result = pgconn.get_result()
        if result is None:  # pragma: no cover - libpq reports a lost connection as a result
            raise self._errors.OperationalError(pgconn.error_message.decode("utf-8", "replace"))
        while pgconn.get_result() is not None:  # pragma: no cover - one statement, one result
            pass
        return result

    @staticmethod
    def _sqlstate(result: Any) -> str | None:
        code = result.error_field(_SQLSTATE)
        return code.decode() if code else None

    def _raise(self, pgconn: Any, result: Any) -> NoReturn:
        """Raise what psycopg would raise for the failed ``result``."""
        sqlstate = self._sqlstate(result)
        raw = result.error_field(_PRIMARY) or result.error_message or pgconn.error_message
        message = (raw or b"no error message").decode("utf-8", "replace")
        try:
            kind = self._errors.lookup(sqlstate) if sqlstate else self._errors.OperationalError
        except KeyError:
            kind = self._errors.DatabaseError
        raise kind(message.strip(), info=result)


def statements(sql: Mapping[str, str], columns: Mapping[str, str]) -> dict[str, Statement]:
    """The statements of ``sql`` named in ``columns``, built for :class:`Runner`."""
    return {op: Statement.build(sql[op], types) for op, types in columns.items()}
