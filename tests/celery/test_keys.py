"""Lock keys of tasks: templates and callables over bound arguments, checked at declaration."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.keys import KeyBuilder, template_fields
from celery_exclusive.task import ExclusiveTask, exclusive_task


@pytest.fixture
def app() -> Celery:
    """A throwaway app (never connected)."""
    return Celery("ce_keys", set_as_current=False, broker="memory://")


def test_positional_and_keyword_calls_give_the_same_key(app: Celery) -> None:
    """t(1) and t(work_id=1) bind to the same arguments, defaults applied, so to the same key."""

    @exclusive_task(app=app, key="pr:{work_id}:{mode}")
    def sync_1(work_id: int, mode: str = "full") -> None: ...

    assert sync_1.lock_key_for((1,), {}) == "pr:1:full"
    assert sync_1.lock_key_for((), {"work_id": 1}) == "pr:1:full"
    assert sync_1.lock_key_for((1, "full"), {}) == "pr:1:full"
    assert sync_1.lock_key_for((1,), {"mode": "quick"}) == "pr:1:quick"


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), ((1,), {}), ((1, 2, 3), {}), ((1,), {"a": 1}), ((1,), {"c": 2}), ((), {"a": 1, "c": 2})],
)
def test_plain_signatures_refuse_what_bind_refuses(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A plain signature binds without Signature.bind, accepting exactly the calls it accepts:
    missing, extra, repeated or unknown arguments are refused as before."""

    def run(a: int, b: int) -> None: ...

    builder = KeyBuilder.for_function("k:{a}:{b}:{task_name}", run, bound=False)
    assert builder.build("t", (1, 2), {}) == builder.build("t", (1,), {"b": 2}) == "k:1:2:t"
    assert builder.build("t", (), {"b": 2, "a": 1}) == "k:1:2:t"
    with pytest.raises(InvalidArgumentError, match="do not match its signature"):
        builder.build("t", args, kwargs)


def test_template_naming_a_missing_parameter_is_rejected_at_decoration(app: Celery) -> None:
    """A template field that is not a parameter raises InvalidArgumentError when the decorator runs."""
    with pytest.raises(InvalidArgumentError, match=r"\{workid\}.*no parameter 'workid'"):

        @exclusive_task(app=app, key="pr:{workid}")
        def sync_2(work_id: int) -> None: ...


def test_app_task_base_form_rejects_a_bad_template_when_the_class_is_made(app: Celery) -> None:
    """@app.task(base=ExclusiveTask, lock_key=...) checks the template when Celery builds the class."""
    app.finalize()
    with pytest.raises(InvalidArgumentError, match="no parameter 'nope'"):

        @app.task(base=ExclusiveTask, lock_key="k:{nope}", shared=False)
        def sync_3(work_id: int) -> None: ...


def test_bound_task_self_is_not_a_parameter(app: Celery) -> None:
    """With bind=True the first parameter (self) is not usable in a key."""

    @exclusive_task(app=app, key="k:{work_id}", bind=True)
    def sync_4(self: Any, work_id: int) -> None: ...

    assert sync_4.lock_key_for((5,), {}) == "k:5"
    with pytest.raises(InvalidArgumentError, match="no parameter 'self'"):

        @exclusive_task(app=app, key="k:{self}", bind=True)
        def other_1(self: Any, work_id: int) -> None: ...


def test_positional_fields_are_rejected() -> None:
    """{} and {0} would depend on how callers pass arguments, so templates must name parameters."""
    with pytest.raises(InvalidArgumentError, match="positional field"):
        template_fields("k:{}")
    with pytest.raises(InvalidArgumentError, match="positional field"):
        template_fields("k:{0}")


def test_task_name_field_and_default_key(app: Celery) -> None:
    """{task_name} is the task's name; no key at all means one global lock named after the task."""

    @exclusive_task(app=app, key="{task_name}:{x}", name="proj.sync")
    def sync_5(x: int) -> None: ...

    @exclusive_task(app=app, name="proj.rollup")
    def rollup_1(x: int) -> None: ...

    assert sync_5.lock_key_for((3,)) == "proj.sync:3"
    assert rollup_1.lock_key_for((3,)) == "proj.rollup"
    assert rollup_1.lock_key_for((4,)) == "proj.rollup"


def test_callable_key_receives_the_bound_arguments(app: Celery) -> None:
    """A key callable gets the task's arguments, defaults applied, however they were passed."""
    calls: list[tuple[Any, ...]] = []

    def key(work_id: int, mode: str = "full") -> str:
        calls.append((work_id, mode))
        return f"pr:{work_id}"

    @exclusive_task(app=app, key=key)
    def sync_6(work_id: int, mode: str = "full") -> None: ...

    assert sync_6.lock_key_for((), {"work_id": 9}) == "pr:9"
    assert calls == [(9, "full")]


def test_attribute_lookup_and_format_spec() -> None:
    """Templates may use attribute/index lookups and format specs."""

    class Pr:
        id = 12

    def run(pr: Any, ids: list[int], n: int) -> None: ...

    builder = KeyBuilder.for_function("{pr.id}:{ids[0]}:{n:04d}", run, bound=False)
    assert builder.build("t", (Pr(), [7], 5), {}) == "12:7:0005"


