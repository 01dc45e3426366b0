"""The public API is exactly ``celery_exclusive.__all__``: sorted, importable, complete."""

from __future__ import annotations

import importlib
import inspect

import celery_exclusive

PUBLIC_MODULES = [
    "celery_exclusive.errors",
    "celery_exclusive.lease",
    "celery_exclusive.many",
    "celery_exclusive.service",
    "celery_exclusive.task",
]


def test_all_is_sorted_and_every_name_exists() -> None:
    """__all__ is sorted, has no duplicates, and every name in it can be imported."""
    names = celery_exclusive.__all__
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(celery_exclusive, name), name


def test_every_public_class_and_exception_is_exported() -> None:
    """Each public class defined in the core modules is re-exported at the top level."""
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if name.startswith("_") or not inspect.isclass(value) or value.__module__ != module_name:
                continue
            if name not in celery_exclusive.__all__:
                missing.append(f"{module_name}.{name}")
    assert missing == []
