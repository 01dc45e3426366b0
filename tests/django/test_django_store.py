"""The django:// store and the Django app, with a real settings module on PostgreSQL and SQLite.

``default`` is PostgreSQL (in a private schema chosen through ``OPTIONS``), ``lite`` a SQLite
file; both are migrated by ``manage.py migrate`` before the tests, so the lock table is the
migration's, and the store (the app is installed) creates nothing itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exclusive import BackendError, ConfigurationError, LockedError, LockService, ReleaseOutcome
from celery_exclusive.providers.base import Grant, Held, RefreshRequest
from celery_exclusive.providers.sql import SqlLockProvider
from tests.conftest import MYSQL_URL, POSTGRES_URL, IdleThread
from tests.django.conftest import ALIASES

pytest.importorskip("django")

ROOT = Path(__file__).resolve().parents[2]


def engine_for(project: dict[str, str], alias: str) -> sa.Engine:
    """An engine of our own on the same database (and PostgreSQL schema) as ``alias``."""
    if alias == "lite":
        return sa.create_engine(f"sqlite:///{project['CE_DJANGO_SQLITE']}")
    if alias == "maria":
        return sa.create_engine(sa.make_url(MYSQL_URL).set(database=project["CE_DJANGO_MYSQL_DB"]))
    return sa.create_engine(
        POSTGRES_URL, connect_args={"options": f"-c search_path={project['CE_DJANGO_PG_SCHEMA']}"}
    )


def objects(engine: sa.Engine) -> set[str]:
    """Every table, sequence and index of the database (PostgreSQL: of the test schema)."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.execute(sa.text("SELECT type, name FROM sqlite_master"))
        elif engine.dialect.name == "mysql":
            rows = conn.execute(
                sa.text(
                    "SELECT 'table', table_name FROM information_schema.tables "
                    "WHERE table_schema = database() "
                    "UNION ALL SELECT 'index', concat(table_name, '.', index_name) "
                    "FROM information_schema.statistics WHERE table_schema = database()"
                )
            )
        else:
            rows = conn.execute(
                sa.text(
                    "SELECT relkind::text, relname FROM pg_class "
                    "WHERE relnamespace = current_schema()::regnamespace"
                )
            )
        return {f"{kind}:{name}" for kind, name in rows}


