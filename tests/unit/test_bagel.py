"""The bagel family against a reference built from transformers modules, fp32 on CPU, tiny random configs.

BAGEL's own code (ByteDance-Seed/Bagel) is not pip-installable, so the reference is composed here as its
modeling/bagel/qwen2_navit.py and bagel.py compute: transformers' Qwen3 decoder layers with ``attention_bias=True``
(o_proj's bias 0) are BAGEL's Qwen2-with-QK-norm layer; two stacks of them (understanding and generation) are routed
per token by boolean masks, attention runs over the whole packed sequence under an additive mask built here from each
sample's splits as data/data_utils.py's ``prepare_attention_mask_per_sample`` does; the ViT is transformers' Siglip
encoder layers run on each image alone; the sin-cos tables and the timestep embedder follow modeling_utils.py."""

import dataclasses
import functools
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config, SiglipVisionConfig
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

from bench.mfu import CASES, case_batch, model_config
from tests.resume_check import RESUME_ARGS, assert_resumes_exactly
from tests.unit.test_attention_kinds import bagel_mask
from titan_mm.config import load_config
from titan_mm.data.packing import collate_rows
from titan_mm.launch.train import main
from titan_mm.models.bagel import BagelConfig, BagelModel
from titan_mm.models.bagel.config import BagelLLMConfig, BagelVAEConfig, BagelViTConfig
from titan_mm.models.bagel.flops import matmul_params
from titan_mm.models.bagel.hf import load_hf, save_hf
from titan_mm.models.bagel.model import flat_positions, patchify
from titan_mm.models.bagel.plan import plan
from titan_mm.models.bagel.spec import SCHEMA, VAE, VIT, param_part, prepare_batch
from titan_mm.models.bagel.synthetic import ROW_TOKENS, class_images, row
from titan_mm.models.hf_io import HFCheckpointError
from titan_mm.nn.attention import SEGMENT_KINDS, build_attn_meta
from titan_mm.objectives import CausalLM, Combined, FlowMatching, build_objective
from titan_mm.observe.metrics import read_metrics
from titan_mm.observe.mfu import doc_lens_from_batch, encoder_inputs
from titan_mm.parallel.plan import match_modules
from titan_mm.registry import get_model_spec
from titan_mm.train.optim import build_optimizer
from titan_mm.train.step import model_inputs, to_device

CFG = BagelConfig(
    llm_config=BagelLLMConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0),
    vit_config=BagelViTConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4),
    vae_config=BagelVAEConfig(z_channels=4, downsample=4), max_latent_size=4, vit_max_num_patch_per_side=4,
    timestep_shift=3.0)
SEQ = ROW_TOKENS + 5  # each row's padding too


# ---- the reference, from transformers modules and BAGEL's formulas ----

