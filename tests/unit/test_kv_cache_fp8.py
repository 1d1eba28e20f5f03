"""A KV cache stored in float8 e4m3 (serve.kv_cache_dtype = "fp8_e4m3"): writes round each key and value to fp8
(torch's cast, round to nearest even, through a byte view since torch has no float8 index_copy_), every read
brings them back in the model's dtype, and nothing else about the attention changes. So:

- the paged kernels over fp8 pools equal the reference over fp32 pools holding the same fp8 values, with the
  tolerances of tests/unit/test_paged_attention.py (fp32 queries: converting an fp8 value to fp32 is exact, so
  only the summation order differs, 3e-5; fp16 queries: the same 6e-3; bf16 queries meet the fp8 keys in fp16,
  the kernels' choice, so 6e-3 plus the bf16 output's rounding, 2^-9 x |o| <= 2^-9 x 6), through
  TRITON_INTERPRET=1 (whose bf16 tl.dot is wrong: the bf16 case checks the fp16 path only); the fused
  decode prologue writes fp8 k / v within one fp8 rounding (2^-4 relative, e4m3's 3 mantissa bits) of the
  composed ops' values, a different summation order in the norm being able to move a value across a rounding
  boundary;
- the engine with an fp8 cache gives, token for token, the greedy tokens of a decode loop over the library's
  contiguous cache in fp8 (the gather path: the same rounding, plain SDPA), whole and chunked prefill, decode
  rows beside chunks in one call (the defaults) and apart; a forked block's copy-on-write is byte for byte;
- an fp8 block is half a bf16 block, the start-up line names the cache dtype, and a bad value or a GPU without
  float8 (capability < 8.9) is one line.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import run_interpreted

from titan_mm.config import ConfigError
from titan_mm.models.qwen3.model import Qwen3Config, Qwen3Model
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.kv_cache import alloc_contiguous_cache, copy_rows, plan_step
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.runner.model_runner import kv_bytes_per_block
from titan_mm.serve.sampling_params import SamplingParams

F8 = torch.float8_e4m3fn


def test_copy_rows_rounds_into_float8_through_bytes():
    g = torch.Generator().manual_seed(0)
    store = torch.zeros(10, 2, 4, dtype=F8)
    rows = torch.randn(3, 2, 4, generator=g) * 100  # some past 448, e4m3's largest finite value
    copy_rows(store, torch.tensor([7, 1, 4]), rows)
    want = rows.to(F8)
    assert all(torch.equal(store[i].view(torch.uint8), want[j].view(torch.uint8)) for j, i in enumerate((7, 1, 4)))
    assert store[0].float().abs().max() == 0 and store.float().abs().max() <= 448
    wide = torch.zeros(10, 2, 4)
    copy_rows(wide, torch.tensor([2]), rows[:1].double())  # other dtypes: index_copy_ as before
    assert torch.equal(wide[2], rows[0])


_INTERP = r"""
import torch
from tests.unit.test_paged_attention import FP16_TOL, FP32_TOL, mixed_batch, sdpa_reference
from titan_mm.kernels import norm_rope_cache as composed
from titan_mm.kernels.norm_rope_cache import norm_rope_cache as fused
from titan_mm.kernels.paged_attention import paged_mixed
from titan_mm.kernels.paged_decode import paged_decode
from titan_mm.nn.kv_cache import paged_decode_reference
F8 = torch.float8_e4m3fn
bad = []
for dt, tol in ((torch.float32, FP32_TOL), (torch.float16, FP16_TOL), (torch.bfloat16, FP16_TOL + 6 * 2.0 ** -9)):
    q, kp, vp, tables, lens, cu = mixed_batch(8, 2, 32, 8, dt)
    k8, v8 = kp.to(F8), vp.to(F8)
    err = float((paged_mixed(q, k8, v8, tables, lens, cu, None).float()
                 - sdpa_reference(q.float(), k8.float(), v8.float(), tables, lens, cu, None)).abs().max())
    if not err <= tol:
        bad.append(f"mixed {dt}: {err}")
    for P in (1, 3):
        qd = q[cu[1:].long() - 1]  # one query per sequence (its last)
        got = paged_decode(qd, k8, v8, tables, lens, None, splits=P)
        want = paged_decode_reference(qd.float(), k8.float(), v8.float(), tables, lens, None)
        err = float((got.float() - want.float()).abs().max())
        if got.dtype != dt or not err <= (1e-5 if dt == torch.float32 else tol):
            bad.append(f"decode {dt} splits {P}: {err}")
