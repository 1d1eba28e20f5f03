"""float8 experts on the CPU: the padded token layout (every expert's group a multiple of 16 rows, the layout the
float8 grouped GEMMs need) gives the unpadded layout's outputs and gradients (fp32; the GEMMs are the loop over
experts on both layouts), the switch reaches the experts from the job config, the trainer refuses it until it pays
(0.70x bf16 measured), and a config that cannot run it stops before the model is built. The float8 GEMMs themselves run on the H200 (tests/gpu/test_grouped_mm_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_mm.config import MEASURE_FLOAT8_EXPERTS, ConfigError, load_config
from titan_mm.nn import moe

ROOT = Path(__file__).resolve().parents[2]


def _top_i(N, K, E, g):
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])


@pytest.mark.parametrize("N,K,E", [(37, 3, 6), (5, 2, 8), (40, 1, 2)])
def test_padded_layout(N, K, E):
    """Groups of multiples of 16 rows at static offsets, every assignment once, pad rows marked by src N."""
    top_i = _top_i(N, K, E, torch.Generator().manual_seed(N))
    r, p = moe.sort_by_expert(top_i, E), moe.sort_by_expert(top_i, E, moe.FLOAT8_ALIGN)
    P = p.src_A.numel()
    assert P % 16 == 0 and P == -(-(N * K + 15 * E) // 16) * 16 and int(p.counts_E.sum()) == P
    assert bool((p.counts_E % 16 == 0).all()) and bool((p.counts_E >= r.counts_E).all())
    real = p.src_A < N
    assert int(real.sum()) == N * K and bool((p.src_A[~real] == N).all())
    # every token's k-th assignment sits in its expert's group, at its unpadded place within the group
    e_NK = torch.repeat_interleave(torch.arange(E), p.counts_E)[p.inv_NK]
    assert torch.equal(p.src_A[p.inv_NK], torch.arange(N)[:, None].expand(N, K))
    assert torch.equal(e_NK, top_i.sort(1).values)
    start, start_r = (torch.cumsum(c, 0) - c for c in (p.counts_E, r.counts_E))
    assert torch.equal(p.inv_NK - start[e_NK], r.inv_NK - start_r[e_NK])
    assert torch.equal(p.order_A[p.inv_NK], r.order_A[r.inv_NK])


def test_padded_experts_equal_unpadded():
    """Forward and every gradient (tokens, router weights, expert weights): pad rows are zeros that the combine never
    reads, so the weight gradients are the unpadded ones; expert 0 gets no token (an empty group)."""
    g = torch.Generator().manual_seed(0)
    N, D, F, E, K = 21, 16, 32, 6, 2
    top_i = _top_i(N, K, E - 1, g) + 1
    plain = moe.GroupedExperts(D, F, E)
    plain.reset_parameters(0.2)
    f8 = moe.GroupedExperts(D, F, E, float8=True)
    f8.load_state_dict(plain.state_dict())
    x, top_w, dy = torch.randn(N, D, generator=g), torch.rand(N, K, generator=g), torch.randn(N, D, generator=g)
    seen, real_swiglu = [], moe.grouped_swiglu

    def spy(x_AD, counts_E, w1, w3, w2, float8, mm):
        seen.append((x_AD.detach().clone(), counts_E.clone(), float8))
        return real_swiglu(x_AD, counts_E, w1, w3, w2, float8, mm)

    results = []
    moe.grouped_swiglu = spy
    try:
        for layer in (plain, f8):
            xs = [t.clone().requires_grad_() for t in (x, top_w)]
            y = layer(xs[0], xs[1], top_i)
            y.backward(dy)
            results.append([y] + [t.grad for t in xs] + [p.grad for p in layer.parameters()])
    finally:
        moe.grouped_swiglu = real_swiglu
    (x0, c0, f0), (x1, c1, f1) = seen
    assert not f0 and f1 and x0.shape[0] == N * K and x1.shape[0] == -(-(N * K + 15 * E) // 16) * 16
    assert int(c1[0]) == 0 and bool((c1 % 16 == 0).all())
    real = torch.zeros(x1.shape[0], dtype=torch.bool)
    real[moe.sort_by_expert(top_i, E, moe.FLOAT8_ALIGN).inv_NK.reshape(-1)] = True
    assert not x1[~real].any() and torch.equal(x1[real], x0)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_the_switch_reaches_the_experts():
    """model config moe_float8 (the trainer's float8.moe_experts) -> Ops -> every MoE layer, same loss as off."""
    from titan_mm.registry import resolve_model

    spec, cfg = resolve_model("qwen3_moe", "debug_moe", overrides={"num_hidden_layers": 2, "vocab_size": 256},
                              moe_float8=True)
    assert cfg.moe_float8 and "moe_float8" not in cfg.to_hf_dict()
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    experts = [m for m in model.modules() if isinstance(m, moe.GroupedExperts)]
    assert experts and all(m.float8 for m in experts)
    off = spec.build(cfg.replace(moe_float8=False))
    off.load_state_dict(model.state_dict())
    assert not any(m.float8 for m in off.modules() if isinstance(m, moe.GroupedExperts))
    ids = torch.randint(0, 256, (2, 16))
    losses = [m(ids, labels=ids).loss_sum for m in (model, off)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    # the VL MoE family pushes it into its text config
    _, vl = resolve_model("qwen3_vl_moe", "debug", moe_float8=True)
    assert vl.text.moe_float8


def test_float8_experts_are_refused_until_they_pay(monkeypatch):
    """0.70x bf16 measured: the switch is one config error (exit 2 from the trainer's CLI) before anything is built,
    saying why and what to use; dense float8 stays allowed; the bench's variable lets it through."""
    monkeypatch.delenv(MEASURE_FLOAT8_EXPERTS, raising=False)
    argv = ["--model.name", "qwen3_moe", "--model.flavor", "debug_moe", "--training.param_dtype", "bfloat16"]
    with pytest.raises(ConfigError, match=r"float8.moe_experts is refused: .* 0.70x .* >= 1.2x; drop "
                                          r"--float8.moe_experts .*--float8.enable still"):
        load_config(argv + ["--float8.moe_experts", "true"])
    assert load_config(argv + ["--float8.enable", "true"]).float8.enable
    env = {k: v for k, v in os.environ.items() if k != MEASURE_FLOAT8_EXPERTS}
    r = subprocess.run([sys.executable, "-m", "titan_mm.launch.train", *argv, "--float8.moe_experts", "true"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: float8.moe_experts is refused"), r.stderr
    monkeypatch.setenv(MEASURE_FLOAT8_EXPERTS, "1")
    assert load_config(argv + ["--float8.moe_experts", "true"]).float8.moe_experts


def test_bench_still_measures_float8_experts(monkeypatch):
    """bench/mfu.py's float8-expert stacks get their config (the variable set in their worker); the others do not
    set it, and their configs keep the experts in bf16."""
    mfu = pytest.importorskip("bench.mfu")
    monkeypatch.delenv(MEASURE_FLOAT8_EXPERTS, raising=False)
    args = mfu.build_parser().parse_args(["--cases", "qwen3_30b_a3b_4l"])
    case = mfu.CASES["qwen3_30b_a3b_4l"]
    assert not mfu.titan_config(case, "titan_opt", args).float8.moe_experts
    assert os.environ.get(MEASURE_FLOAT8_EXPERTS) is None
    for stack in mfu.F8_EXPERT_STACKS:
        cfg = mfu.titan_config(case, stack, args)
        assert cfg.float8.moe_experts and cfg.training.param_dtype == "bfloat16"
    assert os.environ[MEASURE_FLOAT8_EXPERTS] == "1"  # monkeypatch removes it after the test


def test_config_errors_before_the_model_is_built(monkeypatch):
    from titan_mm.train.setup import model_from_config

    monkeypatch.setenv(MEASURE_FLOAT8_EXPERTS, "1")  # the checks behind the refusal, as bench/mfu.py meets them
    with pytest.raises(ConfigError, match="float8.moe_experts needs training.param_dtype='bfloat16'"):
        load_config(["--model.name", "qwen3_moe", "--model.flavor", "debug_moe", "--float8.moe_experts", "true"])
    bf16 = ["--float8.moe_experts", "true", "--training.param_dtype", "bfloat16"]
    dense = load_config(["--model.name", "qwen3", "--model.flavor", "debug"] + bf16)
    with pytest.raises(ConfigError, match="needs a MoE model"):
        model_from_config(dense, torch.device("cpu"))
    moe_cfg = load_config(["--model.name", "qwen3_moe", "--model.flavor", "debug_moe"] + bf16)
    with pytest.raises(ConfigError, match="needs a CUDA GPU with SM>=90"):
        model_from_config(moe_cfg, torch.device("cpu"))
