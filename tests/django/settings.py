"""A real Django settings module for the django:// store tests (names come from the environment).

``default`` is PostgreSQL in a private schema (``OPTIONS`` sets its ``search_path``),
``maria`` MariaDB/MySQL in a private database, ``lite`` a SQLite file; ``unreachable`` and
``memdb`` exist to be refused.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pymysql

from tests.conftest import MYSQL_URL, POSTGRES_URL

pymysql.install_as_MySQLdb()  # Django's MySQL backend expects mysqlclient; PyMySQL stands in
_pg, _my = urlsplit(POSTGRES_URL), urlsplit(MYSQL_URL)

SECRET_KEY = "celery-exclusive-tests"
USE_TZ = True
INSTALLED_APPS = ["celery_exclusive.contrib.django"]
CELERY_EXCLUSIVE_TABLE = os.environ.get("CE_DJANGO_TABLE", "cache_entries")
CELERY_EXCLUSIVE_URL = "django://default"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": _pg.hostname or "127.0.0.1",
        "PORT": _pg.port or 5432,
        "NAME": _pg.path.lstrip("/") or "test",
        "USER": _pg.username or "postgres",
        "PASSWORD": _pg.password or "",
        "OPTIONS": {"options": f"-c search_path={os.environ.get('CE_DJANGO_PG_SCHEMA', 'public')}"},
    },
    "maria": {
        "ENGINE": "django.db.backends.mysql",
        "HOST": _my.hostname or "127.0.0.1",
        "PORT": _my.port or 3306,
        "NAME": os.environ.get("CE_DJANGO_MYSQL_DB", "test"),
        "USER": _my.username or "root",
        "PASSWORD": _my.password or "",
        "OPTIONS": {"charset": "utf8mb4"},
    },
    "lite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("CE_DJANGO_SQLITE", "/nonexistent/ce-django.sqlite3"),
    },
    "unreachable": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "127.0.0.1",
        "PORT": "1",
        "NAME": "nowhere",
        "USER": "someone",
        "PASSWORD": "dj-pw-SECRET-4711",  # contains the contract's OUTAGE_SECRET
        "OPTIONS": {"connect_timeout": 3},
    },
    "memdb": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
