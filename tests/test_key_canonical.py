"""Equal arguments give equal lock keys: mappings and sets in a template are canonical.

``str(dict)`` follows insertion order and ``str(set)`` follows hash order (randomised per
process for strings), so two calls with equal arguments could otherwise get different keys
and run at the same time. Keys of calls whose text was already deterministic stay as they
were.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from typing import Any

import pytest

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.keys import KeyBuilder
from celery_exclusive.semaphore import MAX_LIMIT, slot_keys, slot_of, store_slot_keys
from celery_exclusive.validation import derived_key


def _run(filters: Any, n: int = 0) -> None: ...


BUILDER = KeyBuilder.for_function("report:{filters}:{n}", _run, bound=False)


def _key(filters: Any) -> str:
    return BUILDER.build("t", (filters,), {})


def test_equal_dicts_built_in_another_order_give_one_key() -> None:
    """{'a': 1, 'b': 2} and {'b': 2, 'a': 1} are the same call, so the same key (nested too)."""
    assert _key({"b": 2, "a": 1}) == _key({"a": 1, "b": 2}) == "report:{'a': 1, 'b': 2}:0"
    nested_1 = {"z": {"y": 1, "x": [{"q": 1, "p": 2}]}, "a": (1, {"d": 0, "c": 0})}
    nested_2 = {"a": (1, {"c": 0, "d": 0}), "z": {"x": [{"p": 2, "q": 1}], "y": 1}}
    assert _key(nested_1) == _key(nested_2)
    assert _key(nested_1) == "report:{'a': (1, {'c': 0, 'd': 0}), 'z': {'x': [{'p': 2, 'q': 1}], 'y': 1}}:0"


def test_keys_of_already_deterministic_calls_are_unchanged() -> None:
    """Scalars, lists, tuples and dicts already in sorted order format exactly as str() did."""
    for value in (
        1,
        "x",
        [3, 1, 2],
        (1,),
        (),
        [],
        {},
        {"a": 1, "b": "two"},
        {9: "a", 10: "b"},
        [{"a": None}, (True, 1.5)],
        {"k": [1, (2, 3)]},
    ):
        assert _key(value) == f"report:{value}:0", value


def test_sets_are_sorted_whatever_the_hash_seed() -> None:
    """A set of strings gives the same key in every process (hash order is randomised per process)."""
    code = (
        "from celery_exclusive.keys import KeyBuilder\n"
        "def run(tags, n=0): ...\n"
        "b = KeyBuilder.for_function('k:{tags}', run, bound=False)\n"
        "print(b.build('t', ({'delta', 'alpha', 'charlie', 'bravo', 'echo'},), {}))\n"
        "print(b.build('t', (frozenset({'zz', 'aa', 'mm'}),), {}))\n"
    )
    outputs = set()
    for seed in ("1", "2", "3"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.add(done.stdout)
    assert outputs == {"k:{'alpha', 'bravo', 'charlie', 'delta', 'echo'}\nk:frozenset({'aa', 'mm', 'zz'})\n"}
    assert _key(set()) == "report:set():0"


def test_mixed_key_types_still_give_one_key() -> None:
    """Keys that do not compare (1 and 'a') are ordered by their text instead."""
    assert _key({1: "x", "a": "y"}) == _key({"a": "y", 1: "x"})


def test_conversions_and_format_specs_are_canonical_too() -> None:
    """{filters!r}, {filters!s} and {filters:>30} see the canonical text."""

    for template in ("k:{f!r}", "k:{f!s}", "k:{f:>30}"):
        builder = KeyBuilder.for_function(template, lambda f: None, bound=False)
        assert builder.build("t", ({"b": 1, "a": 2},), {}) == builder.build("t", ({"a": 2, "b": 1},), {})


def test_other_mapping_types_keep_their_own_text() -> None:
    """Only plain dicts, lists, tuples and sets are rewritten; an OrderedDict means its order."""
    ordered = OrderedDict([("b", 1), ("a", 2)])
    assert _key(ordered) == f"report:{ordered}:0"


def test_an_object_inside_a_dict_without_stable_text_is_refused() -> None:
    """A value formatting as its memory address is refused inside a container as on its own."""
    with pytest.raises(InvalidArgumentError, match="memory address"):
        _key({"a": object()})


def _pair(a: Any, b: Any = 7) -> None: ...


@pytest.mark.parametrize(
    "template",
    ["e:{b}:{a}", "{a}", "x{{lit}}:{a}}}{{{b}", "{task_name}/{a}/{a}", "{{}}", "plain", "100%:{a}%s%%{b}"],
)
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1, "x"), {}),
        ((True, 2.5), {}),
        ((-0.0, float("nan")), {}),
        ((10**20, "é{}"), {}),
        ((1,), {}),
        ((), {"a": "k", "b": False}),
        (("s",), {"b": 1e16}),
    ],
)
def test_the_compiled_template_gives_the_full_paths_key(
    template: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A plain template's compiled fill (one str.format over the arguments by position,
    literal braces escaped) gives exactly the key string.Formatter's full path gives."""
    builder = KeyBuilder.for_function(template, _pair, bound=False)
    assert builder._plain is not None
    assert builder._plain.build("t.name", args, kwargs) is not None
    full = KeyBuilder(template, builder.signature)
    full._plain = None  # the full path: Signature.bind and the strict formatter
    assert builder.build("t.name", args, kwargs) == full.build("t.name", args, kwargs)
    fill = builder.positional  # what an exclusive run calls first for an all-positional call
    if fill is not None and not kwargs:
        assert fill(args) in (None, full.build("t.name", args, kwargs))


