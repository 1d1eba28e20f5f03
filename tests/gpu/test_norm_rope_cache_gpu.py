"""The fused decode prologue on a GPU (titan_mm.kernels.norm_rope_cache, kernel op ``norm_rope_cache``: q/k RMSNorm,
RoPE and the paged cache write of k and v in one launch; issue 49 item 2).

- The kernel against the PyTorch ops it replaces, composed, within the bounds derived in
  tests/unit/test_norm_rope_cache.py (fp32; fp16 / bf16 against the exact formula, rounding to nearest here), for
  the unit test's cases and Qwen3-0.6B / 8B head layouts, at 1, 8 and 256 rows; and no host sync.
- The engine (fp32, fused projections) serves transformers' greedy tokens with the prologue fused and unfused,
  every model step under set_sync_debug_mode("error"), for Qwen3, Qwen3-MoE and Qwen3-VL (M-RoPE tables).
- bf16 with CUDA graphs, the kernels ops as from_pretrained serves them: greedy tokens equal with the op on and off
  ("all,-norm_rope_cache"), and the launches per batch-1 decode step (torch.profiler, the graphs' kernels counted)
  drop by at least 6 per layer: the unfused step runs q-norm, k-norm, RoPE, and for each of k and v an index_select
  and an index_copy_ (KVCache.write): at least 7 launches, where the fused one runs 1. The counts are printed (-s)
  for docs/serving.md.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_norm_rope_cache_gpu.py -s
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from bench.serve import decode_step_kernels
from tests.gpu.test_serve_gpu import drive
from tests.parity._qwen3_helpers import titan_twin
from tests.parity.test_serve_generate import MAX_NEW, text_reference, text_setup, vl_setup
from tests.unit._norm_rope_cache_check import CASES, check
from tests.unit.test_norm_rope_cache import _count
from titan_mm import kernels as K
from titan_mm.nn.attention import Attention
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

LAYOUTS = [(16, 8, 128, 16, torch.bfloat16, True, "1d", True), (32, 8, 128, 16, torch.bfloat16, True, "mrope3", True),
           (16, 8, 128, 16, torch.float32, True, "1d", True)]  # Qwen3-0.6B, Qwen3-8B's (Qwen3-VL-8B's) heads


@pytest.mark.parametrize("B", [1, 8, 256])
@pytest.mark.parametrize("case", CASES + LAYOUTS, ids=str)
def test_kernel_matches_the_references(case, B):
    assert check(case, B=B, device="cuda") == []


def test_no_host_sync():
    q, k, v = (torch.randn(8, h, 128, device="cuda", dtype=torch.bfloat16) for h in (16, 8, 8))
    w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    cs = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    pool = torch.zeros(4, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        K.norm_rope_cache(q, k, v, w, w, 1e-6, cs, cs, pool, pool.clone(), slots)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _with_prologue(model, op):
    for m in model.modules():
        if isinstance(m, Attention):
            m.decode_prologue = op
    return model


SETUPS = {"qwen3": lambda: text_setup(False), "qwen3_moe": lambda: text_setup(True),
          "qwen3_vl": lambda: vl_setup(False)}


@pytest.mark.parametrize("model", list(SETUPS))
def test_fp32_engine_serves_hf_tokens_fused_and_unfused_without_host_sync(model):
    tm, spec, prompts, images, eos, refs, data = SETUPS[model]()
    for op in (None, K.norm_rope_cache):
        own = _with_prologue(copy.deepcopy(tm), op)
        engine = Engine(own, spec, own.cfg, ServeConfig(max_model_len=256, dtype="float32"), device="cuda",
                        eos_token_ids=[eos], data=data, owns_weights=True)
        calls = _count(engine.model)
        assert drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images) == refs
        assert (calls[0] > 0) == (op is not None)


def test_bf16_graphs_same_tokens_and_fewer_launches_per_decode_step():
    hf = text_reference(False)[0]
    _, spec, prompts, _, eos, _, data = text_setup(False)
    toks, counts = {}, {}
    off = "all,-norm_rope_cache"
    for kernels in (off, True):
        own = titan_twin(hf, kernels=kernels)
        engine = Engine(own, spec, own.cfg, ServeConfig(max_model_len=256, block_size=16, num_blocks=64),
                        device="cuda", eos_token_ids=[eos], data=data, owns_weights=True)
        assert engine.dtype == torch.bfloat16 and engine.runner.captured
        toks[kernels] = drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), None, check=False)
        counts[kernels] = decode_step_kernels(engine, prompts[0], steps=8)
    layers = own.cfg.num_hidden_layers
    print(json.dumps({"device": torch.cuda.get_device_name(), "layers": layers, "unfused": counts[off],
                      "fused": counts[True]}))
    assert toks[True] == toks[off]
    saved = counts[off]["kernels_per_step"] - counts[True]["kernels_per_step"]
    assert saved >= 6 * layers, (saved, counts)
