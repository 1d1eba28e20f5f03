"""The fused decode prologue (titan_mm.kernels.norm_rope_cache, kernel op ``norm_rope_cache``): q/k RMSNorm, RoPE on
q and k and the paged cache write of k and v in one Triton launch, against the PyTorch ops it replaces (nn's
rms_norm, apply_rope and KVCache.write's index_copy_), composed, through TRITON_INTERPRET=1; and the engine on CPU,
where the op is the reference composition, serving the greedy tokens of the unfused ops.

Bounds (u: the unit roundoff of the dtype; u32 = 2^-24). A = |y1 c| + |y2 s| per output element, y the normed
head halves, c / s the table:
- fp32, kernel against the fp32 references: the two compute mean(x^2) over K terms in other orders (each within
  gamma_K of the exact sum, K u32), then eps, rsqrt (within 9 u32: PTX's rsqrt.approx.f32 is within 2^-22.9
  relative, numpy's 1/sqrt rounds twice) and the two multiplies: y within (K / 2 + 12) u32 relative of the exact
  value on each side, (K + 24) u32 apart; the rotation rounds two products and a sum on each side: 4 u32 A more.
  So |kernel - reference| <= (K + 28) u32 A. v is a copy: exact. Slots no row names stay as they were.
- fp16 / bf16, against the exact (float64) formula on the same inputs: the kernel rounds the normalized value and
  its product with the weight (2u relative of y), its fp32 statistics and rotation add at most (K + 16) u32 A, and
  the store rounds once: |kernel - exact| <= (2r + (K + 16) u32) A + r |exact|, r = u for a rounding to nearest,
  2u for the interpreter's bf16 casts (Triton 3.6 truncates them: `_convert_float`). The references round the two
  products and the sum of the rotation in the dtype as well (3u A + u |exact| with the norm's 2u), so kernel and
  reference are within the sum of both bounds.
Cases: GQA 1 / 4 / 8, head dims 64 / 128 (and 80: masked halves), block sizes 8 / 16 / 128, the fused qkv row's
column views and separate tensors, no q/k norm (Qwen2.5), a half table (K / 2), M-RoPE tables (Qwen3-VL's
interleaved sections, Qwen2.5-VL's chunked ones) from three different position streams, and pad rows that write
their k / v to one scratch slot (with the same inputs, as a decode step's pad rows have).

Run: pytest -q tests/unit/test_norm_rope_cache.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.triton_interp import run_interpreted
from tests.unit.test_serve_weights import _prompts, _randomize
from titan_mm import kernels as K
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.nn.attention import Attention
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

_INTERP = r"""
from tests.unit._norm_rope_cache_check import CASES, check
bad = [msg for case in CASES for msg in check(case, interpreted=True)]
print("BAD" if bad else "OK", bad)
"""


def test_kernel_equals_the_references_composed():
    out = run_interpreted(_INTERP, timeout=600)
    assert "BAD" not in out, out


def test_bad_table_or_pool_is_one_line():
    q, k, v = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)
    pool = torch.zeros(3, 4, 2, 16)
    with pytest.raises(ValueError, match="partial rotary"):
        K.norm_rope_cache(q, k, v, None, None, 1e-6, torch.ones(2, 6), torch.zeros(2, 6), pool, pool.clone(),
                          torch.tensor([0, 1]))


def _tiny(kernels, qk_norm: bool = True, bias: bool = False):
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      qk_norm=qk_norm, attention_bias=bias, kernels=kernels)
    spec = get_model_spec("qwen3")
    model = spec.build(cfg)
    model.init_weights()
    return _randomize(model, 0.1).eval(), spec, cfg


def _count(model) -> list[int]:
    """Wrap every Attention's decode prologue to count its calls; -> the one-element counter."""
    n = [0]
    for m in model.modules():
        if isinstance(m, Attention) and m.decode_prologue is not None:
            op = m.decode_prologue

            def counted(*a, op=op):
                n[0] += 1
                return op(*a)

            m.decode_prologue = counted
    return n


@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True)], ids=["qwen3", "qwen2_no_qk_norm"])
def test_engine_on_cpu_serves_the_unfused_tokens(qk_norm, bias):
    """Kernels on (every op; on CPU each one its reference) takes the fused prologue on every decode step of every
    layer, fused projections or not, and serves the tokens of the model without it and of the plain ops."""
    sc = {"max_model_len": 128, "block_size": 4, "num_blocks": 128, "max_num_seqs": 4}
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(256)
    want = None
    for kernels, fuse in ((False, True), ("all,-norm_rope_cache", True), (True, True), (True, False)):
        model, spec, cfg = _tiny(kernels, qk_norm, bias)
        engine = Engine(copy.deepcopy(model), spec, cfg, ServeConfig(**sc, fuse_projections=fuse), eos_token_ids=[],
                        owns_weights=True)
        calls = _count(engine.model)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, p)]
        want = want or got
        assert got == want, (kernels, fuse)
        on = kernels is True
        # 7 decode steps per request (the first token comes from the prefill), each through both layers
        assert (calls[0] > 0) == on and (not on or calls[0] >= 7 * 2)
