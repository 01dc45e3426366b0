"""The provider registry (``celery_exclusive.providers``) and the SQL providers' split.

``PROVIDERS`` is the one table of URL schemes; the older names in ``urls`` re-export what
is derived from it, and ``SqlLockProvider`` still builds the PostgreSQL store (its
historical name) for a PostgreSQL URL or engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_exclusive import providers, urls
from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers.memory import MemoryLockProvider
from celery_exclusive.providers.postgres import PostgresLockProvider
from celery_exclusive.providers.sql import SqlLockProvider, lock_table
from tests.conftest import POSTGRES_URL, drop_lock_table, require_server


def test_every_scheme_names_an_importable_provider() -> None:
    """Each row resolves to a class or factory; the derived lists follow the table."""
    for scheme in providers.PROVIDERS:
        assert callable(providers.provider_class(scheme)), scheme
    assert tuple(sorted(providers.PROVIDERS)) == providers.KNOWN_SCHEMES
    assert urls.KNOWN_SCHEMES is providers.KNOWN_SCHEMES
    assert {"postgresql", "postgres", "sqlite", "mysql", "mariadb"} == providers.DRIVER_SCHEMES
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        urls.nonexistent  # noqa: B018


@pytest.mark.parametrize(
    ("url", "family"),
    [
        ("memory://", "memory"),
        ("redis://h/0", "redis"),
        ("rediss+cluster://h:1", "redis"),
        ("sentinel://h:26379/svc", "redis"),
        ("unix:///tmp/redis.sock", "redis"),
        ("postgresql://h/db", "sql"),
        ("postgres+psycopg2://h/db", "sql"),
        ("sqlite+pysqlite:///x.db", "sql"),
        ("mysql+mysqldb://h/db", "sql"),
        ("django://default", "sql"),
    ],
)
def test_scheme_families(url: str, family: str) -> None:
    assert providers.scheme_family(url) == urls.scheme_family(url) == family


@pytest.mark.parametrize("url", ["redis+nosuch://h", "django+x://default", "ftp://h", "nourl"])
def test_unknown_schemes_are_refused_naming_the_known_ones(url: str) -> None:
    with pytest.raises(ConfigurationError, match="postgresql, postgresql\\+psycopg"):
        providers.provider_from_url(url)


def test_memory_urls_build_the_memory_store_and_refuse_options() -> None:
    assert isinstance(providers.provider_from_url("memory://"), MemoryLockProvider)
    assert isinstance(urls.provider_from_url("memory://"), MemoryLockProvider)
    with pytest.raises(ConfigurationError, match="ce_tabel"):
        providers.provider_from_url("memory://?ce_tabel=x")


def test_sqlite_urls_build_the_sqlite_and_mariadb_store(tmp_path: Path) -> None:
    provider = providers.provider_from_url(f"sqlite:///{tmp_path / 'locks.db'}?ce_table=ce_reg")
    try:
        assert type(provider) is SqlLockProvider
        assert not isinstance(provider, PostgresLockProvider)
        assert provider.supports_guard is False  # type: ignore[attr-defined]
    finally:
        provider.close()


def test_sql_lock_provider_still_builds_the_postgres_store() -> None:
    """SqlLockProvider(URL), SqlLockProvider(engine) and SqlLockProvider.from_url of a
    PostgreSQL database give the PostgreSQL store, which is an SqlLockProvider for isinstance."""
    require_server(POSTGRES_URL)
    table = f"ce_reg_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(POSTGRES_URL)
    built = [
        SqlLockProvider(POSTGRES_URL, table=table),
        SqlLockProvider.from_url(f"{POSTGRES_URL}?ce_table={table}"),
        SqlLockProvider(engine, table=table),
        providers.provider_from_url(f"{POSTGRES_URL}?ce_table={table}"),
    ]
    try:
        for provider in built:
            assert type(provider) is PostgresLockProvider
            assert isinstance(provider, SqlLockProvider)
            assert provider.supports_guard is True  # type: ignore[attr-defined]
            assert provider.peek("k") is None
        assert issubclass(PostgresLockProvider, SqlLockProvider)
        assert repr(built[0]).startswith("PostgresLockProvider(")
        assert lock_table(sa.MetaData(), table).name == table  # still importable from providers.sql
    finally:
        for provider in built:
            provider.close()
        engine.dispose()
        drop_lock_table(POSTGRES_URL, table)


def test_the_postgres_store_refuses_other_databases(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="'sqlite' for a PostgreSQL lock store"):
        PostgresLockProvider(f"sqlite:///{tmp_path / 'x.db'}")
