"""bench/kernel_ops.py renders its JSON into the docs table (the GPU run itself happens on the H200)."""

import importlib


def _bench():
    return importlib.import_module("bench.kernel_ops")


def test_render_and_update_doc(tmp_path):
    b = _bench()
    rows = []
    for impl, ms in (("eager", 0.4), ("liger", 0.12), ("titan_mm", 0.1)):
        for mode in ("fwd", "fwd+bwd"):
            rows.append(dict(kernel="rms_norm", shape="x [16384, 4096] bf16", impl=impl, mode=mode, ms=ms,
                             peak_mb=128.0, tb_s=2.7, frac_copy=0.64))
    rows.append(dict(kernel="linear_cross_entropy", shape="h", impl="titan_mm", mode="fwd", ms=30.0, peak_mb=1500.0,
                     tflops=600.0, frac_matmul=0.75))
    md = b.render_markdown({"meta": {"device": "H200"}, "results": rows, "errors": []})
    assert "| rms_norm" in md and "1.20x" in md and "600 TFLOP/s" in md
    doc = tmp_path / "k.md"
    doc.write_text(f"head\n{b.DOC_BEGIN}\nold\n{b.DOC_END}\ntail\n")
    b.update_doc(str(doc), md)
    text = doc.read_text()
    assert "old" not in text and "1.20x" in text and text.startswith("head") and text.endswith("tail\n")


def test_retime_reversed_averages_abba(monkeypatch):
    """The GPU-bound CE is timed A B B A: each implementation's ms becomes the mean of its two timings, the
    rates follow, and the second pass runs in reverse order."""
    b = _bench()
    order = []
    second = {"liger": 110.0, "titan_mm": 100.0}

    def fake_run_case(name, case, impl, fn, do_compile):
        order.append(impl)
        return [dict(kernel=name, impl=impl, mode="fwd+bwd", ms=second[impl], peak_mb=1.0)]

    monkeypatch.setattr(b, "run_case", fake_run_case)
    fl = 6e12
    rows = [dict(kernel="ce", impl=i, mode="fwd+bwd", ms=ms, peak_mb=1.0, flops=fl, tflops=0.0, frac_matmul=0.0)
            for i, ms in (("liger", 100.0), ("titan_mm", 104.0))]
    case = {"impls": {"liger": object(), "titan_mm": object()}}
    errors = []
    b.retime_reversed("ce", case, rows, errors)
    assert order == ["titan_mm", "liger"] and not errors
    by = {r["impl"]: r for r in rows}
    assert by["liger"]["ms"] == 105.0 and by["liger"]["ms_runs"] == [100.0, 110.0]
    assert by["titan_mm"]["ms"] == 102.0 and by["titan_mm"]["ms_runs"] == [104.0, 100.0]
    assert by["titan_mm"]["tflops"] == round(fl / 1e12 / 0.102, 1)
    assert by["titan_mm"]["frac_matmul"] == round(by["titan_mm"]["tflops"] / b.MATMUL_CEILING_TFLOPS, 3)
