"""The engine with fused projections (serve.fuse_projections on a model it owns: q/k/v in one GEMM, gate/up in one)
serves the same greedy tokens as transformers' ``generate``, and so as the unfused engine of
tests/parity/test_serve_generate.py, on every one of its serving cases (prefix cache, padded and packed prefill,
preemption, chunked and whole prefill, n-gram and draft speculation) for Qwen3, Qwen3-MoE (its attention fused;
no dense MLP), Qwen3-VL and Qwen3-VL-MoE with images; and for Qwen3.5 and Qwen3.5-MoE (gated attention and linear
attention stay as they are; the dense MLP and the shared expert are fused) on test_serve_qwen3_5.py's cases. The fused GEMM computes the same dot products in another
blocking (tests/unit/test_serve_weights.py bounds each projection), so the tokens must agree wherever the
unfused engine's do. The unfused engine's cases run in test_serve_generate.py.

Run: pytest -q tests/parity/test_serve_fused.py
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tests.parity import test_serve_qwen3_5 as q35  # noqa: E402
from tests.parity.test_serve_generate import CASES, MAX_NEW, MODELS, N, case_engine  # noqa: E402
from titan_mm.nn.mlp import SwiGLU  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

FAST = ("prefix_cache", "padded_prefill")  # the quick suite; -m slow runs the rest of the cases


def _cases():
    return [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES]


_FUSED: dict = {}


def fused_copy(name: str, tm):
    """The engine's own fused copy of the reference's titan model (once per model; the reference stays unfused)."""
    if name not in _FUSED:
        _FUSED[name] = copy.deepcopy(tm)
    return _FUSED[name]


@pytest.mark.parametrize("case", _cases())
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_engine_greedy_matches_transformers_generate(model, case):
    tm, spec, prompts, images, eos, refs, data = MODELS[model]()
    engine = case_engine(model, case, fused_copy(model, tm), tm, spec, eos, data, owns_weights=True)
    lm = engine.model.language_model if model.startswith("qwen3_vl") else engine.model
    attn = lm.layers["0"].attn
    assert attn.wqkv is not None and not hasattr(attn, "wq")  # the fused layout is what served
    with torch.no_grad():
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images=images)
    got = [o.outputs[0].token_ids for o in outs]
    bad = [i for i in range(N) if got[i] != refs[i]]
    assert not bad, f"prompts {bad} differ from HF generate: got {[got[i] for i in bad]}, HF {[refs[i] for i in bad]}"
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "decode_step" else pytest.mark.slow)
                                  for c in q35.CASES])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fused_qwen3_5_greedy_matches_transformers_generate(case, moe):
    r = q35.reference(moe)
    engine = Engine(fused_copy(f"qwen3_5_{moe}", r["tm"]), get_model_spec("qwen3_5_moe" if moe else "qwen3_5"),
                    r["cfg"], ServeConfig(max_model_len=128, **q35.CASES[case]), eos_token_ids=[r["eos"]],
                    owns_weights=True)
    mlps = [m for m in engine.model.modules() if isinstance(m, SwiGLU)]
    assert mlps and all(m.w13 is not None for m in mlps)  # the dense MLPs (dense) or shared experts (MoE), fused
    outs = engine.generate(r["prompts"], SamplingParams(temperature=0.0, max_tokens=q35.MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == r["refs_eos"]
    q35.assert_idle(engine)
