"""The PostgreSQL provider's hot statements, sent through libpq directly (``psycopg.pq``).

psycopg's cursor layer (query conversion, adaptation, row making, its non-blocking wait
loop) costs about 50 µs of Python per statement: more than the statement's own execution
on the server. The lock's hot path is a few fixed statements with text parameters and a
handful of result columns, so it needs none of that: each runs as one prepared statement
(``PQsendQueryPrepared``) and its text results are converted here. Its parameters come
as UTF-8 text (:meth:`Runner.run_text`: the provider's acquire and release make them
themselves) or from a mapping (:meth:`Runner.run`). Errors come back as the psycopg
exception psycopg would have raised, its diagnostics (``exc.diag``) included.

Statements are prepared once per connection under a name derived from their text.
A connection that lost them (``DISCARD ALL``, a pooler that moved the session) prepares
them again. ``prepare=False`` (for PgBouncer before 1.21) sends each as an unnamed
statement instead.

Waiting: the reply is awaited in Python (``poll`` on the socket), not inside libpq, so a
signal handler (Ctrl-C, Celery's soft time limit) runs at once during a statement and its
exception leaves the call there, as psycopg's own wait lets it (which looks for signals
every 0.1 s); the connection is then mid-protocol, and the caller drops it. The same wait
enforces the call's deadline (``end``): no reply by then raises :class:`TooSlow`, and the
caller drops the connection. Sending is not bounded by it: it relies on one statement (a
few KB at most: key, token, holder JSON, or the statement's text unprepared) fitting the
socket's empty send buffer (16 KB by default on Linux: ``net.ipv4.tcp_wmem``), so libpq's blocking write
returns at once even on a network that went silent (every earlier statement on the
connection was answered, so nothing of it is still queued). Why this and not psycopg's
cursor API (measured side by side): BENCHMARKS.md, "The hot path: libpq runner or psycopg's
cursors".
"""

from __future__ import annotations

import hashlib
import operator
import re
import select
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NoReturn

#: A ``:name`` bind parameter in the provider's SQL (not a ``::type`` cast).
PLACEHOLDER = re.compile(r"(?<![:\w]):(\w+)")
_COMMAND_OK, _TUPLES_OK = 1, 2  # psycopg.pq.ExecStatus
_SQLSTATE, _PRIMARY = ord("C"), ord("M")  # psycopg.pq.DiagnosticField
_MISSING = "26000"  # invalid_sql_statement_name: not prepared on this session
_DUPLICATE = "42P05"  # duplicate_prepared_statement: already prepared on this session
_UTF8 = ("utf-8", "utf8")  # psycopg's name of a UTF8 session's encoding (and an alias)


_monotonic = time.monotonic  # one global read per wait, not a global and an attribute


class TooSlow(Exception):
    """No reply came by the statement's deadline: the connection is mid-protocol (drop it)."""


def _converters(types: str, encoding: str) -> tuple[Callable[[bytes], Any], ...]:
    """Text-format result converters: b(ool), i(nt), f(loat), t(ext in ``encoding``)."""

    def text(raw: bytes) -> str:
        return raw.decode(encoding)

    by_type: dict[str, Callable[[bytes], Any]] = {"b": b"t".__eq__, "i": int, "f": float, "t": text}
    return tuple(by_type[t] for t in types)


#: What :meth:`Runner.run_text` answers: the rows, or a grant row's int (see :func:`_rows`).
Answer = list[tuple[Any, ...]] | int


def _column(result: Any, convert: Callable[[bytes], Any]) -> list[tuple[Any, ...]]:
    """The rows of a one-column ``result``, each value converted by ``convert`` (NULL: None)."""
    get = result.get_value
    return [(None if (raw := get(row, 0)) is None else convert(raw),) for row in range(result.ntuples)]


