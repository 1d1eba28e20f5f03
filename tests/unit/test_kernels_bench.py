"""bench/kernels.py renders its JSON into the docs table (the GPU run itself happens on the H200)."""

import importlib


def _bench():
    return importlib.import_module("bench.kernels")


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
