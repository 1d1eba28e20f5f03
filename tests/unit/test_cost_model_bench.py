"""bench/cost_model.py: the fit recovers known coefficients from synthetic timings, the rows it builds carry the
RowCost they claim, and a --cpu smoke run writes its results and a coefficient file but never the shipped one."""

import json

import numpy as np
import pytest

from titan_mm.data.balance import COEFFICIENTS_FILE, RowCost, load_coefficients

cm = pytest.importorskip("bench.cost_model")

# seconds per unit at depth n: c_row + n c_layer + tokens (f_tok + n l_tok) + n l_attn sum L^2 + v terms
TRUE = dict(c_row=2e-3, c_layer=3e-4, f_tok=1.1e-6, l_tok=3.5e-7, l_attn=9e-12, v_patch=4e-6, v_attn=6e-11)


def _timings(rows, depths, noise, seed=0):
    t = np.array([TRUE["c_row"] + n * TRUE["c_layer"] + r.tokens * (TRUE["f_tok"] + n * TRUE["l_tok"])
                  + n * TRUE["l_attn"] * r.doc_sq + TRUE["v_patch"] * r.patches + TRUE["v_attn"] * r.patch_sq
                  for r, n in zip(rows, depths)])
    return t * (1 + noise * np.random.default_rng(seed).standard_normal(t.size))


@pytest.mark.parametrize("vision", [False, True])
@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_fit_recovers_coefficients(vision, noise):
    design = [cm.row_cost(r) for r in cm.design_rows(8192, 2, vision)]
    rows, depths = design * 2, [4] * len(design) + [8] * len(design)
    f = cm.fit(rows, depths, _timings(rows, depths, noise), full_depth=28, row_len=8192)
    want = {"a_tok": (TRUE["c_row"] + 28 * TRUE["c_layer"]) / 8192 + TRUE["f_tok"] + 28 * TRUE["l_tok"],
            "a_attn": 28 * TRUE["l_attn"], "v_patch": TRUE["v_patch"] * vision, "v_attn": TRUE["v_attn"] * vision}
    tol = 1e-6 if noise == 0 else 0.08  # 1% timing noise, extrapolated from depth 4..8 to 28
    for k, v in want.items():
        assert getattr(f["full"], k) == pytest.approx(v, rel=tol, abs=1e-15), k
    # the validation's check: a full row (the row's fixed cost is spread over a full row's tokens) at a measured depth
    row = RowCost.of([4096, 3000, 1096], [64 * 64, 16 * 16] if vision else [])
    assert f["at"](8).cost(row) == pytest.approx(float(_timings([row], [8], 0)[0]), rel=max(tol, 1e-6))


def test_nnls_keeps_terms_non_negative():
    A = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    x = cm.nnls(A, np.array([3.0, 2.0, 1.0]))  # the unconstrained slope is -1
    assert (x >= 0).all() and x[1] == 0 and x[0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two decoder depths"):
        cm.fit([RowCost.of([10])], [4], [1.0], 28, 8192)


def test_rows_carry_their_row_cost():
    for docs in cm.design_rows(1024, 2, True) + cm.mix_rows(8, 1024, True, seed=0):
        n = sum(t for t, _ in docs)
        assert n <= 1024 and all(t >= sum(p // 4 + 2 for p in s) for t, s in docs), docs
        for _, segs in docs:
            for p in segs:
                h, w = cm._grid(p, 2)
                assert h * w == p and h % 2 == 0 and w % 2 == 0
    assert all(not s for r in cm.mix_rows(8, 1024, False, seed=0) for _, s in r)  # text family: no images


def test_cpu_smoke_writes_results_and_a_coefficient_copy(tmp_path):
    shipped = COEFFICIENTS_FILE.read_text()
    out = tmp_path / "cm.json"
    res = cm.main(["--cpu", "--cases", "qwen3:debug", "--seq-len", "128", "--batches", "2", "--validate-depth", "4",
                   "--out", str(out)])
    assert COEFFICIENTS_FILE.read_text() == shipped
    saved = json.loads(out.read_text())
    v = saved["cases"]["qwen3:debug"]["validation"]
    assert len(v["batches"]) == 2 and v["depth"] == 4 and {"predicted_s", "measured_s", "rel_err"} <= set(v["batches"][0])
    assert "mean_abs_rel_err" in v and saved["cases"]["qwen3:debug"]["design"]
    fitted = load_coefficients("qwen3:debug", tmp_path / "cost_coefficients.json")
    assert fitted.source.startswith("fitted by bench/cost_model.py") and fitted.a_tok > 0
    assert load_coefficients("qwen3:1.7b", tmp_path / "cost_coefficients.json") == load_coefficients("qwen3:1.7b")
    assert res["coefficients_out"] == str(tmp_path / "cost_coefficients.json")
    with pytest.raises(SystemExit):
        cm.main(["--cpu", "--cases", "qwen3:debug", "--coefficients-out", str(COEFFICIENTS_FILE)])
