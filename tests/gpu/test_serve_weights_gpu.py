"""The serving engine's load-time weight transforms on a GPU (titan_mm/serve/runner/weights.py).

- Fused projections (q/k/v and gate/up one GEMM each) with the Triton ops (strided q, k, v and gate, up views into
  the fused outputs): fp32 greedy equals transformers' generate and the model step makes no host sync; in bf16 the
  CUDA-graph decode equals the eager one.
- serve.quantization on CUDA (every mode on capability >= 8.9; int4 through tinygemm): the quantized engine serves
  under CUDA graphs without a host sync in its model step, and its perplexity on the built-in text (a tiny model
  whose weights are peaked enough for it to move) is within the stated bound of bf16's: int8 1% (per-row int8:
  half a step of max|w_row| / 127), float8 5% (e4m3 keeps 3 mantissa bits: a relative rounding of <= 2^-4 per
  weight; the w8a8 modes round the activations too), int4 10% (16 levels per group of 128).

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_weights_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.test_serve_gpu import drive
from tests.parity._qwen3_helpers import titan_twin
from tests.parity.test_serve_generate import CASES, MAX_NEW, text_reference, text_setup, vl_setup
from tests.unit.test_serve_weights import builtin_text_ids, tiny
from titan_mm.serve.config import QUANTIZATIONS, ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.runner import weights
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

SETUPS = {"qwen3": lambda: text_setup(False), "qwen3_moe": lambda: text_setup(True), "qwen3_vl": lambda: vl_setup(False)}
PPL_BOUND = {"int8_weight_only": 0.01, "fp8_weight_only": 0.05, "fp8_rowwise": 0.05, "fp8_rowwise_fused": 0.05,
             "int4_weight_only": 0.10}


@pytest.mark.parametrize("case", ["prefix_cache", "chunked_prefill"])
@pytest.mark.parametrize("model", list(SETUPS))
def test_fused_fp32_matches_hf_without_host_sync(model, case):
    tm, spec, prompts, images, eos, refs, data = SETUPS[model]()
    cfg = ServeConfig(max_model_len=256, dtype="float32", **CASES[case])
    own = _kernels_twin(model, tm)
    engine = Engine(own, spec, own.cfg, cfg, device="cuda", eos_token_ids=[eos], data=data, owns_weights=True)
    assert "fused projections" in engine.describe()
    assert drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images) == refs
    assert engine.stats()["kv_blocks_used"] == 0


def _kernels_twin(model: str, tm):
    """The engine's own copy of the reference's titan model; the text models with the titan_mm.kernels ops, as
    from_pretrained serves on CUDA (the Triton ops read the fused outputs' strided views)."""
    if model == "qwen3_vl":
        return copy.deepcopy(tm)
    return titan_twin(text_reference(model == "qwen3_moe")[0], kernels=True)


def test_fused_graph_decode_equals_eager_bf16():
    tm, spec, prompts, _, eos, _, data = text_setup(False)
    outs = {}
    for graphs in (False, True):
        own = _kernels_twin("qwen3", tm)
        engine = Engine(own, spec, own.cfg, ServeConfig(max_model_len=256, block_size=16, num_blocks=64,
                                                        cuda_graphs=graphs),
                        device="cuda", eos_token_ids=[eos], data=data, owns_weights=True)
        assert bool(engine.runner.captured) == graphs and "fused projections" in engine.describe()
        outs[graphs] = drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), None)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("mode", [m for m in QUANTIZATIONS if m != "none"])
def test_quantized_engine_serves_in_graphs_within_its_perplexity_bound(mode):
    if mode.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs CUDA capability >= 8.9")
    ids, vocab = builtin_text_ids(40)
    model, spec, cfg = tiny(vocab, hidden=128, intermediate=256)  # int4: input sizes a multiple of its group of 128
    base = copy.deepcopy(model).to("cuda", torch.bfloat16)
    ppl = weights.perplexity(base, ids, window=256)
    sc = ServeConfig(max_model_len=128, block_size=16, num_blocks=64, max_num_seqs=4, quantization=mode)
    engine = Engine(model, spec, cfg, sc, device="cuda", eos_token_ids=[], owns_weights=True)
    assert f"quantization {mode} (8 linears)" in engine.describe() and engine.runner.captured
    q_ppl = weights.perplexity(engine.model, ids, window=256)
    assert abs(q_ppl / ppl - 1) <= PPL_BOUND[mode], (mode, ppl, q_ppl)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 30)]
    outs = drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), None)
    assert all(len(o) == 8 for o in outs) and engine.stats()["kv_blocks_used"] == 0
