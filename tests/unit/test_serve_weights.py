"""The serving engine's load-time weight transforms (titan_mm/serve/runner/weights.py).

Fused projections compute the same dot products as the unfused ones, in another GEMM blocking: an fp32 dot product
of length D summed in any order is within gamma_D * sum|x_i w_i| of the exact one (gamma_D = D u / (1 - D u),
u = 2^-24), so two orders differ by at most 2 gamma_D (|x| @ |W|^T), elementwise. The engine's fused greedy tokens
equal the unfused engine's (tests/parity/test_serve_fused.py: equal to transformers' generate on every serving case),
a model given to Engine() stays as given, int8 weight-only serves on CPU with its perplexity on the built-in text
within 1% of fp32, and every serve.quantization rule is one ConfigError line, checked before any weight loads.

Run: pytest -q tests/unit/test_serve_weights.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from titan_mm.config import ConfigError
from titan_mm.data.builtin.text import text_corpus
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.nn.attention import Attention
from titan_mm.nn.fp8 import fp8_rows
from titan_mm.nn.mlp import SwiGLU, silu_mul
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import QUANTIZATIONS, ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.runner import weights
from titan_mm.serve.sampling_params import SamplingParams

U = 2.0 ** -24  # fp32 unit roundoff


def reorder_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """2 gamma_D (|x| @ |w|^T): how far two summation orders of x @ w^T may fall apart in fp32 (module docstring)."""
    d = x.shape[-1]
    return 2 * d * U / (1 - d * U) * (x.double().abs() @ w.double().abs().T)


def _randomize(m: torch.nn.Module, std: float, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in n else std * noise)
    return m


@pytest.mark.parametrize("bias", [False, True], ids=["qwen3", "qwen2_bias"])
def test_fused_qkv_and_gate_up_within_reordering_bound(bias):
    attn = _randomize(Attention(64, 4, 2, 16, bias, 1e-6), 0.1)
    mlp = _randomize(SwiGLU(64, 96), 0.1, seed=1)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(2))
    ref_qkv = torch.cat([attn.wq(x), attn.wk(x), attn.wv(x)], -1)
    ref_gu = torch.cat([mlp.w1(x), mlp.w3(x)], -1)
    w_qkv = torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]).detach()
    w_gu = torch.cat([mlp.w1.weight, mlp.w3.weight]).detach()
    model = torch.nn.ModuleList([attn, mlp])
    assert weights.fuse_projections(model) == 3 and weights.fuse_projections(model) == 0  # idempotent
    assert not hasattr(attn, "wq") and not hasattr(mlp, "w1") and attn.qkv_sizes == (64, 32, 32)
    with torch.no_grad():
        for got, ref, w in ((attn.wqkv(x), ref_qkv, w_qkv), (mlp.w13(x), ref_gu, w_gu)):
            assert ((got.double() - ref.double()).abs() <= reorder_bound(x, w)).all()
        # the forwards run through the fused path (q, k, v and gate, up as column views of one output)
        assert attn(x, *_rope(7), None).shape == (3, 7, 64) and mlp(x).shape == (3, 7, 64)


def _rope(s: int):
    return torch.ones(1, s, 16), torch.zeros(1, s, 16)


def tiny(vocab: int = 256, std: float = 0.1, seed: int = 0, hidden: int = 64, intermediate: int = 128):
    """A 2-layer Qwen3 of ``vocab`` tokens with seeded N(0, std) weights (peaked enough for a perplexity to move);
    4 heads of hidden / 4 (2 kv heads)."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512)
    spec = get_model_spec("qwen3")
    model = spec.build(cfg)
    model.init_weights()
    return _randomize(model, std, seed).eval(), spec, cfg


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


def test_fused_engine_serves_the_unfused_tokens_and_a_given_model_stays_as_given():
    model, spec, cfg = tiny()
    sc = dict(max_model_len=128, block_size=4, num_blocks=128, max_num_seqs=4)
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    given = Engine(model, spec, cfg, ServeConfig(**sc), eos_token_ids=[])
    assert "layers.0.attn.wq.weight" in model.state_dict() and "fused" not in given.describe()
    owned = Engine(copy.deepcopy(model), spec, cfg, ServeConfig(**sc), eos_token_ids=[], owns_weights=True)
    names = owned.model.state_dict()
    assert "layers.0.attn.wqkv.weight" in names and "layers.1.mlp.w13.weight" in names
    assert "layers.0.attn.wq.weight" not in names and "fused projections (6 GEMMs fewer" in owned.describe()
    off = Engine(copy.deepcopy(model), spec, cfg, ServeConfig(**sc, fuse_projections=False), eos_token_ids=[],
                 owns_weights=True)
    assert "layers.0.attn.wq.weight" in off.model.state_dict()
    prompts = _prompts(cfg.vocab_size)
    want = [o.outputs[0].token_ids for o in given.generate(prompts, p)]
    assert [o.outputs[0].token_ids for o in owned.generate(prompts, p)] == want
    assert [o.outputs[0].token_ids for o in off.generate(prompts, p)] == want