def ref_table(dim: int, side: int) -> torch.Tensor:
    """modeling_utils.get_2d_sincos_pos_embed (DiT's), numpy: meshgrid(w, h), the first half over grid[0]."""
    grid = np.stack(np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32)), 0)

    def one(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], 1)

    return torch.from_numpy(np.concatenate([one(dim // 2, grid[0]), one(dim // 2, grid[1])], 1)).float()


def ref_timestep(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """modeling_utils.TimestepEmbedder.timestep_embedding."""
    half = dim // 2
    freqs = torch.exp(-np.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


def ref_mask(rows_docs, S: int) -> torch.Tensor:
    """Additive [T, T] mask over the B*S flat tokens: each sample's own mask on the diagonal, a row's padding one more
    causal sample, nothing across samples (BAGEL's nested_attention_masks)."""
    blocks = []
    for docs in rows_docs:
        splits = [d.segments for d in docs]
        pad = S - sum(len(d) for d in docs)
        blocks += [bagel_mask(s) for s in splits] + ([bagel_mask([(pad, "causal")])] if pad else [])
    m = torch.block_diag(*blocks)
    return torch.zeros(m.shape).masked_fill(~m, float("-inf"))


def both(fu, fg, x, g):
    """BAGEL's routing: und rows through ``fu``, gen rows (``g``) through ``fg``, written back by boolean index."""
    yu, yg = fu(x[~g]), fg(x[g])
    out = yu.new_zeros((x.shape[0],) + yu.shape[1:])
    out[~g], out[g] = yu, yg
    return out


class Reference(nn.Module):
    def __init__(self, cfg: BagelConfig):
        super().__init__()
        c, v = cfg.llm_config, cfg.vit_config
        qc = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, attention_bias=True,
                         rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, attn_implementation="eager")
        self.heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.moe = c.layer_module == "Qwen2MoEDecoderLayer"  # the MLP-only split: gen's layers lend their MLPs only
        self.und = nn.ModuleList(Qwen3DecoderLayer(qc, i) for i in range(c.num_hidden_layers))
        self.gen = nn.ModuleList(Qwen3DecoderLayer(qc, i) for i in range(c.num_hidden_layers))
        self.rotary = Qwen3RotaryEmbedding(qc)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.norm, self.norm_gen = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps), Qwen3RMSNorm(c.hidden_size,
                                                                                             c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        sc = SiglipVisionConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                                num_hidden_layers=v.num_hidden_layers, num_attention_heads=v.num_attention_heads,
                                image_size=v.image_size, patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps,
                                attn_implementation="eager")
        self.vit_layers = nn.ModuleList(SiglipEncoderLayer(sc) for _ in range(v.num_hidden_layers))
        self.patch = nn.Linear(v.patch_dim, v.hidden_size)
        self.vit_pos = nn.Embedding(v.positions, v.hidden_size)
        self.post_ln = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.fc1, self.fc2 = nn.Linear(v.hidden_size, c.hidden_size), nn.Linear(c.hidden_size, c.hidden_size)
        self.t1, self.t2 = nn.Linear(256, c.hidden_size), nn.Linear(c.hidden_size, c.hidden_size)
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, c.hidden_size)
        self.llm2vae = nn.Linear(c.hidden_size, cfg.patch_latent_dim)
        self.register_buffer("vit_table", ref_table(c.hidden_size, cfg.vit_max_num_patch_per_side))
        self.register_buffer("lat_table", ref_table(c.hidden_size, cfg.max_latent_size))

    def vit(self, patches, pos, lens):
        outs = []
        for p, q in zip(patches.split(lens), pos.split(lens)):  # each image alone: no mask needed
            x = (self.patch(p) + self.vit_pos(q))[None]
            for layer in self.vit_layers:
                x = layer(x, None)
            outs.append(self.fc2(F.gelu(self.fc1(self.post_ln(x)[0]), approximate="tanh")) + self.vit_table[q])
        return torch.cat(outs)

    def layer(self, und, gen, h, g, cos, sin, mask):
        H, G, K = self.heads
        a = und if self.moe else gen  # the gen tokens' attention and norms: Qwen2MoEDecoderLayer shares und's
        x = both(und.input_layernorm, a.input_layernorm, h, g)
        proj = {n: both(getattr(und.self_attn, n), getattr(a.self_attn, n), x, g)
                for n in ("q_proj", "k_proj", "v_proj")}
        q = both(und.self_attn.q_norm, a.self_attn.q_norm, proj["q_proj"].view(-1, H, K), g)
        k = both(und.self_attn.k_norm, a.self_attn.k_norm, proj["k_proj"].view(-1, G, K), g)
        v = proj["v_proj"].view(-1, G, K)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        o, _ = eager_attention_forward(und.self_attn, q, k, v.transpose(0, 1)[None], mask[None, None], K**-0.5)
        h = h + both(und.self_attn.o_proj, a.self_attn.o_proj, o.reshape(h.shape[0], H * K), g)
        return h + both(lambda y: und.mlp(und.post_attention_layernorm(y)),
                        lambda y: gen.mlp(a.post_attention_layernorm(y)), h, g)

    def forward(self, b, mask):
        """(final hidden [T, D], CE sum, MSE sum) of the prepared batch ``b`` (flattened to T tokens)."""
        kind = b["token_kind"].reshape(-1)
        g = kind == VAE
        h = self.embed(b["input_ids"].reshape(-1))
        h[kind == VIT] = self.vit(b["vit_patches"], b["vit_pos"], b["vit_lens"].tolist())
        P = b["noisy_latents"].shape[-1]
        x = (b["noisy_latents"] + b["cond_latents"]).reshape(-1, P)[g]
        t = b["timesteps"].reshape(-1)[g]
        temb = self.t2(F.silu(self.t1(ref_timestep(t))))
        h[g] = self.vae2llm(x) + temb + self.lat_table[b["latent_pos"].reshape(-1)[g]]
        cos, sin = self.rotary(h[None], b["position_ids"].reshape(1, -1))
        for und, gen in zip(self.und, self.gen):
            h = self.layer(und, gen, h, g, cos, sin, mask)
        h = both(self.norm, self.norm_gen, h, g)
        labels = b["labels"].reshape(-1)
        keep = labels != -100
        ce = F.cross_entropy(self.lm_head(h[keep]), labels[keep], reduction="sum")
        lat = b["latent_mask"].reshape(-1)
        mse = (self.llm2vae(h[lat]) - b["flow_target"].reshape(-1, P)[lat]).square().sum()
        return h, ce, mse


def pairs(model: BagelModel, ref: Reference):
    """(our parameter name, the reference's parameter) for every parameter of ours."""
    out = []
    for i, layer in enumerate(model.layers.values()):
        for e, r in (("und", ref.und[i]), ("gen", ref.gen[i])):
            a = r.self_attn
            attn = {"attn_norm.weight": r.input_layernorm.weight, "ffn_norm.weight": r.post_attention_layernorm.weight,
                    "wo.weight": a.o_proj.weight, "q_norm.weight": a.q_norm.weight, "k_norm.weight": a.k_norm.weight}
            for ours, theirs in (("wq", a.q_proj), ("wk", a.k_proj), ("wv", a.v_proj)):
                attn |= {f"{ours}.weight": theirs.weight, f"{ours}.bias": theirs.bias}
            mlp = {"w1.weight": r.mlp.gate_proj.weight, "w3.weight": r.mlp.up_proj.weight,
                   "w2.weight": r.mlp.down_proj.weight}
            if ref.moe:  # layers.{i}.shared: und's attention and norms; layers.{i}.{und,gen}: the MLPs
                out += [(f"layers.{i}.shared.{k}", p) for k, p in attn.items() if e == "und"]
                out += [(f"layers.{i}.{e}.{k}", p) for k, p in mlp.items()]
            else:
                out += [(f"layers.{i}.{e}.{k}", p) for k, p in (attn | {f"mlp.{k}": p for k, p in mlp.items()}).items()]
    for j, r in enumerate(ref.vit_layers):
        out += [(f"vit.blocks.{j}.{k}", p) for k, p in r.named_parameters()]
    for ours, theirs in (("tok_embeddings", ref.embed), ("norm", ref.norm), ("norm_gen", ref.norm_gen),
                         ("output", ref.lm_head), ("vit.embeddings.patch_embedding", ref.patch),
                         ("vit.embeddings.position_embedding", ref.vit_pos), ("vit.post_layernorm", ref.post_ln),
                         ("connector.0", ref.fc1), ("connector.2", ref.fc2), ("time_embedder.0", ref.t1),
                         ("time_embedder.2", ref.t2), ("vae2llm", ref.vae2llm), ("llm2vae", ref.llm2vae)):
        out += [(f"{ours}.{k}", p) for k, p in theirs.named_parameters()]
    return out


def _pair(seed: int = 0, cfg: BagelConfig = CFG):
    torch.manual_seed(seed)
    model = BagelModel(cfg)
    model.init_weights()
    with torch.no_grad():  # away from the init's zeros and ones, so that every weight matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref = Reference(cfg)
    ours = dict(model.named_parameters())
    pp = pairs(model, ref)
    assert sorted(n for n, _ in pp) == sorted(ours), "the reference must cover every parameter once"
    with torch.no_grad():
        for n, p in pp:
            p.copy_(ours[n])
        for r in (*ref.und, *ref.gen):
            r.self_attn.o_proj.bias.zero_()  # Qwen3 with attention_bias has one on o_proj; BAGEL's Qwen2 has none
    return model, ref, pp


def _rows(n_rows: int = 2, seed: int = 5):
    pixels, latents = class_images(CFG)
    return [row(CFG, torch.Generator().manual_seed(seed + r), pixels, latents) for r in range(n_rows)]


def _objective():
    spec = get_model_spec("bagel")
    return build_objective(load_config(["--config", "debug_bagel"]), spec, CFG)


def _ours(model, batch, obj, backend="sdpa", device="cpu"):
    """The train step's path: the family's prepare_batch and the metadata on the host, then the forward."""
    pb = prepare_batch(dataclasses.replace(CFG, attn_backend=backend), batch, device)
    attn = build_attn_meta(pb, backend, device, kind=obj.mask_kind)
    b = to_device(pb, torch.device(device), obj.host_keys)
    return model(b["input_ids"], position_ids=b["position_ids"], attn=attn, loss=obj.bind(b), **model_inputs(b, obj))


def test_bagel_matches_the_reference():
    """Hidden states, both loss sums and every parameter's gradient equal the reference's (packed rows of
    understanding, generation and editing samples: text, ViT, clean and noised VAE splits)."""
    model, ref, pp = _pair()
    obj = _objective()
    assert isinstance(obj, Combined) and obj.mask_kind == "segments" and obj.parts[1].sampler == "shifted"
    rows = _rows()
    batch = obj.prepare([collate_rows(rows, SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    assert_matches(_ours(model, batch, obj), ref(batch, ref_mask(rows, SEQ)), model, pp)


def test_the_head_runs_on_the_labeled_tokens_only():
    """prepare_batch hands the causal LM ``label_index`` (the labeled tokens over B*S, built on the host), and the
    head runs on those rows alone: the same loss and gradients, bit for bit, as the CPU path that drops the unlabeled
    rows by a boolean index (a sync on a GPU), with a fifth or fewer of the rows labeled."""
    model, _, _ = _pair()
    obj = _objective()
    batch = obj.prepare([collate_rows(_rows(), SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    pb = prepare_batch(CFG, batch, "cpu")
    want = (batch["labels"].reshape(-1) != -100).nonzero().squeeze(1)
    assert torch.equal(pb["label_index"], want) and 0 < want.numel() < batch["labels"].numel()
    h = torch.randn(*batch["labels"].shape, CFG.llm_config.hidden_size, requires_grad=True)
    by_index = model.lm_loss(h, batch["labels"], None, pb["label_index"])
    g_index, = torch.autograd.grad(by_index, h)
    dropped = model.lm_loss(h, batch["labels"])
    g_dropped, = torch.autograd.grad(dropped, h)
    assert torch.equal(by_index, dropped) and torch.equal(g_index, g_dropped)
    assert "label_index" in obj.loss_keys  # the loss reads it; the forward never sees it


def test_the_kernels_spec_picks_the_fused_cross_entropy():
    """``kernels`` with linear_cross_entropy sends the LM loss to titan_mm.kernels' fused op (GPU test:
    test_fused_cross_entropy_matches_the_reference_on_cuda); off the Triton path it is the same chunked CE, bit for
    bit."""
    plain = _pair()[0]
    fused = _pair(cfg=dataclasses.replace(CFG, kernels="all"))[0]
    assert fused.fused_ce and not plain.fused_ce
    assert not _pair(cfg=dataclasses.replace(CFG, kernels="all,-linear_cross_entropy"))[0].fused_ce
    labels = torch.tensor([[1, -100, 7, 3, -100, 47]])
    h = torch.randn(1, 6, CFG.llm_config.hidden_size, requires_grad=True)
    a, b = plain.lm_loss(h, labels), fused.lm_loss(h, labels)
    assert torch.equal(a, b)
    assert torch.equal(*(torch.autograd.grad(x, h)[0] for x in (a, b)))


def assert_matches(out, want, model, pp):
    """Our output's hidden states and loss sums equal the reference's ``want`` (hidden, ce, mse), then the
    gradients of ce + mse of every parameter."""
    h, ce, mse = want
    # fp32, the same products in other orders (index_copy vs boolean scatter, fused vs eager attention): ~1e-6
    torch.testing.assert_close(out.hidden.reshape(h.shape), h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.terms["ce"], ce, atol=0, rtol=1e-5)
    torch.testing.assert_close(out.terms["mse"], mse, atol=0, rtol=1e-5)
    (out.terms["ce"] + out.terms["mse"]).backward()
    (ce + mse).backward()
    ours = dict(model.named_parameters())
    for n, p in pp:  # fp32 sums over the batch's tokens: errors ~1e-7 of the tensor's largest gradient here
        err, scale = (ours[n].grad - p.grad).abs().max(), p.grad.abs().max().clamp(min=1.0)
        assert err <= 1e-5 * scale, (n, float(err), float(scale))


@pytest.mark.parametrize("flags", [{"freeze_und": True}, {"freeze_vit": True},
                                   {"freeze_und": True, "freeze_vit": True}])
def test_frozen_parts_do_not_move_over_a_step(flags):
    """BAGEL's freeze_und / freeze_vit: the frozen parts take no gradient and are in no group of the trainer's
    optimizer (build_optimizer with the family's param_groups), so a step of both losses leaves them bit for bit
    while every other parameter, the generation expert's among them, moves."""
    cfg = dataclasses.replace(CFG, **flags)
    frozen = {part for part in ("und", "vit") if flags.get(f"freeze_{part}")}
    torch.manual_seed(0)
    model = BagelModel(cfg)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    spec = get_model_spec("bagel")
    opt = build_optimizer(model, load_config(["--config", "debug_bagel"]),
                          split=functools.partial(spec.param_groups, model, cfg))
    assert {g["name"].rsplit("/", 1)[1] for g in opt.param_groups} == {"und", "gen", "vit"} - frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    obj = _objective()
    batch = obj.prepare([collate_rows(_rows(), SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    out = _ours(model, batch, obj)
    (out.terms["ce"] + out.terms["mse"]).backward()
    opt.step()
    parts = set()
    for n, p in model.named_parameters():
        part = param_part(n)
        parts.add(part)
        assert p.requires_grad == (part not in frozen) and (p.grad is None) == (part in frozen), n
        assert torch.equal(p.detach(), before[n]) == (part in frozen), n
    assert parts == {"und", "gen", "vit"}


MOE = dataclasses.replace(CFG, llm_config=dataclasses.replace(CFG.llm_config, layer_module="Qwen2MoEDecoderLayer"))


def test_mlp_only_split_matches_the_reference_and_round_trips(tmp_path):
    """BAGEL's Qwen2MoEDecoderLayer (one attention with its norms for every token, the MLP by expert): hidden states,
    both losses and every gradient equal the reference's (its gen layers lending their MLPs only); the weights go out
    under that layer's names (no _moe_gen attention copies) and back bit for bit, the config with them."""
    model, ref, pp = _pair(cfg=MOE)
    obj = _objective()
    rows = _rows()
    batch = obj.prepare([collate_rows(rows, SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    assert_matches(_ours(model, batch, obj), ref(batch, ref_mask(rows, SEQ)), model, pp)
    save_hf(model, MOE, tmp_path)
    with safe_open(tmp_path / "ema.safetensors", "pt") as f:
        layer0 = {n.removeprefix("language_model.model.layers.0.") for n in f.keys() if ".model.layers.0." in n}
    attn = {f"self_attn.{m}.{leaf}" for m in ("q_proj", "k_proj", "v_proj") for leaf in ("weight", "bias")}
    attn |= {f"{m}.weight" for m in ("self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "input_layernorm",
                                     "post_attention_layernorm")}
    assert layer0 == attn | {f"mlp{g}.{p}_proj.weight" for g in ("", "_moe_gen") for p in ("gate", "up", "down")}
    keep = {k: getattr(MOE, k) for k in ("vae_config", "latent_patch_size", "max_latent_size",
                                         "vit_max_num_patch_per_side", "timestep_shift")}
    assert BagelConfig.from_hf(tmp_path, **keep) == MOE
    fresh = BagelModel(MOE)
    load_hf(fresh, tmp_path)
    want = model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in fresh.state_dict().items())
    assert {param_part(n) for n, _ in model.named_parameters()} == {"und", "gen", "vit", "shared"}


def test_vit_matches_siglip_per_image():
    """The packed NaViT tower (two images of different sizes under one bidirectional per-image mask) equals
    transformers' Siglip encoder layers run on each image alone, given the same patch embeddings and positions."""
    model, ref, _ = _pair(1)
    p = CFG.vit_config.patch_size
    imgs = [torch.randn(3, 2 * p, 2 * p), torch.randn(3, 3 * p, p)]
    patches = torch.cat([patchify(x, p) for x in imgs])
    pos = torch.cat([flat_positions(x.shape[1] // p, x.shape[2] // p, CFG.vit_max_num_patch_per_side) for x in imgs])
    lens = torch.tensor([4, 3])
    doc = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), lens)[None]
    for backend in ("sdpa", "flex"):
        meta = build_attn_meta({"doc_ids": doc}, backend, "cpu", kind="bidirectional")
        with torch.no_grad():
            got = model.embed_vit(patches, pos, meta)
            want = ref.vit(patches, pos, lens.tolist())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_each_sample_alone():
    """A packed row's hidden states equal each of its samples run alone in a row of its own (flex and sdpa)."""
    model, _, _ = _pair(2)
    obj = _objective()
    rows = _rows(1)
    packed = obj.prepare([collate_rows(rows, SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    for backend in ("sdpa", "flex"):
        with torch.no_grad():
            h = _ours(model, packed, obj, backend).hidden[0]
        start = 0
        for d in rows[0]:
            alone = collate_rows([[d]], len(d), 0, 1, multiple=1, schema=SCHEMA)
            # the packed row's noise for this sample: same t and x_t, so the inputs are the same
            keys = ("noisy_latents", "timesteps", "flow_target", "flow_weight")
            alone.update({k: packed[k][:, start:start + len(d)] for k in keys})
            alone["num_latent_elements"] = packed["num_latent_elements"]
            with torch.no_grad():
                h1 = _ours(model, alone, obj, backend).hidden[0]
            torch.testing.assert_close(h[start:start + len(d)], h1, atol=1e-5, rtol=1e-5)
            start += len(d)


def compile_units(model: BagelModel, **kw) -> list[str]:
    """``Module.compile(**kw)`` each of the plan's compile units, as titan_mm.parallel.apply does; their FQNs."""
    units = match_modules(model, plan(model.cfg).compile_units)
    for _, mod in units:
        mod.compile(**kw)
    return [fqn for fqn, _ in units]


def test_compile_units_trace_as_whole_graphs():
    """The plan's compile units (every MoT layer, the whole ViT) trace with fullgraph=True (no graph break: the
    routing and the masks are tensors built on the host) and give the eager forward bit for bit (dynamo's eager
    backend: the trace, not inductor's kernels, which tests/gpu/test_bagel_gpu.py runs)."""
    model, _, _ = _pair(3)
    obj = _objective()
    batch = obj.prepare([collate_rows(_rows(1), SEQ, 0, 1, multiple=1, schema=SCHEMA)], 0)[0]
    with torch.no_grad():
        want = _ours(model, batch, obj).hidden
        assert compile_units(model, fullgraph=True, backend="eager") == ["layers.0", "layers.1", "vit"]
        assert torch.equal(_ours(model, batch, obj).hidden, want)


def test_segment_mask_equals_the_reference_mask():
    """The step's "segments" metadata (from the collator's seg_ids / seg_kinds / doc_ids) is BAGEL's mask element by
    element, and every image split shares one RoPE position."""
    rows = _rows(2)
    batch = collate_rows(rows, SEQ, 0, 1, multiple=1, schema=SCHEMA)
    meta = build_attn_meta(batch, "sdpa", "cpu", kind="segments")
    B, S = batch["input_ids"].shape
    want = torch.isfinite(ref_mask(rows, S)).view(B, S, B, S)
    for b in range(B):
        assert torch.equal(meta.sdpa_mask[b, 0], want[b, :, b])
    for b, docs in enumerate(rows):
        o = 0
        for d in docs:
            for n, mode in d.segments:
                p = batch["position_ids"][b, o:o + n]
                assert bool((p.diff() == (1 if mode == "causal" else 0)).all()), (mode, p)
                o += n


def test_flops_count_every_matmul_weight():
    """matmul_params covers every Linear weight once: per token (a decoder expert, llm2vae), per labeled token (the
    LM head: the head runs on them alone; every token without labels), per ViT patch (the tower and the
    connector), per latent token (vae2llm, the timestep embedder)."""
    spec = get_model_spec("bagel")
    for name in ("debug", "7B-MoT"):
        cfg = spec.flavor(name)
        with torch.device("meta"):
            m = spec.build(cfg)
        weights = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))
        expert = sum(p.numel() for n, p in m.layers["0"].gen.named_parameters() if n.endswith("weight") and
                     p.dim() == 2) * cfg.llm_config.num_hidden_layers
        assert sum(matmul_params(cfg)) + expert == weights  # a token runs one of the two experts
    cfg = spec.flavor("debug")
    tok, head, vit, lat = matmul_params(cfg)
    c, v = cfg.llm_config, cfg.vit_config
    want = 6 * (10 * tok + 4 * vit + 2 * lat) + 12 * c.hidden_size * c.num_hidden_layers * 55 + \
        12 * v.hidden_size * v.num_hidden_layers * 16
    kinds = torch.tensor([[0, 0, VIT, VIT, VIT, VIT, 0, VAE, VAE, 0]])
    batch = {"vit_lens": torch.tensor([4]), "token_kind": kinds}
    assert spec.flops(cfg, [10], **encoder_inputs(batch)) == want + 6 * 10 * head
    labels = torch.tensor([[-100] * 6 + [5, 6, -100, 7]])  # 3 labeled tokens: the head's rows
    assert spec.flops(cfg, [10], **encoder_inputs({**batch, "labels": labels})) == want + 6 * 3 * head
    # the decoder alone ("MFU (LLM only)"): the ViT tower and its attention left out, the labeled head kept
    vit_part = 6 * 4 * vit + 12 * v.hidden_size * v.num_hidden_layers * 16
    llm = spec.flops(cfg, [10], **encoder_inputs({**batch, "labels": labels}, encoders=False))
    assert llm == want + 6 * 3 * head - vit_part


def test_flops_count_the_segment_masks_pairs():
    """The attention term counts the pairs BAGEL's mask computes (docs/flops.md's convention): the collated rows'
    "segments" mask (= the reference's, test_segment_mask_equals_the_reference_mask), padding a causal document; and
    a hand-made row whose noise splits are followed by more splits of their document (bagel_mask, BAGEL's rule)."""
    spec, cfg = get_model_spec("bagel"), get_model_spec("bagel").flavor("debug")
    c = cfg.llm_config
    per_pair = 12 * c.num_attention_heads * c.head_dim * c.num_hidden_layers

    def pairs(lens, seg_ids, seg_kinds):
        causal = spec.flops(cfg, lens)
        return (spec.flops(cfg, lens, seg_ids=seg_ids, seg_kinds=seg_kinds) - causal) / per_pair + \
            sum(n * (n + 1) // 2 for n in lens)

    batch = collate_rows(_rows(2), SEQ, 0, 1, multiple=1, schema=SCHEMA)
    meta = build_attn_meta(batch, "sdpa", "cpu", kind="segments")
    enc = encoder_inputs(batch)
    assert pairs(doc_lens_from_batch(batch), enc["seg_ids"], enc["seg_kinds"]) == int(meta.sdpa_mask.sum())
    docs = ([(3, "causal"), (4, "noise"), (2, "causal"), (3, "full"), (2, "noise"), (1, "causal")],
            [(2, "causal"), (3, "full"), (1, "causal")], [(3, "causal")])  # the last one: the row's padding
    splits = [sp for d in docs for sp in d]
    seg_ids = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor([n for n, _ in splits]))[None]
    seg_kinds = torch.repeat_interleave(torch.tensor([SEGMENT_KINDS.index(k) for _, k in splits]),
                                        torch.tensor([n for n, _ in splits]))[None]
    want = sum(int(bagel_mask(d).sum()) for d in docs)
    assert pairs([sum(n for n, _ in d) for d in docs], seg_ids, seg_kinds) == want
    # causal 120 + 21 + 6, the splits' later keys 6 + 3 + 1 + 3, the noised tokens hidden from 8 and 1 later tokens
    assert want == 147 + 13 - (4 * 8 + 2 * 1)


def test_bench_case_rows_hold_text_vit_and_noised_latents():
    """bench/mfu.py's bagel_7b_mot_4l: 7B-MoT's widths with 4 MoT layers, and one full packed row of understanding
    (text, a 32 x 32 ViT image, an answer with CE) and generation samples (text, a noised 32 x 32 latent image) that
    the family's prepare_batch takes."""
    case = CASES["bagel_7b_mot_4l"]
    spec, mc = model_config(case)
    assert mc.llm_config.num_hidden_layers == 4
    assert mc.llm_config.hidden_size == spec.flavor("7B-MoT").llm_config.hidden_size
    b = case_batch(case, spec, mc, "cpu")
    kinds = b["token_kind"].reshape(-1)
    assert b["input_ids"].shape == (1, 8192) and int((b["doc_ids"] < 0).sum()) == 0
    assert [int((kinds == k).sum()) for k in (VIT, VAE)] == [3 * 1024, 3 * 1024]
    assert b["vit_lens"].tolist() == [1024] * 3 and int(b["latent_mask"].sum()) == 3 * 1024
    assert int(b["num_label_tokens"]) > 3 * 255 and set(b["noise_unit"].unique().tolist()) == {-1, 0, 1, 2}
    pb = prepare_batch(mc, b, "cpu")
    assert pb["gen_index"].numel() == 3 * 1024 and pb["vit_index"].numel() == 3 * 1024


def test_released_layout_round_trips_bit_for_bit(tmp_path):
    """save_hf writes BAGEL-7B-MoT's layout (ema.safetensors under the reference module's names, llm_config.json,
    vit_config.json with the dropped ViT layer counted back); load_hf reads it into a fresh plain or meta-built model
    bit for bit, and from_hf reads the config back. The names: the module tree of Bagel(Qwen2ForCausalLM with
    Qwen2MoTDecoderLayer, SiglipVisionModel after convert_conv2d_to_linear, MLPconnector, TimestepEmbedder,
    PositionEmbedding x 2), written out here for layer 0."""
    torch.manual_seed(0)
    model = BagelModel(CFG)
    model.init_weights()
    with torch.no_grad():  # no zeros or ones left: a swapped pair of tensors would show
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_hf(model, CFG, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema.safetensors", "llm_config.json", "vit_config.json"]
    with safe_open(tmp_path / "ema.safetensors", "pt") as f:
        names = set(f.keys())
        tables = {k: f.get_tensor(k) for k in ("latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed")}
    layer0 = {f"language_model.model.layers.0.{m}{g}.{leaf}" for g in ("", "_moe_gen") for m, leafs in (
        ("self_attn.q_proj", "wb"), ("self_attn.k_proj", "wb"), ("self_attn.v_proj", "wb"), ("self_attn.o_proj", "w"),
        ("self_attn.q_norm", "w"), ("self_attn.k_norm", "w"), ("input_layernorm", "w"),
        ("post_attention_layernorm", "w")) for leaf in ({"w": "weight", "b": "bias"}[x] for x in leafs)}
    layer0 |= {f"language_model.model.layers.0.mlp{g}.{p}_proj.weight" for g in ("", "_moe_gen")
               for p in ("gate", "up", "down")}
    vit0 = {f"vit_model.vision_model.encoder.layers.0.{m}.{leaf}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "layer_norm1", "layer_norm2",
        "mlp.fc1", "mlp.fc2") for leaf in ("weight", "bias")}
    top = {"language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
           "language_model.model.norm_moe_gen.weight", "language_model.lm_head.weight",
           "vit_model.vision_model.embeddings.patch_embedding.weight",
           "vit_model.vision_model.embeddings.patch_embedding.bias",
           "vit_model.vision_model.embeddings.position_embedding.weight",
           "vit_model.vision_model.post_layernorm.weight", "vit_model.vision_model.post_layernorm.bias",
           *(f"{m}.{leaf}" for m in ("connector.fc1", "connector.fc2", "time_embedder.mlp.0", "time_embedder.mlp.2",
                                     "vae2llm", "llm2vae") for leaf in ("weight", "bias")), *tables}
    assert {n for n in names if ".layers.0." in n} == layer0 | vit0
    assert {n for n in names if ".layers." not in n} == top
    assert len(names) == len(top) + 2 * len(layer0) + 2 * len(vit0)  # 2 MoT layers, 2 ViT layers
    c = CFG.llm_config.hidden_size
    assert torch.equal(tables["latent_pos_embed.pos_embed"], ref_table(c, CFG.max_latent_size))
    assert torch.equal(tables["vit_pos_embed.pos_embed"], ref_table(c, CFG.vit_max_num_patch_per_side))
    vit_json = json.loads((tmp_path / "vit_config.json").read_text())
    assert vit_json["num_hidden_layers"] == CFG.vit_config.num_hidden_layers + 1
    keep = {k: getattr(CFG, k) for k in ("vae_config", "latent_patch_size", "max_latent_size",
                                         "vit_max_num_patch_per_side", "timestep_shift")}
    assert BagelConfig.from_hf(tmp_path, **keep) == CFG
    want = model.state_dict()
    torch.manual_seed(1)
    fresh = BagelModel(CFG)
    with torch.device("meta"):
        meta = BagelModel(CFG)
    for m in (fresh, meta):
        load_hf(m, tmp_path)
        got = m.state_dict()
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = dataclasses.replace(CFG, max_latent_size=2)  # a flavor whose latent table the file does not hold
    with pytest.raises(HFCheckpointError, match="latent_pos_embed.pos_embed"):
        load_hf(BagelModel(other), tmp_path)


def test_a_segments_part_sets_the_combined_mask():
    """Contract v2's combined objective: the causal LM's "causal" yields to a part's "segments" (the description holds
    causal segments); other kinds still clash in one line."""
    assert Combined((CausalLM(), FlowMatching(mask="segments"))).mask_kind == "segments"
    assert Combined((CausalLM(), FlowMatching())).mask_kind == "causal"
    with pytest.raises(ValueError, match="different attention kinds"):
        Combined((CausalLM(), FlowMatching(mask="bidirectional")))


def test_config_mistakes_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="llm_config.num_hidden_layers = 2.5 is a float"):
        BagelConfig.from_hf_dicts({"num_hidden_layers": 2.5}, {})
    with pytest.raises(ValueError, match="builds Qwen2MoTDecoderLayer or Qwen2MoEDecoderLayer"):
        BagelConfig.from_hf_dicts({"layer_module": "Qwen2DecoderLayer"}, {})
    cfg = BagelConfig.from_hf_dicts({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
                                    {"num_hidden_layers": 27})
    assert cfg.vit_config.num_hidden_layers == 26 and cfg.llm_config.head_dim == 16
    with pytest.raises(ValueError, match="vit_max_num_patch_per_side 70 exceeds the ViT's position table of 8 x 8"):
        BagelConfig.from_hf_dicts({}, {"image_size": 32, "patch_size": 4})
    with pytest.raises(ValueError, match="llm_config.json cannot be read"):
        BagelConfig.from_hf(tmp_path)
    batch = collate_rows(_rows(1), SEQ, 0, 1, multiple=1, schema=SCHEMA)
    with pytest.raises(ValueError, match="4 ViT tokens .* but 3 vit_patches"):
        prepare_batch(CFG, {**batch, "vit_patches": batch["vit_patches"][:3]}, "cpu")


# ---- the launcher: train_configs/debug_bagel.toml on synthetic rows, both losses falling, exact resume ----

RUN = ["--config", "debug_bagel", "--metrics.enable_tensorboard", "False", "--training.deterministic", "True",
       "--checkpoint.async_mode", "disabled"]


def _terms(run_dir):
    return {s: (r["loss"], r["loss/ce"], r["loss/mse"]) for s, r in read_metrics(run_dir / "metrics.jsonl").items()}


@pytest.mark.slow
def test_debug_bagel_trains_and_resumes_exactly(tmp_path):
    """python -m titan_mm.launch.train --config debug_bagel.toml: both losses fall; stopped at a checkpoint and
    resumed, the run's later losses are the straight run's, bit for bit."""
    assert main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", "full"]) == 0
    full = _terms(tmp_path / "full")
    first = [sum(full[s][i] for s in range(1, 6)) / 5 for i in (1, 2)]
    last = [sum(full[s][i] for s in range(max(full) - 4, max(full) + 1)) / 5 for i in (1, 2)]
    assert last[0] < 0.5 * first[0] and last[1] < 0.9 * first[1], (first, last)

    assert_resumes_exactly(lambda name, steps: main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", name,
                                                     "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2",
                                                     *RESUME_ARGS]), tmp_path,
                           lambda r: (r["loss"], r["loss/ce"], r["loss/mse"]))


def test_debug_bagel_mistakes_are_one_line(tmp_path, capsys):
    assert main([*RUN, "--job.dump_folder", str(tmp_path), "--data.seq_len", "40"]) == 2
    assert f"data.seq_len = 40: a synthetic BAGEL row holds {ROW_TOKENS} tokens" in capsys.readouterr().err
    # a BAGEL folder: its configs are read; weights that do not fit the model are one error (exit 1)
    hf = tmp_path / "hf"
    hf.mkdir()
    c = CFG.llm_config
    files = {"config.json": {"model_type": "bagel"},
             "llm_config.json": {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                            "num_attention_heads", "num_key_value_heads")},
             "vit_config.json": {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "image_size": 280, "patch_size": 4}}
    for name, d in files.items():
        (hf / name).write_text(json.dumps(d))
    save_file({"x": torch.zeros(1)}, hf / "ema.safetensors")
    args = [*RUN, "--job.dump_folder", str(tmp_path), "--model.hf_path", str(hf), "--training.steps", "1"]
    assert main(args) == 1
    assert "ema.safetensors does not match the model" in capsys.readouterr().err

