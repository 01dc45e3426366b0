"""benchmarks.itemise's arithmetic: own and inclusive instructions per function from a
callgrind profile's inclusive rows, the traced call tree, and the stubs' cost per call."""

from __future__ import annotations

from pathlib import Path

from benchmarks.itemise import _with_self


def test_own_and_inclusive_costs_with_the_stubs_taken_off(tmp_path: Path) -> None:
    """A calls B twice, each B calls C once, D calls C once; every wrapped call adds a stub
    of 10 to its caller. True own costs per call: A 50, B 20, C 5, D 7."""
    edges = tmp_path / "names.edges"
    edges.write_text("\tA\nA\tB\nB\tC\nA\tB\nB\tC\n\tD\nD\tC\n")
    stub = 10.0
    # What callgrind counts per run (inclusive, stubs of wrapped callees included).
    rows = [("A", 140.0, 1.0), ("B", 70.0, 2.0), ("C", 15.0, 3.0), ("D", 22.0, 1.0)]
    got = {
        name: (inclusive, calls, own) for name, inclusive, calls, own in _with_self(rows, str(edges), stub)
    }
    assert got == {
        "A": (100.0, 1.0, 50.0),  # 50 + 2 x (20 + 5)
        "B": (50.0, 2.0, 40.0),
        "C": (15.0, 3.0, 15.0),
        "D": (12.0, 1.0, 7.0),
    }


def test_without_a_trace_own_is_inclusive(tmp_path: Path) -> None:
    rows = [("A", 140.0, 1.0)]
    assert _with_self(rows, str(tmp_path / "missing.edges"), 10.0) == [("A", 140.0, 1.0, 140.0)]
