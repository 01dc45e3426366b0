"""PostgreSQL: the lock table's marker function, ``<table>_unless`` (the until_done dedupe
marker re-reads both keys with it once it holds the marker key's lock; 0001 makes it for
tables created since, this for tables migrated before). Nothing on the other databases."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from celery_exclusive.contrib.django import schema


def create_unless_function(apps: Any, schema_editor: Any) -> None:
    schema.create_unless_function(schema_editor, schema.table_name())


def drop_unless_function(apps: Any, schema_editor: Any) -> None:
    schema.drop_unless_function(schema_editor, schema.table_name())


class Migration(migrations.Migration):  # type: ignore[misc]  # Django ships no type hints
    dependencies = [("celery_exclusive", "0001_initial")]
    operations = [migrations.RunPython(create_unless_function, drop_unless_function)]
