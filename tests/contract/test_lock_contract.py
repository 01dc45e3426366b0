"""Our five stores (the ``store`` fixture of tests/conftest.py) through the exported contract.

The tests themselves live in :mod:`celery_exclusive.testing.contract`, the same suite a
third-party store runs: there is no second copy here.
"""

from __future__ import annotations

from celery_exclusive.testing.contract import LockContract


class TestLockContract(LockContract):
    """memory, SQLite, PostgreSQL, MariaDB and Redis, each in turn."""
