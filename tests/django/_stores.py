"""Provider factories for the contract suite's spawned processes (module level: picklable).

A spawned process starts without Django: each factory sets it up on the test settings
(the CE_DJANGO_* environment the test passes on names the databases) and opens the alias.
"""

from __future__ import annotations

import os

from celery_exclusive.providers.base import LockProvider
from celery_exclusive.urls import provider_from_url


def _open(alias: str) -> LockProvider:
    import django
    from django.conf import settings

    if not settings.configured:  # a spawned process; the test process is set up already
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
        django.setup()
    return provider_from_url(f"django://{alias}")


def postgres() -> LockProvider:
    """``django://default``: PostgreSQL."""
    return _open("default")


def sqlite() -> LockProvider:
    """``django://lite``: SQLite."""
    return _open("lite")
