"""The package's import graph has no cycle and keeps its layers (docs/architecture.md).

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` of a
``celery_exclusive`` module, at module level, inside functions (the lazy imports) and under
``if TYPE_CHECKING:`` alike, relative imports resolved. ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module, else to ``pkg``. The implicit import of a parent
package (``import a.b.c`` runs ``a/__init__``) is not an edge: every module would otherwise
depend on the package's re-exports.

Layers, bottom up:

* leaf: ``_info`` (the store's record types, ``LockInfo`` and ``CompletionInfo``) imports
  nothing internal; ``errors`` only ``_info`` (the records its exceptions carry);
  ``validation``, ``urls`` (and any ``_validation``, ``_urls``, ``*_urls``) import only
  ``errors`` and ``_info``;
* providers (``providers/*``): only leaf modules, ``providers.base`` and ``providers._*``;
  the registry ``providers/__init__.py`` is the one place that may name every provider;
* lock core (``lease``, ``heartbeat``, ``service`` and its collaborators ``_core``, ``_process``,
  ``_acquiring``, ``_releasing``, ``_leasing``, ``_records``, ``waiting``, ``many``,
  ``semaphore``, ``_store``, ``_prefixed``, ``_marking``, ``_options``; the heartbeat's ``_inflight`` and
  ``_refreshing``): leaf,
  ``providers.base``, the registry, ``signals`` and each other; no concrete provider
  (``providers.<backend>``) and nothing of the Celery layer;
* everything else (the Celery layer: task, worker, settings, keys, observe, policies,
  redelivery..., and cli, metrics): no provider module beyond ``providers.base`` (and the
  registry). The package facade ``celery_exclusive`` re-exports ``MemoryLockProvider``, and
  ``celery_exclusive.testing`` builds its store on it: both may import ``providers.memory``;
  ``contrib/*`` adapts a framework (Django's ``DATABASES``) to the provider it builds on, and
  may import any provider. Below the Celery layer only the registry may import ``contrib``.

Breaks the code still has are listed in ``ALLOWED`` with the follow-up that removes them;
any other break fails, and so does an entry of ``ALLOWED`` that is no longer needed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PACKAGE = "celery_exclusive"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: Import edges (importer, imported) that break a rule or close a cycle today, each with
#: the follow-up that removes it. Keep it shrinking: a stale entry fails the test.
ALLOWED: dict[tuple[str, str], str] = {
    # urls keeps its public names provider_from_url, scheme_family and KNOWN_SCHEMES as thin
    # re-exports of the provider registry (imported on use, so urls loads no provider).
    # Follow-up: deprecate them in favour of celery_exclusive.providers' (a public-name change).
    ("urls", "providers"): "provider_from_url / scheme_family / KNOWN_SCHEMES re-export the registry",
    # SqlLockProvider(postgresql URL or engine) keeps building the PostgreSQL store, as it did
    # before PostgreSQL got its own module. Follow-up: deprecate that spelling.
    ("providers.sql", "providers.postgres"): "SqlLockProvider(PostgreSQL URL) builds PostgresLockProvider",
}


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def short(name: str) -> str:
    """``celery_exclusive.providers.base`` -> ``providers.base``; the package itself stays."""
    return name[len(PACKAGE) + 1 :] if name.startswith(PACKAGE + ".") else name


def imports_of(name: str) -> Iterator[tuple[str, int]]:
    """The package modules ``name`` imports, with the line of each import."""
    path = MODULES[name]
    yield from imports_in(path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py")


def imports_in(source: str, name: str, *, is_package: bool) -> Iterator[tuple[str, int]]:
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source_module = ".".join([*base, node.module] if node.module else base)
            else:
                source_module = node.module or ""
            if source_module != PACKAGE and not source_module.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                target = f"{source_module}.{alias.name}"
                yield (target if target in MODULES else source_module), node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """Short module name -> {short imported module name: line}."""
    graph: dict[str, dict[str, int]] = {}
    for name in MODULES:
        edges = graph.setdefault(short(name), {})
        for target, line in imports_of(name):
            assert target in MODULES, f"{name}:{line} imports {target}, which is not a module here"
            if target != name:
                edges.setdefault(short(target), line)
    return graph


LEAF = {"_info", "errors", "validation", "_validation", "urls", "_urls"}
CORE = {
    "lease",
    "heartbeat",
    "service",
    "_core",
    "_process",
    "_acquiring",
    "_releasing",
    "_leasing",
    "_records",
    "waiting",
    "many",
    "semaphore",
    "_store",
    "_inflight",
    "_refreshing",
    "_prefixed",
    "_marking",
    "_options",
}
REGISTRY = "providers"


def is_leaf(mod: str) -> bool:
    return mod in LEAF or ("." not in mod and mod.endswith("_urls"))


def is_provider(mod: str) -> bool:
    return mod.startswith("providers.")


def upper_may_import(importer: str, imported: str) -> bool:
    if not is_provider(imported) or imported == "providers.base" or importer.startswith("contrib."):
        return True
    return imported == "providers.memory" and (importer == PACKAGE or importer.startswith("testing"))


#: (which importers, what each may import, the rule), first match decides; the Celery layer
#: and the other upper modules are the catch-all last row.
RULES: list[tuple[Callable[[str], bool], Callable[[str, str], bool], str]] = [
    (lambda m: m == "_info", lambda m, t: False, "_info (the store's record types) imports nothing internal"),
    (lambda m: m == "errors", lambda m, t: t == "_info", "errors imports only _info (its records)"),
    (is_leaf, lambda m, t: t in {"errors", "_info"}, "leaf modules import only errors and _info"),
    (
        is_provider,
        lambda m, t: is_leaf(t) or t == "providers.base" or t.startswith("providers._"),
        "providers import only leaf modules, providers.base and providers._*",
    ),
    (
        lambda m: m in CORE,
        lambda m, t: is_leaf(t) or t in {"providers.base", REGISTRY, "signals", *CORE},
        "the lock core imports no concrete provider and nothing of the Celery layer",
    ),
    (lambda m: True, upper_may_import, "the Celery layer imports no provider beyond providers.base"),
]


def rule_broken(importer: str, imported: str) -> str | None:
    """The rule ``importer`` breaks by importing ``imported``; None if it may."""
    for applies, may_import, rule in RULES:
        if applies(importer):
            return None if may_import(importer, imported) else rule
    raise AssertionError("the last rule applies to every module")


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walker_sees_every_kind_of_import() -> None:
    """Lazy, TYPE_CHECKING, relative and ``from pkg import module`` imports all count."""
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        import os
        import celery_exclusive.errors
        from celery_exclusive import signals, LockService
        from . import base
        from .base import Grant
        from .. import urls
        if TYPE_CHECKING:
            from celery_exclusive.service import LockService
        def lazy():
            from celery_exclusive.providers import memory
        """
    )
    found = [target for target, _ in imports_in(source, "celery_exclusive.providers.x", is_package=False)]
    assert found == [
        "celery_exclusive.errors",
        "celery_exclusive.signals",
        "celery_exclusive",
        "celery_exclusive.providers.base",
        "celery_exclusive.providers.base",
        "celery_exclusive.urls",
        "celery_exclusive.service",
        "celery_exclusive.providers.memory",
    ]
    package = [t for t, _ in imports_in("from . import lease", "celery_exclusive", is_package=True)]
    assert package == ["celery_exclusive.lease"]
    assert PACKAGE in import_graph()["testing._workers"]  # from celery_exclusive import LockService


