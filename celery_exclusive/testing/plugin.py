"""The pytest plugin of celery-exclusive (entry point ``pytest11``: ``celery_exclusive``).

Inert unless a test asks for one of its fixtures: it adds fixtures only, no hook, option or
setting, and creates nothing until a fixture is used. ``-p no:celery_exclusive`` disables it.

* ``exclusive_app``: the Celery app the store is installed for; the current app unless
  you override this fixture (``return my_project.celery_app``).
* ``exclusive_store``: an :class:`~celery_exclusive.testing.ExclusiveStore` installed for
  ``exclusive_app`` for the test, removed (and its leases dropped) afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_exclusive.testing import ExclusiveStore


@pytest.fixture
def exclusive_app() -> Any:
    """The Celery app whose tasks use ``exclusive_store``: override it to name yours."""
    from celery import current_app

    return current_app._get_current_object()  # type: ignore[attr-defined, unused-ignore]  # a Proxy; celery-types says Celery


@pytest.fixture
def exclusive_store(exclusive_app: Any) -> Iterator[ExclusiveStore]:
    """An in-memory lock store on a fake clock, used by every task of ``exclusive_app``."""
    from celery_exclusive.testing import ExclusiveStore

    store = ExclusiveStore()
    store.install(exclusive_app)
    try:
        yield store
    finally:
        store.close()