def schema_of(engine: sa.Engine, table: str) -> dict[str, Any]:
    """The lock table's and fence counter's definitions, with the table's name taken out."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.execute(
                sa.text("SELECT name, sql FROM sqlite_master WHERE name LIKE :t ESCAPE '!' ORDER BY name"),
                {"t": table.replace("_", "!_") + "%"},
            )
            found = {name.replace(table, "T"): sql.replace(table, "T") for name, sql in rows}
            # Rows with a negative id are the boot clock's offsets, written on first use.
            found["counter"] = conn.execute(sa.text(f"SELECT id FROM {table}_fence WHERE id > 0")).all()
            return found
        if engine.dialect.name == "mysql":
            found = {}
            for name in (table, f"{table}_fence", f"{table}_done"):
                columns = conn.execute(
                    sa.text(
                        "SELECT column_name, column_type, is_nullable, column_default, character_set_name, "
                        "collation_name, column_key, ordinal_position FROM information_schema.columns "
                        "WHERE table_schema = database() AND table_name = :t ORDER BY ordinal_position"
                    ),
                    {"t": name},
                ).all()
                options = conn.execute(
                    sa.text(
                        "SELECT engine, table_collation FROM information_schema.tables "
                        "WHERE table_schema = database() AND table_name = :t"
                    ),
                    {"t": name},
                ).all()
                found[name.replace(table, "T")] = (columns, options)
            found["counter"] = conn.execute(sa.text(f"SELECT id FROM {table}_fence")).all()  # n: usage
            return found
        columns, done_columns = (
            conn.execute(
                sa.text(
                    "SELECT column_name, data_type, character_maximum_length, is_nullable, column_default, "
                    "collation_name, ordinal_position FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = :t ORDER BY ordinal_position"
                ),
                {"t": name},
            ).all()
            for name in (table, f"{table}_done")
        )
        key = conn.execute(
            sa.text(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = CAST(:t AS regclass) AND i.indisprimary"
            ),
            {"t": table},
        ).all()
        sequence = conn.execute(
            sa.text(
                "SELECT data_type, start_value, increment_by, cache_size, cycle FROM pg_sequences "
                "WHERE schemaname = current_schema() AND sequencename = :s"
            ),
            {"s": f"{table}_fence_seq"},
        ).all()
        function = conn.execute(
            sa.text("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(:f)"),
            {"f": f'"{table}_unless"(varchar,varchar)'},
        ).scalar()
        return {
            "columns": columns,
            "done columns": done_columns,
            "primary key": key,
            "sequence": sequence,
            # the marker function's body, which names its table
            "function": None if function is None else function.replace(table, "<table>"),
        }


@pytest.mark.parametrize("alias", ALIASES)
def test_the_migration_creates_exactly_the_schema_the_store_creates(
    project: dict[str, str], alias: str
) -> None:
    """The migrated table and fence counter equal what the store builds at run time, column by column."""
    engine = engine_for(project, alias)
    own = f"ce_dj_own_{uuid.uuid4().hex[:8]}"
    provider = SqlLockProvider(engine, table=own)  # create_table=True: the store's own DDL
    try:
        assert provider.peek("nothing") is None
        migrated, created = schema_of(engine, project["CE_DJANGO_TABLE"]), schema_of(engine, own)
        assert migrated == created
        assert migrated["sequence" if alias == "default" else "counter"]  # the fence counter is there
        assert (migrated.get("function") is not None) == (alias == "default")  # PostgreSQL's marker function
    finally:
        provider.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {own}_done"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {own}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {own}_fence"))
            if alias == "default":
                conn.execute(sa.text(f"DROP SEQUENCE IF EXISTS {own}_fence_seq"))
                conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {own}_unless(varchar, varchar)"))
        engine.dispose()


@pytest.mark.parametrize("alias", ALIASES)
def test_the_store_works_on_the_migrated_table_and_creates_nothing(
    project: dict[str, str], alias: str
) -> None:
    """Through django://<alias> the lock cycle runs on the migrated table; no object is added."""
    engine = engine_for(project, alias)
    before = objects(engine)
    service = LockService(f"django://{alias}", prefix=f"t{uuid.uuid4().hex[:8]}:", thread_factory=IdleThread)
    try:
        assert service.provider.table.name == project["CE_DJANGO_TABLE"]  # CELERY_EXCLUSIVE_TABLE
        with service.lock("job") as lease:
            assert lease.fence > 0
        assert objects(engine) == before
    finally:
        service.close()
        engine.dispose()
    # With the app installed the store never creates: a table nobody migrated is an error.
    missing = LockService(f"django://{alias}?ce_table=ce_dj_never_migrated", thread_factory=IdleThread)
    try:
        with pytest.raises(BackendError):
            missing.try_lock("job")
    finally:
        missing.close()