def test_no_layer_break_outside_the_allow_list() -> None:
    graph = import_graph()
    breaks = [
        f"{MODULES[importer if importer == PACKAGE else f'{PACKAGE}.{importer}'].relative_to(ROOT.parent)}"
        f":{line} imports {imported}: {why}"
        for importer, edges in sorted(graph.items())
        for imported, line in sorted(edges.items())
        if (importer, imported) not in ALLOWED and (why := rule_broken(importer, imported))
    ]
    assert breaks == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    kept = {mod: {t: n for t, n in edges.items() if (mod, t) not in ALLOWED} for mod, edges in graph.items()}
    assert cycles(kept) == []


def test_the_allow_list_has_no_stale_entry() -> None:
    """Each allowed edge still exists and is still needed (breaks a rule or closes a cycle)."""
    graph = import_graph()
    stale = []
    for importer, imported in ALLOWED:
        if imported not in graph.get(importer, {}):
            stale.append(f"{importer} -> {imported}: no such import any more")
            continue
        on_cycle = any({importer, imported} <= set(component) for component in cycles(graph))
        if rule_broken(importer, imported) is None and not on_cycle:
            stale.append(f"{importer} -> {imported}: breaks no rule and closes no cycle")
    assert stale == []


def test_the_rules_catch_what_they_forbid() -> None:
    """The rule check itself: each forbidden kind of edge is reported, the allowed kinds are not."""
    assert rule_broken("errors", "validation")
    assert rule_broken("errors", "providers.base")
    assert rule_broken("_info", "errors")
    assert rule_broken("validation", "providers.base")
    assert rule_broken("providers.redis", "service")
    assert rule_broken("providers.sql", "providers.redis")
    assert rule_broken("lease", "providers.sql")
    assert rule_broken("service", "task")
    assert rule_broken("task", "providers.redis")
    assert rule_broken("worker", "providers.memory")
    assert rule_broken("service", "contrib.django.store")
    assert rule_broken("providers.sql", "contrib.django.store")
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c"]]
    for importer, imported in [
        ("urls", "errors"),
        ("errors", "_info"),
        ("providers.base", "_info"),
        ("providers.sql", "providers._sql_common"),
        ("providers.postgres", "urls"),
        ("service", "providers"),
        ("service", "heartbeat"),
        ("task", "providers.base"),
        ("testing", "providers.memory"),
        ("contrib.django.store", "providers.sql"),
        (PACKAGE, "providers.memory"),
    ]:
        assert rule_broken(importer, imported) is None, (importer, imported)


