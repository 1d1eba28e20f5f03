"""Benches that know their machine: bench/ceilings.py measures copy bandwidth and bf16 matmul on the device it runs
on (here the CPU: the fields, not the figures), bench/serve.py's rooflines divide by the bandwidth they are given
(no H200 constant), and bench/mfu.py refuses, as a row that says so, a (case, stack) whose H200 peak does not fit
the device's memory or whose stack would train another model (torchtitan on the vision cases)."""

from __future__ import annotations

import torch

from bench import ceilings
from bench.mfu import CASES, does_not_fit, not_comparable
from bench.serve import roofline_s

H100 = {"device": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2}
H200 = {"device": "NVIDIA H200", "memory_gib": 139.8}


def test_measure_reports_the_device_and_its_ceilings():
    c = ceilings.measure(torch.device("cpu"))
    assert set(c) == {"device", "memory_gib", "copy_tb_s", "bf16_tflops", "copy_bytes", "matmul_n", "torch"}
    assert c["device"] == "cpu" and c["memory_gib"] is None
    assert c["copy_tb_s"] > 0 and c["bf16_tflops"] > 0 and c["copy_bytes"] == ceilings.SIZES["cpu"][0]


def test_serve_roofline_scales_with_the_measured_bandwidth():
    args = ([100, 200, 300], [10, 20, 30], 2, 10**9, 10**5)
    h100, h200 = roofline_s(*args, tb_s=3.0), roofline_s(*args, tb_s=4.3)
    assert h100 > h200 and abs(h100 * 3.0 - h200 * 4.3) <= 1e-12 * h100 * 3.0
    # one request of 3 new tokens: 3 steps, each reading 1e12 weight bytes at 1 TB/s
    assert roofline_s([1], [3], 1, 10**12, 0, tb_s=1.0) == 3.0


def test_cases_over_80gb_are_refused_on_an_h100_only():
    marked = {(c, s) for c, case in CASES.items() for s in case.get("over_80gb", {})}
    assert ("qwen3_vl_8b_12l", "titan") in marked and ("qwen3_1.7b", "titan") not in marked
    for case, stack in marked:
        assert does_not_fit(case, stack, H100) and "79.2 GiB" in does_not_fit(case, stack, H100)
        assert does_not_fit(case, stack, H200) is None
    assert does_not_fit("qwen3_1.7b", "titan", H100) is None
    assert does_not_fit("qwen3_vl_8b_12l", "titan", {"error": "no CUDA"}) is None  # unknown memory: run it


def test_torchtitan_is_no_peer_of_the_vision_cases():
    """torchtitan 0.2.2 has no Qwen3-VL / Omni model: its stack on a VL case would train the text decoder alone, so
    the driver refuses it with a row that says so."""
    assert "text decoder alone" in not_comparable("qwen3_vl_8b_12l", "torchtitan")
    assert not_comparable("qwen3_vl_8b_12l", "hf_liger") is None and not_comparable("qwen3_8b_12l", "torchtitan") is None


def test_a_failed_worker_keeps_its_exception_lines_before_a_graph_dump():
    """A compile error is followed by the graph it failed on: the row keeps the exception lines, not the dump's
    last line (2026-12-06: a bagel_ref row read 'failed: default](args = (%mul_100, ...')."""
    from bench.mfu import error_lines

    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: torch._inductor.exc.InductorError: LoweringException: AssertionError: index_add on bf16",
        *[f"[rank0]:     %mul_{i} : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor]" for i in range(50)],
        "[rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace",
    ])
    assert error_lines(stderr) == ("[rank0]: torch._inductor.exc.InductorError: LoweringException: AssertionError: "
                                   "index_add on bf16\n")
    assert error_lines("all fine\n") == ""
