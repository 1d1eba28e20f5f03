"""bench/trace_gaps.py: GPU idle gaps in a chrome trace and the host ops open during them."""

import json

import pytest

tg = pytest.importorskip("bench.trace_gaps")


def _x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_gaps_and_host_ops(tmp_path):
    ev = [
        _x("kernel", "k1", 0, 100, tid=7), _x("kernel", "k2", 50, 100, tid=7),  # overlapping: busy 0-150
        _x("gpu_memcpy", "copy", 400, 50, tid=7),  # 250 us gap after k2
        _x("kernel", "k3", 455, 10, tid=7),  # 5 us gap: under the threshold
        _x("kernel", "k4", 1000, 100, tid=7),  # 535 us gap, during the backward thread's op
        _x("cpu_op", "Optimizer.step", 100, 400), _x("cpu_op", "aten::_fused_adamw_", 200, 200),
        _x("cpu_op", "aten::mm", 600, 10), _x("cpu_op", "aten::mm", 610, 10), _x("cpu_op", "aten::mm", 620, 10),
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 500, 450, tid=2),
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = tg.summarize(p, min_us=20, top=5, depth=2)
    assert r["gaps"] == 2 and r["gpu_busy_ms"] == pytest.approx((150 + 50 + 10 + 100) / 1e3)
    assert r["idle_ms"] == pytest.approx((250 + 535) / 1e3)
    assert r["longest"][0]["gap_us"] == 535 and r["longest"][0]["host"] == "autograd::engine::evaluate_function: MmBackward0"
    assert r["idle_by_host_op_ms"]["Optimizer.step > aten::_fused_adamw_"] == pytest.approx(0.25)


def test_a_gap_names_the_innermost_python_frames(tmp_path):
    """With with_stack, python_function events nest under the op: ``host_inner`` reads them innermost first."""
    ev = [
        _x("kernel", "k1", 0, 100, tid=7), _x("kernel", "k2", 1000, 100, tid=7),
        _x("python_function", "bench/mfu.py(500): step", 90, 900),
        _x("python_function", "titan_mm/train/step.py(370): train_step", 95, 890),
        _x("python_function", "titan_mm/objectives/flow_matching.py(190): corrupt", 100, 800),
        _x("cpu_op", "aten::add", 300, 500),
    ]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    gap = tg.summarize(p, min_us=20)["longest"][0]
    assert gap["host_inner"].split(" < ")[:2] == ["aten::add", "titan_mm/objectives/flow_matching.py(190): corrupt"]
    assert gap["host"].startswith("bench/mfu.py(500): step > titan_mm/train/step.py(370): train_step")
