"""The docs' code examples run as written: the tutorial, README's quickstarts, every import;
and every package name and method their prose names exists.

The tutorial (docs/tutorial/first-task.md) runs in a fresh process in a temporary
directory: its ``tasks.py`` is written from the page and its ``pycon`` sessions are run by
doctest, their output compared with the page's (holder host and pid aside). README's lock
core example runs on a SQLite file, its Celery examples are declared and run eagerly.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from celery_exclusive import LockService

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path, language: str) -> list[str]:
    """The fenced ``language`` blocks of a page, in order."""
    text = path.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def block_after(path: Path, marker: str, language: str = "python") -> str:
    """The first ``language`` block after the line containing ``marker``."""
    text = path.read_text(encoding="utf-8")
    rest = text[text.index(marker) :]
    found = re.search(rf"^```{language}\n(.*?)^```", rest, re.S | re.M)
    assert found, f"no {language} block after {marker!r} in {path.name}"
    return found.group(1)


def run_block(code: str, namespace: dict[str, Any]) -> None:
    """Run a README block in ``namespace``: the page's own code, so exec is the point."""
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102


def imported_names(tree: ast.Module) -> list[tuple[str, str | None]]:
    names: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_exclusive"):
            names.extend((node.module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(
                (alias.name, None) for alias in node.names if alias.name.startswith("celery_exclusive")
            )
    return names


def test_every_python_block_parses_and_imports_what_exists() -> None:
    """Each ``python`` block of README and docs/ is Python, and each package name it imports exists.

    README's API summary (signatures with ``…``) is a sketch, not code, and is left out."""
    problems = []
    for page in PAGES:
        for code in blocks(page, "python"):
            if "…" in code:
                continue
            try:
                tree = ast.parse(code)
            except SyntaxError as exc:
                problems.append(f"{page.name}: {exc}")
                continue
            for module, name in imported_names(tree):
                imported = importlib.import_module(module)
                if name is not None and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        problems.append(f"{page.name}: {module} has no {name}")
    assert not problems


class HolderAgnostic(doctest.OutputChecker):
    """Compares output with the host and pid in holder metadata replaced (they are this run's)."""

    HOLDER = re.compile(r"'host': '[^']*', 'pid': \d+")

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        same = self.HOLDER.sub("'host': H, 'pid': P", want), self.HOLDER.sub("'host': H, 'pid': P", got)
        return super().check_output(*same, optionflags)


RUN_TUTORIAL = textwrap.dedent(
    """
    import doctest, sys
    sys.path.insert(0, ".")
    from tests.test_docs_examples import HolderAgnostic
    sessions = [open(name, encoding="utf-8").read() for name in sys.argv[1:]]
    runner = doctest.DocTestRunner(checker=HolderAgnostic(), optionflags=doctest.ELLIPSIS)
    globs = {}
    for number, session in enumerate(sessions):
        test = doctest.DocTestParser().get_doctest(session, globs, f"session {number + 1}", None, 0)
        runner.run(test, clear_globs=False)
        globs.update(test.globs)  # DocTest copies its globals: the next session sees this one's names
    sys.exit(1 if runner.summarize(verbose=False).failed else 0)
    """
)


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    """docs/tutorial/first-task.md: its tasks.py and both Python sessions give the page's output."""
    page = ROOT / "docs" / "tutorial" / "first-task.md"
    (tmp_path / "tasks.py").write_text(block_after(page, "Create `tasks.py`"), encoding="utf-8")
    sessions = blocks(page, "pycon")
    assert len(sessions) == 2
    names = []
    for number, session in enumerate(sessions):
        name = tmp_path / f"session{number}.txt"
        name.write_text(session, encoding="utf-8")
        names.append(str(name))
    (tmp_path / "run.py").write_text(RUN_TUTORIAL, encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "run.py", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "locks.sqlite3").exists()  # the page's store, where the page puts it


def test_the_readme_lock_core_example_runs(tmp_path: Path) -> None:
    """README's "Without Celery" block runs on a store URL of its own: a result, a fence, released."""
    code = block_after(ROOT / "README.md", "Without Celery:")
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    assert '"postgresql://app@localhost/app"' in code
    code = code.replace('"postgresql://app@localhost/app"', repr(url))
    fences: list[int] = []

    def rebuild_rollups(fence: int) -> None:
        fences.append(fence)

    namespace: dict[str, Any] = {"walk_open_prs": lambda n: n + 1, "rebuild_rollups": rebuild_rollups}
    run_block(code, namespace)
    assert namespace["count"] == 43
    assert fences
    assert fences[0] >= 1
    namespace["locks"].close()
    checker = LockService(url)
    try:
        assert checker.peek("rollup") is None
        assert checker.peek("community-pr:42") is None
    finally:
        checker.close()


def test_the_readme_celery_examples_declare_and_run(tmp_path: Path) -> None:
    """README's quickstart and "The Celery API" blocks declare real tasks, which run and lock."""
    from celery_exclusive import ExclusiveTask, is_skipped

    readme = ROOT / "README.md"
    quickstart = block_after(readme, "## Quickstart")
    assert 'broker="redis://localhost:6379/0"' in quickstart
    quickstart = quickstart.replace('broker="redis://localhost:6379/0"', 'broker="memory://"')
    quickstart = quickstart.replace(
        '"postgresql://app@localhost/app"', repr(f"sqlite:///{tmp_path / 'q.db'}")
    )
    namespace: dict[str, Any] = {}
    run_block(quickstart, namespace)
    app, process_work = namespace["app"], namespace["process_work"]
    assert isinstance(process_work, ExclusiveTask)
    assert process_work.apply(args=(42,)).get() == 7
    locks = LockService(app.conf.exclusive_url)
    try:
        with locks.lock("community-pr:42"):
            assert is_skipped(process_work.apply(kwargs={"work_id": 42}).get())
    finally:
        locks.close()

    api = block_after(readme, "## The Celery API")
    written: list[int] = []

    def write_rows(fence: int) -> None:
        written.append(fence)

    namespace.update(ExclusiveTask=ExclusiveTask, write_rows=write_rows)
    run_block(api, namespace)
    import_tenant, rollup = namespace["import_tenant"], namespace["rollup"]
    assert (import_tenant.lock_key, import_tenant.lock_on_locked, import_tenant.lock_ttl) == (
        "import:{tenant}",
        "retry",
        300,
    )
    assert (rollup.lock_key, rollup.lock_on_locked) == ("rollup:{day}", "skip")
    assert import_tenant.apply(args=("acme",)).get() is None
    assert written
    assert written[0] >= 1
    assert rollup.apply(args=("2026-12-05",)).get() is None


def test_the_index_shows_the_readme_quickstart() -> None:
    """docs/index.md shows README's quickstart (without its ``return``), not a drifted copy."""
    comment = "   # or redis://…, sqlite:///locks.db"
    readme = block_after(ROOT / "README.md", "## Quickstart").replace(comment, "")
    assert block_after(ROOT / "docs" / "index.md", "```python") in readme


def test_the_beat_guides_start_up_job_runs_once_for_workers_starting_one_after_another(
    tmp_path: Path,
) -> None:
    """docs/how-to/beat.md's "once per cluster" job, its receiver called as two workers'
    ``worker_ready`` would call it, the second after the first's job has ended: the job
    runs once. (The page used to show a bare ``run_exclusive``, which ran it again.)"""
    from types import SimpleNamespace

    from celery import Celery
    from celery.signals import worker_ready

    from celery_exclusive import get_lock_service

    code = block_after(ROOT / "docs/how-to/beat.md", "## Once per cluster at start-up")
    runs: list[int] = []
    namespace: dict[str, Any] = {"warm": lambda: runs.append(1)}
    run_block(code, namespace)
    apps = [Celery(f"beat_guide_{n}", broker="memory://", set_as_current=False) for n in (1, 2)]
    try:
        for app in apps:
            app.conf.exclusive_url = f"sqlite:///{tmp_path / 'locks.db'}"
            namespace["warm_caches"](sender=SimpleNamespace(app=app))
    finally:
        worker_ready.disconnect(namespace["warm_caches"])
        for app in apps:
            get_lock_service(app).close()
    assert runs == [1]


#: Dotted names in the docs that are not code: the OpenTelemetry span attributes.
NOT_CODE = ("celery_exclusive.lock.",)


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package, or an attribute of one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_package_name_in_the_prose_exists() -> None:
    """Each ``celery_exclusive.<module>[.<name>]`` in a code span of README and docs/ is a
    module or an attribute of one: a renamed or removed name leaves no reference behind."""
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for dotted in sorted(set(re.findall(r"`(celery_exclusive(?:\.\w+)+)", text))):
            if not dotted.startswith(NOT_CODE) and not resolves(dotted):
                problems.append(f"{page.relative_to(ROOT)}: {dotted}")
    assert not problems


def test_every_method_and_attribute_named_in_the_prose_exists() -> None:
    """``LockService.x``, ``service.x``, ``lease.x``, ``self.lock.x``, ``self.locks.x``,
    ``task.x`` and ``exclusive_store.x`` in the code spans of README and docs/ name real
    attributes (a file name such as ``lease.py`` aside)."""
    from celery_exclusive import ExclusiveTask, Lease, LeaseSet
    from celery_exclusive.testing import ExclusiveStore

    owners: dict[str, type] = {
        "LockService": LockService,
        "service": LockService,
        "Lease": Lease,
        "lease": Lease,
        "self.lock": Lease,
        "self.locks": LeaseSet,
        "task": ExclusiveTask,
        "exclusive_store": ExclusiveStore,
    }
    owner_names = "|".join(name.replace(".", r"\.") for name in owners)
    pattern = re.compile(rf"(?<![\w.])({owner_names})\.(\w+)")
    problems = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page.read_text(encoding="utf-8")):
            for owner, name in pattern.findall(span):
                if name not in ("py", "md") and not hasattr(owners[owner], name):
                    problems.append(f"{page.relative_to(ROOT)}: {owner}.{name}")
    assert not problems
