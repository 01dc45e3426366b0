"""PostgreSQL lock store (first class), via SQLAlchemy and psycopg 3.

Leases are rows of one table (see :mod:`._sql_common` for the schema, shared with the other
SQL stores); every time comparison uses the server's clock. Fences come from the sequence
``<table>_fence_seq``, drawn under a per-key transaction-scoped advisory lock, so one key's
fences grow in commit order.

Each operation is one autocommit statement (their text: providers/_pg_sql.py). How
statements are sent is chosen once, when the provider is built (providers/_pg_executor.py):
with psycopg 3 on a connection the provider keeps (acquire and release as prepared statements through
libpq directly, see ``_libpq.py``), and a contended acquire writes nothing (no transaction
id, no WAL); with any other driver through SQLAlchemy's pool, the same statements. Taking
over a dead row is the one case that needs a second statement. A semaphore's slot
(``acquire_any``) is taken in one statement, take-over included.

Waiters (``LockService.lock(key, wait=)``) are woken by LISTEN/NOTIFY: the release
statements, when they free a live lease while a waiter is registered on the key, call
``pg_notify`` in the same statement, and say so in their reply, so the releaser gives way
to that waiter (:meth:`PostgresLockProvider.had_waiters`); :meth:`PostgresLockProvider.subscribe`
LISTENs on one connection per provider and process (providers/_pg_listen.py). Behind
PgBouncer (``ce_pgbouncer=true``) and with drivers other than psycopg 3, waiters poll (and
register nowhere, so releasers do not give way to them).

Completion records live in ``<table>_done``: the record is written by the release
statement itself and checked by the acquire statement itself; expired records are pruned
by later releases.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from celery_exclusive.errors import InvalidArgumentError, LockLost
from celery_exclusive.providers import _deadline, _libpq, _pg_executor, _pg_listen, _pg_sql
from celery_exclusive.providers._signals import Woken
from celery_exclusive.providers._sql_common import (
    INHERITED,
    Rows,
    SqlStore,
    check_sweep,
    has_unless_function,
    info_of,
    like_pattern,
    live,
    prune_suffix,
    record_params,
    unless_function,
)
from celery_exclusive.providers.base import (
    SWEEP_LIMIT,
    Completion,
    CompletionInfo,
    Diagnosis,
    Done,
    Grant,
    Held,
    LockInfo,
    RefreshRequest,
)

_bounded_connect = _deadline.bounded_connect  # its old name here
logger = logging.getLogger("celery_exclusive.providers.postgres")
_channel = _pg_listen.channel
_float_texts, _float_text = _libpq.FLOAT_TEXT, _libpq.float_text
#: ``Grant(fence, ttl)`` in three C calls (see acquire): its slots' descriptors set them.
_new_grant, _set_fence, _set_ttl = (
    object.__new__,
    Grant.__dict__["fence"].__set__,
    Grant.__dict__["ttl"].__set__,
)
#: The parameters of the statements whose text acquire and release make themselves, in order.
_TEXT_ORDERS = {
    "acquire": ("key", "token", "ttl", "life", "holder"),
    "acquire_once": ("key", "task_id", "token", "ttl", "life", "holder"),
    "release": ("key", "token", "channel"),
    **dict.fromkeys(
        ("release_done", "release_done_prune"),
        ("key", "token", "task_id", "outcome", "attempt", "retain", "channel"),
    ),
}


#: The text parameters of the latest record of each outcome written here: outcome ->
#: (attempt, retain, outcome, attempt and retain as text). A process writes few kinds of
#: record (attempt 0, one retention), so each is made once, not per release (an int and
#: a float converted, two encodes: ~2.5k instructions).
_RECORDS: dict[str, tuple[Any, Any, bytes, bytes, bytes]] = {}
_MAX_RECORDS = 16


def _release_text(key: str, token: str, completion: Completion, channel: str) -> list[bytes | None]:
    """The text parameters of release_done (``_TEXT_ORDERS``) for ``completion``'s record, as
    the runner makes them from a mapping with :func:`record_params`'s (``key`` and ``token``
    are str: the caller checked)."""
    task_id, outcome = completion.task_id, completion.outcome
    if task_id.__class__ is not str or outcome.__class__ is not str:
        record = _libpq.utf8_text(tuple(record_params(completion).values()))
        return [key.encode(), token.encode(), *record, channel.encode()]
    attempt, retain = completion.attempt, completion.retain
    made = _RECORDS.get(outcome)
    # Equal attempts (retains) make equal text: it is made from int() (float()) of them.
    if made is None or made[0] != attempt or made[1] != retain:
        seconds = float(retain)
        made = (
            attempt,
            retain,
            outcome.encode(),
            str(int(attempt)).encode(),
            _float_texts.get(seconds) or _float_text(seconds),
        )
        if len(_RECORDS) < _MAX_RECORDS:
            _RECORDS[outcome] = made
    return [key.encode(), token.encode(), task_id.encode(), made[2], made[3], made[4], channel.encode()]


T = TypeVar("T")


def _answer(rows: Rows, token: str, granted: float) -> Grant | Held | None:
    """What an acquire statement's rows mean; None for a dead row (left to take_over).

    No rows: a concurrent acquirer inserted the key between our read and our insert.
    """
    if not rows:
        return Held(None)
    first = rows[0]
    if first[0]:  # granted: the fence is the only other column set
        return Grant(int(first[3]), granted)
    info = info_of(first[1:])
    if not live(info):
        return None
    return Grant(info.fence, info.expires_in) if info.token == token else Held(info)


def _grant_params(token: str, granted: float, life: float, holder: str, **keys: str) -> dict[str, Any]:
    """The bind parameters of a statement that may grant: ``keys`` names the key(s)."""
    return {**keys, "token": token, "ttl": granted, "life": float(life), "holder": holder}


def _taken_over(rows: Rows, token: str, granted: float) -> Grant | Held | None:
    """The take-over statement's answer (:func:`_answer`), None when it wrote no row (it lost
    the key to a racing grant: asked again)."""
    return _answer(rows, token, granted) if rows else None


def _slot_answer(rows: Rows, token: str, granted: float) -> tuple[int, Grant] | Held | None:
    """What an ``acquire_any`` statement's rows mean (0-based slot index); None when the
    picked slot was lost to a racing acquirer (the caller tries again)."""
    if rows and rows[0][0] == "g":  # a grant: the statement's one row (the common case)
        return int(rows[0][1]) - 1, Grant(int(rows[0][4]), granted)
    slots: list[tuple[int, LockInfo]] = []
    raced = False
    for kind, index, *row in rows:
        if kind == "g":
            return int(index) - 1, Grant(int(row[2]), granted)
        if kind == "f":
            raced = True
        else:
            slots.append((int(index), info_of(row)))
    mine = [(index, info) for index, info in slots if info.token == token]
    if mine:
        index, info = min(mine)
        return index - 1, Grant(info.fence, info.expires_in)
    return None if raced else Held(min(slots)[1])


def _unless_answer(rows: Rows, token: str, granted: float) -> Grant | Held | None:
    """What an ``acquire_unless`` statement's rows mean; None when it found ``:key`` being
    taken meanwhile and wrote nothing (the caller asks again)."""
    found: dict[str, LockInfo] = {}
    for kind, *row in rows:
        if kind == "g":
            return Grant(int(row[2]), granted)
        found[kind] = info_of(row)
    blocker, queued = found.get("b"), found.get("q")
    if blocker is not None:
        return Held(blocker)
    if queued is not None:
        return Grant(queued.fence, queued.expires_in) if queued.token == token else Held(queued)
    return None


def _asked(
    call: Callable[[float | None], Rows], answer: Callable[[Rows], T], times: int, timeout: float | None
) -> T:
    """``answer`` of the rows of ``call(seconds left)``, called again while it answers None, at
    most ``times`` times (at least once), all within ``timeout`` seconds (None: no deadline)."""
    end = None if timeout is None else time.monotonic() + timeout
    for _ in range(max(times, 1)):
        found = answer(call(None if end is None else max(end - time.monotonic(), 0.001)))
        if found is not None:
            break
    return found


@functools.lru_cache(maxsize=4096)
def _text_array(values: tuple[str, ...]) -> str:
    """``values`` as a PostgreSQL array literal (every element quoted), for ``CAST(... AS
    varchar[])``; cached, as a semaphore's slot keys are sent on each of its acquires."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _guard_found(connection: Any, sql: str, psycopg_sql: str, params: dict[str, Any]) -> bool:
    """Whether the guard statement (``sql``, or ``psycopg_sql`` in psycopg's placeholders)
    found the live row on the caller's ``connection`` (see :func:`_guard_connection`)."""
    alchemy, psycopg_connection = _guard_connection(connection)
    if alchemy is not None:
        return alchemy.execute(sa.text(sql), params).first() is not None
    return psycopg_connection.execute(psycopg_sql, params).fetchone() is not None


