"""BAGEL slice 3: text-to-image rows through the FLUX VAE (a tiny random diffusers AutoencoderKL built here, generated
images; nothing downloads) and the image sampler against a loop written from the reference's equations
(ByteDance-Seed/Bagel modeling/bagel/bagel.py generate_image / _forward_flow, modeling/autoencoder.py,
data/data_utils.py patchify), fp32 on CPU."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING
from PIL import Image
from safetensors.torch import save_file

from tests.unit.test_bagel import (
    CFG,
    MOE,
    RUN,
    _objective,
    _ours,
    _pair,
    both,
    ref_timestep,
)
from titan_mm.data.packing import collate_rows
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.launch.train import main
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.data import (
    T2IData,
    generation_doc,
    read_t2i,
    source_image,
    specials_for,
)
from titan_mm.models.bagel.sample import _Branch, sample
from titan_mm.models.bagel.spec import ROUTING_KEYS, SCHEMA, prepare_batch
from titan_mm.models.bagel.synthetic import (
    BOS,
    DEBUG_SPECIALS,
    EOS,
    VISION_END,
    VISION_START,
    Specials,
)
from titan_mm.models.bagel.vae import FluxVAE, load_ae, load_vae
from titan_mm.nn.attention import build_attn_meta
from titan_mm.tools.bagel_generate import main as generate

SCALE, SHIFT = 0.3611, 0.1159  # FLUX's scaling_factor / shift_factor (BAGEL's load_ae)


def tiny_vae(z: int = 4, levels: int = 3) -> AutoencoderKL:
    """FLUX's AutoencoderKL config (no quant convs, its scale / shift), tiny: 2^(levels-1) x down, z channels."""
    torch.manual_seed(1)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
                         up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=(8,) * levels,
                         layers_per_block=1, latent_channels=z, norm_num_groups=4, scaling_factor=SCALE,
                         shift_factor=SHIFT, use_quant_conv=False, use_post_quant_conv=False).eval()


def tokenize(text: str) -> list[int]:
    return [10 + ord(c) % 30 for c in text]


def ref_patchify(image, p):
    """data/data_utils.py patchify."""
    c, h, w = image.shape
    return torch.einsum("chpwq->hwpqc", image.reshape(c, h // p, p, w // p, p)).reshape(-1, p**2 * c)


def write_rows(tmp_path, sizes):
    rng = np.random.default_rng(0)
    lines = []
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "caption": f"picture {i}"}))
    (tmp_path / "t2i.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "t2i.jsonl"


def test_t2i_rows_are_flux_latents_packed_for_the_loss(tmp_path):
    """Each sample is [bos caption eos] then the image's latent patches as BAGEL computes them (the posterior's mode,
    scale x (z - shift), patchified), packed best-fit and collated; the loss runs on the batch with one t per
    image."""
    sizes = [(16, 16), (16, 24), (8, 16)]
    path = write_rows(tmp_path, sizes)
    vae = tiny_vae()
    data = T2IData(CFG, read_t2i(path), FluxVAE(vae, CFG), tokenize)
    batches = list(data.batches(seq_len=40, rows_per_batch=2))
    assert len(batches) == 1
    b = batches[0]
    want = []
    for i in range(len(sizes)):
        img = torch.from_numpy(np.asarray(Image.open(tmp_path / f"{i}.png"), np.float32)).permute(2, 0, 1)
        z = vae.encode((img / 127.5 - 1)[None]).latent_dist.mode()[0]
        want.append(ref_patchify(SCALE * (z - SHIFT), CFG.latent_patch_size))
    lat, pos, found = b["latent_mask"], b["position_ids"].reshape(2, -1), []
    for r in range(2):
        ids, units = b["input_ids"][r], b["noise_unit"][r][lat[r]].unique().tolist()
        assert units == list(range(len(units)))  # one t per image of the row, numbered from 0
        for u in units:
            tokens = lat[r] & (b["noise_unit"][r] == u)
            i = next(j for j, x in enumerate(want) if x.shape[0] == int(tokens.sum())
                     and torch.equal(b["latents"][r][tokens], x))
            found.append(i)
            first, n, cap = int(tokens.nonzero()[0]), want[i].shape[0], tokenize(f"picture {i}")
            assert ids[first - len(cap) - 3:first - 1].tolist() == [BOS, *cap, EOS]
            assert ids[first - 1].item() == VISION_START and ids[first + n].item() == VISION_END
            assert (pos[r, first - 1:first + n + 1] == pos[r, first - 2] + 1).all()  # one position per image
    assert sorted(found) == list(range(len(sizes)))
    assert (b["labels"] == -100).all()
    obj = _objective()
    model, _, _ = _pair()
    out = _ours(model, obj.prepare([b], 0)[0], obj)
    assert torch.isfinite(out.terms["mse"]) and out.terms["mse"] > 0


def test_t2i_mistakes_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"image": "a.png"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no string \"image\" and \"caption\""):
        read_t2i(tmp_path / "bad.jsonl")
    path = write_rows(tmp_path, [(12, 16)])
    with pytest.raises(ValueError, match="is 12x16; its sides must be multiples of 8"):
        list(T2IData(CFG, read_t2i(path), FluxVAE(tiny_vae(), CFG), tokenize).batches(40, 1))
    with pytest.raises(ValueError, match="the VAE has 16 latent channels and 8x downsampling"):
        FluxVAE(tiny_vae(16, 4), CFG)