g = torch.Generator().manual_seed(2)
B, H, G, D, NB, BS = 3, 8, 2, 64, 6, 4
q, k, v = (torch.randn(B, n, D, generator=g) for n in (H, G, G))
qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
cos, sin = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
slots = torch.tensor([5, 0, 17])
pools = []
for run in (fused, composed):
    kp8, vp8 = torch.zeros(NB, BS, G, D, dtype=F8), torch.zeros(NB, BS, G, D, dtype=F8)
    run(q, k, v, qw, kw, 1e-6, cos, sin, kp8, vp8, slots)
    pools.append((kp8.float(), vp8.float()))
for a, b in zip(*pools):
    if not bool(((a - b).abs() <= 2.0 ** -4 * b.abs() + 2.0 ** -9).all()) or float(b.abs().max()) == 0:
        bad.append(f"norm_rope_cache: {float((a - b).abs().max())}")
print("BAD" if bad else "OK", bad)
"""


def test_kernels_over_fp8_pools_in_the_interpreter():
    run_interpreted(_INTERP)


def tiny_qwen3() -> tuple[Qwen3Model, object]:
    spec = get_model_spec("qwen3")
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3Model(cfg)
    with torch.no_grad():
        model.init_weights()
        for p in model.parameters():  # larger weights: k / v values across fp8's binades, sharper logits
            p.mul_(4.0)
    return model.eval(), spec


@torch.no_grad()
def greedy_over_fp8_cache(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of one prompt through the library's contiguous cache stored in fp8 (the gather path)."""
    c, dev = model.cfg, next(model.parameters()).device
    cache = alloc_contiguous_cache(c.num_hidden_layers, 1, len(prompt) + n, c.num_key_value_heads, c.head_dim, F8,
                                   dev)
    ids, out = torch.tensor([prompt], device=dev), []
    for _ in range(n):
        cache = plan_step(cache, [ids.shape[1]])
        meta = build_attn_meta({"input_ids": ids}, "sdpa", dev, kv_cache=cache)
        step = model(ids, position_ids=cache.step.positions, attn=meta)
        cache = step.kv_cache
        out.append(int(step.logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]], device=dev)
    return out


PROMPTS = [[3, 17, 5, 60, 2, 9, 41], [8, 8, 1], [70, 12, 33, 4, 4, 90, 15, 6, 27, 50, 11], [5]]
CASES = {"default": {}, "chunked": dict(max_num_batched_tokens=4, max_num_seqs=4),
         "apart": dict(mixed_attention=False), "padded": dict(mixed_attention=False, packed_prefill=False)}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_a_decode_loop_over_an_fp8_cache(case):
    model, spec = tiny_qwen3()
    want = [greedy_over_fp8_cache(model, p, 12) for p in PROMPTS]
    e = Engine(model, spec, model.cfg, ServeConfig(kv_cache_dtype="fp8_e4m3", block_size=4, num_blocks=64,
                                                   max_model_len=64, **CASES[case]), device="cpu")
    assert all(p.dtype == F8 for p in e.runner.cache.k + e.runner.cache.v)
    assert "KV cache fp8_e4m3" in e.describe()
    outs = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    # copy-on-write of a forked sequence's block (n > 1 sampling, beams) over fp8 pools: byte for byte
    pool = e.runner.cache.k[0]
    pool[3].copy_(torch.randn(pool[3].shape).to(F8))
    e.runner.copy_blocks([(3, 9)])
    assert torch.equal(pool[9].view(torch.uint8), pool[3].view(torch.uint8)) and pool[9].float().abs().max() > 0
    # the rounding matters: an fp32 cache's tokens differ somewhere, so the comparison above saw the fp8 values
    fp32 = Engine(model, spec, model.cfg, ServeConfig(block_size=4, num_blocks=64, max_model_len=64), device="cpu")
    assert [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))] != want


def test_fp8_blocks_hold_half_the_bytes_and_mistakes_are_one_line():
    dims = get_model_spec("qwen3").dims(tiny_qwen3()[0].cfg)
    assert 2 * kv_bytes_per_block(dims, 16, F8) == kv_bytes_per_block(dims, 16, torch.bfloat16)
    with pytest.raises(ConfigError, match="serve.kv_cache_dtype='fp8' is not a cache dtype"):
        ServeConfig(kv_cache_dtype="fp8").check()
    with pytest.raises(ConfigError, match="needs a CUDA GPU of compute capability >= 8.9"):
        ServeConfig(kv_cache_dtype="fp8_e4m3").check_weights(torch.device("cuda"), False, (8, 0))
    ServeConfig(kv_cache_dtype="fp8_e4m3").check_weights(torch.device("cuda"), False, (9, 0))  # Hopper: fine
    assert ServeConfig(kv_cache_dtype="fp8_e4m3").kv_dtype(torch.device("cpu")) == F8
    assert ServeConfig().kv_dtype(torch.device("cpu")) == torch.float32
