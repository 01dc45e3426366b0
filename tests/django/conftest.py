"""The Django test project: tests/django/settings.py set up once for this package.

The environment that names its private databases is set only while Django reads the
settings: DJANGO_SETTINGS_MODULE left set would make every later Celery app load Celery's
Django fix-up. Tests that start processes pass it on themselves.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.conftest import MYSQL_URL, POSTGRES_URL, require_server

#: The DATABASES aliases the lock store is tested on: PostgreSQL, MariaDB, SQLite.
ALIASES = ["default", "maria", "lite"]


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Django set up on tests/django/settings.py, every alias migrated; all of it dropped after."""
    require_server(POSTGRES_URL)
    require_server(MYSQL_URL)
    import django
    from django.core.management import call_command
    from django.db import connections

    suffix = uuid.uuid4().hex[:10]
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.django.settings",
        "CE_DJANGO_PG_SCHEMA": f"ce_dj_{suffix}",
        "CE_DJANGO_SQLITE": str(tmp_path_factory.mktemp("django") / "db.sqlite3"),
        "CE_DJANGO_TABLE": f"ce_dj_locks_{suffix}",
        "CE_DJANGO_MYSQL_DB": f"ce_dj_{suffix}",
    }
    admin, my_admin = sa.create_engine(POSTGRES_URL), sa.create_engine(MYSQL_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {env['CE_DJANGO_PG_SCHEMA']}"))
    with my_admin.begin() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {env['CE_DJANGO_MYSQL_DB']} CHARACTER SET utf8mb4"))
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        django.setup()  # reads the settings module now; the environment is restored at once
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    try:
        for alias in ALIASES:
            call_command("migrate", database=alias, verbosity=0)
        yield env
    finally:
        connections.close_all()
        # The settings made PyMySQL pose as MySQLdb for Django; later tests expect no MySQLdb.
        for name in [m for m in sys.modules if m == "MySQLdb" or m.startswith("MySQLdb.")]:
            del sys.modules[name]
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {env['CE_DJANGO_PG_SCHEMA']} CASCADE"))
        with my_admin.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {env['CE_DJANGO_MYSQL_DB']}"))
        admin.dispose()
        my_admin.dispose()
