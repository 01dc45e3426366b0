"""``celery-exclusive list --done`` and ``forget`` on every lock store (issue #10)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

from celery_exclusive.cli import cli
from celery_exclusive.providers.base import Completion
from tests.conftest import Store


def invoke(store: Store, *args: str) -> Result:
    """The standalone CLI in-process on ``store``'s URL and prefix."""
    prefix = store.service().prefix
    return CliRunner().invoke(
        cli,
        ["--url", store.url, "--prefix", prefix, *args],
        env={"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None},
    )


def test_list_done_and_forget(store: Store) -> None:
    """Records written by releases are listed (text and JSON) and forgotten one task id at a time."""
    if store.name == "memory":
        pytest.skip("the CLI process would open a memory store of its own")
    service = store.service()
    for key, task_id in (("sync:1", "aaa"), ("sync:2", "bbb"), ("other", "aaa")):
        service.lock(key, task_id=task_id).release(Completion(task_id, "success", 0, 600.0))
    listed = invoke(store, "list", "--done")
    assert listed.exit_code == 0, listed.output
    assert listed.output.splitlines()[0].split() == [
        "KEY",
        "TASK",
        "ID",
        "OUTCOME",
        "ATTEMPT",
        "AGE",
        "EXPIRES",
        "IN",
    ]
    assert [line.split()[:3] for line in listed.output.splitlines()[1:]] == [
        ["other", "aaa", "success"],
        ["sync:1", "aaa", "success"],
        ["sync:2", "bbb", "success"],
    ]
    as_json = json.loads(invoke(store, "list", "--done", "--json", "sync:").output)
    assert [(r["key"], r["task_id"], r["attempt"]) for r in as_json["done"]] == [
        ("sync:1", "aaa", 0),
        ("sync:2", "bbb", 0),
    ]
    assert 500 < as_json["done"][0]["expires_in"] <= 600
    assert invoke(store, "list").output.startswith("no live leases")  # records are not leases
    one = invoke(store, "forget", "aaa", "--key", "other")
    assert one.exit_code == 0, one.output
    assert service.completion("other", "aaa") is None
    assert service.completion("sync:1", "aaa") is not None
    every = invoke(store, "forget", "aaa")
    assert every.exit_code == 0
    assert "'sync:1'" in every.output
    assert [r.task_id for r in service.completions()] == ["bbb"]
    none = invoke(store, "forget", "aaa")
    assert none.exit_code == 1
    assert "nothing forgotten" in none.output
    assert invoke(store, "list", "--done", "zzz").output.startswith("no completion records")


@pytest.mark.parametrize("task_id", ["", "a\x00b", "x" * 201])
def test_forget_rejects_a_task_id_no_record_can_have_before_touching_the_store(task_id: str) -> None:
    """An empty, NUL-bearing or too long TASK_ID is an input error (exit 2), with or without
    --key, and the store is not asked: the URL below refuses connections. On main, without
    --key, it listed every record and answered "nothing forgotten" (exit 1), and an
    unreachable store made it exit 3."""
    for extra in ([], ["--key", "k"]):
        result = CliRunner().invoke(
            cli,
            ["--url", "redis://127.0.0.1:1/0", "forget", task_id, *extra],
            env={"CELERY_EXCLUSIVE_URL": None, "CELERY_EXCLUSIVE_PREFIX": None},
        )
        assert result.exit_code == 2, (extra, result.output)
        assert "task_id" in result.stderr