def _guard_connection(connection: Any) -> tuple[Connection | None, Any]:
    """``(SQLAlchemy connection, None)`` or ``(None, psycopg connection)`` of a guard() call,
    checked to be inside a transaction on PostgreSQL."""
    from sqlalchemy.orm import Session

    if isinstance(connection, Session):
        connection = connection.connection()
    if isinstance(connection, Connection):
        if connection.dialect.name != "postgresql":
            raise InvalidArgumentError(
                f"guard() needs a connection to the PostgreSQL lock database, got a "
                f"{connection.dialect.name} connection"
            )
        if getattr(connection.connection.driver_connection, "autocommit", False) is True:
            raise InvalidArgumentError(
                "guard() needs a connection inside a transaction, not in autocommit mode: "
                "the share lock would end with the statement"
            )
        return connection, None
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is how PostgreSQL is reached
        psycopg = None  # type: ignore[assignment]
    if psycopg is not None and isinstance(connection, psycopg.Connection):
        if connection.autocommit:
            raise InvalidArgumentError(
                "guard() needs a psycopg connection inside a transaction, not in autocommit "
                "mode: the share lock would end with the statement"
            )
        return None, connection
    raise InvalidArgumentError(
        "guard() needs the SQLAlchemy Connection or Session (or psycopg connection) of your "
        f"transaction, got {type(connection).__name__}"
    )