def _three(a: Any, b: Any, c: Any) -> None: ...


@pytest.mark.parametrize("template", ["{a}", "{b}/{b}", "{c}:{a}", "{a}{b}{c}", "{c}-{b}-{a}-{c}"])
@pytest.mark.parametrize("args", [(1, "x", 2.5), (True, "é", -0.0), (1, "x"), (1, "x", 2, 3), (1, [2], "x")])
def test_the_positional_fill_gives_the_full_paths_key_or_none(template: str, args: tuple[Any, ...]) -> None:
    """``KeyBuilder.positional`` (one, two and more typed fields) gives the full path's key
    for every argument by position of a plain type, and None (the caller then takes
    ``build``) for another count of arguments or a value of another type in a field."""
    builder = KeyBuilder.for_function(template, _three, bound=False)
    fill = builder.positional
    assert fill is not None
    full = KeyBuilder(template, builder.signature)
    full._plain = None
    fields = [name for name in "abc" if "{" + name + "}" in template]
    plain = len(args) == 3 and all(type(args["abc".index(n)]) in (str, int, float, bool) for n in fields)
    if plain:
        assert fill(args) == full.build("t", args, {})
    else:
        assert fill(args) is None
    assert KeyBuilder.for_function("{task_name}:{a}", _three, bound=False).positional is None
    assert KeyBuilder.for_function("fixed", _three, bound=False).positional is None


def test_the_compiled_template_leaves_other_types_to_the_full_path() -> None:
    """A str or int subclass, or a container, is not filled by the compiled template."""

    class Tag(str):
        def __format__(self, spec: str) -> str:
            return "tag"

    builder = KeyBuilder.for_function("e:{a}:{b}", _pair, bound=False)
    assert builder._plain is not None
    for args in [(Tag("x"), 1), (1, [1, 2]), (1, {"b": 1, "a": 2})]:
        assert builder._plain.build("t", args, {}) is None
        assert builder.positional is not None
        assert builder.positional(args) is None
    assert builder.build("t", (Tag("x"), 1), {}) == "e:tag:1"
    assert builder.build("t", (1, {"b": 1, "a": 2}), {}) == "e:1:{'a': 2, 'b': 1}"


def test_a_derived_key_fits_the_store_and_is_the_same_in_every_process() -> None:
    """``key + suffix`` where it fits; else the key's start, ``~``, 32 hex digits of its
    SHA-256 and the suffix, exactly the store's longest key: equal for equal keys (also in
    another process), different for keys differing only past the start kept. A key that
    does not fit itself is refused, naming the store's limit."""
    prefix, limit = "p:", 512
    room = limit - len(prefix)
    assert (
        derived_key("k" * (room - 7), "#queued", prefix=prefix, max_length=limit)
        == "k" * (room - 7) + "#queued"
    )
    long_a, long_b = "a" * (room - 1) + "1", "a" * (room - 1) + "2"
    derived = derived_key(long_a, "#queued", prefix=prefix, max_length=limit)
    assert len(derived) == room
    assert derived.startswith("a" * (room - 7 - 33) + "~")
    assert derived.endswith("#queued")
    assert derived != derived_key(long_b, "#queued", prefix=prefix, max_length=limit)
    elsewhere = subprocess.run(
        [
            sys.executable,
            "-c",
            "from celery_exclusive.validation import derived_key;"
            f"print(derived_key({long_a!r}, '#queued', prefix={prefix!r}, max_length={limit}))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert elsewhere.stdout.strip() == derived
    with pytest.raises(InvalidArgumentError, match=f"at most {room}"):
        derived_key("a" * (room + 1), "#queued", prefix=prefix, max_length=limit)
    assert derived_key("x" * 5000, "#q", prefix="", max_length=None) == "x" * 5000 + "#q"


def test_slot_keys_of_a_key_near_the_stores_longest_fit_and_share_their_braced_text() -> None:
    """A semaphore's slot keys ``{key}#i`` where they fit; else ``{<key's start>~<hash>}#i``
    for each slot that does not, all with the same braced text (a Redis Cluster hash tag:
    those slots stay in one hash slot), short enough for two-digit slots: every slot key
    fits, and differs from another key's."""
    prefix, limit = "p:", 512
    room = limit - len(prefix)
    fits = "f" * (room - 5)
    assert slot_keys(fits, MAX_LIMIT, prefix=prefix, max_length=limit) == slot_keys(fits, MAX_LIMIT)
    for key in ("a" * room, "a" * (room - 3), "a" * (room - 4)):
        slots = slot_keys(key, MAX_LIMIT, prefix=prefix, max_length=limit)
        assert slots[0] == key
        assert all(len(prefix + slot) <= limit for slot in slots)
        assert len(set(slots)) == MAX_LIMIT
        plain = [slot for slot in slots[1:] if slot == f"{{{key}}}#{slot_of(slot)[1]}"]
        assert len(plain) == (8 if len(key) == room - 4 else 0)  # {key}#2..#9 fit, #10.. do not
        hashed = {slot_of(slot)[0] for slot in slots[1:] if slot not in plain}
        assert len(hashed) == 1
        assert hashed != {
            slot_of(slot)[0] for slot in slot_keys(key[:-1] + "b", 3, prefix=prefix, max_length=limit)[1:]
        }
    # A store whose longest key has no room for the hash: the slot key is refused, as before.
    with pytest.raises(InvalidArgumentError, match="at most 28"):
        store_slot_keys(prefix, "k" * 27, 3, 30)
