"""The PostgreSQL store over TLS (``sslmode=require``), against a private server of its own.

The provider's hot statements go through libpq directly and their replies are awaited with
``poll()`` on the socket (``celery_exclusive/providers/_libpq.py``); over TLS, decrypted
bytes can wait in OpenSSL's buffer while the socket is not readable, so replies of every
size are read here (a 64 KB holder, a listing and a refresh of 1,000 leases), waiters are
woken through LISTEN on a TLS connection of its own, and the lock contract runs once more.
"""

from __future__ import annotations

import json
import os
import pwd
import uuid
from collections.abc import Iterator

import pytest

from celery_exclusive import LockService
from celery_exclusive._process import MAX_HOLDER_LENGTH
from celery_exclusive.providers.base import Grant, Held, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import Store
from tests.contract.test_waiting import assert_woken_handovers
from tests.faults.servers import PrivatePostgres, ServerUnavailable, postgres_bindir
from tests.scale._servers import self_signed, unavailable
from tests.scale.conftest import contract_store, contract_tests


@pytest.fixture(scope="module")
def pg_tls() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL taking TLS (``ssl=on``, a self-signed certificate), stopped and
    deleted after the module."""
    bindir = postgres_bindir()
    if bindir is None:
        unavailable("PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; set CE_TEST_PG_BIN")
        raise AssertionError  # unreachable
    server = PrivatePostgres(bindir)
    try:
        cert, key = self_signed(server.root)
        if os.geteuid() == 0:  # the server runs as postgres and reads its key (mode 0600) itself
            owner = pwd.getpwnam("postgres")
            for each in (cert, key):
                os.chown(each, owner.pw_uid, owner.pw_gid)
        server.settings.update({"ssl": "on", "ssl_cert_file": f"'{cert}'", "ssl_key_file": f"'{key}'"})
        try:
            server.start()
        except ServerUnavailable as exc:
            unavailable(f"private PostgreSQL with ssl=on could not start: {exc}")
        yield server
    finally:
        server.stop()


@pytest.fixture
def url(pg_tls: PrivatePostgres) -> str:
    """The URL a user would write for the TLS server (``sslmode=require``), with a lock table
    of this test's own (left on the private server)."""
    return tls_url(pg_tls, f"tls_{uuid.uuid4().hex[:10]}")


def tls_url(server: PrivatePostgres, table: str) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres?sslmode=require&ce_table={table}"


def encrypted(server: PrivatePostgres) -> list[bool]:
    """Whether each client connection to ``server`` uses TLS (asked on one that does not)."""
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=server.port, user="postgres", dbname="postgres", sslmode="disable"
    ) as conn:
        rows = conn.execute(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
            "WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()"
        ).fetchall()
    return [bool(row[0]) for row in rows]


def test_every_connection_is_encrypted(pg_tls: PrivatePostgres, url: str) -> None:
    """The store's connections (the statements' and the waiters' LISTEN one) use TLS: the
    server lists each in pg_stat_ssl as encrypted."""
    service = LockService(url)
    try:
        subscription = service.provider.subscribe("warm-up")  # type: ignore[attr-defined]
        with service.lock("seen"):
            seen = encrypted(pg_tls)
        subscription.close()
        assert len(seen) >= 2, seen  # the pool's connection and the listener's
        assert all(seen), seen
    finally:
        service.close(release=True)


#: Holder JSON lengths around the sizes where a reply's bytes fill libpq's 16 KB input
#: buffer, a TLS record (16 KB) or the server's 8 KB send buffer, up to the longest taken.
HOLDER_LENGTHS = (10, 8_000, 8_192, 8_300, 16_000, 16_384, 16_500, 24_576, 32_800, 50_000, MAX_HOLDER_LENGTH)


def test_replies_of_every_size_arrive_over_tls(url: str) -> None:
    """Acquire, a refused acquire, peek, a refresh and release, 20 rounds for each holder
    length up to the longest: every reply (the refusal's, read by the libpq runner, and the
    peek's, up to 64 KB in several TLS records) is read whole by its deadline, none left in
    OpenSSL's buffer while the socket is quiet (TooSlow: a BackendError at the 5 s deadline)."""
    provider = SqlLockProvider.from_url(url)
    try:
        for length in HOLDER_LENGTHS:
            holder = json.dumps({"h": "x" * (length - 9)})
            assert len(holder) == length
            key = f"size-{length}"
            for n in range(20):
                token = f"t{n}"
                assert isinstance(provider.acquire(key, token, 30.0, 60.0, holder, timeout=5.0), Grant)
                refused = provider.acquire(key, "other", 30.0, 60.0, "{}", timeout=5.0)
                assert isinstance(refused, Held)
                assert refused.holder is not None
                assert (refused.holder.token, refused.holder.holder) == (token, json.loads(holder))
                info = provider.peek(key, timeout=5.0)
                assert info is not None
                assert (info.token, info.holder) == (token, json.loads(holder))
                assert provider.refresh([RefreshRequest(key, token, 30.0)], timeout=5.0) != [None]
                assert provider.release(key, token, timeout=5.0) is True
    finally:
        provider.close()


def test_a_thousand_leases_are_listed_and_refreshed_in_one_reply_over_tls(url: str) -> None:
    """1,000 leases with 1 KB holders: a listing (about 1 MB in one reply) and a refresh of
    all of them in one batch, ten times each, answer in full by their deadline."""
    provider = SqlLockProvider.from_url(url)
    keys = [f"many-{i:04}" for i in range(1_000)]
    holder = json.dumps({"h": "y" * 1_000})
    try:
        for key in keys:
            assert isinstance(provider.acquire(key, "tok", 60.0, 120.0, holder, timeout=5.0), Grant)
        for _ in range(10):
            listed = provider.scan("many-", timeout=10.0)
            assert sorted(info.key for info in listed) == keys
            assert all(info.holder == json.loads(holder) for info in listed)
            answers = provider.refresh([RefreshRequest(key, "tok", 60.0) for key in keys], timeout=10.0)
            assert all(answer is not None for answer in answers)
    finally:
        provider.close()


def test_a_waiter_is_woken_through_listen_over_tls(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``lock(wait=10)`` blocked on a held key is woken by its holder's release, five
    times (:func:`assert_woken_handovers`: polling slowed to 60 s): the release's NOTIFY, read on the
    listener's own TLS connection."""
    assert_woken_handovers(url, monkeypatch)


@pytest.fixture
def store(pg_tls: PrivatePostgres) -> Iterator[Store]:
    """PostgreSQL over TLS as the contract suite's one store."""
    yield from contract_store("postgresql-tls", tls_url(pg_tls, f"tls_{uuid.uuid4().hex[:10]}"))


# The lock contract over TLS, its heartbeat tests among them (the outage test needs an
# unreachable server, not this one; the guard test a SQLAlchemy engine the contract store
# does not give).
globals().update(contract_tests())
