"""HolderTemplate: a task's per-run holder JSON, encoded around its task id, is exactly what
holder_json makes of the same mapping (the stored text others read), in any process."""

from __future__ import annotations

import json
import os

import pytest

from celery_exclusive import _process
from celery_exclusive._process import EncodedHolder, HolderTemplate, holder_json
from celery_exclusive.errors import InvalidArgumentError


def generic(holder: dict[str, object]) -> str:
    """holder_json's general path, for the same mapping as a plain dict."""
    return holder_json(dict(holder))


@pytest.mark.parametrize(
    "task_id",
    ["0f3c2a8e-1111-2222-3333-444455556666", "", 'q"uo\\te\n\t', "é ü \U0001f600", "\ud800", "\x00x"],
)
def test_the_json_is_holder_jsons(task_id: str) -> None:
    fields = {
        "task_name": "app.tasks.sync",
        "worker": "celery@höst",
        "cooldown": 2.5,
        "hands_on_reruns": True,
    }
    holder = HolderTemplate(fields, "task_id").holder(task_id)
    assert type(holder) is EncodedHolder
    assert dict(holder) == {**fields, "task_id": task_id}
    assert holder_json(holder) == generic(holder)
    assert json.loads(holder_json(holder))["task_id"] == task_id


def test_values_it_cannot_fill_take_the_general_path() -> None:
    class Id(str):
        pass

    template = HolderTemplate({"task_name": "t"}, "task_id")
    for value in (None, 42, Id("abc")):
        holder = template.holder(value)
        assert type(holder) is dict
        assert holder_json(holder) == _process._encode(
            {**_process.this.meta, "task_name": "t", "task_id": value}
        )


def test_fields_that_contain_the_slot_text_take_the_general_path() -> None:
    holder = HolderTemplate({"task_name": _process._SLOT}, "task_id").holder("abc")
    assert type(holder) is dict
    assert holder_json(holder) == generic(holder)


def test_a_new_process_identity_reencodes(monkeypatch: pytest.MonkeyPatch) -> None:
    template = HolderTemplate({"task_name": "t"}, "task_id")
    before = holder_json(template.holder("a"))
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    _process.this.reset()  # what a forked child runs
    try:
        stale = EncodedHolder({"task_name": "t", "task_id": "a"})
        stale.json, stale.made_for = before, "an older process"
        assert holder_json(stale) == generic(stale)  # a holder encoded elsewhere is not trusted
        after = holder_json(template.holder("a"))
        assert '"pid":424242' in after
        assert after == generic({"task_name": "t", "task_id": "a"})
    finally:
        monkeypatch.undo()
        _process.this.reset()


def test_bad_fields_are_refused_when_the_template_is_made() -> None:
    with pytest.raises(InvalidArgumentError):
        HolderTemplate({1: "x"}, "task_id")  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "task_id", ["0f3c2a8e-1111-2222-3333-444455556666", 'q"uo\\te', "é \U0001f600", "\x00x"]
)
def test_text_is_the_json_holder_attaches(task_id: str) -> None:
    """text(): the stored JSON alone (the task layer's short path), the holder's own."""
    template = HolderTemplate({"task_name": "app.tasks.sync", "worker": "celery@höst"}, "task_id")
    assert template.text(task_id) == holder_json(template.holder(task_id))
    assert template.text(task_id) == generic(
        {"task_name": "app.tasks.sync", "worker": "celery@höst", "task_id": task_id}
    )


def test_text_is_none_where_the_holder_is_a_plain_dict() -> None:
    class Id(str):
        pass

    assert HolderTemplate({"task_name": "t"}, "task_id").text(Id("abc")) is None
    assert HolderTemplate({"task_name": "t"}, "task_id").text(None) is None
    assert HolderTemplate({"task_name": _process._SLOT}, "task_id").text("abc") is None


def test_text_reencodes_for_a_new_process_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    template = HolderTemplate({"task_name": "t"}, "task_id")
    assert '"pid":424242' not in (template.text("a") or "")
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    _process.this.reset()  # what a forked child runs
    try:
        assert template.text("a") == generic({"task_name": "t", "task_id": "a"})
        assert '"pid":424242' in (template.text("a") or "")
    finally:
        monkeypatch.undo()
        _process.this.reset()