@pytest.mark.parametrize("alias", ALIASES)
def test_lock_behaviour_through_django_settings(project: dict[str, str], alias: str) -> None:
    """Acquire, contention across two services, refresh, peek, scan and release via django://<alias>."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    first = LockService(f"django://{alias}", prefix=prefix, thread_factory=IdleThread)
    second = LockService(f"django://{alias}", prefix=prefix, thread_factory=IdleThread)
    assert first.provider is not second.provider  # two stores, two connection pools
    try:
        lease = first.lock("job", ttl=30, holder={"task_name": "demo.job"})
        with pytest.raises(LockedError) as refused:
            second.lock("job")
        assert refused.value.holder is not None
        assert refused.value.holder.fence == lease.fence
        assert refused.value.holder.holder["task_name"] == "demo.job"
        other = second.lock("other", ttl=30)

        provider, store_key = second.provider, prefix + "job"
        assert isinstance(provider.acquire(store_key, "intruder", 30, 60, "{}"), Held)
        again = provider.acquire(store_key, lease.token, 30, 3600, "{}")  # idempotent for its own token
        assert isinstance(again, Grant)
        assert again.fence == lease.fence
        [remaining, none] = provider.refresh(
            [RefreshRequest(store_key, lease.token, 20.0), RefreshRequest(store_key, "intruder", 20.0)]
        )
        assert remaining is not None
        assert 0 < remaining <= 20.0
        assert none is None
        info = second.peek("job")
        assert info is not None
        assert info.token == lease.token
        assert info.expires_in <= 20.0
        assert [i.key for i in second.locks()] == ["job", "other"]
        assert provider.release(store_key, "intruder") is False

        assert lease.release() is ReleaseOutcome.RELEASED
        assert second.peek("job") is None
        taken = second.lock("job", ttl=30)
        assert taken.fence > lease.fence
        taken.release()
        other.release()
        assert second.locks() == []
    finally:
        first.close()
        second.close()


def test_guard_fences_a_django_transaction_on_postgresql(project: dict[str, str]) -> None:
    """lease.guard(Django's own psycopg connection) passes inside atomic(), fails once the lease is gone."""
    from django.db import connections, transaction

    from celery_exclusive import LockLost

    service = LockService("django://default", prefix=f"t{uuid.uuid4().hex[:8]}:", thread_factory=IdleThread)
    try:
        lease = service.lock("invoice:1", ttl=30)
        with transaction.atomic(using="default"):
            connections["default"].ensure_connection()
            lease.guard(connections["default"].connection)
        service.force_release(lease.key, lease.token)
        with pytest.raises(LockLost), transaction.atomic(using="default"):
            lease.guard(connections["default"].connection)
    finally:
        service.close()


def run_manage(project: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.django.manage", *args],
        cwd=ROOT,
        env={**os.environ, **project},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_manage_py_exclusive_lists_a_lease_held_by_another_process(project: dict[str, str]) -> None:
    """``manage.py exclusive list`` reads CELERY_EXCLUSIVE_URL (django://default) and sees our lease."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    service = LockService("django://default", prefix=prefix, thread_factory=IdleThread)
    try:
        lease = service.lock("nightly", ttl=60, holder={"task_name": "reports.nightly"})
        listed = run_manage(project, "exclusive", "--prefix", prefix, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)["locks"]
        assert row["key"] == "nightly"
        assert row["fence"] == lease.fence
        text = run_manage(project, "exclusive", "--prefix", prefix, "list")
        assert text.returncode == 0, text.stderr
        assert "nightly" in text.stdout
        assert "reports.nightly" in text.stdout
        helped = run_manage(project, "exclusive", "--help")
        assert helped.returncode == 0, helped.stderr
        assert "settings.CELERY_EXCLUSIVE_URL" in helped.stdout
        assert "app.conf" not in helped.stdout
        bad = run_manage(project, "exclusive", "--url", "nosuch://x", "list")
        assert bad.returncode == 2
        assert "unknown lock store scheme" in bad.stderr
    finally:
        service.close()


def test_call_command_exclusive_raises_command_error_on_failure(project: dict[str, str]) -> None:
    """call_command('exclusive', ...) succeeds quietly, and a failing CLI run is a CommandError."""
    from django.core.management import CommandError, call_command

    call_command("exclusive", "list")
    with pytest.raises(CommandError) as failed:
        call_command("exclusive", "--url", "django://unreachable", "list")
    assert failed.value.returncode == 3


def test_credentials_never_show(project: dict[str, str]) -> None:
    """An unreachable alias is a BackendError; neither it nor the provider's repr shows the password."""
    service = LockService("django://unreachable", thread_factory=IdleThread)
    try:
        assert "dj-pw-SECRET-4711" not in repr(service.provider)
        with pytest.raises(BackendError) as failed:
            service.try_lock("job")
        assert "dj-pw-SECRET-4711" not in str(failed.value)
        assert "dj-pw-SECRET-4711" not in repr(failed.value)
    finally:
        service.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("django://", "expected django://<DATABASES alias>"),
        ("django://user:pw-SECRET@default", "names only a DATABASES alias"),
        ("django://:pw-SECRET@default?ce_tabel=x", "unknown option 'ce_tabel'"),
        ("django://default/x", "names only a DATABASES alias"),
        ("django://default?sslmode=require", "names only a DATABASES alias"),
        ("django://default?ce_tabel=x", "unknown option 'ce_tabel'"),
        ("django://default?ce_create_table=maybe", "must be true or false"),
        ("django://nosuch", "no DATABASES alias 'nosuch'"),
        ("django://memdb", "in-memory SQLite"),
        ("django://default?ce_table=1bad", "invalid lock table name"),
    ],
)
def test_bad_django_urls_are_refused_by_name(project: dict[str, str], url: str, message: str) -> None:
    """A malformed django:// URL or unusable alias is a ConfigurationError before any connection."""
    with pytest.raises(ConfigurationError, match=message) as refused:
        LockService(url)
    assert "pw-SECRET" not in str(refused.value)


