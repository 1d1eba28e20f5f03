"""Qwen2 / Qwen2.5 (the qwen2 family: Qwen3's decoder without qk-norm, q/k/v bias) vs transformers'
Qwen2ForCausalLM on tiny random configs (CPU, fp32): logits, loss and the gradient of every parameter (untied
and tied head, sliding windows, packed documents on sdpa and flex), HF folders in and out (our load_hf of a
save_pretrained folder, transformers' from_pretrained of our save_hf), the config.json reader, and the spec."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from _qwen3_helpers import assert_grads_close, grads_by_titan_name, packed_batch, randomize_
from titan_mm.nn.attention import build_attn_meta
from titan_mm.models.hf_io import HFCheckpointError
from titan_mm.models.qwen2 import FLAVORS, Qwen2Config, build
from titan_mm.models.qwen2 import hf as qwen2_hf

transformers = pytest.importorskip("transformers")

VOCAB = 128
LOGIT_TOL = 1e-5
GRAD_RTOL = 1e-4  # max |grad error| / max |grad|, per parameter


def hf_model(tie: bool = False, seed: int = 0, attn: str = "eager", **kw):
    """A tiny random HF Qwen2ForCausalLM; every tensor randomized (HF zero-inits the biases, ones the norms)."""
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        attention_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return randomize_(transformers.Qwen2ForCausalLM(cfg).float().eval())


def titan_from_hf_dir(hf, path, **runtime):
    """Our model read from ``hf.save_pretrained(path)`` through the family's own config reader and load_hf."""
    hf.save_pretrained(path)
    cfg = Qwen2Config.from_hf(path, **runtime)
    m = build(cfg)
    qwen2_hf.load_hf(m, path)
    return m


def max_err(a, b) -> float:
    return (a - b).abs().max().item()


def assert_logits(ours, ref, what=""):
    err = max_err(ours, ref)
    assert err <= LOGIT_TOL, f"{what}: max |logit error| {err:.3e}"
    return err


def random_params_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if "norm" in n else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_loss_and_grads(tmp_path, tie):
    hf = hf_model(tie=tie)
    tt = titan_from_hf_dir(hf, tmp_path, loss_chunk_size=7)
    assert tt.cfg.qk_norm is False and tt.layers["0"].attn.q_norm is None
    assert tt.layers["0"].attn.wq.bias is not None and tt.layers["0"].attn.wo.bias is None
    assert (tt.output is None) == tie
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    assert_logits(tt(ids).logits, hf(input_ids=ids).logits, "plain batch")

    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    ref = F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    ref.backward()
    out = tt(ids, labels=labels)
    assert abs(out.loss_sum.item() - ref.item()) <= 1e-4
    assert out.aux_loss.item() == 0.0
    (out.loss_sum + out.aux_loss).backward()
    tg, hg = grads_by_titan_name(tt, hf)
    assert any(n.endswith("wq.bias") for n in tg) and len(tg) == len(list(tt.parameters()))
    assert_grads_close(tg, hg, rtol=GRAD_RTOL)


@pytest.mark.parametrize("hf_attn", ["eager", "sdpa"])
def test_sliding_window_matches_hf(tmp_path, hf_attn):
    # layer 0 attends fully, layer 1 (>= max_window_layers) to the last 4 keys; 16 tokens > window
    hf = hf_model(seed=2, attn=hf_attn, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = hf(input_ids=ids).logits
    R = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4))
    (ref * R).sum().backward()
    no_window = titan_from_hf_dir(hf, tmp_path / "full", use_sliding_window=False)
    with torch.no_grad():
        assert max_err(no_window(ids).logits, ref) > 1e-3  # the window changes the logits: the test can fail
    for backend in ("sdpa", "flex"):
        tt = titan_from_hf_dir(hf, tmp_path / backend, attn_backend=backend)
        assert (tt.cfg.layer_window(0), tt.cfg.layer_window(1), tt.cfg.attn_sliding_window) == (None, 4, 4)
        meta = build_attn_meta({"input_ids": ids}, backend, "cpu", sliding_window=tt.cfg.attn_sliding_window)
        out = tt(ids, attn=meta).logits
        assert_logits(out, ref, f"window, titan {backend} vs HF {hf_attn}")
        (out * R).sum().backward()
        assert_grads_close(*grads_by_titan_name(tt, hf), rtol=GRAD_RTOL)
        hf.zero_grad(set_to_none=False)
        (hf(input_ids=ids).logits * R).sum().backward()  # the next backend compares against fresh HF grads


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_packed_documents_equal_documents_alone(tmp_path, backend, window):
    kw = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
    hf = hf_model(seed=1, tie=True, **kw)
    tt = titan_from_hf_dir(hf, tmp_path, attn_backend=backend)
    lens = [5, 7, 4]
    batch = packed_batch(lens, S=20, vocab=VOCAB)
    meta = build_attn_meta(batch, backend, "cpu", sliding_window=tt.cfg.attn_sliding_window)
    with torch.no_grad():  # forward-only: the real flex kernel runs on CPU
        out_ng = tt(batch["input_ids"], position_ids=batch["position_ids"], attn=meta).logits
    out = tt(batch["input_ids"], position_ids=batch["position_ids"], attn=meta).logits
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    loss_t = loss_h = 0.0
    o = 0
    for L in lens:  # HF runs each document alone
        ref = hf(input_ids=batch["input_ids"][:, o : o + L]).logits
        assert_logits(out_ng[:, o : o + L], ref, "packed, no grad")
        assert_logits(out[:, o : o + L], ref, "packed")
        loss_t = loss_t + (out[:, o : o + L] * R[:, o : o + L]).sum()
        loss_h = loss_h + (ref * R[:, o : o + L]).sum()
        o += L
    loss_t.backward()
    loss_h.backward()
    assert_grads_close(*grads_by_titan_name(tt, hf), rtol=GRAD_RTOL)


