"""Every row of the generated tables of docs/benchmarks.md and docs/efficiency.md names its device (an H100's rows
and an H200's stand side by side in one results file), and each generated block of docs/benchmarks.md is what its
generator renders from bench/results now (the device comes from the generator, never typed into the page)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
dev = pytest.importorskip("bench.devices")
mfu = pytest.importorskip("bench.mfu")
eff = pytest.importorskip("bench.efficiency")
profile_split = pytest.importorskip("bench.profile_split")
scaling = pytest.importorskip("bench.scaling")
plans = pytest.importorskip("bench.multigpu_plans")
contract_ab = pytest.importorskip("bench.contract_ab")


def _load(name: str) -> dict:
    return json.loads((ROOT / "bench/results" / name).read_text())


def _rendered() -> dict[str, str]:
    """marker -> what its generator renders now (the commands are in docs/benchmarks.md beside each block)."""
    sc, pl = _load("scaling.json"), _load("multigpu_plans.json")
    return {
        "mfu-bench": mfu.render(_load("mfu.json")["rows"]),
        "mfu-kernels": mfu.render(_load("mfu_kernels.json")["rows"]),
        "profile-split": profile_split.render([r for r in _load("mfu_profile.json")["rows"] if "profile_ms" in r]),
        "scaling": scaling.render(sc["runs"], sc["checks"], sc["meta"].get("gpu")),
        "multigpu-plans": plans.render(pl["checks"], pl["mfu"], pl["meta"].get("gpu")),
        "mfu-contract": contract_ab.render(_load("mfu_contract.json")),
    }


def _block(doc: str, marker: str) -> str:
    a, b = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    return doc[doc.index(a) + len(a): doc.index(b)].strip("\n")


def _device_cells(text: str) -> list[tuple[str, str]]:
    """(row, its device cell) of every table row in ``text``; a table without a device column fails."""
    out, col = [], None
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if not ln.startswith("|"):
            col = None
            continue
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if col is None:  # a header
            assert "device" in cells, f"a table without a device column: {ln}"
            col = cells.index("device")
        elif not set(ln) <= set("|-"):
            out.append((ln, cells[col]))
    return out


def test_device_label():
    assert dev.device_label("NVIDIA H200") == "H200"
    assert dev.device_label("NVIDIA H100 80GB HBM3") == "H100 80GB HBM3"
    assert dev.device_label("cpu") == "CPU"
    assert dev.device_label(None) == "not recorded"
    assert dev.device_of({"gpu": "NVIDIA H200"}) == "NVIDIA H200"
    assert dev.device_of({"device": "NVIDIA H100 80GB HBM3", "gpu": "x"}) == "NVIDIA H100 80GB HBM3"
    assert dev.device_of({}, "NVIDIA H200") == "NVIDIA H200"


def test_benchmarks_blocks_are_rendered_and_name_their_device():
    doc = (ROOT / "docs/benchmarks.md").read_text()
    for marker, table in _rendered().items():
        assert _block(doc, marker) == table.strip("\n"), \
            f"docs/benchmarks.md's {marker} block is stale: rerun its generator (the command beside it)"
        rows = _device_cells(table)
        assert rows, marker
        for ln, cell in rows:
            assert cell and cell != "not recorded", f"{marker}: a row without its device: {ln}"


def test_efficiency_rows_name_their_device():
    rows = _device_cells(eff.report().split("### Not measured yet")[0])
    assert rows
    for ln, cell in rows:
        assert cell in {"H200", "H100 80GB HBM3"}, f"a row without its device: {ln}"


def test_an_h100_row_stands_beside_an_h200_row(tmp_path):
    """The same case and stack on two cards: two rows, each naming its card; the peer ratio stays within a card."""
    base = dict(case="qwen3_1.7b", ac="none", tflops=1.0, mfu=0.5, peak_mem_gb=1.0)
    rows = [dict(base, stack="titan", tokens_per_s=100.0, gpu="NVIDIA H200"),
            dict(base, stack="torchtitan", tokens_per_s=50.0, gpu="NVIDIA H200"),
            dict(base, stack="titan", tokens_per_s=80.0, device="NVIDIA H100 80GB HBM3")]
    (tmp_path / "mfu.json").write_text(json.dumps({"rows": rows}))
    table = eff.tables(eff.load(tmp_path)["LLM dense"])
    lines = [ln for ln in "\n".join(table).splitlines() if ln.startswith("| qwen3_1.7b")]
    assert any(ln.startswith("| qwen3_1.7b | H200 | titan | none | 100 |") and ln.endswith("| 2.00x |") for ln in lines)
    assert any(ln.startswith("| qwen3_1.7b | H100 80GB HBM3 | titan | none | 80 |") and ln.endswith("|  |")
               for ln in lines)
