"""No test asserts on a measured time: speed moves between machines (an H100 and an H200, two CPUs), so a timed
assert fails on one and passes on another. Speed belongs in bench/ (printed and recorded, never asserted).

A test may time things and print them; what fails here is an ``assert`` whose ordering comparison (<, <=, >, >=)
reads a timer (a call to one of TIMERS, or a name assigned from one) against anything but 0. Deadlines in wait
loops (``while ...: assert time.monotonic() < deadline``) guard a hang, not a speed, and stay allowed."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIMERS = {"perf_counter", "monotonic", "time", "elapsed_time", "cuda_ms", "bench", "do_bench", "timeit", "time_ms"}
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _calls_timer(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in TIMERS:
                return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _timed_names(fn: ast.AST) -> set[str]:
    """Names assigned from a timer, or from an expression of such names (t = perf_counter() - t0), to a fixpoint."""
    timed: set[str] = set()
    assigns = [(t, n.value) for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    while True:
        new = {x for t, v in assigns if _calls_timer(v) or _names(v) & timed for x in _names(t)} - timed
        if not new:
            return timed
        timed |= new


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0


def timed_asserts(source: str) -> list[int]:
    """Line numbers of asserts that order a measured time against something other than 0."""
    tree = ast.parse(source)
    in_loop = {id(n) for w in ast.walk(tree) if isinstance(w, ast.While) for n in ast.walk(w)}
    bad = []
    top = ast.Module(body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                    ast.ClassDef))], type_ignores=[])
    for fn in [top, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        timed = _timed_names(fn)
        for a in (n for n in ast.walk(fn) if isinstance(n, ast.Assert) and id(n) not in in_loop):
            for c in (n for n in ast.walk(a.test) if isinstance(n, ast.Compare)):
                sides = [c.left, *c.comparators]
                for op, lhs, rhs in zip(c.ops, sides, sides[1:]):
                    if not isinstance(op, ORDER) or _is_zero(lhs) or _is_zero(rhs):
                        continue
                    if any(_calls_timer(s) or _names(s) & timed for s in (lhs, rhs)):
                        bad.append(a.lineno)
    return sorted(set(bad))


def test_the_check_finds_timed_asserts():
    assert timed_asserts("def f():\n    mine = cuda_ms(g)\n    theirs = cuda_ms(h)\n    assert mine < theirs\n") == [4]
    assert timed_asserts("def f():\n    ms = {k: cuda_ms(v) for k, v in x}\n    assert ms['a'] < ms['b']\n") == [3]
    assert timed_asserts("import time\nt0 = time.perf_counter()\nt = time.perf_counter() - t0\nassert t < 5\n") == [4]
    assert timed_asserts("def f():\n    ms = cuda_ms(g)\n    assert ms > 0\n    print(ms)\n") == []
    assert timed_asserts("def f():\n    while x:\n        assert time.monotonic() < deadline\n") == []


def test_no_test_asserts_on_a_measured_time():
    bad = [f"{p.relative_to(TESTS.parent)}:{line}" for p in sorted(TESTS.rglob("*.py"))
           for line in timed_asserts(p.read_text())]
    assert not bad, f"timed asserts (move the speed to bench/, print or record it): {bad}"