# ---------------------------------------------------------------------------------------- HF folders in / out
@pytest.mark.parametrize("flavor_kw", [dict(tie_word_embeddings=False), dict(tie_word_embeddings=True),
                                       dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)],
                         ids=["untied", "tied", "window"])
def test_save_hf_loads_in_transformers_with_identical_logits(tmp_path, flavor_kw):
    cfg = FLAVORS["debug"].replace(vocab_size=VOCAB, **flavor_kw)
    torch.manual_seed(0)
    ours = build(cfg)
    random_params_(ours)  # init_weights zeroes the biases; random ones test their names
    qwen2_hf.save_hf(ours, cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen2" and written["architectures"] == ["Qwen2ForCausalLM"]
    assert not {"head_dim", "attention_bias", "qk_norm", "attn_backend", "kernels"} & set(written)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    meta = build_attn_meta({"input_ids": ids}, "sdpa", "cpu", sliding_window=cfg.attn_sliding_window)
    with torch.no_grad():
        assert_logits(ours(ids, attn=meta).logits, hf(input_ids=ids).logits, "save_hf -> transformers")
    # and back: our config reader and loader give the same model
    assert Qwen2Config.from_hf(tmp_path) == cfg
    again = build(cfg)
    qwen2_hf.load_hf(again, tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_save_hf_dtype_and_state_dict_input(tmp_path):
    cfg = FLAVORS["debug"].replace(vocab_size=VOCAB)
    ours = build(cfg)
    random_params_(ours)
    qwen2_hf.save_hf(ours.state_dict(), cfg, tmp_path, dtype=torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["model_type"] == "qwen2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.model.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="Qwen2Config"):
        qwen2_hf.save_hf(ours, ours.cfg, tmp_path)  # the decoder config would write model_type qwen3


def test_load_hf_into_meta_model_and_errors(tmp_path):
    from titan_mm.registry import get_model_spec, spec_for_hf_dir

    hf = hf_model(seed=5)
    hf.save_pretrained(tmp_path / "ok")
    spec = spec_for_hf_dir(str(tmp_path / "ok"))
    assert spec is get_model_spec("qwen2")
    cfg = spec.config_from_hf(str(tmp_path / "ok"))
    with torch.device("meta"):
        m = spec.build(cfg)
    spec.load_hf(m, str(tmp_path / "ok"))  # assign=True path; RoPE buffer recomputed
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        assert_logits(m(ids).logits, hf(input_ids=ids).logits, "meta-built + load_hf")
    # the wrong shapes: named by HF name
    with pytest.raises(HFCheckpointError, match=r"self_attn\.q_proj\.bias"):
        qwen2_hf.check_hf_dir(tmp_path / "ok", cfg.replace(hidden_size=32, num_attention_heads=2,
                                                           num_key_value_heads=2))
    # a Qwen3 folder is refused by model_type
    q3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))
    q3.save_pretrained(tmp_path / "q3")
    with pytest.raises(HFCheckpointError, match="model_type='qwen3'"):
        qwen2_hf.load_hf(build(cfg), tmp_path / "q3")
    with pytest.raises(ValueError, match="model_type='qwen3'"):
        Qwen2Config.from_hf(tmp_path / "q3")


# ----------------------------------------------------------------------------------------------- config.json
# Qwen/Qwen2.5-0.5B's config.json (the hub file, transformers 4.40 era)
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "use_mrope": False,
}


