"""The GPU suite's areas (tests/gpu/shards.py, run by scripts/gpu_verify.sh --area X) cover every GPU test exactly
once: every test function of tests/gpu/test_*.py and every gpu-marked one elsewhere under tests/; the smoke set
names existing GPU tests; each area's estimate fits its time limit; a wrong area is one line and exit 2; the
summary counts the JUnit XML, or the -v log when the time limit killed pytest first."""

from __future__ import annotations

import ast
import subprocess
from collections import Counter
from pathlib import Path

from tests.gpu.shards import AREAS, LIMIT_S, SMOKE, summarize

ROOT = Path(__file__).resolve().parents[2]


def _is_gpu_mark(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "gpu" and "mark" in ast.unparse(node)


def gpu_tests() -> dict[str, set[str]]:
    """file -> its GPU test functions: all of a module marked gpu (pytestmark), else those decorated gpu."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and any(_is_gpu_mark(x) for x in ast.walk(n.value)) for n in tree.body)
        tests = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name.startswith("test_") and (marked or any(_is_gpu_mark(x) for d in n.decorator_list
                                                                   for x in ast.walk(d)))}
        if tests:
            out[str(path.relative_to(ROOT))] = tests
    return out


def _expand(entry: str, tests: dict[str, set[str]]) -> set[tuple[str, str]]:
    path, _, name = entry.partition("::")
    assert path in tests, f"{entry}: no GPU tests in {path}"
    name = name.split("[")[0]
    assert not name or name in tests[path], f"{entry}: {path} has no GPU test {name}"
    return {(path, t) for t in tests[path] if not name or t == name}


def test_every_gpu_test_file_is_marked():
    tests = gpu_tests()
    for path in sorted((ROOT / "tests/gpu").glob("test_*.py")):
        src = path.read_text()
        defined = {n.name for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        assert defined and tests.get(str(path.relative_to(ROOT))) == defined, f"{path.name}: set pytestmark gpu"


def test_areas_cover_every_gpu_test_exactly_once():
    tests = gpu_tests()
    assert "tests/unit/test_attention_kinds.py" in tests  # gpu-marked tests outside tests/gpu are found
    seen = Counter(t for entries in AREAS.values() for e in entries for t in _expand(e, tests))
    every = {(p, t) for p, ts in tests.items() for t in ts}
    assert not every - set(seen), f"in no area of tests/gpu/shards.py: {sorted(every - set(seen))}"
    assert not [t for t, n in seen.items() if n > 1], f"in two areas: {[t for t, n in seen.items() if n > 1]}"


def test_smoke_names_gpu_tests_and_areas_fit_their_limits():
    tests = gpu_tests()
    for e in SMOKE:
        assert _expand(e, tests)
    assert sum(SMOKE.values()) <= LIMIT_S["smoke"]
    for name, entries in AREAS.items():
        assert sum(entries.values()) <= LIMIT_S["area"], name


def test_gpu_verify_refuses_an_unknown_area_in_one_line():
    r = subprocess.run(["bash", "scripts/gpu_verify.sh", "--area", "kernel"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "gpu_verify: unknown GPU area 'kernel'; choose one of: smoke, " + ", ".join(AREAS)], r.stderr


def test_summary_of_a_run_cut_off_by_the_limit(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("collected 3 items\n\ntests/gpu/test_serve_gpu.py::test_a[qwen3] PASSED   [ 33%]\n"
                   "tests/gpu/test_serve_gpu.py::test_b FAILED   [ 66%]\nsome print\n")
    s = summarize("serve", str(tmp_path / "missing.xml"), str(log), 480.0, 124)
    assert (s["tests"], s["passed"], s["failed"], s["timed_out"], s["ok"]) == (2, 1, 1, True, False)
    assert s["failed_tests"] == ["tests/gpu/test_serve_gpu.py::test_b"] and s["device"]
