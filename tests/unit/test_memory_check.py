"""bench/memory_check.py: the real estimator (titan_mm.parallel.memory) against the peak memory measured on
the H200 (bench/results/mfu.json), on CPU. The best-understood rows must be within 15%."""

import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# memory_check.json first: it keeps the FSDP2 peaks of rows that bench/mfu.py has since measured on the one-rank
# cast path (mfu.json's rows with mixed_precision "cast", which load_measured leaves out)
MEASURED = [os.path.join(ROOT, "bench", "results", n) for n in ("memory_check.json", "mfu.json")]
BEST_UNDERSTOOD = [("qwen3_1.7b", "titan", "none"), ("qwen3_1.7b", "titan", "full"), ("qwen3_4b", "titan", "none")]


def _bench():
    return importlib.import_module("bench.memory_check")


def _measured(b):
    path = next((p for p in MEASURED if os.path.exists(p)), None)
    if path is None:
        pytest.skip("no measured peaks (bench/results/mfu.json or memory_check.json)")
    return b.load_measured(path)


def test_best_understood_rows_within_15_percent():
    b = _bench()
    measured = _measured(b)
    rows = b.check(measured, rows=BEST_UNDERSTOOD)
    assert [(r["case"], r["stack"], r["ac"]) for r in rows] == BEST_UNDERSTOOD
    for r in rows:
        assert abs(r["rel_error"]) <= 0.15, (r["case"], r["ac"], r["estimate_gib"], r["measured_gib"])
        # the breakdown adds up to the estimate and the peak phase is the largest one
        assert abs(sum(v for k, v in r["breakdown_gib"].items() if k != "total") - r["estimate_gib"]) < 0.01
        assert r["estimate_gib"] >= max(r["phases_gib"].values()) - 1e-3
    by = {(r["case"], r["ac"]): r for r in rows}
    # no AC peaks when the backward starts (all activations saved); full AC when the gradients have piled up
    assert by[("qwen3_1.7b", "none")]["peak_phase"].startswith("backward_block_")
    assert by[("qwen3_1.7b", "none")]["breakdown_gib"]["grads"] == 0.0
    assert by[("qwen3_1.7b", "full")]["breakdown_gib"]["grads"] > 4.0
    assert by[("qwen3_1.7b", "full")]["estimate_gib"] < by[("qwen3_1.7b", "none")]["estimate_gib"]


def test_every_row_estimated_and_rendered():
    b = _bench()
    rows = b.check(_measured(b))
    assert len(rows) >= 3
    assert sum(r["within_tolerance"] for r in rows) >= 3
    md = b.render(rows)
    assert md.count("\n") == len(rows) + 1 and "| qwen3_1.7b | titan | none |" in md


def test_chunked_ce_working_set_counts_fp32_chunks():
    """Qwen3-VL's loss is the PyTorch chunked CE: fp32 [C, V] buffers dominate its working set."""
    from titan_mm.parallel.memory import Topology, loss_bytes
    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3_vl")
    cfg = spec.flavor("2B")
    work, keep = loss_bytes(cfg, spec.plan(cfg), Topology(), 8192, 2)
    C, V, D = cfg.text.loss_chunk_size, cfg.text.vocab_size, cfg.text.hidden_size
    assert work == 4 * V * D + 2 * 8192 * D + (16 + 2) * C * V
    assert keep == 2 * V * D + 2 * 8192 * D


def test_multi_gpu_trainer_runs_within_15_percent():
    """The FSDP2 / tp2 / cp2 / ep2 runs on two H200s (and their 1-GPU references, with gradient accumulation)."""
    b = _bench()
    rows = [b.estimate_multi_gpu(r) for r in b.MULTI_GPU_ROWS]
    assert {r["world"] for r in rows} == {1, 2}
    for r in rows:
        assert abs(r["rel_error"]) <= 0.15, (r["run"], r["estimate_gib"], r["measured_gib"])
    # accumulation keeps every gradient shard alive: the 1-GPU 1.7B run (2 micro-batches) holds 4 bytes / param more
    by = {r["run"]: r for r in rows}
    assert by["scaling qwen3_1.7b_w1"]["breakdown_gib"]["grads"] > 6.0