def builtin_text_ids(n_docs: int = 12) -> tuple[list[int], int]:
    """The built-in text corpus in Qwen3 tokens, its distinct tokens renumbered 0..n-1 (the same sequence over a
    vocabulary a tiny model can hold); -> (ids, n)."""
    tok = load_tokenizer(None)
    ids = [t for d in text_corpus(n_docs, seed=7) for t in tok.encode(d)]
    index = {t: i for i, t in enumerate(sorted(set(ids)))}
    return [index[t] for t in ids], len(index)


def test_int8_weight_only_serves_on_cpu_with_perplexity_within_one_percent_of_fp32():
    """int8 weight-only rounds each weight to its row's scale max|w_row| / 127: at most half a step, ~0.7% of the
    row's standard deviation RMS for Gaussian rows of 64..128 entries. The perplexity moves by far less than that
    relative noise; the stated bound is 1%. The quantized weights are really in use: the perplexity moved."""
    ids, vocab = builtin_text_ids()
    model, spec, cfg = tiny(vocab)
    ppl = weights.perplexity(model, ids, window=128)
    sc = ServeConfig(max_model_len=128, block_size=4, num_blocks=128, max_num_seqs=4, quantization="int8_weight_only")
    engine = Engine(copy.deepcopy(model), spec, cfg, sc, eos_token_ids=[], owns_weights=True)
    assert "quantization int8_weight_only (8 linears)" in engine.describe()  # wqkv, wo, w13, w2 of 2 layers
    wq = engine.model.layers["0"].attn.wqkv.weight
    assert type(wq).__name__ == "Int8Tensor"
    q_ppl = weights.perplexity(engine.model, ids, window=128)
    assert q_ppl != ppl and abs(q_ppl / ppl - 1) <= 0.01, (ppl, q_ppl)
    outs = engine.generate(_prompts(vocab), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs) and engine.stats()["kv_blocks_used"] == 0


