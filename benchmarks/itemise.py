"""Inclusive instructions per Python function of a counted run, by callgrind (issue #16).

CPython 3.11 shows no Python function under valgrind: every Python frame is
``_PyEval_EvalFrameDefault``. This module gives each function of the package a C function
of its own for callgrind to count: a small C extension, built when the run starts, holds
one trampoline per wrapped function (``ce_py_<n>``, which only calls it), and each wrapped
function's code becomes a stub that calls its trampoline with its arguments, the original
code running in a copy of the function. ``callgrind_annotate --inclusive=yes`` then names
every wrapped function's inclusive cost and calls (the stub's own cost, a star-argument
call of ~1k instructions, falls in the caller's row, not in the function's).

Used by :mod:`benchmarks.instructions` (``--itemise``): functions that have a closure, or
are generators or coroutines, are left unwrapped (their stub cannot stand in for them).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path
from typing import Any

_SOURCE_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
typedef PyObject *(*tramp_t)(PyObject *, PyObject *const *, size_t, PyObject *);
typedef struct { PyObject_HEAD PyObject *fn; Py_ssize_t idx; vectorcallfunc vc; } W;
"""

_TRAMPOLINE = r"""
__attribute__((noinline)) PyObject *ce_py_%(n)d(PyObject *fn, PyObject *const *a, size_t n, PyObject *k)
{ PyObject *r = PyObject_Vectorcall(fn, a, n, k); __asm__ volatile("" ::: "memory"); return r; }
"""

_SOURCE_TAIL = r"""
static tramp_t tramps[] = { %(table)s };
static PyObject *w_vc(PyObject *self, PyObject *const *a, size_t n, PyObject *k)
{ W *w = (W *)self; return tramps[w->idx](w->fn, a, n, k); }
static void w_dealloc(PyObject *self) { Py_XDECREF(((W *)self)->fn); Py_TYPE(self)->tp_free(self); }
static PyObject *w_get(PyObject *self, PyObject *obj, PyObject *type)
{ if (obj == NULL || obj == Py_None) { Py_INCREF(self); return self; } return PyMethod_New(self, obj); }
static PyTypeObject WType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ce_itemise.W", .tp_basicsize = sizeof(W), .tp_dealloc = w_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_call = PyVectorcall_Call, .tp_vectorcall_offset = offsetof(W, vc), .tp_descr_get = w_get,
};
static PyObject *wrap(PyObject *mod, PyObject *args)
{
    PyObject *fn; Py_ssize_t idx;
    if (!PyArg_ParseTuple(args, "On", &fn, &idx)) return NULL;
    if (idx < 0 || idx >= (Py_ssize_t)(sizeof(tramps) / sizeof(tramps[0]))) {
        PyErr_SetString(PyExc_IndexError, "no such trampoline"); return NULL; }
    W *w = PyObject_New(W, &WType); if (!w) return NULL;
    Py_INCREF(fn); w->fn = fn; w->idx = idx; w->vc = w_vc; return (PyObject *)w;
}
static PyMethodDef methods[] = { {"wrap", wrap, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL} };
static struct PyModuleDef def = { PyModuleDef_HEAD_INIT, "ce_itemise", NULL, -1, methods };
PyMODINIT_FUNC PyInit_ce_itemise(void)
{ if (PyType_Ready(&WType) < 0) return NULL; return PyModule_Create(&def); }
"""


def _build(count: int, where: str) -> Any:
    """The C extension with ``count`` trampolines, built in ``where`` and imported."""
    source = Path(where, "ce_itemise.c")
    source.write_text(
        _SOURCE_HEAD
        + "".join(_TRAMPOLINE % {"n": n} for n in range(count))
        + _SOURCE_TAIL % {"table": ", ".join(f"ce_py_{n}" for n in range(count))}
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    library = Path(where, f"ce_itemise{suffix}")
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [
            "cc",
            "-O1",
            "-g",
            "-fno-optimize-sibling-calls",
            "-shared",
            "-fPIC",
            f"-I{include}",
            "-o",
            str(library),
            str(source),
        ],
        check=True,
    )
    sys.path.insert(0, where)
    return importlib.import_module("ce_itemise")


def _functions(package: str) -> list[tuple[str, types.FunctionType]]:
    """Every plain function of ``package``'s modules, named ``module:qualname``: module
    functions, and the methods, static and class methods and property accessors of their classes."""
    root = importlib.import_module(package)
    names = [package] + [
        m.name
        for m in pkgutil.walk_packages(root.__path__, f"{package}.")
        if ".contrib" not in m.name and ".testing" not in m.name
    ]
    found: dict[int, tuple[str, types.FunctionType]] = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for value in vars(module).values():
            candidates: list[Any] = [value]
            if isinstance(value, type) and value.__module__ == name:
                for member in vars(value).values():
                    if isinstance(member, (staticmethod, classmethod)):
                        candidates.append(member.__func__)
                    elif isinstance(member, property):
                        candidates += [member.fget, member.fset]
                    else:
                        candidates.append(member)
            for each in candidates:
                if (
                    isinstance(each, types.FunctionType)
                    and each.__module__ == name
                    and each.__closure__ is None
                    and not each.__code__.co_flags
                    & 0xA0  # generator, coroutine (CO_GENERATOR | CO_COROUTINE)
                    and not each.__code__.co_flags & 0x200  # async generator
                ):
                    found[id(each)] = (f"{name}:{each.__qualname__}", each)
    return sorted(found.values(), key=lambda item: item[0])