def bfl_layout(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """The diffusers VAE's tensors under BFL's ``ae.safetensors`` names: diffusers' single-file conversion run
    backwards (its fixed table, then its block and attention renames; attention's linears back to 1x1 convs)."""
    n, fixed = len(vae.config.up_block_types), DIFFUSERS_TO_LDM_MAPPING["vae"]
    out = {}
    for k, v in vae.state_dict().items():
        if k in fixed:
            out[fixed[k]] = v
            continue
        k = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", k)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
        k = re.sub(r"up_blocks\.(\d+)\.resnets\.", lambda m: f"up.{n - 1 - int(m[1])}.block.", k)
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{n - 1 - int(m[1])}.upsample.", k)
        k = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", k)
        k = k.replace("conv_shortcut", "nin_shortcut")
        if "mid_block.attentions.0." in k:
            k = k.replace("mid_block.attentions.0.", "mid.attn_1.")
            for a, b in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
                k = k.replace(a, b)
            v = v[:, :, None, None] if v.ndim == 2 else v
        out[k] = v.contiguous()
    return out


def test_ae_safetensors_in_bfl_layout_loads_into_the_autoencoder(tmp_path, capsys):
    """A tiny random VAE written in BFL's layout (ae.safetensors) is read back through diffusers' converter into
    the same AutoencoderKL, every tensor equal, so it encodes and decodes as the original; FLUX's config (the
    default, and what a BAGEL folder's ae.safetensors gets) refuses the tiny file in one line."""
    vae = tiny_vae()
    sd = bfl_layout(vae)
    assert {"encoder.down.0.block.0.conv1.weight", "decoder.up.2.upsample.conv.weight", "encoder.norm_out.bias",
            "decoder.mid.block_2.norm1.weight"} <= set(sd) and sd["encoder.mid.attn_1.q.weight"].ndim == 4
    save_file(sd, tmp_path / "ae.safetensors")
    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    got = load_ae(tmp_path / "ae.safetensors", CFG, config=config)
    want = vae.state_dict()
    assert got.vae.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[k]) for k, t in got.vae.state_dict().items())
    img = torch.rand(1, 3, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ref = FluxVAE(vae, CFG)
    assert torch.equal(got.encode(img), ref.encode(img))
    assert torch.equal(got.decode(ref.encode(img)), ref.decode(ref.encode(img)))
    with pytest.raises(ValueError, match=r"does not hold the autoencoder \[128, 256, 512, 512\] x 16 in BFL's layout"):
        load_vae(tmp_path, CFG)
    (tmp_path / "run").mkdir()
    assert generate(["--model", str(tmp_path / "run"), "--prompt-ids", "6", "--height", "16", "--width", "16",
                     "--vae", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "no ae.safetensors, no config.json there" in err and err.count("\n") == 1, err


# ---- the sampler against the reference's loop ----

def ref_velocity(ref, ctx, x, t, lat_pos):
    """_forward_flow through the KV-cache form, written flat: the context's splits as the inferencer adds them
    (``("text", ids)`` with BOS / EOS, causal, one position per token; ``("vae", patches, pos)`` a clean image at
    t = 0 and ``("vit", patches, pos)``, full, one position each) and the query [vs, x, ve] at the next position,
    attending to the context and to itself; und weights for text and ViT, gen for the latents; llm2vae at the
    query's latents."""
    dev, P = x.device, x.shape[-1]
    parts = [*ctx, ("noise", x, lat_pos)]
    toks, gen, pos, split, causal, lat, t_tok, lpos, vit_at = [], [], [], [], [], [], [], [], []
    rope = 0
    for k, (kind, *a) in enumerate(parts):
        if kind == "text":
            ids = [BOS, *a[0], EOS]
            toks += ids
            gen += [False] * len(ids)
            pos += range(rope, rope + len(ids))
            rope += len(ids)
            split += [k] * len(ids)
            causal += [True] * len(ids)
            continue
        n = a[0].shape[0]
        toks += [VISION_START] + [0] * n + [VISION_END]
        gen += [False] + [kind != "vit"] * n + [False]
        pos += [rope] * (n + 2)
        rope += 1
        split += [k] * (n + 2)
        causal += [False] * (n + 2)
        if kind == "vit":
            vit_at.append((len(toks) - n - 1, a[0], a[1]))
        else:
            lat.append(a[0])
            lpos.append(a[1])
            t_tok += [0.0 if kind == "vae" else float(t)] * n
    S = len(toks)
    h = ref.embed(torch.tensor(toks, device=dev))
    for at, patches, vpos in vit_at:
        h[at:at + patches.shape[0]] = ref.vit(patches.to(dev), vpos.to(dev), [patches.shape[0]])
    g = torch.tensor(gen, device=dev)
    temb = ref.t2(F.silu(ref.t1(ref_timestep(torch.tensor(t_tok, device=dev)))))
    x_all = torch.cat([a.to(dev) for a in lat]).reshape(-1, P)
    h[g] = ref.vae2llm(x_all) + temb + ref.lat_table[torch.cat(lpos).to(dev)]
    sp, c = torch.tensor(split), torch.tensor(causal)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    allowed = (sp[j] < sp[i]) | ((sp[j] == sp[i]) & (~c[i] | (j <= i)))
    mask = torch.zeros(S, S).masked_fill(~allowed, float("-inf")).to(dev)
    cos, sin = ref.rotary(h[None], torch.tensor(pos, device=dev)[None])
    for und, gen_layer in zip(ref.und, ref.gen):
        h = ref.layer(und, gen_layer, h, g, cos, sin, mask)
    return ref.llm2vae(both(ref.norm, ref.norm_gen, h, g)[-x.shape[0] - 1:-1])


def lat_positions(h, w):
    return (torch.arange(h)[:, None] * CFG.max_latent_size + torch.arange(w)).flatten()


def ref_generate(ref, prompt, noise, hw, steps, shift, scale, interval, renorm_min, source=None, img_scale=1.0):
    """generate_image + _forward_flow (text CFG, then image CFG, "global" renorm), then decode_image's unpacking;
    the contexts as interleave_inference builds them for [source image, prompt]."""
    p = CFG.latent_patch_size
    h, w = hw[0] // p, hw[1] // p
    image = []
    if source is not None:
        lat, pix = source
        vp = CFG.vit_config.patch_size
        vit_pos = torch.arange(pix.shape[1] // vp)[:, None] * CFG.vit_max_num_patch_per_side + torch.arange(
            pix.shape[2] // vp)
        image = [("vae", ref_patchify(lat, p), lat_positions(lat.shape[1] // p, lat.shape[2] // p)),
                 ("vit", ref_patchify(pix, vp), vit_pos.flatten())]
    gen_ctx, cfg_text_ctx, cfg_img_ctx = [*image, ("text", prompt)], image, [("text", prompt)]
    x_t = noise
    timesteps = torch.linspace(1, 0, steps)
    timesteps = shift * timesteps / (1 + (shift - 1) * timesteps)
    dts = timesteps[:-1] - timesteps[1:]
    for i, t in enumerate(timesteps[:-1]):
        on = interval[0] < t <= interval[1]
        s_text, s_img = (scale, img_scale) if on else (1.0, 1.0)
        v_t = ref_velocity(ref, gen_ctx, x_t, t, lat_positions(h, w))
        if s_text > 1.0:
            cfg_text_v = ref_velocity(ref, cfg_text_ctx, x_t, t, lat_positions(h, w))
            v_ = cfg_text_v + s_text * (v_t - cfg_text_v)
            if s_img > 1.0:
                cfg_img_v = ref_velocity(ref, cfg_img_ctx, x_t, t, lat_positions(h, w))
                v_ = cfg_img_v + s_img * (v_ - cfg_img_v)
            v_t = v_ * (torch.norm(v_t) / (torch.norm(v_) + 1e-8)).clamp(min=renorm_min, max=1.0)
        x_t = x_t - v_t * dts[i]
    z = CFG.vae_config.z_channels
    return torch.einsum("nhwpqc->nchpwq", x_t.reshape(1, h, w, p, p, z)).reshape(z, h * p, w * p)


@pytest.mark.parametrize("scale,interval,renorm_min", [(1.0, (0.4, 1.0), 0.0), (4.0, (0.4, 1.0), 0.0),
                                                       (3.0, (0.0, 1.0), 0.5)])
def test_sampler_equals_the_reference_loop(scale, interval, renorm_min):
    """The sampler's latents (the context in a KV cache, the image query per step) equal the reference's loop (flat
    KV-cache form, from transformers layers): fp32, the same steps; the attention sums differ in order only (~1e-6
    per step)."""
    model, ref, _ = _pair()
    hw, prompt = (4, 6), [7, 8, 9]
    noise = torch.randn(6, CFG.patch_latent_dim, generator=torch.Generator().manual_seed(3))
    kw = {"steps": 6, "shift": 3.0}
    ours = sample(model, prompt, noise, hw, cfg_text_scale=scale, cfg_interval=interval, cfg_renorm_min=renorm_min,
                  **kw)
    with torch.no_grad():
        want = ref_generate(ref, prompt, noise, hw, kw["steps"], kw["shift"], scale, interval, renorm_min)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


def test_editing_sampler_equals_the_reference_loop():
    """Editing: the source image's clean VAE split and ViT split before the prompt, text guidance against the image
    alone, image guidance against the prompt alone, as interleave_inference and _forward_flow run them."""
    model, ref, _ = _pair()
    g = torch.Generator().manual_seed(4)
    source = (torch.randn(4, 4, 4, generator=g), torch.randn(3, 8, 12, generator=g))  # latent; ViT pixels (2 x 3)
    noise = torch.randn(6, CFG.patch_latent_dim, generator=g)
    ours = sample(model, [7, 8], noise, (4, 6), steps=5, shift=3.0, cfg_text_scale=4.0, cfg_interval=(0.0, 1.0),
                  source=source, cfg_img_scale=1.5)
    with torch.no_grad():
        want = ref_generate(ref, [7, 8], noise, (4, 6), 5, 3.0, 4.0, (0.0, 1.0), 0.0, source, 1.5)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    plain = sample(model, [7, 8], noise, (4, 6), steps=5, shift=3.0, cfg_text_scale=4.0, cfg_interval=(0.0, 1.0),
                   source=source)
    assert (plain - ours).abs().max() > 1e-3  # the image guidance matters


def recompute_velocity(model, prompt, hw, source, x, t):
    """The sampler's step before the KV cache: the whole sample (context and image query) through the training forward
    under its segment mask, llm2vae at the query's latents."""
    doc = generation_doc(CFG, prompt, torch.zeros(CFG.vae_config.z_channels, *hw), DEBUG_SPECIALS, source)
    b = prepare_batch(CFG, collate_rows([[doc]], len(doc), pad_id=0, position_axes=1, multiple=1, schema=SCHEMA),
                      "cpu")
    m = b["latent_mask"]
    noisy = torch.zeros(*m.shape, x.shape[-1])
    noisy[m] = x
    vit = {k: b[k] for k in ("vit_patches", "vit_pos", "vit_index", "vit_attn") if k in b}
    out = model(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu", kind="segments"),
                loss=lambda mo, o: mo.predict_velocity(o, b), **{k: b[k] for k in ROUTING_KEYS},
                noisy_latents=noisy, cond_latents=b["cond_latents"], timesteps=torch.where(m, t, 0.0),
                latent_pos=b["latent_pos"], **vit)
    return out.terms[m]


@torch.no_grad()
def test_cached_steps_equal_recomputing_the_whole_sample():
    """Each branch's step (the prompt; none; the source, then the prompt; the source alone; and the MLP-only split's)
    against the context's KV cache equals the whole sample recomputed through the training forward: the same
    products, only the order of the GEMMs' and attention's sums differs (their blocking follows the row count), so
    the velocities (|v| ~ 1) agree to a few units in the last place; 64 fp32 ulps of |v| bounds that (measured: 2)."""
    model, _, _ = _pair()
    g = torch.Generator().manual_seed(4)
    source = (torch.randn(4, 4, 4, generator=g), torch.randn(3, 8, 12, generator=g))
    x = torch.randn(6, CFG.patch_latent_dim, generator=g)
    moe, _, _ = _pair(cfg=MOE)  # the MLP-only split, its editing branch
    for m, prompt, src, ts in ((model, [7, 8, 9], None, (1.0, 0.5, 0.1)), (model, None, None, (1.0, 0.5, 0.1)),
                               (model, [7, 8], source, (1.0, 0.5, 0.1)), (model, None, source, (1.0, 0.5, 0.1)),
                               (moe, [7, 8], source, (0.5,))):
        branch = _Branch(m, prompt, (4, 6), DEBUG_SPECIALS, src)
        for t in ts:
            want = recompute_velocity(m, prompt, (4, 6), src, x, torch.tensor(t))
            got = branch.velocity(x, torch.tensor(t))
            tol = 64 * torch.finfo(torch.float32).eps * want.abs().max()
            assert (got - want).abs().max() <= tol, (m.cfg.llm_config.layer_module, prompt, src is not None, t)


def test_sampler_mistakes_are_one_line():
    model, _, _ = _pair()
    noise = torch.randn(6, CFG.patch_latent_dim)
    for kw, msg in (({"steps": 1}, "needs at least 2 points"), ({"shift": 0.0}, "it must be > 0"),
                    ({"cfg_interval": (0.5, 0.2)}, "give \\(low, high\\)")):
        with pytest.raises(ValueError, match=msg):
            sample(model, [7], noise, (4, 6), **kw)
    with pytest.raises(ValueError, match="image guidance needs a source image"):
        sample(model, [7], noise, (4, 6), cfg_img_scale=1.5)
    with pytest.raises(ValueError, match="a latent of 3x6 does not fit"):
        sample(model, [7], noise, (3, 6))
    with pytest.raises(ValueError, match=r"noise of shape \[6, 16\] is not \[4, 16\]"):
        sample(model, [7], noise, (4, 4))


# ---- python -m titan_mm.tools.bagel_generate ----

def test_a_few_steps_debug_model_draws_a_png(tmp_path, capsys):
    """debug_bagel trained 3 steps (its final checkpoint) -> the tool writes a PNG through a FLUX-config VAE folder,
    and the latent .pt is the sampler's [z, h, w]."""
    args = [*RUN, "--job.dump_folder", str(tmp_path), "--job.name", "run", "--training.steps", "3",
            "--checkpoint.interval", "3"]
    assert main(args) == 0
    tiny_vae().save_pretrained(tmp_path / "vae")
    common = ["--model", str(tmp_path / "run"), "--prompt-ids", "6,13", "--height", "16", "--width", "24",
              "--steps", "4"]
    assert generate([*common, "--vae", str(tmp_path / "vae"), "--out", str(tmp_path / "seven.png")]) == 0
    with Image.open(tmp_path / "seven.png") as im:
        assert im.size == (24, 16) and im.mode == "RGB"
    assert generate([*common, "--out", str(tmp_path / "z.pt")]) == 0
    assert torch.load(tmp_path / "z.pt").shape == (4, 4, 6)
    # editing: the source image's size, image guidance on
    assert generate([*common[:4], "--steps", "3", "--image", str(tmp_path / "seven.png"), "--vae",
                     str(tmp_path / "vae"), "--out", str(tmp_path / "edit.png")]) == 0
    with Image.open(tmp_path / "edit.png") as im:
        assert im.size == (24, 16)
    capsys.readouterr()
    for extra, msg in ((["--out", str(tmp_path / "x.png")], "a PNG needs --vae"),
                       (["--vae", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")], "no config.json there"),
                       (["--prompt", "seven", "--out", str(tmp_path / "x.pt")], "one of them"),
                       (["--height", "18", "--out", str(tmp_path / "x.pt")], "must be multiples of the VAE's"),
                       (["--height", "4", "--out", str(tmp_path / "x.pt")], "a latent of 1x6 does not fit"),
                       (["--prompt-ids", "6,99", "--out", str(tmp_path / "x.pt")], "outside the model's vocabulary"),
                       (["--image", str(tmp_path / "seven.png"), "--out", str(tmp_path / "x.pt")], "pass --vae")):
        assert generate([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_special_ids_are_the_tokenizers_inside_the_vocabulary():
    """BAGEL's <|im_start|> / <|im_end|> / <|vision_start|> / <|vision_end|> from the tokenizer for a full-vocabulary
    model; the debug vocabulary's 1-4 for a model too small to hold them."""
    tok = load_tokenizer()
    want = Specials(tok.im_start_id, tok.im_end_id, tok.vision_start_id, tok.vision_end_id)
    assert specials_for(tok, FLAVORS["7B-MoT"]) == want and None not in want
    assert specials_for(tok, CFG) == DEBUG_SPECIALS
    doc = generation_doc(FLAVORS["7B-MoT"], [100, 101], torch.zeros(16, 4, 2), want)
    assert doc.input_ids.tolist() == [want.bos, 100, 101, want.eos, want.vision_start, 0, 0, want.vision_end]


def test_caption_dropout_leaves_the_image_split_alone_reproducibly(tmp_path):
    """drop_text (BAGEL's text_cond_dropout_prob): a dropped sample is the image split alone at position 0 (the
    sampler's unconditional context); the draws depend on (seed, sample) only."""
    path = write_rows(tmp_path, [(8, 8)] * 12)
    vae = FluxVAE(tiny_vae(), CFG)
    docs = [T2IData(CFG, read_t2i(path), vae, tokenize, drop_text=0.5, seed=s).doc(i) for s in (0, 0, 1)
            for i in range(12)]
    a, b, c = (docs[k * 12:(k + 1) * 12] for k in range(3))
    dropped = [len(d.segments) == 1 for d in a]
    assert 0 < sum(dropped) < 12 and dropped == [len(d.segments) == 1 for d in b]
    assert dropped != [len(d.segments) == 1 for d in c]
    for d, drop in zip(a, dropped):
        assert [k for _, k in d.segments] == (["noise"] if drop else ["causal", "noise"])
        if drop:
            assert d.positions.max() == 0 and d.input_ids[0] == VISION_START
    with pytest.raises(ValueError, match="drop_text = 1.0: the caption dropout"):
        T2IData(CFG, read_t2i(path), vae, tokenize, drop_text=1.0)


def test_an_editing_source_is_the_vae_latent_and_a_vit_copy_in_patch_multiples(tmp_path):
    path = write_rows(tmp_path, [(16, 24)])
    vae = tiny_vae()
    cfg3 = dataclasses.replace(CFG, vit_config=dataclasses.replace(CFG.vit_config, patch_size=3))
    lat, vit = source_image(read_t2i(path)[0].image, FluxVAE(vae, cfg3), cfg3)
    img = torch.from_numpy(np.asarray(Image.open(tmp_path / "0.png"), np.float32)).permute(2, 0, 1) / 127.5 - 1
    assert torch.equal(lat, SCALE * (vae.encode(img[None]).latent_dist.mode()[0] - SHIFT))
    assert vit.shape == (3, 15, 24)  # the ViT's copy: 16 -> 15 rows (multiples of 3), 24 columns kept
    assert torch.equal(source_image(read_t2i(path)[0].image, FluxVAE(vae, CFG), CFG)[1], img)