def test_unformattable_value_fails_with_a_clear_error() -> None:
    """A value the template cannot format raises InvalidArgumentError naming the task and template."""

    def run(n: Any) -> None: ...

    builder = KeyBuilder.for_function("k:{n:d}", run, bound=False)
    with pytest.raises(InvalidArgumentError, match=r"lock key of proj\.t from template 'k:\{n:d\}'"):
        builder.build("proj.t", ("seven",), {})


def test_object_without_stable_text_is_refused() -> None:
    """An object that would format as its memory address is refused (no per-call keys)."""

    def run(thing: Any) -> None: ...

    builder = KeyBuilder.for_function("k:{thing}", run, bound=False)
    with pytest.raises(InvalidArgumentError, match="memory address"):
        builder.build("t", (object(),), {})


def test_var_keyword_tasks_accept_any_name_and_fail_clearly_when_missing() -> None:
    """With **kwargs any name is accepted at declaration; a missing one fails at call time."""

    def run(**kwargs: Any) -> None: ...

    builder = KeyBuilder.for_function("k:{tenant}", run, bound=False)
    assert builder.build("t", (), {"tenant": "acme"}) == "k:acme"
    with pytest.raises(InvalidArgumentError, match="no argument named 'tenant'"):
        builder.build("t", (), {})


def test_the_var_keyword_parameter_itself_is_its_arguments() -> None:
    """``{kwargs}`` on ``run(**kwargs)`` is every keyword argument, items sorted, as
    ``{args}`` on ``run(*args)`` is the positional ones: it was accepted when declared and
    then failed every call ("no argument named 'kwargs' was passed"). A keyword argument
    passed under that very name still wins."""

    def run(*args: Any, **kwargs: Any) -> None: ...

    builder = KeyBuilder.for_function("k:{args}:{kwargs}", run, bound=False)
    assert builder.build("t", (1,), {"b": 2, "a": "x"}) == "k:(1,):{'a': 'x', 'b': 2}"
    assert builder.build("t", (), {}) == "k:():{}"
    assert builder.build("t", (), {"kwargs": 5}) == "k:():5"


def test_bad_option_is_rejected_at_decoration(app: Celery) -> None:
    """An unknown on_locked policy is rejected when the decorator runs."""
    with pytest.raises(InvalidArgumentError, match="on_locked must be one of"):

        @exclusive_task(app=app, on_locked="block")
        def sync_7() -> None: ...


def test_class_based_task_template_binds_without_self(app: Celery) -> None:
    """A class-based ExclusiveTask's run(self, ...) is bound: its template names run's own parameters."""

    class Import(ExclusiveTask):  # type: ignore[misc]
        name = "ce_keys.import"
        lock_key = "import:{tenant}"

        def run(self, tenant: str) -> None: ...

    task = app.register_task(Import())
    assert task.lock_key_for(("acme",)) == "import:acme"
    with pytest.raises(InvalidArgumentError, match="no parameter 'self'"):

        class Broken(ExclusiveTask):  # type: ignore[misc]
            lock_key = "import:{self}"

            def run(self, tenant: str) -> None: ...


class _Unstable:
    """An object whose text is its memory address: refused as a key field."""


def _both(spec: str, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[object, object]:
    """What ``build`` gives (a key, or the error text) through its plain-template path and
    through the full path (``Signature.bind`` + the strict formatter)."""
    quick, full = (
        KeyBuilder.for_function(spec, fun, bound=False),
        KeyBuilder.for_function(spec, fun, bound=False),
    )
    assert quick._plain is not None, "the plain path must apply to this template"
    full._plain = None
    outcomes = []
    for builder in (quick, full):
        try:
            outcomes.append(builder.build("t.name", args, kwargs))
        except InvalidArgumentError as exc:
            outcomes.append(f"InvalidArgumentError: {exc}")
    return outcomes[0], outcomes[1]


def _body(work_id: Any, mode: Any = "full", task_name: Any = "own") -> None: ...


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        ((), {"work_id": "x y"}),
        ((1.5, "quick"), {}),
        ((True,), {"mode": False}),
        ((10**30,), {"task_name": "mine"}),
        (({"b": 2, "a": 1},), {}),  # a dict: the strict formatter's canonical text
        (([3, 1],), {"mode": frozenset({2, 1})}),
        ((_Unstable(),), {}),  # refused, with the same message
        ((), {}),  # a missing argument
        ((1,), {"nope": 2}),  # an unknown keyword
        ((1,), {"work_id": 2}),  # given twice
        ((1, 2, 3, 4), {}),  # too many
    ],
)
def test_the_plain_template_path_gives_what_the_full_path_gives(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A template of plain ``{name}`` fields skips Signature.bind and string.Formatter per call:
    its key, or its refusal, is the full path's for every kind of call and value."""
    quick, full = _both("k:{work_id}:{mode}:{task_name}", _body, args, kwargs)
    assert quick == full


def test_templates_and_signatures_the_plain_path_does_not_take() -> None:
    """Conversions, format specs, attribute lookups, ``*args``/``**kwargs`` take the full path."""

    def varargs(*values: Any, **more: Any) -> None: ...

    for spec, fun in (("k:{work_id!r}", _body), ("k:{work_id:>4}", _body), ("k:{work_id.real}", _body)):
        assert KeyBuilder.for_function(spec, fun, bound=False)._plain is None
    assert KeyBuilder.for_function("k:{a}", varargs, bound=False)._plain is None