def test_fp8_linear_is_its_dequantized_product_within_e4m3_rounding():
    """weights.Fp8Linear (serve.quantization fp8_rowwise_fused) computes x8 * sx @ (w8 * sw).T + b: equal to that
    product of its own dequantized operands to fp32 accumulation, the scales placed per input row and per output
    row. Against the unquantized linear, each operand is off by at most half an e4m3 step (2^-4 relative; values
    below e4m3's normal range, 2^-6 of the row's scale, by at most 2^-10 of it), so |y - x @ w.T - b| <=
    (|x| @ |w|.T) * (2 * 2^-4 + 2^-8) + 2 * 2^-10 * 448 * sx * sw * K."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(2, 5, 64) * torch.logspace(-2, 2, 5)[:, None]
    f = weights.Fp8Linear(lin)
    y = f(x)
    x8, sx = fp8_rows(x.reshape(-1, 64))
    want = (x8.float() * sx) @ (f.weight_fp8.float() * f.weight_scale.t()).t() + lin.bias
    torch.testing.assert_close(y.reshape(-1, 48), want, rtol=1e-5, atol=1e-5)
    exact = lin(x).detach().reshape(-1, 48)
    mag = x.reshape(-1, 64).abs() @ lin.weight.detach().abs().t()
    tail = 2 * 2**-10 * 448 * sx * f.weight_scale * 64
    assert ((y.reshape(-1, 48) - exact).abs() <= mag * (2 * 2**-4 + 2**-8) + tail + 1e-6).all()


def test_fp8_rowwise_fused_replaces_the_projections_within_its_perplexity_bound():
    """quantize(..., "fp8_rowwise_fused") turns wqkv, wo, w13, w2 of both layers into Fp8Linear (the head and
    embeddings stay), and the perplexity moves, by less than the 5% the GPU test allows (torch._scaled_mm runs on the
    CPU too; the engine refuses fp8 there, so the model is quantized directly)."""
    ids, vocab = builtin_text_ids()
    model, _spec, _cfg = tiny(vocab)
    ppl = weights.perplexity(model, ids, window=128)
    weights.fuse_projections(model)
    assert weights.quantize(model, "fp8_rowwise_fused") == 8
    layers = model.layers
    assert type(layers["0"].attn.wqkv) is weights.Fp8Linear and type(layers["1"].mlp.w2) is weights.Fp8Linear
    assert sum(type(m) is weights.Fp8Linear for m in model.modules()) == 8 and type(model.output) is torch.nn.Linear
    assert all(type(layers[i].mlp) is weights.Fp8SwiGLU for i in ("0", "1"))
    q_ppl = weights.perplexity(model, ids, window=128)
    assert q_ppl != ppl and abs(q_ppl / ppl - 1) <= 0.05, (ppl, q_ppl)


def test_fp8_swiglu_equals_the_swiglu_of_its_fp8_linears():
    """weights.Fp8SwiGLU (silu(gate) * up and its fp8 cast in one launch, kernels.swiglu_fp8_rows) gives exactly
    what SwiGLU.forward gives with the same two Fp8Linears: the product rounded to the input's dtype, then cast."""
    torch.manual_seed(0)
    mlp = SwiGLU(64, 96)
    mlp.reset_parameters(0.1)
    weights.fuse_projections(mlp)
    weights.quantize(mlp, "fp8_rowwise_fused")  # a bare SwiGLU is its own root: its linears only
    w13, w2 = mlp.w13, mlp.w2
    fused = weights.Fp8SwiGLU(w13, w2)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 64).to(dtype)
        y = fused(x)
        assert y.dtype == dtype and torch.equal(y, mlp(x)), dtype  # mlp: SwiGLU.forward on the same linears
        assert torch.equal(y, w2(silu_mul(*w13(x).chunk(2, dim=-1)))), dtype


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("fields, device, cap, owned, says", [
    (dict(quantization="int8_weight_onyl"), CPU, None, True, "did you mean 'int8_weight_only'"),
    (dict(quantization="int8_weight_only", tensor_parallel_size=2), CPU, None, True, "not split over tp"),
    (dict(quantization="int8_weight_only"), CPU, None, False, "owns_weights=True"),
    (dict(quantization="fp8_weight_only"), CPU, None, True, "capability >= 8.9 (Ada, Hopper or newer); this device "
                                                              "is cpu"),
    (dict(quantization="fp8_rowwise"), CUDA, (8, 0), True, "this device is cuda of capability 8.0"),
    (dict(quantization="int4_weight_only"), CPU, None, True, "needs CUDA of compute capability >= 8.0"),
    (dict(quantization="int4_weight_only"), CUDA, (7, 5), True, "this device is cuda of capability 7.5"),
    (dict(quantization="int4_weight_only", dtype="float32"), CUDA, (9, 0), True, "needs serve.dtype bfloat16"),
    (dict(quantization="fp8_rowwise_fused", dtype="float16"), CUDA, (9, 0), True, "needs serve.dtype bfloat16"),
])
def test_quantization_rules_are_one_line(fields, device, cap, owned, says):
    cfg = ServeConfig(**fields)
    with pytest.raises(ConfigError) as e:
        cfg.check()
        cfg.check_weights(device, owned, cap)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mode", QUANTIZATIONS)
def test_supported_devices_pass(mode):
    cfg = ServeConfig(quantization=mode)
    cfg.check()
    cfg.check_weights(CUDA, True, (9, 0))  # an H100 takes every mode
    if mode in ("none", "int8_weight_only"):
        cfg.check_weights(CPU, True, None)


def test_from_pretrained_refuses_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="capability >= 8.9"):  # the folder is empty: the rule came first
        Engine.from_pretrained(tmp_path, ServeConfig(quantization="fp8_weight_only"), device="cpu")


def test_perplexity_through_the_kv_cache():
    """weights.perplexity with ``kv_dtype``: each window one prefill step through a paged cache of that dtype. In
    fp32 the cache is lossless, so the perplexity is the plain forward's to fp32 summation order (1e-5); an e4m3
    cache rounds every key and value to 3 mantissa bits (at most 2^-4 of the value), which moves the perplexity,
    here by far less than that relative step (the stated bound)."""
    ids, vocab = builtin_text_ids()
    model, spec, cfg = tiny(vocab)
    ids = ids[:300]
    ppl = weights.perplexity(model, ids, window=128)
    same = weights.perplexity(model, ids, window=128, spec=spec, model_cfg=cfg, kv_dtype=torch.float32)
    assert abs(same / ppl - 1) <= 1e-5, (ppl, same)
    fp8 = weights.perplexity(model, ids, window=128, spec=spec, model_cfg=cfg, kv_dtype=torch.float8_e4m3fn)
    assert fp8 != ppl and abs(fp8 / ppl - 1) <= 2**-4, (ppl, fp8)
