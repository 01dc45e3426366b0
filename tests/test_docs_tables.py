"""The docs' tables name what the code has: every module, setting, task option and CLI flag.

Each test reads a table or list from README.md, CONTRIBUTING.md or docs/ and compares it
with the code in both directions, so a new module, setting or flag without its line (or a
line left behind by a removed one) fails here rather than misleading a reader.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import click
import pytest

from celery_exclusive import LockService, signals
from celery_exclusive._leasing import DEFAULT_SWEEP_INTERVAL
from celery_exclusive.cli import cli, exclusive
from celery_exclusive.service import DEFAULT_TTL
from celery_exclusive.settings import (
    ON_LOCKED_POLICIES,
    ON_LOST_POLICIES,
    OPTIONS,
    TASK_OPTIONS,
    ExclusiveSettings,
)
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import STARTUP_CHECK_ENV, STARTUP_CHECK_SETTING, startup_check_mode
from tests.test_layering import CORE

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "celery_exclusive"


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level or above."""
    start = text.index(heading + "\n") + len(heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    end = re.search(rf"^#{{1,{level}}} ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``text``, header and rule left out."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if not row[0].startswith(("setting", "app.conf", "module"))]


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_module_has_a_line_in_the_architecture_map() -> None:
    """docs/architecture.md's module map names every module of the package, and nothing else."""
    rows = table_rows(section(read("docs/architecture.md"), "## Module map"))
    mapped = {path for row in rows for path in code_spans(row[0])}
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    folders = {path for path in mapped if path.endswith("/")}
    unmapped = {m for m in modules if m not in mapped and not any(m.startswith(f) for f in folders)}
    assert not unmapped, f"modules without a line in docs/architecture.md: {sorted(unmapped)}"
    stale = {path for path in mapped if not list(PACKAGE.glob(path.rstrip("/")))}
    assert not stale, f"lines for modules that do not exist: {sorted(stale)}"


def test_the_documented_lock_core_is_the_layering_tests() -> None:
    """The lock core's modules in docs/architecture.md's layering rule are test_layering's CORE."""
    rule = read("docs/architecture.md").split("3. **Lock core**", 1)[1].split("4. **", 1)[0]
    listed = set(code_spans(rule.split(") imports", 1)[0]))
    assert listed == CORE


#: The default column of docs/celery.md's configuration table, read as a value: the cell's
#: first word (a code span, "N s", "N h", a number, "none"). Defaults derived from other
#: settings are compared with their own words below.
DERIVED = {
    "refresh_interval": "ttl / 3",
    "done_retention": "Celery's `result_expires`",
    "dedupe_ttl": "1 h after",
}


def documented_default(cell: str) -> object:
    first = re.split(r"[;(]| between", cell, maxsplit=1)[0].strip()
    if first.startswith("`"):
        value = first.strip("`")
        return {"False": False, "True": True}.get(value, value)
    if first in ("none", "none (required)"):
        return None
    number, _, unit = first.partition(" ")
    scale = {"": 1, "s": 1, "h": 3600}[unit]
    return int(number) * scale if unit == "" else float(number) * scale


def test_the_configuration_table_has_every_setting_with_its_names_and_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/celery.md's table: one row per setting, its conf, env and task names, its real default."""
    rows = table_rows(section(read("docs/celery.md"), "## Configuration"))
    documented = {row[0].strip("`"): row for row in rows}
    expected = {option.conf_name: option for option in OPTIONS}
    assert set(documented) == {*expected, STARTUP_CHECK_SETTING}
    defaults = ExclusiveSettings()
    for conf_name, option in expected.items():
        _, env, per_task, default = documented[conf_name]
        assert code_spans(env)[0] == option.env, conf_name
        assert next(iter(code_spans(per_task)), None) == option.keyword, conf_name
        if option.field in DERIVED:
            assert default.startswith(DERIVED[option.field]), conf_name
            continue
        value = DEFAULT_TTL if option.field == "ttl" else getattr(defaults, option.field)
        assert documented_default(default) == value, (
            f"{conf_name}: {default!r} documented, {value!r} in the code"
        )
    monkeypatch.delenv(STARTUP_CHECK_ENV, raising=False)
    _, env, _, default = documented[STARTUP_CHECK_SETTING]
    assert code_spans(env)[0] == STARTUP_CHECK_ENV
    assert documented_default(default) == startup_check_mode({})


def test_the_readme_configuration_rows_are_the_full_tables() -> None:
    """README's configuration table is a subset of docs/celery.md's, with the same names."""
    full = {row[0]: row[1:3] for row in table_rows(section(read("docs/celery.md"), "## Configuration"))}
    short = table_rows(section(read("README.md"), "## Configuration"))
    assert short
    for row in short:
        assert row[0] in full, row[0]
        assert code_spans(row[1]) == code_spans(full[row[0]][0]), row[0]
        assert row[2] == full[row[0]][1], row[0]


def test_every_decorator_keyword_and_task_attribute_is_documented() -> None:
    """docs/celery.md's paragraph on ``exclusive_task`` names every keyword and ``lock_*`` attribute."""
    text = read("docs/celery.md")
    paragraph = text[text.index("`exclusive_task(key=...") :].split("\n\n", 1)[0]
    keywords = [
        name for name in inspect.signature(exclusive_task).parameters if name not in ("fun", "options")
    ]
    missing = [name for name in keywords if f"{name}=" not in paragraph]
    assert not missing, f"exclusive_task keywords not in docs/celery.md: {missing}"
    attributes = ["lock_key", *TASK_OPTIONS.values()]
    missing = [name for name in attributes if f"`{name}`" not in paragraph]
    assert not missing, f"task attributes not in docs/celery.md: {missing}"


def commands() -> dict[str, click.Command]:
    assert set(cli.commands) == set(exclusive.commands)  # the two front ends, one set of commands
    return dict(cli.commands)


def test_every_cli_command_and_flag_is_in_docs_cli() -> None:
    """Each sub-command has its heading in docs/cli.md naming its arguments and every flag."""
    text = read("docs/cli.md")
    headings = {h.split()[0]: h for h in re.findall(r"^### `([^`]+)`", text, re.M)}
    assert set(headings) == set(commands())
    for name, command in commands().items():
        flags = {opt for param in command.params if isinstance(param, click.Option) for opt in param.opts}
        flags.discard("--help")
        for flag in flags:
            if flag.startswith("--"):
                assert flag in headings[name], f"{name} {flag} missing from its docs/cli.md heading"
        body = section(text, f"### `{headings[name]}`")
        for param in command.params:
            if isinstance(param, click.Option) and type(param.default) is int:  # sweep --limit
                assert f"`{param.opts[0]}` ({param.default})" in body, f"{name} {param.opts[0]}'s default"
    global_flags = {opt for param in cli.params for opt in param.opts if opt.startswith("--")}
    table = section(text, "## Global options")
    assert {
        flag for row in table_rows(table) for flag in re.findall(r"--[a-z-]+", row[0])
    } == global_flags | {"--help"}


def test_the_readme_lists_every_cli_command() -> None:
    """README's CLI block shows each sub-command at least once."""
    block = section(read("README.md"), "## CLI")
    shown = set(re.findall(r"exclusive (?:--url \S+ )?([a-z]+)", block))
    assert shown == set(commands())


#: LockService keywords README's API sketch leaves to its prose (test knobs).
UNSKETCHED = {"clock", "thread_factory"}


#: What README's sketch writes as ``…`` in a call (its prose says so, naming these four).
ELIDED = {"ttl", "refresh_interval", "max_lifetime", "holder"}


def sketched_calls(block: str) -> dict[str, ast.Call]:
    """README's API sketch as calls: ``LockService(...)`` and each ``service.<method>(...)``;
    a ``…`` in a call stands for :data:`ELIDED`, added as keywords without a value."""
    calls: dict[str, ast.Call] = {}
    text = block.replace("*, ", "").replace("[k1, k2, …]", "keys")
    for found in re.finditer(r"^(LockService|service\.\w+)\((.*?)\)(?= *(?:->|#|$))", text, re.M | re.S):
        arguments = " ".join(found.group(2).split())
        elided = "…, " in arguments
        call = ast.parse(f"f({arguments.replace('…, ', '')})", mode="eval").body
        assert isinstance(call, ast.Call)
        if elided:
            call.keywords += [ast.keyword(arg=name, value=ast.Constant(...)) for name in sorted(ELIDED)]
        calls[found.group(1).removeprefix("service.")] = call
    return calls


def test_the_readme_api_sketch_names_real_parameters_with_their_defaults() -> None:
    """README's lock core API: every parameter it shows exists, with the default shown; and
    ``LockService`` shows all of its own but the test knobs."""
    block = section(read("README.md"), "## The lock core API").split("```python\n", 1)[1].split("```", 1)[0]
    calls = sketched_calls(block)
    assert {"LockService", "run_exclusive", "lock", "try_lock", "lock_many", "peek", "close"} <= set(calls)
    for name, call in calls.items():
        target = LockService.__init__ if name == "LockService" else getattr(LockService, name)
        parameters = inspect.signature(target).parameters
        for argument in call.args:
            assert isinstance(argument, ast.Name), (name, ast.dump(argument))
            assert argument.id in parameters, f"{name}({argument.id}): no such parameter"
        for keyword in call.keywords:
            assert keyword.arg in parameters, f"{name}({keyword.arg}=): no such parameter"
            if isinstance(keyword.value, ast.Constant) and keyword.value.value is ...:
                continue  # one of the ``…``
            default = parameters[keyword.arg].default
            if keyword.arg == "sweep_interval":
                default = DEFAULT_SWEEP_INTERVAL  # FROM_ENV: the environment, else this
            assert ast.literal_eval(keyword.value) == default, f"{name}({keyword.arg}=) default"
    shown = {keyword.arg for keyword in calls["LockService"].keywords} | {"store"}
    assert shown | UNSKETCHED == {*inspect.signature(LockService.__init__).parameters} - {"self"}


def test_the_readme_api_sketch_shows_every_parameter_of_the_methods_it_sketches() -> None:
    """Each ``service.<method>(...)`` line of README's lock core API shows all of the method's
    parameters, ``…`` counted as its four: a parameter added to a method shows up in the sketch.
    (``lock(task_id=)`` and ``close(release=)`` were missing from it.)"""
    block = section(read("README.md"), "## The lock core API").split("```python\n", 1)[1].split("```", 1)[0]
    for name, call in sketched_calls(block).items():
        if name == "LockService":
            continue  # its own test above: all but the test knobs
        shown = {argument.id for argument in call.args if isinstance(argument, ast.Name)}
        shown |= {keyword.arg for keyword in call.keywords if keyword.arg}
        parameters = set(inspect.signature(getattr(LockService, name)).parameters) - {"self"}
        assert parameters <= shown | {"keys", "key"}, f"{name}: {sorted(parameters - shown)} not in README"


def test_the_readme_names_every_on_locked_and_on_lost_policy() -> None:
    """README's ``on_locked`` and ``on_lost`` bullets name every policy the settings accept,
    as docs/celery.md's table has a row for each (``"wait"`` was missing from README)."""
    api = section(read("README.md"), "## The Celery API")
    on_locked = api[api.index("* **`on_locked`**") :].split("\n* ", 1)[0]
    on_lost = api[api.index("* **`on_lost`**") :].split("\n* ", 1)[0]
    assert [p for p in ON_LOCKED_POLICIES if f'`"{p}"`' not in on_locked] == []
    assert [p for p in ON_LOST_POLICIES if f'`"{p}"`' not in on_lost] == []
    table = table_rows(section(read("docs/celery.md"), "## When the key is held: `on_locked`"))
    assert {p for row in table for p in re.findall(r'^`"(\w+)"`$', row[0])} == set(ON_LOCKED_POLICIES)


def test_every_json_output_of_the_cli_is_described() -> None:
    """docs/cli.md's "JSON output" names every sub-command that takes ``--json`` (``sweep``'s
    was missing), or, for ``list --done``, its own section gives the shape."""
    text = section(read("docs/cli.md"), "## JSON output")
    with_json = {
        name for name, command in commands().items() if any("--json" in p.opts for p in command.params)
    }
    missing = {name for name in with_json if f"`{name}" not in text}
    assert not missing, f"--json output not described in docs/cli.md: {sorted(missing)}"


def test_every_signal_is_in_the_observability_table_and_the_readme() -> None:
    """docs/observability.md's signal table has one row per signal of ``celery_exclusive.signals``,
    and README's Observability paragraph names each."""
    from celery.utils.dispatch import Signal

    defined = {name for name, value in vars(signals).items() if isinstance(value, Signal)}
    rows = table_rows(section(read("docs/observability.md"), "## Signals"))
    assert {code_spans(row[0])[0] for row in rows if row[0].startswith("`")} == defined
    readme = section(read("README.md"), "## Observability")
    assert [name for name in sorted(defined) if f"`{name}`" not in readme] == []


def test_every_metric_is_in_the_observability_table() -> None:
    """docs/observability.md's metric table names exactly the metrics ``install()`` registers."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_exclusive.metrics import Metrics

    registry = prometheus_client.CollectorRegistry()
    Metrics.create(registry)
    registered = {
        metric.name + ("_total" if metric.type == "counter" else "") for metric in registry.collect()
    }
    rows = table_rows(section(read("docs/observability.md"), "## Prometheus metrics"))
    documented = {code_spans(row[0])[0] for row in rows if row[0].startswith("`celery_exclusive_")}
    assert documented == registered
