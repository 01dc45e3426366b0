"""Lock keys for tasks: a format template or a callable over the task's bound arguments.

A template such as ``"community-pr:{work_id}"`` is filled from the arguments bound to the
task's signature with defaults applied, so ``t.delay(1)`` and ``t.delay(work_id=1)`` give
the same key; ``{task_name}`` is the task's name (unless the task has a parameter of that
name); the names of ``*args`` and ``**kwargs`` parameters are all of those arguments (a
tuple, a dict with its items sorted). Attribute and index lookups (``{pr.id}``,
``{ids[0]}``) and format specs work.
A template naming a parameter the task does not have, holding a NUL or a lone surrogate,
or using a conversion other than ``!r``/``!s``/``!a``, is rejected when the task is
declared. A callable key receives the same arguments as the task (defaults applied) and
returns the key; one that cannot take them is rejected when the task is declared too.
No key spec means one global lock named after the task.

Several keys: a list or tuple of templates (``["tenant:{a}", "resource:{b}"]``, each
checked when the task is declared), or a callable returning a list or tuple of keys. The
run then holds every key (:meth:`LockService.lock_many`, all or none). :meth:`KeyBuilder.build`
gives them as a list in canonical order (sorted, the order ``lock_many`` takes them in), so
its first key is the same for equal arguments; a list of one key is that key, a plain str.
An empty list, a key repeated after formatting or more than :data:`MAX_KEYS` keys is
refused when the key is built, naming the task.

Equal arguments give equal keys: a ``dict``, ``set`` or ``frozenset`` in a template field
(also nested in lists and tuples) is written with its items sorted (by value where they
compare, else by their text), so ``{'b': 2, 'a': 1}`` and ``{'a': 1, 'b': 2}`` give one
key, and a set of strings the same key in every process. A value that already formatted
the same every time (scalars, lists, tuples, dicts built in sorted order) keeps its text.
Other mapping types (``OrderedDict``...) keep their own text. A callable key gets the raw
arguments: canonicalising them is its job.
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.many import MAX_KEYS, check_keys
from celery_exclusive.validation import check_key, refused_call

TASK_NAME_FIELD = "task_name"
KeySpec = str | Sequence[str] | Callable[..., str | Sequence[str]] | None

_FIELD_ROOT = re.compile(r"^[^.\[]*")


_CONTAINERS = (dict, list, tuple, set, frozenset)
#: Types whose ``format(value, "")`` is ``str(value)``, always stable (see ``_StrictFormatter``).
_PLAIN = (str, int, float, bool)
_PLAIN_TYPES = frozenset(_PLAIN)


def _check_stable(value: Any) -> None:
    kind: Any = type(value)
    if (
        kind.__format__ is object.__format__
        and kind.__str__ is object.__str__
        and kind.__repr__ is object.__repr__
    ):
        article = "an" if kind.__name__[:1].lower() in "aeiou" else "a"
        raise InvalidArgumentError(
            f"{article} {kind.__name__} has no stable text form (it would format as its memory "
            "address, so every call would get a different key); use one of its attributes, "
            "e.g. {param.id}, or a key callable"
        )


def _sorted(items: list[tuple[Any, str]]) -> list[str]:
    """The texts of ``(value, text)`` pairs ordered by value, or by text if values do not compare."""
    try:
        return [text for _, text in sorted(items, key=lambda item: item[0])]
    except TypeError:
        return sorted(text for _, text in items)


def canonical_text(value: Any) -> str:
    """``repr(value)`` with the items of every dict and set sorted (see the module docstring)."""
    kind = type(value)
    if kind is dict:
        items = [(k, f"{canonical_text(k)}: {canonical_text(v)}") for k, v in value.items()]
        return "{" + ", ".join(_sorted(items)) + "}"
    if kind in (set, frozenset):
        texts = _sorted([(item, canonical_text(item)) for item in value])
        inner = "{" + ", ".join(texts) + "}" if texts else "()"
        return inner if kind is set and texts else f"{kind.__name__}({inner if texts else ''})"
    if kind is list:
        return "[" + ", ".join(canonical_text(item) for item in value) + "]"
    if kind is tuple:
        texts = [canonical_text(item) for item in value]
        return "(" + ", ".join(texts) + ("," if len(texts) == 1 else "") + ")"
    _check_stable(value)
    return repr(value)


class _StrictFormatter(string.Formatter):
    """Refuses values whose text would differ per object (``<Foo object at 0x...>``).

    Plain dicts, sets, lists and tuples are formatted through :func:`canonical_text`.
    """

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion in ("r", "s") and type(value) in _CONTAINERS:
            return canonical_text(value)
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        if type(value) in _CONTAINERS:
            return format(canonical_text(value), format_spec)
        _check_stable(value)
        return super().format_field(value, format_spec)


_FORMATTER = _StrictFormatter()


def template_fields(template: str) -> list[str]:
    """The root names a template refers to (``{pr.id}`` -> ``pr``); positional fields rejected."""
    names: list[str] = []
    try:
        parsed = list(_FORMATTER.parse(template))
    except ValueError as exc:
        raise InvalidArgumentError(f"lock key template {template!r} is malformed: {exc}") from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise InvalidArgumentError(
                f"lock key template {template!r} uses the conversion !{conversion} in {{{field}}}; "
                "a conversion is !r, !s or !a"
            )
        root = _FIELD_ROOT.match(field).group(0)  # type: ignore[union-attr]  # always matches
        if root == "" or root.isdigit():
            raise InvalidArgumentError(
                f"lock key template {template!r} uses a positional field {{{field}}}; "
                "name the task's parameter instead, e.g. {work_id}"
            )
        names.append(root)
        if spec:
            names.extend(template_fields(spec))
    return names


class KeyBuilder:
    """Builds the lock key of one task from its call arguments.

    ``signature`` is the task's ``run`` signature without ``self`` (with ``bind=True``).
    Construction validates the spec; :meth:`build` raises InvalidArgumentError with the
    reason when the key cannot be made (missing argument, unformattable value).
    """

    def __init__(self, spec: KeySpec, signature: inspect.Signature) -> None:
        self.spec = spec
        self.signature = signature
        #: The templates of a list spec (several keys), else None.
        self.templates: tuple[str, ...] | None = None
        self._plain: _Plain | None = None
        #: The key of a call whose arguments are all given by position, Celery's usual call
        #: (:meth:`_Plain.positional`), or None where that takes :meth:`build`; None for any
        #: other spec. The caller passes ``args`` when there are no keyword arguments.
        self.positional: Callable[[Sequence[Any]], str | None] | None = None
        if callable(spec):
            _check_callable(spec, signature)
        if spec is None or callable(spec):
            return
        if isinstance(spec, (list, tuple)):
            self.templates = tuple(spec)
            if not spec:
                raise InvalidArgumentError("a lock key list must not be empty")
            if len(spec) > MAX_KEYS:
                raise InvalidArgumentError(
                    f"a lock key list has at most {MAX_KEYS} templates, got {len(spec)}"
                )
            for template in spec:
                self._check_template(template)
            if len(set(self.templates)) != len(self.templates):
                raise InvalidArgumentError(f"a lock key list repeats a template: {list(spec)!r}")
            return
        self._check_template(spec)
        self._plain = plain = _Plain.of(str(spec), signature)
        if plain is not None:
            self.positional = plain.positional()

    @property
    def source(self) -> str:
        """Where the keys come from, for error messages: the template(s), the callable, or
        the task name."""
        if self.spec is None:
            return "name (no key given)"
        if callable(self.spec):
            return "key callable"
        if self.templates is not None:
            return f"key templates {list(self.templates)!r}"
        return f"key template {self.spec!r}"

    @property
    def several(self) -> bool:
        """Whether the spec is a list of templates (a callable may also give several keys)."""
        return self.templates is not None and len(self.templates) > 1

    def _check_template(self, spec: object) -> None:
        if not isinstance(spec, str):
            raise InvalidArgumentError(
                "lock key must be a format template str or a callable, got "
                f"{type(spec).__name__} (several keys: a list of templates)"
            )
        if not spec:
            raise InvalidArgumentError("lock key template must not be empty")
        try:
            check_key(spec)  # its text is in every key: a NUL or lone surrogate in it would be
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"lock key template {spec!r}: {exc}") from None
        signature = self.signature
        params = signature.parameters
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name in template_fields(spec):
            if name in params or name == TASK_NAME_FIELD or takes_any_keyword:
                continue
            raise InvalidArgumentError(
                f"lock key template {spec!r} names {{{name}}}, but the task has no parameter "
                f"{name!r} (parameters: {', '.join(params) or 'none'}; also available: "
                f"{{{TASK_NAME_FIELD}}})"
            )

    @classmethod
    def for_function(cls, spec: KeySpec, fun: Callable[..., Any], *, bound: bool) -> KeyBuilder:
        """A builder for the task body ``fun``; ``bound`` drops its first parameter (``self``)."""
        try:
            signature = inspect.signature(fun)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"cannot read the signature of {fun!r}: {exc}") from None
        if bound:
            params = list(signature.parameters.values())
            signature = signature.replace(parameters=params[1:])
        return cls(spec, signature)

    def build(self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | list[str]:
        """The key for a call with ``args`` and ``kwargs``; several keys as a sorted list."""
        if self.spec is None:
            return task_name
        plain = self._plain
        if plain is not None:
            fill = self.positional
            if fill is not None and not kwargs:  # Celery's usual call, every parameter by position
                key = fill(args)
                if key is not None:
                    return key
            quick = plain.build(task_name, args, kwargs)
            if quick is not None:
                return quick
        return self._build(task_name, args, kwargs)

    def _build(self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | list[str]:
        """:meth:`build` the full way: ``Signature.bind`` and the strict formatter."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"cannot build the lock key of {task_name} (from its {self.source}): its arguments "
                f"do not match its signature: {exc}"
            ) from None
        bound.apply_defaults()
        if callable(self.spec):
            try:
                key = self.spec(*bound.args, **bound.kwargs)
            except Exception as exc:  # the caller's own error, kept; the note says whose key
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"while building the lock key of {task_name} with its key callable")
                raise
            if isinstance(key, (list, tuple)):
                return _several(task_name, key)
            if not isinstance(key, str) or not key:
                raise InvalidArgumentError(
                    f"the lock key callable of {task_name} must return a non-empty str "
                    f"(or a list of them), got {key!r}"
                )
            return key
        values: dict[str, Any] = {TASK_NAME_FIELD: task_name}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                values.setdefault(name, value)  # {kwargs}: all of them (a kwarg of that name wins)
                values.update(value)
            else:
                values[name] = value
        if self.templates is None:
            return self._format(task_name, str(self.spec), values)
        return _several(task_name, [self._format(task_name, template, values) for template in self.templates])

    @staticmethod
    def _format(task_name: str, template: str, values: dict[str, Any]) -> str:
        try:
            return _FORMATTER.vformat(template, (), values)
        except KeyError as exc:
            reason = f"no argument named {exc.args[0]!r} was passed"
        except InvalidArgumentError as exc:
            reason = str(exc)
        except (AttributeError, IndexError, LookupError, TypeError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        raise InvalidArgumentError(
            f"cannot build the lock key of {task_name} from template {template!r}: {reason}"
        )


class _Plain:
    """A template of plain ``{name}`` fields over plain parameters, filled without
    ``Signature.bind`` and ``string.Formatter`` (a third of what an exclusive run itself cost):
    the same key :meth:`KeyBuilder.build` makes, or None when the call needs that full path
    (arguments that do not bind; a value of another type than ``_PLAIN``'s, which
    ``_StrictFormatter`` formats and checks).

    The template is compiled once into a ``%`` pattern and a getter of its fields' values
    among the arguments by position (``"e:{tag}:{i}"`` over ``(i, tag)`` is ``"e:%s:%s"`` and
    ``itemgetter(1, 0)``; the task name after the parameters), filled by one ``%``: for a
    value of exactly ``str``, ``int``, ``float`` or ``bool``, ``%s`` writes ``str(value)``,
    which is ``format(value, "")``, what the full path writes for it. (One ``%`` costs about
    two thirds of one ``str.format``, which parses its template at every call.)"""

    __slots__ = ("count", "defaults", "names", "pattern", "pick", "required", "typed", "uses_name")

    def __init__(self, pieces: list[tuple[str, str | None]], signature: inspect.Signature) -> None:
        params = signature.parameters.values()
        self.names = names = tuple(p.name for p in params)
        self.count = len(names)
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.required = tuple(p.name for p in params if p.default is p.empty)
        text: list[str] = []
        fields: list[int] = []
        self.uses_name = False
        for literal, field in pieces:
            text.append(literal.replace("%", "%%"))
            if field is None:
                continue
            if field in names:
                fields.append(names.index(field))
            else:  # the task name, after the parameters
                fields.append(len(names))
                self.uses_name = True
            text.append("%s")
        #: The positions of the parameters the template uses, whose types are checked.
        self.typed = tuple(sorted({index for index in fields if index < len(names)}))
        self.pattern = "".join(text)
        #: The fields' values, in the template's order, from the values by position (None: no field).
        self.pick: Callable[[Sequence[Any]], Any] | None = (
            None if not fields else itemgetter(*fields) if len(fields) > 1 else _one(fields[0])
        )

    @classmethod
    def of(cls, template: str, signature: inspect.Signature) -> _Plain | None:
        """The compiled form of ``template``, if it and ``signature`` are plain enough."""
        if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in signature.parameters.values()):
            return None
        pieces: list[tuple[str, str | None]] = []
        for literal, field, spec, conversion in _FORMATTER.parse(template):
            if field is not None and (spec or conversion or not field.isidentifier()):
                return None
            pieces.append((literal, field))
        return cls(pieces, signature)

    def positional(self) -> Callable[[Sequence[Any]], str | None] | None:
        """The key of a call with every parameter by position and no keyword arguments, by
        one function of ``args``: :meth:`build`'s result for such a call, or None (another
        count of arguments, a value of another type than ``_PLAIN``'s) where the caller
        takes :meth:`build`. None for a template without fields or naming the task."""
        pick = self.pick
        if pick is None or self.uses_name:
            return None
        count, typed, pattern, plain = self.count, self.typed, self.pattern, _PLAIN_TYPES
        if len(typed) == 1:
            (only,) = typed

            def fill_one(args: Sequence[Any]) -> str | None:
                if len(args) == count and type(args[only]) in plain:
                    return pattern % pick(args)  # type: ignore[no-any-return]  # a str
                return None

            return fill_one
        if len(typed) == 2:  # the usual template of two fields, unrolled
            first, second = typed

            def fill_two(args: Sequence[Any]) -> str | None:
                if len(args) == count and type(args[first]) in plain and type(args[second]) in plain:
                    return pattern % pick(args)  # type: ignore[no-any-return]  # a str
                return None

            return fill_two

        def fill(args: Sequence[Any]) -> str | None:
            if len(args) != count:
                return None
            for index in typed:
                if type(args[index]) not in plain:
                    return None
            return pattern % pick(args)  # type: ignore[no-any-return]  # a str

        return fill

    def build(self, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        values: Sequence[Any]
        if not kwargs and len(args) == self.count:  # every parameter by position: Celery's usual
            values = args
        else:
            names = self.names
            if len(args) > len(names):
                return None
            given: dict[str, Any] = {**self.defaults, **dict(zip(names, args, strict=False))}
            for name, value in kwargs.items():
                if name not in names or name in names[: len(args)]:
                    return None
                given[name] = value
            if any(name not in given for name in self.required):
                return None
            values = [given[name] for name in names]
        for index in self.typed:
            if type(values[index]) not in _PLAIN_TYPES:
                return None
        if self.uses_name:
            if type(task_name) is not str:
                return None
            values = (*values, task_name)
        return self.pattern if self.pick is None else self.pattern % self.pick(values)


def _check_callable(spec: Callable[..., Any], task: inspect.Signature) -> None:
    """InvalidArgumentError if the key callable ``spec`` cannot be called as
    :meth:`KeyBuilder.build` calls it: with the task's parameters, those before ``*`` by
    position, keyword-only ones by name (no extra ``*args``/``**kwargs``)."""
    params = task.parameters.values()
    by_position = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    refused = refused_call(spec, *by_position, **dict.fromkeys(by_name))
    if refused is not None:
        shown = ", ".join([*by_position, *(f"{name}=" for name in by_name)]) or "none"
        raise InvalidArgumentError(
            f"the lock key callable must take the task's arguments ({shown}), as the task does; {refused}"
        )


def _one(index: int) -> Callable[[Sequence[Any]], tuple[Any]]:
    """The getter of one field's value, as a 1-tuple (``%`` would take a tuple value for its
    arguments; the value's type is checked first anyway)."""

    def pick(values: Sequence[Any]) -> tuple[Any]:
        return (values[index],)

    return pick


def _several(task_name: str, keys: Sequence[Any]) -> str | list[str]:
    """Checked keys of one call in canonical order (sorted); one key as itself."""
    try:
        found = check_keys(keys)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"the lock keys of {task_name}: {exc}") from None
    if not all(found):
        raise InvalidArgumentError(f"the lock keys of {task_name}: a key is empty: {found!r}")
    return found[0] if len(found) == 1 else sorted(found)