def install(package: str = "celery_exclusive") -> dict[int, str]:
    """Wrap every function of ``package`` (see the module docstring) whose ``module:qualname``
    matches ``CE_ITEMISE_ONLY`` (a regular expression; all without it): the trampolines' names."""
    only = re.compile(os.environ.get("CE_ITEMISE_ONLY") or ".")
    chosen = [(name, function) for name, function in _functions(package) if only.search(name)]
    _CODES.update({id(function.__code__): name for name, function in chosen})
    module = _build(len(chosen), tempfile.mkdtemp(prefix="ce-itemise-"))
    names: dict[int, str] = {}
    for index, (name, function) in enumerate(chosen):
        copy = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__
        )
        copy.__kwdefaults__ = function.__kwdefaults__
        copy.__dict__.update(function.__dict__)
        glue = f"__ce_itemise_{index}"
        function.__globals__[glue] = module.wrap(copy, index)
        namespace: dict[str, Any] = {}
        exec(  # noqa: S102 - a stub of two lines made here
            f"def stub(*args, **kwargs):\n    return {glue}(*args, **kwargs)\n",
            function.__globals__,
            namespace,
        )
        stub_code = namespace["stub"].__code__.replace(co_name=function.__code__.co_name)
        function.__code__ = stub_code
        function.__defaults__ = None
        function.__kwdefaults__ = None
        names[index] = name
    return names


#: The wrapped functions' original code objects (by id) and names: what :func:`trace` names.
_CODES: dict[int, str] = {}


def trace(run: Any) -> None:
    """Call ``run()`` under ``sys.setprofile``, and append to ``CE_ITEMISE_NAMES.edges`` each
    ``caller<TAB>callee`` of wrapped functions (the nearest wrapped frame above the callee)."""
    edges: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        callee = _CODES.get(id(frame.f_code))
        if callee is None:
            return
        above = frame.f_back
        while above is not None and id(above.f_code) not in _CODES:
            above = above.f_back
        edges.append(f"{'' if above is None else _CODES[id(above.f_code)]}\t{callee}\n")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    target = os.environ.get("CE_ITEMISE_NAMES")
    if target:
        with Path(f"{target}.edges").open("a") as out:
            out.writelines(edges)


def write_names(names: dict[int, str]) -> None:
    """The trampolines' names to ``CE_ITEMISE_NAMES`` (a file), one ``n<TAB>name`` a line."""
    target = os.environ.get("CE_ITEMISE_NAMES")
    if target:
        Path(target).write_text("".join(f"{n}\t{name}\n" for n, name in names.items()))


def table(
    profile: str, names_file: str, count: int, overhead: float = 0.0
) -> list[tuple[str, float, float, float]]:
    """``(function, inclusive instructions, calls, own instructions)`` per run of ``profile``
    (a kept callgrind output of ``count`` runs), from ``callgrind_annotate --inclusive=yes``."""
    names = dict(line.split("\t", 1) for line in Path(names_file).read_text().splitlines())
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", profile],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    calls = _calls(profile)
    rows: list[tuple[str, float, float]] = []
    seen: set[str] = set()
    for line in annotated.splitlines():
        found = _ROW.match(line)
        if found and found.group(2) not in seen:
            n = found.group(2)
            seen.add(n)
            rows.append(
                (names.get(n, n), int(found.group(1).replace(",", "")) / count, calls.get(n, 0) / count)
            )
    return _with_self(sorted(rows, key=lambda row: -row[1]), f"{names_file}.edges", overhead)


def wrapped_calls(profile: str, count: int) -> float:
    """Calls of wrapped functions per run in ``profile``."""
    return sum(_calls(profile).values()) / count


def _with_self(
    rows: list[tuple[str, float, float]], edges_file: str, overhead: float
) -> list[tuple[str, float, float, float]]:
    """``rows`` with each function's own cost (its inclusive cost less its wrapped callees',
    by the traced edges of one run; a callee of several callers split by their calls), both
    less ``overhead`` per wrapped call made under the function (what the stubs add)."""
    inclusive = {name: cost for name, cost, _ in rows}
    edges: dict[tuple[str, str], int] = {}  # calls per run
    if Path(edges_file).exists():
        for line in Path(edges_file).read_text().splitlines():
            caller, callee = line.split("\t")
            edges[caller, callee] = edges.get((caller, callee), 0) + 1
    into: dict[str, int] = {}
    for (_, callee), n in edges.items():
        into[callee] = into.get(callee, 0) + n

    def under(name: str, seen: frozenset[str]) -> float:
        """Wrapped calls per run made below ``name``'s calls (all of them)."""
        return sum(
            n * (1 + under(callee, seen | {callee}) / into[callee])
            for (caller, callee), n in edges.items()
            if caller == name and callee not in seen
        )

    own = dict(inclusive)
    for (caller, callee), n in edges.items():
        if caller in own and callee in inclusive:
            own[caller] -= inclusive[callee] * n / into[callee] + overhead * n
    return [
        (name, cost - overhead * under(name, frozenset({name})), calls, own[name])
        for name, cost, calls in rows
    ]


_ROW = re.compile(r"^\s*([\d,]+)\s.*?\bce_py_(\d+)\b")
_NAMED = re.compile(r"^c?fn=\((\d+)\)(?: (.*))?$")


def _calls(profile: str) -> dict[str, int]:
    """Calls of each trampoline, from the profile's ``calls=`` lines (its callers' records)."""
    calls: dict[str, int] = {}
    names: dict[str, str] = {}
    callee = ""
    for line in Path(profile).read_text(errors="replace").splitlines():
        named = _NAMED.match(line)
        if named:
            ident, label = named.groups()
            if label:
                names[ident] = label
            if line.startswith("cfn="):
                callee = names.get(ident, "")
        elif line.startswith("cfn="):
            callee = line[4:]
        elif line.startswith("calls=") and "ce_py_" in callee:
            n = callee.split("ce_py_")[1].split()[0]
            calls[n] = calls.get(n, 0) + int(line[6:].split()[0])
    return calls
