"""The exported lock contract, run through ``django://<alias>`` on PostgreSQL and SQLite.

The store is built from a real settings module's DATABASES alias, on the table the app's
migration created; spawned processes set Django up themselves (tests/django/_stores.py).
On PostgreSQL ``lease.guard`` is checked on Django's own connection inside ``atomic()``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_exclusive import LockService
from celery_exclusive.providers.base import LockProvider
from celery_exclusive.testing.contract import LockContract, Store, open_store
from tests.conftest import CONTRACT_CYCLES
from tests.django import _stores

LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def django_transaction() -> Iterator[Any]:
    """Django's own psycopg connection to ``default``, inside ``transaction.atomic()``."""
    from django.db import connections, transaction

    with transaction.atomic(using="default"):
        yield connections["default"].connection


FACTORIES: dict[str, Callable[[], LockProvider]] = {"default": _stores.postgres, "lite": _stores.sqlite}


class TestDjangoStoreContract(LockContract):
    """django://default (PostgreSQL) and django://lite (SQLite) through the whole contract."""

    @pytest.fixture(params=sorted(FACTORIES))
    def store(
        self, request: pytest.FixtureRequest, project: dict[str, str], monkeypatch: pytest.MonkeyPatch
    ) -> Iterator[Store]:
        for name, value in project.items():
            if name != "DJANGO_SETTINGS_MODULE":
                monkeypatch.setenv(name, value)  # for the spawned processes' settings
        alias: str = request.param
        with open_store(
            f"django-{alias}",
            provider_factory=FACTORIES[alias],
            outage=lambda: LockService("django://unreachable"),
            guard=django_transaction if alias == "default" else None,
            # Spawned processes cost ~15 s per test here (each sets Django up): PostgreSQL
            # runs them in the long mode (CE_LONG=1); SQLite across processes is the same
            # SqlLockProvider the main contract suite covers.
            cross_process=alias == "default" and LONG,
            cycles=CONTRACT_CYCLES,
        ) as store:
            yield store
