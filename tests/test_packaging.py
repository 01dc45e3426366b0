"""Release packaging: the sdist and wheel that ``python -m build`` makes, checked by twine.

Built once per session (without build isolation, from the dev extra's setuptools, so no
download): the wheel holds the package with its data files and no tests; the sdist holds
every tracked file, so its test suite runs as it stands; the metadata has one version,
the licence file, the project URLs and a classifier per supported Python.
"""

from __future__ import annotations

import email.parser
import email.policy
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

import celery_exclusive

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = ["3.10", "3.11", "3.12", "3.13"]


@dataclass
class Dists:
    sdist: Path
    wheel: Path

    def wheel_names(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as wheel:
            return wheel.namelist()

    def sdist_names(self) -> list[str]:
        with tarfile.open(self.sdist) as sdist:
            root = sdist.getnames()[0].split("/")[0]
            return [n[len(root) + 1 :] for n in sdist.getnames() if n != root]

    def metadata(self) -> Message:
        with zipfile.ZipFile(self.wheel) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            text = wheel.read(name).decode()
        return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def source_copy(into: Path) -> Path:
    """A clean copy of the source tree: setuptools would add the files listed by a stale
    ``*.egg-info/SOURCES.txt`` to the sdist, hiding a file that MANIFEST.in misses."""
    skip = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__", "*_cache", "build", "dist")
    shutil.copytree(ROOT, into, ignore=skip)
    return into


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist, and the wheel built from it, of a clean copy of this source tree."""
    out = tmp_path_factory.mktemp("dist")
    source = source_copy(tmp_path_factory.mktemp("source") / "tree")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, f"python -m build failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dists(sdist, wheel)


def tracked_files() -> list[str]:
    """The files git tracks in this tree (skips when this is not a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an unpacked sdist, say): nothing to compare with")
    return [name for name in listed.stdout.split("\0") if name and (ROOT / name).exists()]


def test_twine_check_passes_for_both_distributions(dists: Dists) -> None:
    """The metadata and the README rendering are what PyPI accepts."""
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_wheel_holds_the_package_with_its_data_and_no_tests(dists: Dists) -> None:
    """Every tracked file of the package (py.typed, any .lua/.sql/migration) is in the
    wheel; nothing of tests/ or the other top-level folders is."""
    names = set(dists.wheel_names())
    assert "celery_exclusive/py.typed" in names
    assert "celery_exclusive/testing/plugin.py" in names
    assert "celery_exclusive/providers/redis_scripts/prelude.lua" in names  # Redis loads them at import
    top_levels = {name.split("/")[0] for name in names}
    assert top_levels == {"celery_exclusive", f"celery_exclusive-{celery_exclusive.__version__}.dist-info"}
    package_files = [n for n in tracked_files() if n.startswith("celery_exclusive/")]
    assert package_files
    assert sorted(set(package_files) - names) == []
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".sqlite3"))]


def test_the_sdist_carries_every_tracked_file_so_its_test_suite_runs(dists: Dists) -> None:
    """The sdist is the whole source tree: tests with their conftest.py files, and what the
    tests read (scripts, benchmarks, the example worker, docs, compose file)."""
    names = set(dists.sdist_names())
    assert {"tests/conftest.py", "tests/celery/conftest.py", "LICENSE", "pyproject.toml"} <= names
    assert sorted(set(tracked_files()) - names) == []
    assert not [n for n in names if "__pycache__" in n or n.startswith((".venv/", ".git/"))]


def test_the_metadata_has_one_version_the_license_urls_and_classifiers(dists: Dists) -> None:
    """One version source (``__version__``), MIT with its file, project URLs, and a
    classifier for each supported Python, agreeing with requires-python."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project
    assert project["dynamic"] == ["version"]
    meta = dists.metadata()
    assert meta["Version"] == celery_exclusive.__version__
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    dist_info = f"celery_exclusive-{celery_exclusive.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in dists.wheel_names()
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    urls = dict(url.split(", ", 1) for url in meta.get_all("Project-URL") or [])
    assert set(urls) >= {"Homepage", "Source", "Documentation", "Issues", "Changelog"}
    assert all(u.startswith("https://github.com/celery-exclusive/celery-exclusive") for u in urls.values())
    classifiers = meta.get_all("Classifier") or []
    minor = re.compile(r"Programming Language :: Python :: (3\.\d+)")
    versions = [m.group(1) for m in map(minor.fullmatch, classifiers) if m]
    assert versions == SUPPORTED
    assert meta["Requires-Python"] == f">={SUPPORTED[0]}"


def test_the_entry_points_are_packaged(dists: Dists) -> None:
    """The CLI, the celery sub-command and the pytest plugin are declared in the wheel."""
    with zipfile.ZipFile(dists.wheel) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
        text = wheel.read(name).decode()
    assert "celery-exclusive = celery_exclusive.cli:main" in text
    assert "[pytest11]\ncelery_exclusive = celery_exclusive.testing.plugin" in text


def test_the_changelog_links_the_release_on_the_project_repository() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "example.invalid" not in changelog
    assert (
        f"[{celery_exclusive.__version__}]: https://github.com/celery-exclusive/celery-exclusive/"
        in changelog
    )
