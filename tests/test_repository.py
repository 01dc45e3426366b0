"""Repository habits: the pre-commit hooks check a commit exactly as scripts/test checks CI."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def script_commands() -> list[list[str]]:
    """The ruff and mypy command lines of scripts/test, continuation lines joined."""
    text = (ROOT / "scripts" / "test").read_text(encoding="utf-8").replace("\\\n", " ")
    return [
        shlex.split(line)
        for line in text.splitlines()
        if line.startswith((".venv/bin/ruff", ".venv/bin/mypy"))
    ]


def hook_commands() -> list[list[str]]:
    """What each local pre-commit hook runs, as scripts/test would spell it."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    commands = []
    for repo in config["repos"]:
        assert repo["repo"] == "local", "hooks use the project's own .venv tools"
        for hook in repo["hooks"]:
            assert hook["language"] == "system"
            words = [w for w in shlex.split(hook["entry"]) if w != "--force-exclude"]
            # A hook given the changed files checks what `ruff ... .` would check of them.
            commands.append(words + (["."] if hook.get("pass_filenames", True) else []))
    return commands


def test_pre_commit_runs_the_linters_of_scripts_test() -> None:
    assert len(script_commands()) == 4  # ruff check, ruff format --check, mypy twice
    assert hook_commands() == script_commands()
