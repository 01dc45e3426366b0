"""Create the lock table (``CELERY_EXCLUSIVE_TABLE``, default ``cache_entries``), its
completion-record table and its fence counter."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from celery_exclusive.contrib.django import schema


def create_lock_table(apps: Any, schema_editor: Any) -> None:
    schema.create(schema_editor, schema.table_name())


def drop_lock_table(apps: Any, schema_editor: Any) -> None:
    schema.drop(schema_editor, schema.table_name())


class Migration(migrations.Migration):  # type: ignore[misc]  # Django ships no type hints
    initial = True
    dependencies: list[tuple[str, str]] = []
    # atomic=False: on MySQL/MariaDB (no transactional DDL) Django refuses DDL in a transaction;
    # on PostgreSQL and SQLite the migration's own transaction still covers it.
    operations = [migrations.RunPython(create_lock_table, drop_lock_table, atomic=False)]
