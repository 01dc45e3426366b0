"""The MariaDB store over TLS (``ssl_ca=``), against a private server of its own whose lock
user is created ``REQUIRE SSL``: a connection without TLS is refused, not quietly plain.

Replies of every size are read (tests/providers/test_pg_tls.py's: a 64 KB holder, a listing
and a refresh of 1,000 leases), a waiter gets a key its holder releases, and the lock
contract runs once more (heartbeat, expiry, fences, processes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import Store
from tests.contract.test_waiting import handovers

# Replies of every size over TLS, on this module's `url`.
from tests.providers.test_pg_tls import (  # noqa: F401
    test_a_thousand_leases_are_listed_and_refreshed_in_one_reply_over_tls,
    test_replies_of_every_size_arrive_over_tls,
)
from tests.scale._servers import binary, free_port, processes, self_signed, start, wait_for
from tests.scale.conftest import contract_store, contract_tests

#: The user the stores connect as: TLS required by the server (``REQUIRE SSL``).
USER = "tls_locks"


@pytest.fixture(scope="module")
def mariadb_tls() -> Iterator[str]:
    """A private MariaDB taking TLS with a self-signed certificate (a temp data dir, stopped
    and deleted after the module); the URL a user would write for it, without a table."""
    import pymysql

    install = binary("mariadb-install-db", "/usr/bin/mariadb-install-db")
    server = binary("mariadbd", "/usr/sbin/mariadbd")
    # Not under pytest's temp dir: mariadbd drops root for the mysql user, which must reach it.
    folder = Path(tempfile.mkdtemp(prefix="ce-mariadb-tls-"))
    try:
        cert, key = self_signed(folder)
        user = []  # as root, the server and its files are the mysql user's (it refuses root)
        if os.geteuid() == 0:
            user = ["--user=mysql"]
            for item in (folder, *folder.iterdir()):
                shutil.chown(item, "mysql", "mysql")
        data = folder / "data"
        made = [install, "--no-defaults", f"--datadir={data}", *user, "--skip-test-db"]
        made += ["--auth-root-authentication-method=normal"]
        subprocess.run(made, check=True, capture_output=True, timeout=120)
        port = free_port()
        args = [server, "--no-defaults", f"--datadir={data}", *user, "--bind-address=127.0.0.1"]
        args += [f"--port={port}", f"--socket={folder / 'sock'}", f"--pid-file={folder / 'pid'}"]
        args += ["--skip-log-bin", "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"]
        args += [f"--ssl-cert={cert}", f"--ssl-key={key}"]
        with processes() as started:
            proc = start(started, args, folder / "server.log")
            tls = {"ca": str(cert)}

            def admin() -> pymysql.Connection:  # type: ignore[type-arg]
                return pymysql.connect(host="127.0.0.1", port=port, user="root", ssl=tls, autocommit=True)

            wait_for(lambda: bool(admin().close() or True), "private MariaDB with TLS", proc, timeout=60)
            with admin() as conn, conn.cursor() as cursor:
                cursor.execute("CREATE DATABASE locks")
                cursor.execute(f"CREATE USER '{USER}'@'127.0.0.1' REQUIRE SSL")
                cursor.execute(f"GRANT ALL ON locks.* TO '{USER}'@'127.0.0.1'")
            yield f"mysql+pymysql://{USER}@127.0.0.1:{port}/locks?ssl_ca={cert}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def url(mariadb_tls: str) -> str:
    """The TLS store's URL with a lock table of this test's own (left on the private server)."""
    return f"{mariadb_tls}&ce_table=tls_{uuid.uuid4().hex[:10]}"


def test_the_stores_connections_are_encrypted(url: str) -> None:
    """The store's connections use TLS (the server names their cipher), and its user gets no
    connection without TLS: the URL's ``ssl_ca`` is what made them secure."""
    provider = SqlLockProvider.from_url(url)
    try:
        assert provider.peek("warm-up") is None
        with provider._engine.connect() as conn:
            cipher = conn.execute(sa.text("SHOW STATUS LIKE 'Ssl_cipher'")).one()[1]
        assert cipher, "the store's connection is not encrypted"
    finally:
        provider.close()
    plain = sa.create_engine(url.split("?", maxsplit=1)[0], connect_args={"ssl_disabled": True})
    try:
        with pytest.raises(sa.exc.OperationalError, match="Access denied"), plain.connect():
            pass
    finally:
        plain.dispose()


def test_a_waiter_gets_the_key_its_holder_releases_over_tls(url: str) -> None:
    """A ``lock(wait=10)`` blocked on a held key gets it when the holder releases, five times
    (the waiter polls the store over TLS: MariaDB has no release signal)."""
    assert len(handovers(url)) == 5


@pytest.fixture
def store(mariadb_tls: str) -> Iterator[Store]:
    """MariaDB over TLS as the contract suite's one store."""
    yield from contract_store("mariadb-tls", f"{mariadb_tls}&ce_table=tls_{uuid.uuid4().hex[:10]}")


# The lock contract over TLS, its heartbeat tests among them (the outage test needs an
# unreachable server, not this one; the guard test a PostgreSQL store).
globals().update(contract_tests())
