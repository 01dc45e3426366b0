"""KeptConnections across fork (a child never takes a connection its parent kept) and
across close (a connection given back while the store closes is closed too)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from celery_exclusive.providers._kept import KeptConnections
from celery_exclusive.providers.postgres import PostgresLockProvider
from celery_exclusive.providers.redis import RedisLockProvider
from tests.conftest import POSTGRES_URL, REDIS_URL, drop_lock_table, in_forked_child, require_server


def test_a_forked_child_hands_the_parents_connections_to_on_fork_and_takes_none() -> None:
    inherited: list[str] = []
    kept: KeptConnections[str] = KeptConnections(on_fork=inherited.extend)
    kept.give("parent's", 1.0)

    def child() -> bool:
        first = kept.take()
        kept.give("child's", 2.0)
        return first is None and inherited == ["parent's"] and kept.take() == ("child's", 2.0)

    assert in_forked_child(child)
    assert kept.take() == ("parent's", 1.0)  # the parent's own, untouched by the child
    assert inherited == []


def test_a_grandchild_is_a_new_process_too() -> None:
    kept: KeptConnections[str] = KeptConnections()
    kept.give("parent's", 1.0)

    def child() -> bool:
        if kept.take() is not None:
            return False
        kept.give("child's", 2.0)
        return in_forked_child(lambda: kept.take() is None and len(kept) == 0)

    assert in_forked_child(child)
    assert len(kept) == 1


class _PausedAppend(list[tuple[Any, float]]):
    """A kept list whose next ``append`` stops just before it appends, until let go: the
    giving thread descheduled between give()'s closed check and its append."""

    def __init__(self, items: list[tuple[Any, float]]) -> None:
        super().__init__(items)
        self.arrived, self.go = threading.Event(), threading.Event()
        self.appended: list[Any] = []

    def append(self, item: tuple[Any, float]) -> None:
        self.appended.append(item[0])
        self.arrived.set()
        self.go.wait(30)
        super().append(item)


def _given_back_during_close(provider: Any, kept: KeptConnections[Any], key: str) -> Any:
    """Pause the next give() of ``kept`` just before its append, while ``provider.peek(key)``
    in another thread gives its connection back; close ``provider`` meanwhile, then let the
    give go on. The connection given back."""
    paused = _PausedAppend(kept._idle)
    kept._idle = paused
    peek = threading.Thread(target=provider.peek, args=(key,), kwargs={"timeout": 5})
    peek.start()
    assert paused.arrived.wait(10), "the peek never gave its connection back"
    provider.close()
    paused.go.set()
    peek.join(10)
    assert not peek.is_alive()
    (connection,) = paused.appended
    return connection


def test_a_connection_given_back_while_the_store_closes_is_closed() -> None:
    """PostgreSQL: a call gives its connection back while close() runs, between give()'s
    check that the kept connections are not closed and its append. The connection is closed
    all the same (by close(), or by the caller when give() refuses it), never left open in
    a list close() no longer looks at."""
    require_server(POSTGRES_URL)
    table = f"ce_kept_{uuid.uuid4().hex[:10]}"
    provider = PostgresLockProvider(POSTGRES_URL, table=table)
    try:
        provider.peek("k", timeout=5)  # its connection now kept, out of the pool
        kept = provider._executor.kept
        assert kept is not None
        assert len(kept) == 1
        connection = _given_back_during_close(provider, kept, "k")
        assert connection.closed, "the connection given back during close() was left open"
    finally:
        provider.close()
        drop_lock_table(POSTGRES_URL, table)


def test_a_redis_connection_given_back_while_the_store_closes_is_closed() -> None:
    """Redis: the same interleaving on the fast path's kept connections (``Wire``). Its
    close() drained them without marking them closed, so the connection given back just
    after the drain stayed kept, and connected, until something closed the store again."""
    require_server(REDIS_URL)
    provider = RedisLockProvider(REDIS_URL)
    key = f"ce-kept:{uuid.uuid4().hex}"
    try:
        provider.peek(key, timeout=5)  # its connection now kept by the wire
        wire = provider._wire
        assert wire is not None
        assert len(wire.kept) == 1
        connection = _given_back_during_close(provider, wire.kept, key)
        assert len(wire.kept) == 0, "the connection given back during close() is still kept"
        assert connection._sock is None, "the connection given back during close() was left open"
    finally:
        provider.close()


def test_a_redis_call_after_close_keeps_no_connection() -> None:
    """Redis: a provider called after close() (its own caller's, without a service) still
    answers, on a connection it closes after the call instead of keeping it."""
    require_server(REDIS_URL)
    provider = RedisLockProvider(REDIS_URL)
    key = f"ce-kept:{uuid.uuid4().hex}"
    try:
        provider.peek(key, timeout=5)
        provider.close()
        assert provider.peek(key, timeout=5) is None
        wire = provider._wire
        assert wire is not None
        assert len(wire.kept) == 0, "a connection made after close() is kept"
    finally:
        provider.close()