def _rows(types: str, encoding: str, grant: int | None = None) -> Callable[[Any], Answer]:
    """A function of a result returning its rows converted by :func:`_converters` (NULL
    stays None): each row's raw values fetched by one ``map`` (no Python frame per column),
    each column converted unless NULL; a one-column result's single row without a loop.

    With ``grant`` (a column index of type ``i``), a one-row result whose first column is
    true is a grant, answered as that column's int alone (one ``get_value`` each instead
    of one per column, about 9k instructions less for the acquire's eight; no list, no
    row tuple for the reader to index, about 2k less again)."""
    columns = _converters(types, encoding)
    indexes = range(len(columns))
    pairs = tuple(zip(indexes, columns, strict=True))
    if len(columns) == 1:
        (convert,) = columns

        def one_column(result: Any) -> list[tuple[Any, ...]]:
            if result.ntuples == 1:  # a release's answer
                raw = result.get_value(0, 0)
                return [(None if raw is None else convert(raw),)]
            # Not a comprehension here: its locals would be cells, made on every call.
            return _column(result, convert)

        return one_column

    def many_columns(result: Any) -> list[tuple[Any, ...]]:
        get = result.get_value
        out = []
        for row in range(result.ntuples):
            values = [*map(get, repeat(row), indexes)]
            for col, convert in pairs:
                raw = values[col]
                if raw is not None:
                    values[col] = convert(raw)
            out.append(tuple(values))
        return out

    if grant is None:
        return many_columns

    def granted_or_many(result: Any) -> Answer:
        if result.ntuples == 1:
            get = result.get_value
            if get(0, 0) == b"t":
                return int(get(0, grant))  # a grant's fence: never NULL (the sequence's)
        return many_columns(result)

    return granted_or_many