def test_option_mapping() -> None:
    """OPTIONS, socket HOSTs and MySQL's ssl dict become driver parameters; Django's own keys do not."""
    from celery_exclusive.contrib.django.store import sqlalchemy_url

    pg = sqlalchemy_url(
        "a",
        "postgresql",
        {
            "HOST": "/run/postgresql",
            "PORT": "6432",
            "NAME": "app",
            "USER": "u",
            "PASSWORD": "p@ss:w/rd",
            "OPTIONS": {"sslmode": "require", "isolation_level": 1, "server_side_binding": True},
        },
    )
    assert pg.drivername == "postgresql+psycopg"
    assert (pg.host, pg.port, pg.database, pg.username, pg.password) == (None, 6432, "app", "u", "p@ss:w/rd")
    assert dict(pg.query) == {"sslmode": "require", "host": "/run/postgresql"}
    assert sa.make_url(pg.render_as_string(hide_password=False)).password == "p@ss:w/rd"
    my = sqlalchemy_url(
        "b",
        "mysql",
        {
            "HOST": "db",
            "PORT": 3306,
            "NAME": "app",
            "OPTIONS": {"ssl": {"ca": "/ca.pem"}, "charset": "utf8mb4"},
        },
    )
    assert my.drivername == "mysql+pymysql"
    assert dict(my.query) == {"ssl_ca": "/ca.pem", "charset": "utf8mb4"}
    with pytest.raises(ConfigurationError, match="OPTIONS\\['cursor'\\] is a"):
        sqlalchemy_url("c", "postgresql", {"NAME": "x", "OPTIONS": {"cursor": object()}})
    with pytest.raises(ConfigurationError, match="'oracle' database"):
        sqlalchemy_url("d", "oracle", {"NAME": "x"})
    with pytest.raises(ConfigurationError, match="PORT must be a number"):
        sqlalchemy_url("e", "postgresql", {"NAME": "x", "PORT": "five"})


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_django_is_imported_only_for_the_django_scheme(tmp_path: Path) -> None:
    """Other schemes never import Django; without Django installed, django:// names the extra."""
    quiet = run_python(
        f"""
        import sys
        import kombu.utils.json  # kombu itself imports django.utils.functional when Django is there
        baseline = {{m for m in sys.modules if m.split(".")[0] == "django"}}
        from celery_exclusive import LockService
        import celery_exclusive.cli, celery_exclusive.contrib.django
        for url in ("memory://", "sqlite:///{tmp_path / "x.sqlite3"}"):
            LockService(url).close()
        added = {{m for m in sys.modules if m.split(".")[0] == "django"}} - baseline
        assert not added, sorted(added)
        assert "celery_exclusive.contrib.django.store" not in sys.modules
        """,
        DJANGO_SETTINGS_MODULE="tests.django.settings",
    )
    assert quiet.returncode == 0, quiet.stderr
    missing = run_python(
        """
        import sys
        sys.modules["django"] = None  # as if Django were not installed
        from celery_exclusive import LockService, MissingDriverError
        try:
            LockService("django://default")
        except MissingDriverError as exc:
            print(exc)
        """
    )
    assert missing.returncode == 0, missing.stderr
    assert "pip install 'celery-exclusive[django]'" in missing.stdout
    unconfigured = run_python(
        """
        from celery_exclusive import LockService, ConfigurationError
        try:
            LockService("django://default")
        except ConfigurationError as exc:
            print(exc)
        """
    )
    assert unconfigured.returncode == 0, unconfigured.stderr
    assert "DJANGO_SETTINGS_MODULE" in unconfigured.stdout


@pytest.mark.parametrize("alias", ALIASES)
def test_the_migration_reverses_and_reapplies(project: dict[str, str], alias: str) -> None:
    """``migrate celery_exclusive zero`` drops the table and its counter; migrating again restores both."""
    from django.core.management import call_command

    engine = engine_for(project, alias)
    table = project["CE_DJANGO_TABLE"]
    try:
        with_table = objects(engine)
        assert any(table in name for name in with_table)
        call_command("migrate", "celery_exclusive", "zero", database=alias, verbosity=0)
        assert not any(table in name for name in objects(engine))
        call_command("migrate", "celery_exclusive", database=alias, verbosity=0)
        assert objects(engine) == with_table
    finally:
        engine.dispose()
