"""Names a module serves on first use (PEP 562 module ``__getattr__``).

The package and ``celery_exclusive.testing`` re-export Celery-integration names this way,
so importing either imports neither ``celery_exclusive.task`` nor ``celery_exclusive.worker``
(and connects no worker-signal receiver) until such a name is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any


def load(namespace: MutableMapping[str, Any], lazy: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``lazy`` maps it to, kept in ``namespace`` (a module's
    globals) so later lookups skip the module's ``__getattr__``; AttributeError if unknown."""
    module = lazy.get(name)
    if module is None:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value