def _getter(names: tuple[str, ...]) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """A function of a parameter mapping returning the values of ``names`` as a tuple, in
    order (``operator.itemgetter``, one C call, for two or more)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda params: tuple(params[name] for name in names)


@dataclass(frozen=True)
class Statement:
    """One statement: ``:name`` placeholders become ``$n``; ``columns`` is one type letter
    per result column (``b`` bool, ``i`` int, ``f`` float, ``t`` text; NULL stays None)."""

    name: bytes
    sql: bytes
    params: tuple[str, ...]
    columns: str
    #: The values of ``params``, in order, from a parameter mapping.
    values: Callable[[Mapping[str, Any]], tuple[Any, ...]] = field(compare=False, repr=False)
    #: The column a grant's one row is answered as (its int, see :func:`_rows`); None: rows.
    grant: int | None = None
    #: The key of the statement's row builder in a session: ``columns``, and ``grant``.
    shape: str = ""

    @classmethod
    def build(cls, sql: str, columns: str, grant: int | None = None) -> Statement:
        if grant is not None and not (
            columns[:1] == "b" and 0 < grant < len(columns) and columns[grant] == "i"
        ):
            raise ValueError(f"grant column {grant} needs a first column of type b and a later one of type i")
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
            _getter(tuple(params)),
            grant,
            columns if grant is None else f"{columns}:{grant}",
        )


class _Session:
    """What the runner remembers of one connection: its encoding, the statement names it has
    prepared, and a ``poll`` object registered on its socket for the replies."""

    __slots__ = ("encoding", "poll", "prepared", "rows", "utf8")

    def __init__(self, connection: Any) -> None:
        self.encoding: str = connection.info.encoding
        self.utf8 = self.encoding in _UTF8
        self.prepared: set[bytes] = set()
        #: The row builder of each column-type string (:func:`_rows`), in this session's encoding.
        self.rows: dict[str, Callable[[Any], Answer]] = {}
        poller = select.poll()
        poller.register(connection.pgconn.socket, select.POLLIN)
        self.poll = poller.poll


#: The UTF-8 text of the float parameters seen lately (a lease's ttl and lifetime repeat),
#: filled by :func:`float_text`; equal floats share one text (-0.0 may go as 0.0: the same
#: number to the server). A caller may read it first (``FLOAT_TEXT.get(x) or float_text(x)``)
#: to skip the call: the dict is never replaced, only cleared.
FLOAT_TEXT: dict[float, bytes] = {}


def float_text(value: float) -> bytes:
    """The text ``str(value)`` gives a float, ASCII, kept in :data:`FLOAT_TEXT`."""
    text = FLOAT_TEXT.get(value)
    if text is None:
        if len(FLOAT_TEXT) >= 64:
            FLOAT_TEXT.clear()
        text = FLOAT_TEXT[value] = repr(value).encode()
    return text


def utf8_text(raw: tuple[Any, ...]) -> list[bytes | None]:
    """``raw`` as the UTF-8 text parameters :meth:`Runner.run_text` takes, None as SQL NULL:
    the text ``str()`` gives (a float's by :func:`float_text`), without calling ``str`` on a
    str (a type call each)."""
    values: list[bytes | None] = []
    append = values.append
    for value in raw:
        if value.__class__ is str:
            append(value.encode())
        elif value is None:
            append(None)
        elif value.__class__ is float:
            append(FLOAT_TEXT.get(value) or float_text(value))
        else:
            append(str(value).encode())
    return values


def _transcoded(values: Sequence[bytes | None], encoding: str) -> list[bytes | None]:
    """UTF-8 text parameters in a session's other ``encoding`` (raises UnicodeEncodeError
    for a character it lacks, as ``str.encode`` did)."""
    return [None if v is None else v.decode().encode(encoding) for v in values]


class Runner:
    """Runs :class:`Statement` objects on psycopg connections; one per provider, thread-safe
    as long as each connection is used by one thread at a time (as psycopg requires)."""

    def __init__(self, *, prepare: bool) -> None:
        import psycopg

        self._prepare = prepare
        self._errors = psycopg.errors
        # Per live connection: its session (encoding, prepared names, row builders, poll).
        self._sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
        #: The connection of the last statement and its session, as one tuple (swapped
        #: atomically between threads): the hot path skips the weak dictionary's lookup.
        self._last: tuple[Any, _Session] | None = None

    def _session(self, connection: Any) -> _Session:
        """``connection``'s session (remembered as the last statement's, which :meth:`run`
        looks at first)."""
        session = self._sessions.get(connection)
        if session is None:
            session = self._sessions[connection] = _Session(connection)
        self._last = (connection, session)
        return session

    def run(
        self, connection: Any, statement: Statement, params: Mapping[str, Any], end: float | None = None
    ) -> Answer:
        """:meth:`run_text` of the values of a parameter mapping (see :func:`utf8_text`)."""
        return self.run_text(connection, statement, utf8_text(statement.values(params)), end)

    def run_text(
        self, connection: Any, statement: Statement, values: Sequence[bytes | None], end: float | None = None
    ) -> Answer:
        """The statement's rows, converted (a grant row of a statement built with ``grant``:
        its int, see :func:`_rows`); raises the psycopg error for a failure, and
        :class:`TooSlow` if no reply came by ``end`` (monotonic seconds; None: no deadline).

        ``values``: the statement's parameters in its order (``statement.params``) as UTF-8
        text, None as SQL NULL; a session in another encoding gets them transcoded. The list
        is the caller's no more (it may be sent again after a re-prepare)."""
        last = self._last
        session = last[1] if last is not None and last[0] is connection else self._session(connection)
        if not session.utf8:
            values = _transcoded(values, session.encoding)
        pgconn = connection.pgconn
        name = statement.name
        if name in session.prepared and self._prepare:
            # _execute's and _result's usual case inline (two Python frames per statement):
            # the statement is prepared on this session, its reply awaited on the socket.
            pgconn.send_query_prepared(name, values)
            poll = session.poll  # no is_busy() first: see _result
            while True:
                if end is None:
                    poll()
                else:
                    left = end - _monotonic()
                    if left <= 0 or not poll(left * 1000.0):
                        raise TooSlow()
                pgconn.consume_input()
                if not pgconn.is_busy():
                    break
            result = pgconn.get_result()
            if result is None or pgconn.get_result() is not None:  # pragma: no cover - as _result
                result = self._finish(pgconn, result)
            if result.status != _TUPLES_OK:
                result = self._failed(
                    pgconn, statement=statement, values=values, session=session, end=end, result=result
                )
        else:
            result = self._execute(pgconn, statement, values, session, end)
            if result.status != _TUPLES_OK:
                self._raise(pgconn, result)
        rows = session.rows.get(statement.shape)
        if rows is None:
            rows = session.rows[statement.shape] = _rows(statement.columns, session.encoding, statement.grant)
        return rows(result)

    def _finish(self, pgconn: Any, result: Any) -> Any:  # pragma: no cover - see _result
        """:meth:`_result`'s ending for an unusual reply: no result (a lost connection) or
        more than one (drained)."""
        if result is None:
            raise self._errors.OperationalError(pgconn.error_message.decode("utf-8", "replace"))
        while pgconn.get_result() is not None:
            pass
        return result

    def _failed(
        self,
        pgconn: Any,
        *,
        statement: Statement,
        values: Sequence[bytes | None],
        session: _Session,
        end: float | None,
        result: Any,
    ) -> Any:
        """After a prepared statement failed with ``result``: sent again, prepared first, if
        the session lost its statements (as :meth:`_execute` does); else its error raised."""
        if self._sqlstate(result) == _MISSING:
            result = self._prepared_again(pgconn, statement, values, session, end)
        if result.status != _TUPLES_OK:
            self._raise(pgconn, result)
        return result

    def _execute(
        self,
        pgconn: Any,
        statement: Statement,
        values: Sequence[bytes | None],
        session: _Session,
        end: float | None,
    ) -> Any:
        """The statement's result: prepared on this session first if it is not (or no longer)."""
        if not self._prepare:
            pgconn.send_query_params(statement.sql, values)
            return self._result(pgconn, session, end)
        if statement.name not in session.prepared:
            self._prepare_on(pgconn, statement, session, end)
        pgconn.send_query_prepared(statement.name, values)
        result = self._result(pgconn, session, end)
        if result.status != _TUPLES_OK and self._sqlstate(result) == _MISSING:
            result = self._prepared_again(pgconn, statement, values, session, end)
        return result

    def _prepared_again(
        self,
        pgconn: Any,
        statement: Statement,
        values: Sequence[bytes | None],
        session: _Session,
        end: float | None,
    ) -> Any:
        """The result of ``statement`` sent again after the session lost its prepared
        statements (every one, not just this one: e.g. DISCARD ALL): prepared first."""
        session.prepared.clear()
        self._prepare_on(pgconn, statement, session, end)
        pgconn.send_query_prepared(statement.name, values)
        return self._result(pgconn, session, end)

    def _prepare_on(self, pgconn: Any, statement: Statement, session: _Session, end: float | None) -> None:
        pgconn.send_prepare(statement.name, statement.sql)
        result = self._result(pgconn, session, end)
        if result.status != _COMMAND_OK and self._sqlstate(result) != _DUPLICATE:
            self._raise(pgconn, result)
        session.prepared.add(statement.name)

    def _result(self, pgconn: Any, session: _Session, end: float | None) -> Any:
        """The result of the one statement just sent, waited for on the socket here (by
        ``end``, else :class:`TooSlow`): a signal handler's exception interrupts ``poll`` at
        once (PEP 475 retries only when the handler returns). A broken connection raises
        psycopg's OperationalError.

        The socket is polled before libpq is first asked whether the reply is in
        (``PQisBusy``, about 0.8k instructions a call): it cannot be, as the server answers
        only what was just sent, and libpq reads nothing while sending a statement that fits
        the send buffer (see the module docstring); a reply already on the socket makes
        ``poll`` return at once."""
        poll = session.poll
        while True:
            if end is None:
                poll()
            else:
                left = end - _monotonic()
                if left <= 0 or not poll(left * 1000.0):
                    raise TooSlow()
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


def statements(
    sql: Mapping[str, str], columns: Mapping[str, str], grants: Mapping[str, int] | None = None
) -> dict[str, Statement]:
    """The statements of ``sql`` named in ``columns``, built for :class:`Runner`; ``grants``:
    the column each one's grant row is read for (see :func:`_rows`)."""
    grants = grants or {}
    return {op: Statement.build(sql[op], types, grants.get(op)) for op, types in columns.items()}