def test_config_reader_real_file_and_strictness():
    cfg = Qwen2Config.from_hf_dict(QWEN25_05B)
    assert cfg == FLAVORS["0.5B"]
    assert cfg.head_dim == 64 and cfg.attn_sliding_window is None and cfg.layer_window(23) is None
    # what we write, transformers reads as the same model, and we read back unchanged
    hf_cfg = transformers.Qwen2Config(**cfg.to_hf_dict())
    assert (hf_cfg.hidden_size, hf_cfg.num_key_value_heads, hf_cfg.rope_parameters["rope_theta"]) == (896, 2, 1e6)
    assert Qwen2Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert Qwen2Config.from_hf_dict(hf_cfg.to_dict()) == cfg.replace(sliding_window=None)  # HF drops the unused window
    # runtime fields come from the caller
    assert Qwen2Config.from_hf_dict(QWEN25_05B, attn_backend="flex").attn_backend == "flex"
    with pytest.raises(ValueError, match="num_key_value_head"):
        Qwen2Config.from_hf_dict({**QWEN25_05B, "num_key_value_head": 2})  # a typo: unknown key, with hint
    with pytest.raises(ValueError, match="use_mrope=True"):
        Qwen2Config.from_hf_dict({**QWEN25_05B, "use_mrope": True})
    with pytest.raises(ValueError, match="head_dim=128"):
        Qwen2Config.from_hf_dict({**QWEN25_05B, "head_dim": 128})
    with pytest.raises(ValueError, match="attention_bias=False"):
        Qwen2Config.from_hf_dict({**QWEN25_05B, "attention_bias": False})
    with pytest.raises(ValueError, match="quantization_config"):
        Qwen2Config.from_hf_dict({**QWEN25_05B, "quantization_config": {"quant_method": "awq"}})
    # a yarn rope dict (Qwen2.5 long-context recipe) reaches the decoder
    rope = {"factor": 4.0, "original_max_position_embeddings": 32768}
    yarn = Qwen2Config.from_hf_dict({**QWEN25_05B, "rope_scaling": {"type": "yarn", **rope}})
    assert yarn.decoder().rope_scaling == {"rope_type": "yarn", **rope}
    # explicit per-layer windows that HF would not derive are kept
    lt = ("sliding_attention", "full_attention") + ("full_attention",) * 22
    odd = Qwen2Config.from_hf_dict({**QWEN25_05B, "use_sliding_window": True, "sliding_window": 512,
                                    "layer_types": list(lt)})
    assert odd.layer_types == lt and odd.layer_window(0) == 512 and odd.layer_window(1) is None


# ------------------------------------------------------------------------------------------------ the spec
def test_spec_answers():
    from titan_mm.models.qwen3 import spec as qwen3_spec
    from titan_mm.parallel.memory import Topology
    from titan_mm.registry import get_model_spec, resolve_model

    spec = get_model_spec("qwen2")
    assert spec.hf_model_types == ("qwen2",) and spec.flavors["debug"].model_type == "qwen2"
    _, cfg = resolve_model("qwen2", "7B", overrides='{"num_hidden_layers": 4}', attn_backend="flex", kernels="all")
    assert (cfg.num_hidden_layers, cfg.attn_backend, cfg.kernels) == (4, "flex", "all")
    d = spec.dims(cfg)
    assert (d.head_dim, d.num_heads, d.num_kv_heads, d.vocab_size, d.dense_layers) == (128, 28, 4, 152064, 4)
    assert spec.runtime(cfg).attn_backend == "flex" and spec.runtime(cfg).sliding_window is None
    ks = spec.kernel_shapes(cfg, tp=2)
    assert ks.head_norm == () and ks.rope == ((14, 2, 128),) and ks.swiglu == (18944 // 2,)
    assert spec.data_needs(cfg).chat_template == "chatml"
    assert qwen3_spec.data_needs(cfg.decoder()).chat_template == "chatml_think"
    p = spec.plan(cfg)
    assert not [k for k in {**p.tp, **p.sequence_parallel} if "norm" in k and "attn." in k]
    assert p.tp["layers.*.attn.wq"] == "colwise" and p.loss_parallel == "output"
    assert spec.plan(FLAVORS["0.5B"]).loss_parallel == "tok_embeddings"  # tied
    terms = spec.memory_terms(cfg, Topology(tp=2), 2)
    assert terms.decoder.full > 0 and terms.loss_chunk == cfg.loss_chunk_size


def test_flops_formula():
    # 6 T P_matmul + 12 H K sum_layers pairs: by hand for a tiny config with one windowed layer
    cfg = FLAVORS["debug"].replace(vocab_size=VOCAB, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    from titan_mm.models.qwen2.flops import num_params
    from titan_mm.registry import get_model_spec

    spec_flops = get_model_spec("qwen2").flops
    D, H, G, K, Fi, L = 64, 4, 2, 16, 192, 2
    P = L * (D * H * K + 2 * D * G * K + H * K * D + 3 * D * Fi) + VOCAB * D
    lens = [5, 2]
    full = sum(n * (n + 1) // 2 for n in lens)
    windowed = (3 * 4 // 2 + 2 * 3) + 3  # L=5, w=3: 6 + 2*3; L=2: 3
    assert spec_flops(cfg, lens) == 6 * sum(lens) * P + 12 * H * K * (full + windowed)
    n_bias = L * (H + 2 * G) * K
    n_norm = L * 2 * D + D
    assert num_params(cfg) == P + n_bias + n_norm  # tied: the head (in P) is the embedding, stored once