#: Modules that mean the Celery integration or Celery's worker machinery got imported.
WORKER_MACHINERY = [
    "celery_exclusive.task",
    "celery_exclusive.worker",
    "celery_exclusive.settings",
    "celery_exclusive.observe",
    "celery_exclusive.redelivery",
    "celery_exclusive.keys",
    "celery.worker",
    "celery.app.trace",
    "celery.app.task",
    "celery.apps.worker",
    "celery.concurrency",
    "celery.bootsteps",
]

PROBE = textwrap.dedent(
    """
    import json, sys, weakref
    {statement}
    from celery import signals

    def receiver(ref):
        return ref() if isinstance(ref, weakref.ReferenceType) else ref

    receivers = sorted(
        f"{{name}}: {{fn.__module__}}.{{fn.__qualname__}}"
        for name, signal in vars(signals).items() if isinstance(signal, signals.Signal)
        for fn in (receiver(ref) for _, ref in signal.receivers)
        if str(getattr(fn, "__module__", "")).startswith("celery_exclusive")
    )
    print(json.dumps({{"modules": sorted(sys.modules), "receivers": receivers}}))
    """
)


def probe(statement: str) -> dict[str, list[str]]:
    """What running ``statement`` in a fresh interpreter loads, and the receivers it connects."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(statement=statement)], capture_output=True, text=True, check=True
    )
    value: dict[str, list[str]] = json.loads(result.stdout)
    return value


@pytest.mark.parametrize(
    "module",
    [
        "celery_exclusive",
        "celery_exclusive.service",
        "celery_exclusive.providers.memory",
        "celery_exclusive.cli",
        "celery_exclusive.diagnostics",
        "celery_exclusive.testing",
    ],
)
def test_the_lock_core_imports_no_worker_machinery_and_connects_no_receiver(module: str) -> None:
    """The lock core, the ``celery exclusive`` command and the test helpers (whose Celery
    names are served lazily) load without the Celery integration."""
    seen = probe(f"import {module}")
    loaded = [m for m in WORKER_MACHINERY if any(s == m or s.startswith(m + ".") for s in seen["modules"])]
    assert loaded == []
    assert seen["receivers"] == []


def test_an_exclusive_task_connects_the_worker_hooks() -> None:
    """Whatever imports ExclusiveTask (even lazily, through the package) connects every hook."""
    seen = probe("import celery_exclusive; celery_exclusive.exclusive_task")
    assert "celery_exclusive.worker" in seen["modules"]
    hooked = {line.split(":")[0] for line in seen["receivers"]}
    assert hooked == {
        "celeryd_after_setup",
        "worker_process_init",
        "worker_process_shutdown",
        "worker_shutdown",
        "task_revoked",
        "task_failure",
        # No task_prerun / task_postrun: once anyone listens, Celery sends both for every
        # task of the worker, plain ones too; the queued markers end in ExclusiveTask.__call__.
        "task_rejected",
        "task_unknown",
    }


def test_the_lazy_names_are_the_real_objects() -> None:
    import celery_exclusive
    from celery_exclusive import exclusive_task
    from celery_exclusive.settings import ExclusiveSettings
    from celery_exclusive.task import ExclusiveTask, is_skipped
    from celery_exclusive.worker import get_lock_service

    assert exclusive_task is sys.modules["celery_exclusive.task"].exclusive_task
    assert celery_exclusive.ExclusiveTask is ExclusiveTask
    assert celery_exclusive.is_skipped is is_skipped
    assert celery_exclusive.get_lock_service is get_lock_service
    assert celery_exclusive.ExclusiveSettings is ExclusiveSettings
    assert set(celery_exclusive.__all__) <= set(dir(celery_exclusive))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        celery_exclusive.nonexistent  # noqa: B018
    from celery_exclusive import testing

    assert testing.is_skipped is is_skipped
    assert testing.skip_marker is sys.modules["celery_exclusive.task"].skip_marker
    assert set(testing.__all__) <= set(dir(testing))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        testing.nonexistent  # noqa: B018