class PostgresLockProvider(SqlStore):
    """Leases in a PostgreSQL table; see the module docstring. Thread-safe and fork-safe.

    ``SqlLockProvider`` builds this class for a PostgreSQL URL or engine, and
    ``isinstance(provider, SqlLockProvider)`` holds for it.
    """

    _DIALECTS = ("postgresql",)
    _kind = "PostgreSQL "

    def _setup(self, *, pgbouncer: bool) -> None:
        # Whether the table's marker function exists (_unless_op): made with the schema when
        # create_table is on; else looked up on first use.
        self._fresh: bool | None = None
        if self._owns_engine:
            event.listen(self._engine, "do_connect", _bounded_connect)
        self._pg_sql = _pg_sql.pg_statements(self._engine.dialect, self.table.name)
        self._pg_sql.update(_pg_sql.pg_sweep_statements(self._engine.dialect, self.table.name))
        self._psycopg_sql = {n: _libpq.PLACEHOLDER.sub(r"%(\1)s", s) for n, s in self._pg_sql.items()}
        # How statements are sent, chosen once: psycopg 3 directly, else SQLAlchemy's pool.
        self._executor = _pg_executor.for_engine(
            self._engine,
            self._psycopg_sql,
            self._pg_sql,
            keep=self._owns_engine,
            pgbouncer=pgbouncer,
            masked=self._masked,
        )
        self._driver_errors = self._executor.errors
        #: The direct executor's ``run_text`` (None for other drivers): acquire and release
        #: make their statements' text parameters themselves, in these orders.
        self._run_text = None
        if isinstance(self._executor, _pg_executor.DirectExecutor):
            for op, order in _TEXT_ORDERS.items():
                if self._executor.statements[op].params != order:  # pragma: no cover - a SQL edit
                    raise RuntimeError(f"{op} takes {self._executor.statements[op].params}, not {order}")
            self._run_text = self._executor.run_text
        # Waiters are woken by LISTEN/NOTIFY (:mod:`._pg_listen`); the release statements
        # notify whatever the driver, for waiters in other processes.
        self._listening = _pg_listen.PerProcess(
            lambda: _pg_executor.detached(self._engine),
            self.table.name,
            pgbouncer=pgbouncer,
            driver=self._engine.dialect.driver,
        )
        #: ``KnowsWaiters``: the keys whose latest release here notified a registered waiter.
        self._woken = Woken()
        #: The set behind ``had_waiters`` (``KnowsWaiters.had_waiters``: ``key in`` it, then
        #: discarded), which the lock service's release tests inline.
        self.woken_keys = self._woken._keys

    @property
    def _listener(self) -> _pg_listen.Listener | None:
        """This process's listener, once a waiter subscribed (for tests)."""
        return self._listening.listener

    @property
    def _kept(self) -> list[Any] | None:
        """The connections kept out of the pool (None: the engine is the caller's, or the
        driver not psycopg 3)."""
        kept = self._executor.kept
        return None if kept is None else [connection for connection, _ in kept.idle]

    # -- the LockProvider operations -------------------------------------------------

    def acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        task_id: str | None = None,
        timeout: float | None = None,
    ) -> Grant | Held | Done:
        # float(min(ttl, max_lifetime)) and float(max_lifetime) without their calls for the
        # floats the service passes; min()'s own test (ttl unless max_lifetime is smaller),
        # so a NaN gives what min() gave.
        granted = max_lifetime if max_lifetime < ttl else ttl
        if granted.__class__ is not float:
            granted = float(granted)
        life = max_lifetime if max_lifetime.__class__ is float else float(max_lifetime)
        params = None
        # _records_on() inline once known (True: the usual answer, without the call).
        if task_id is not None and self._records is not True and not self._records_on(timeout):
            task_id = None
        end = None if timeout is None else time.monotonic() + timeout
        op = "acquire" if task_id is None else "acquire_once"
        if not self._ready:  # _call and _run_pg inline: two Python frames fewer on the hot path
            self._ensure_schema(timeout)
        run_text = self._run_text
        try:
            if (
                run_text is not None
                and key.__class__ is str is token.__class__ is holder.__class__
                and (task_id is None or task_id.__class__ is str)
            ):
                # The statement's text parameters made here, in its order (see _setup), as
                # the runner would make them from a mapping (_libpq.utf8_text).
                texts = _float_texts
                values = [
                    key.encode(),
                    token.encode(),
                    texts.get(granted) or _float_text(granted),
                    texts.get(life) or _float_text(life),
                    holder.encode(),
                ]
                if task_id is not None:
                    values.insert(1, task_id.encode())
                rows = run_text(op, values, timeout)
            else:
                params = {"key": key, "token": token, "ttl": granted, "life": life, "holder": holder}
                rows = self._executor.run(
                    op, params if task_id is None else {**params, "task_id": task_id}, timeout
                )
        except self._driver_errors as exc:
            raise self._error(op, exc) from exc
        if task_id is not None and not isinstance(rows, int) and rows and rows[0][0] is None:
            _, outcome, _, tries, age, left, *_ = rows[0]  # the completion record's row
            return Done(CompletionInfo(key, task_id, str(outcome), int(tries), float(age), float(left)))
        if isinstance(rows, int):  # granted: the libpq runner answers a grant row as its fence
            # Grant(rows, granted) without type.__call__'s way to its Python __init__: the
            # same object (Grant defines no __new__), its two slots set as __init__ sets them.
            grant = _new_grant(Grant)
            _set_fence(grant, rows)
            _set_ttl(grant, granted)
            return grant
        if rows and rows[0][0]:  # granted, from another driver (_answer's first case, inline)
            return Grant(int(rows[0][3]), granted)
        answer = _answer(rows, token, granted)
        if answer is None:  # a dead row (its holder crashed or lost it): take it over
            if params is None:
                params = {"key": key, "token": token, "ttl": granted, "life": life, "holder": holder}
            left = None if end is None else max(end - time.monotonic(), 0.001)
            # No rows: it lost the key to a racing grant and wrote nothing; asked once more,
            # it names the new holder (or takes the key, if that grant rolled back).
            call = functools.partial(self._call, "take_over", params)
            # A partial, not a lambda: one would make token and granted cells, made on every
            # acquire (the hot path), not only on this rare one.
            answer = _asked(call, functools.partial(_taken_over, token=token, granted=granted), 2, left)
        return Held(None) if answer is None else answer

    def acquire_any(
        self,
        keys: Sequence[str],
        token: str,
        ttl: float,
        max_lifetime: float,
        holder: str,
        *,
        timeout: float | None = None,
    ) -> tuple[int, Grant] | Held:
        """A semaphore's first free slot in one statement (:func:`_acquire_any_statement`);
        a contended attempt (every slot live) writes nothing, nor does one whose slot a racing
        acquirer took between the statement's read and its write: that attempt is tried
        again, at most once per slot."""
        granted = float(min(ttl, max_lifetime))
        params = _grant_params(token, granted, max_lifetime, holder, keys=_text_array(tuple(keys)))
        call = functools.partial(self._call, "acquire_any", params)
        answer = functools.partial(_slot_answer, token=token, granted=granted)
        found = _asked(call, answer, len(keys), timeout)
        return Held(None) if found is None else found  # None: every attempt lost its slot to a racer

    def acquire_unless(
        self, key: str, token: str, ttl: float, holder: str, *, blocker: str, timeout: float | None = None
    ) -> Grant | Held:
        """``key`` unless ``blocker`` is live (``AcquiresUnless``) in one statement (see
        :func:`._pg_sql._acquire_unless_statement`); one that waited for a grant in flight,
        or whose re-read under the key's lock found a key taken since its snapshot, wrote
        nothing and is sent once more (its answer names the new holder)."""
        params = _grant_params(token, float(ttl), ttl, holder, key=key, blocker=blocker)
        call = functools.partial(self._call, self._unless_op(timeout), params)
        answer = functools.partial(_unless_answer, token=token, granted=float(ttl))
        found = _asked(call, answer, 2, timeout)
        return Held(None) if found is None else found

    def refresh(
        self, requests: Sequence[RefreshRequest], *, timeout: float | None = None
    ) -> list[float | None]:
        wanted = {(r.key, r.token): float(r.ttl) for r in requests}  # a repeated request: the last ttl wins
        if not wanted:
            return []
        pairs = sorted(wanted)  # a stable lock order across concurrent refreshers
        params = {
            "keys": [k for k, _ in pairs],
            "tokens": [t for _, t in pairs],
            "ttls": [wanted[p] for p in pairs],
        }
        answers = {
            pairs[int(index) - 1]: float(left) for index, left in self._call("refresh", params, timeout)
        }
        return [answers.get((r.key, r.token)) for r in requests]

    def release(
        self, key: str, token: str, completion: Completion | None = None, *, timeout: float | None = None
    ) -> bool:
        channel = _channel(self.table.name, key)
        if completion is not None and self._records is not True and not self._records_on(timeout):
            completion = None
        # Our own listener may still hold the key's registration for a wait that just ended
        # (its unlock is sent by the listener's thread): a notify then may be ours alone,
        # and the release does not count it (a give-way missed, never one for nobody).
        # No listener in this process (nobody here ever waited): nothing is ours and nothing
        # lingers, so PerProcess.releasing's answer, (False, None), without its two calls.
        listening = self._listening
        ours, mark = (False, None) if listening.listener is None else listening.releasing(channel)
        # Per deleted row: 0 (it was no live lease), 1 (freed), 2 (freed and a waiter notified).
        if not self._ready:  # _call and _run_pg inline: two frames fewer
            self._ensure_schema(timeout)
        op = "release" if completion is None else "release_done" + prune_suffix(completion)
        run_text = self._run_text
        try:
            if run_text is not None and key.__class__ is str is token.__class__:
                # The statement's text parameters made here, in its order (see _setup), as
                # the runner would make them from a mapping (_libpq.utf8_text).
                if completion is None:
                    rows = run_text(op, [key.encode(), token.encode(), channel.encode()], timeout)
                else:
                    rows = run_text(op, _release_text(key, token, completion, channel), timeout)
            else:
                params: dict[str, Any] = {"key": key, "token": token, "channel": channel}
                if completion is not None:
                    params.update(record_params(completion))
                rows = self._executor.run(op, params, timeout)
            # No release statement is in LIBPQ_GRANTS; a list passes isinstance() on its exact
            # type (a failing one also looks up __class__: about 0.25k instructions).
            assert isinstance(rows, list)
        except self._driver_errors as exc:
            raise self._error(op, exc) from exc
        # Each row a 1-tuple, compared as one (no list made).
        notified = (2,) in rows
        if mark is not None:  # PerProcess.released does nothing without a mark
            listening.released(channel, mark, notified)
        reached = notified and not ours
        if reached or self._woken._keys:  # Woken.note(key, False) with no key noted: nothing to do
            self._woken.note(key, reached)
        return notified or (1,) in rows

    def had_waiters(self, key: str) -> bool:
        """Whether this process's latest release of ``key`` (prefixed) freed it while a waiter
        was registered on it (``KnowsWaiters``): the release statement notified, which it does
        only while some process's listener holds the key's waiter registration, held while
        that process waits (not while its channel only lingers, see providers/_pg_listen.py).
        Told once; no round trip. A waiter behind PgBouncer registers nowhere: it is never counted.
        The lock service's release tests :attr:`woken_keys` inline instead."""
        keys = self._woken._keys  # Woken.told, inline
        if key in keys:
            keys.discard(key)
            return True
        return False

    def subscribe(self, key: str) -> _pg_listen.Subscription:
        """Listen for releases of ``key`` (``WakesWaiters``): ``LISTEN`` on the key's channel,
        notified by the release statement, on one connection per provider and process
        (providers/_pg_listen.py). Returns once listening or shortly after (see there).
        Raises SignalsLost behind PgBouncer (``ce_pgbouncer=true``) and with drivers other
        than psycopg 3: the waiter then polls."""
        return self._listening.subscribe_any([key])

    def subscribe_any(self, keys: Sequence[str]) -> _pg_listen.Subscription:
        """Listen for releases of any of ``keys`` (``WakesOnAny``: a semaphore's slots), one
        channel per key LISTENed in one batch; otherwise as :meth:`subscribe`."""
        return self._listening.subscribe_any(keys)

    def forget(self, key: str, task_id: str, *, timeout: float | None = None) -> bool:
        if not self._records_on(timeout):
            return False
        rows = self._call("done_forget", {"key": key, "task_id": task_id}, timeout)
        return any(bool(alive) for (alive,) in rows)

    def sweep(self, prefix: str, limit: int = SWEEP_LIMIT, *, timeout: float | None = None) -> int:
        """Delete up to ``limit`` dead leases and ``limit`` expired records under ``prefix``
        in one statement (see ``Sweeps.sweep``); the rows deleted."""
        params = {"pattern": like_pattern(check_sweep(prefix, limit)), "limit": int(limit)}
        op = "sweep" if self._records_on(timeout) else "sweep_leases"
        rows = self._call(op, params, timeout)
        return sum(int(n) for n in rows[0]) if rows else 0

    @property
    def supports_guard(self) -> bool:
        """True: PostgreSQL is the one SQL store where :meth:`guard` works."""
        return True

    def guard(self, connection: Any, key: str, token: str, fence: int) -> None:
        """Check, inside the caller's transaction, that ``token`` holds ``key`` with ``fence``.

        PostgreSQL only. ``connection`` is the caller's SQLAlchemy ``Connection`` (or ORM
        ``Session``), or a psycopg 3 connection, to the database that holds the lock table,
        with a transaction open (autocommit is refused: the check would end with the
        statement). The live row is locked ``FOR SHARE`` until that transaction ends, and
        a takeover or release must UPDATE or DELETE it, so it waits: the caller's writes
        in the same transaction commit only while the lease is current. Raises
        :class:`LockLost` if the lease expired, was released or taken over (the caller
        should roll back). The caller's own driver errors are not translated.

        Trade-off: the heartbeat's refresh of that row waits too (and with it the whole
        batched refresh of the service's leases), so keep guarded transactions well
        shorter than the ttl minus its safety margin, and end them before releasing the
        lease (a release waits for them). Under REPEATABLE READ or SERIALIZABLE, acquire
        the lease before the transaction takes its snapshot; a concurrent refresh or
        takeover then makes this statement fail with a serialization error (retry the
        transaction).
        """
        params = {"key": key, "token": token, "fence": int(fence)}
        if not _guard_found(connection, self._pg_sql["guard"], self._psycopg_sql["guard"], params):
            raise LockLost(
                key,
                fence,
                "guard found no live lease with this token and fence: it expired, was released "
                "or taken over; roll back this transaction",
            )

    def close(self) -> None:
        """Dispose of the engine's connections if this provider created the engine."""
        self._closed = True
        self._listening.close()
        self._executor.close(final=True)
        if self._owns_engine:
            self._engine.dispose()

    def diagnose(self, *, timeout: float | None = None) -> list[Diagnosis]:
        """Schema presence (the table's marker function too), server clock vs this machine's,
        a read-only server, and the server's ``synchronous_commit`` (which acquire and
        refresh override). With ``timeout``, a store that does not answer by then is a
        failed ``connect`` finding."""
        findings: list[Diagnosis] = []
        try:
            with self._connected(timeout) as conn:
                if self._schema_findings(conn, findings) and not has_unless_function(conn, self.table.name):
                    name = unless_function(self.table.name)
                    detail = (
                        f"function {name!r} is missing: until_done dedupe markers are judged on "
                        "one snapshot (a provider with create_table on makes it)"
                    )
                    findings.append(Diagnosis("marker_function", "warn", detail))
                findings += _pg_sql.server_findings(conn)
        except sa_exc.SQLAlchemyError as exc:
            findings.append(Diagnosis("connect", "fail", str(self._error("connect", exc))))
        return findings

    # -- plumbing --------------------------------------------------------------------

    def _unless_op(self, timeout: float | None) -> str:
        """``acquire_unless``, or its form without the re-read when the schema lacks the
        table's marker function (made by an earlier version, with create_table off: looked
        up once, and warned about)."""
        end = None if timeout is None else time.monotonic() + timeout
        self._ensure_schema(timeout)  # with create_table on, this makes the function
        fresh = self._fresh
        if fresh is None:
            left = None if end is None else max(end - time.monotonic(), 0.001)
            with self._translated("look for the marker function"), self._connected(left) as conn:
                fresh = has_unless_function(conn, self.table.name)
            if not fresh:
                logger.warning(
                    "PostgreSQL lock store %s: function %r is missing, so an until_done dedupe "
                    "marker is judged on its statement's snapshot alone (a sender descheduled "
                    "there can queue one extra message); a provider with create_table on makes "
                    "it (its first call, or set_up()), as do lock_table(metadata, %r) with "
                    "metadata.create_all() and the Django migrations",
                    self._masked,
                    unless_function(self.table.name) + "(varchar, varchar)",
                    self.table.name,
                )
            self._fresh = fresh
        return "acquire_unless" if fresh else "acquire_unless_snapshot"

    def _create_schema(self, end: float | None = None) -> None:  # (end: SQLite's)
        _pg_sql.create_schema(self._engine, self.table)
        self._fresh = True

    def _call(self, op: str, params: dict[str, Any], timeout: float | None) -> Rows:
        """``_run_pg``, passing ``timeout`` only when there is one."""
        if timeout is None:
            return self._run_pg(op, params)
        return self._run_pg(op, params, timeout=timeout)

    def _read(self, op: str, statement: str, params: dict[str, Any], timeout: float | None) -> Rows:
        return self._call(statement, params, timeout)

    def _run_pg(self, op: str, params: dict[str, Any], timeout: float | None = None) -> Rows:
        """Run one statement through the executor; its rows (driver errors translated as
        :meth:`_translated` does, inline: no context manager object per statement)."""
        if not self._ready:
            self._ensure_schema(timeout)
        try:
            rows = self._executor.run(op, params, timeout)
        except self._driver_errors as exc:
            raise self._error(op, exc) from exc
        # Only a grant statement (LIBPQ_GRANTS) answers an int, and acquire() runs those itself.
        assert not isinstance(rows, int)
        return rows

    def settled(self, *, timeout: float | None = None) -> bool:
        """Whether a release that found nothing of a token's is final: True once no session
        this provider dropped mid-statement (an acquire whose reply did not come in time)
        still exists on the server, which could still commit that token's lease. Always True
        behind PgBouncer (its pids are not the server's) and with drivers other than psycopg 3."""
        try:
            return self._executor.settled(timeout)
        except self._driver_errors as exc:
            raise self._error("settle", exc) from exc

    def _after_fork(self) -> None:
        super()._after_fork()
        # The child never shares the parent's sockets: the kept connections see the fork
        # themselves (providers/_kept.py), the pool's are dropped without closing, as
        # SQLAlchemy recommends after fork.
        self._engine.dispose(close=False)
        self._listening.after_fork(INHERITED)
