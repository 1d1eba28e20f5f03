"""The mixed-row paged attention kernel on CUDA (titan_mm.kernels.paged_attention), and the engine with it
(serve.mixed_attention): bf16 and fp32 pools equal the reference for packed batches of decode rows, prefill chunks
with and without a cached prefix (up to 700 keys, chunks of 300) and an idle row (GQA, block sizes 16 and 256, a
sliding window), with no host sync (torch.cuda.set_sync_debug_mode("error")) once compiled, fp8 pools too
(serve.kv_cache_dtype); the fp32 engine with
it matches transformers' generate with every model step sync-free (chunked prefill, n-gram speculation under
preemption; Qwen3 and Qwen3-VL with images), and the bf16 engine's greedy tokens with it equal those without; the fp32 engine with an fp8 cache gives the
greedy tokens of a decode loop over the library's contiguous fp8 cache.

Tolerances: fp32 IEEE dots, summation order only (1e-5 on outputs |o| < 6, as the decode kernel's test); bf16
rounds q x scale and the probabilities to bf16 before the dots (2^-8 relative each): 2 x 2^-8 x 6 < 5e-2. Greedy
bf16 tokens: equal up to the first step whose top-2 logprob gap (without mixed_attention) is under 2^-8 x 16
(bf16's step on logits up to 16 in magnitude): there either path may round to the other token; after it nothing
is compared.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_paged_attention_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.test_serve_gpu import drive
from tests.parity.test_serve_generate import CASES, MAX_NEW, text_setup, vl_setup
from tests.unit.test_kv_cache_fp8 import CASES as FP8_CASES
from tests.unit.test_kv_cache_fp8 import PROMPTS, greedy_over_fp8_cache, tiny_qwen3
from titan_mm.kernels import paged_attention, paged_decode_attention
from titan_mm.nn.kv_cache import paged_attention_reference
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GAP = 2.0 ** -8 * 16


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H,G,K,BS,window", [(16, 8, 128, 16, None), (32, 4, 128, 256, None), (14, 2, 64, 16, 100)])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode_rows"])
def test_kernel_matches_reference_without_sync(dtype, tol, H, G, K, BS, window, decode_only):
    torch.manual_seed(0)
    q_lens = [1] * 8 if decode_only else [1, 300, 0, 1, 37, 1, 120, 1]
    seq_lens = [700, 300, 64, 1, 437, 250, 620, 90]  # chunk rows: no prefix (300), prefixes of 400 and 500
    B, MB = len(q_lens), -(-max(seq_lens) // BS)
    NB = B * MB
    kp, vp = (torch.randn(NB, BS, G, K, device="cuda").to(dtype) for _ in "kv")
    tables = torch.randperm(NB, device="cuda")[: B * MB].view(B, MB).to(torch.int32)
    cu = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, K, device="cuda").to(dtype)
    paged_attention(q, kp, vp, tables, lens, cu, window)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = paged_attention(q, kp, vp, tables, lens, cu, window)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = paged_attention_reference(q, kp, vp, tables, lens, cu, window)
    assert got.dtype == dtype and float((got.float() - want.float()).abs().max()) <= tol


@pytest.mark.parametrize("case", ["mixed_attention", "mixed_spec_preempt"])
@pytest.mark.parametrize("model", ["qwen3", "qwen3_vl"])
def test_fp32_engine_with_it_has_no_host_sync_and_matches_hf(model, case):
    tm, spec, prompts, images, eos, refs, data = (text_setup(False) if model == "qwen3" else vl_setup(False))
    cfg = ServeConfig(max_model_len=256, dtype="float32", **CASES[case])
    engine = Engine(copy.deepcopy(tm), spec, tm.cfg, cfg, device="cuda", eos_token_ids=[eos], data=data)
    assert engine.runner.mixed
    assert drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images) == refs
    assert engine.stats()["kv_blocks_used"] == 0


def test_bf16_greedy_tokens_equal_without_it():
    tm, spec, prompts, _, eos, _, data = text_setup(False)
    runs = []
    for mixed in (False, True):
        cfg = ServeConfig(max_model_len=256, block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8,
                          mixed_attention=mixed)
        engine = Engine(copy.deepcopy(tm), spec, tm.cfg, cfg, device="cuda", eos_token_ids=[eos], data=data)
        assert engine.dtype == torch.bfloat16 and engine.runner.mixed == mixed
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2))
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    compared = 0
    for (want, lps), (got, _) in zip(*runs):
        for i, (w, lp) in enumerate(zip(want, lps)):
            top = sorted(lp.values(), reverse=True)
            if len(top) > 1 and top[0] - top[1] < GAP:
                break  # a near tie: either token is right in bf16, and the rest follows from it
            assert i < len(got) and got[i] == w, (want, got)
            compared += 1
    assert compared >= len(prompts)  # not all skipped as ties


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode_rows"])
def test_kernels_over_fp8_pools_match_the_reference_without_sync(dtype, tol, decode_only):
    """serve.kv_cache_dtype fp8_e4m3: the kernels load float8 keys / values and convert them to the query's dtype
    (exact), so they equal the reference over the same values with the tolerances above."""
    torch.manual_seed(1)
    H, G, K, BS = 16, 8, 128, 16
    q_lens = [1] * 8 if decode_only else [1, 300, 0, 1, 37, 1, 120, 1]
    seq_lens = [700, 300, 64, 1, 437, 250, 620, 90]
    B, MB = len(q_lens), -(-max(seq_lens) // BS)
    kp, vp = (torch.randn(B * MB, BS, G, K, device="cuda").to(torch.float8_e4m3fn) for _ in "kv")
    tables = torch.randperm(B * MB, device="cuda").view(B, MB).to(torch.int32)
    cu = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, K, device="cuda").to(dtype)
    run = (lambda: paged_decode_attention(q, kp, vp, tables, lens)) if decode_only else \
        (lambda: paged_attention(q, kp, vp, tables, lens, cu))
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = paged_attention_reference(q, kp.to(dtype), vp.to(dtype), tables, lens, cu)
    assert got.dtype == dtype and float((got.float() - want.float()).abs().max()) <= tol


@pytest.mark.parametrize("case", ["default", "chunked", "apart"])
def test_fp32_engine_with_an_fp8_cache_equals_the_fp8_decode_loop_on_cuda(case):
    """The CPU test's comparison on the GPU: the Triton kernels (decode, mixed, the fused prologue's fp8 store)
    against the library's contiguous fp8 cache and SDPA, fp32 math."""
    model, spec = tiny_qwen3()
    model = model.cuda()
    want = [greedy_over_fp8_cache(model, p, 12) for p in PROMPTS]
    e = Engine(model, spec, model.cfg, ServeConfig(kv_cache_dtype="fp8_e4m3", dtype="float32", block_size=4,
                                                   num_blocks=64, max_model_len=64, **FP8_CASES[case]), device="cuda")
    outs = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
