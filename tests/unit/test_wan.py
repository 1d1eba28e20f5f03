"""The wan family against diffusers' WanTransformer3DModel on tiny random configs, fp32 on CPU: predictions and
gradients (Wan2.1 T2V: one t per clip; Wan2.2 TI2V: a t per patch, the first frame clean), and diffusers folders
in and out, bit for bit."""

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")  # the optional extra [diffusers]

from titan_mm.config import ConfigError, load_config  # noqa: E402
from titan_mm.export import main as export_main  # noqa: E402
from titan_mm.launch.train import main  # noqa: E402
from titan_mm.loader import load_model  # noqa: E402
from titan_mm.models.hf_io import HFCheckpointError  # noqa: E402
from titan_mm.models.wan import WanConfig, WanModel, patchify, unpatchify  # noqa: E402
from titan_mm.models.wan.flops import matmul_params  # noqa: E402
from titan_mm.models.wan.hf import DIFFUSERS_SINGLE, load_hf, save_hf  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.objectives import FlowMatching, build_objective  # noqa: E402
from titan_mm.observe.metrics import read_metrics  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.train.state import TrainState  # noqa: E402
from titan_mm.train.step import StepContext, eval_loss_sums, train_step  # noqa: E402
from titan_mm.train.synthetic import SyntheticLoader  # noqa: E402

TINY = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
# Wan2.2-TI2V-5B's transformer differs from Wan2.1's only in sizes (48 latent channels); its pipeline gives a t per
# patch (expand_timesteps). Here: a patch over 2 frames too, and no cross-attention norm.
TI2V = {**TINY, "patch_size": [2, 2, 2], "in_channels": 6, "out_channels": 6, "cross_attn_norm": False}
B, FR, H, W, L = 2, 4, 6, 8, 5


def _pair(hf: dict, tmp_path):
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**hf).float()
    for p in ref.parameters():  # diffusers zero-inits no bias here, but make every weight matter
        torch.nn.init.normal_(p, std=0.2)
    ref.save_pretrained(tmp_path / "transformer")
    cfg = WanConfig.from_hf(tmp_path)  # a pipeline folder: its transformer/ subfolder
    model = WanModel(cfg)
    load_hf(model, tmp_path)
    return ref, model, cfg


def _inputs(cfg: WanConfig, per_patch: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, cfg.in_channels, FR, H, W, generator=g)
    text = torch.randn(B, L, cfg.text_dim, generator=g)
    patches, grid = patchify(x, cfg.patch_size)
    S = patches.shape[1]
    t = torch.rand(B, 1, generator=g).expand(B, S).clone()
    if per_patch:  # TI2V: the first latent frame is the clean conditioning image (t = 0)
        t[:, grid[0, :, 0] == 0] = 0.0
    return x, text, patches, grid, t


@pytest.mark.parametrize("hf,per_patch", [(TINY, False), (TI2V, True)], ids=["wan2.1", "wan2.2_ti2v"])
def test_wan_matches_diffusers(hf, per_patch, tmp_path):
    ref, model, cfg = _pair(hf, tmp_path)
    x, text, patches, grid, t = _inputs(cfg, per_patch)
    x_ref, text_ref = x.clone().requires_grad_(), text.clone().requires_grad_()
    t_ref = t * 1000 if per_patch else t[:, 0] * 1000  # diffusers' timestep = sigma x 1000
    want = ref(x_ref, t_ref, text_ref).sample  # [B, C, F, H, W]

    patches.requires_grad_()
    text.requires_grad_()
    meta = build_attn_meta({"doc_ids": torch.zeros(B, patches.shape[1], dtype=torch.int32)}, "sdpa", "cpu",
                           kind="bidirectional")
    # the family's host choice: one t per clip runs the time MLP per clip (clip_timesteps [B]), else per patch
    tb = get_model_spec("wan").prepare_batch(cfg, {"timesteps": t, "latent_mask": torch.ones(t.shape, dtype=bool)},
                                             "cpu")
    assert set(tb) == {"latent_mask", "timesteps" if per_patch else "clip_timesteps"}
    out = model(attn=meta, noisy_latents=patches, text_states=text, grid_fhw=grid, **tb)
    pred = model.predict_velocity(out, {})
    f, hh, ww = (n // p for n, p in zip((FR, H, W), cfg.patch_size))
    got = unpatchify(pred, (f, hh, ww), cfg.patch_size)
    # fp32, the same products summed in other orders (conv vs linear, per-token vs per-clip time MLP): ~1e-6
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (want * w).sum().backward()
    (got * w).sum().backward()
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(text.grad, text_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(unpatchify(patches.grad, (f, hh, ww), cfg.patch_size), x_ref.grad, atol=1e-4,
                               rtol=1e-4)


def test_time_mlp_per_clip_equals_per_patch(tmp_path):
    """One t per clip: the time MLP once per row, broadcast, gives the per-patch path's prediction (the same
    products; the GEMMs' blocking may differ by an ulp); prepare_batch keeps the per-patch path where a row's
    latents do not share t (two clips packed in a row, a clean first frame) and ignores non-latent positions."""
    _, model, cfg = _pair(TINY, tmp_path)
    x, text, patches, grid, t = _inputs(cfg, per_patch=False)
    meta = build_attn_meta({"doc_ids": torch.zeros(B, patches.shape[1], dtype=torch.int32)}, "sdpa", "cpu",
                           kind="bidirectional")
    kw = dict(attn=meta, noisy_latents=patches, text_states=text, grid_fhw=grid)
    with torch.no_grad():
        per_patch = model(timesteps=t, **kw).hidden
        per_clip = model(clip_timesteps=t[:, 0], **kw).hidden
    torch.testing.assert_close(per_clip, per_patch, atol=1e-6, rtol=1e-6)
    prep = get_model_spec("wan").prepare_batch
    mask = torch.ones(t.shape, dtype=torch.bool)
    mask[:, -3:] = False
    padded = torch.where(mask, t, 0.0)  # flow matching gives non-latent positions t = 0
    assert torch.equal(prep(cfg, {"timesteps": padded, "latent_mask": mask}, "cpu")["clip_timesteps"], t[:, 0])
    two = t.clone()
    two[1, 5:] = 0.5  # row 1 holds two clips
    assert torch.equal(prep(cfg, {"timesteps": two, "latent_mask": mask}, "cpu")["timesteps"], two)


def test_flops_count_every_matmul_weight():
    """flops.matmul_params covers every Linear / Conv3d weight once (per video token, per text token or per clip:
    the time MLP), and the objective's bidirectional mask adds the other half of each clip's attention pairs to the
    family's causal ones."""
    spec = get_model_spec("wan")
    for name in ("debug", "1.3B"):
        cfg = spec.flavor(name)
        with torch.device("meta"):
            m = spec.build(cfg)
        weights = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, (torch.nn.Linear, torch.nn.Conv3d)))
        assert sum(matmul_params(cfg)) == weights
    cfg = spec.flavor("debug")
    tok, text, time = matmul_params(cfg)
    obj = build_objective(load_config(["--config", "debug_wan"]), spec, cfg)
    S, T = 48, 5  # one clip of 48 patches, 5 text tokens
    want = 6 * S * tok + 6 * (T * text + time) + 12 * cfg.dim * cfg.num_layers * (S * S + S * T)
    assert obj.mask_kind == "bidirectional" and obj.flops(spec, cfg, [S], text_len=T) == want


def test_flow_matching_settings_of_the_job():
    """[objective] flow_sampler / flow_shift / flow_weighting replace the family's flow-matching choices (Wan's
    training: uniform t shifted as diffusers' scheduler); a family without flow matching refuses them in one line."""
    spec = get_model_spec("wan")
    cfg = spec.flavor("debug")
    job = load_config(["--config", "debug_wan", "--objective.flow_sampler", "uniform", "--objective.flow_shift", "3",
                       "--objective.flow_weighting", "sigma_sqrt"])
    obj = build_objective(job, spec, cfg)
    assert (obj.sampler, obj.shift, obj.weighting, obj.mask_kind) == ("uniform", 3.0, "sigma_sqrt", "bidirectional")
    default = build_objective(load_config(["--config", "debug_wan"]), spec, cfg)
    assert (default.sampler, default.shift, default.weighting) == ("logit_normal", 1.0, "none")
    with pytest.raises(ConfigError, match="flow matching sampler 'cosine' is unknown"):
        build_objective(load_config(["--config", "debug_wan", "--objective.flow_sampler", "cosine"]), spec, cfg)
    qwen = get_model_spec("qwen3")
    with pytest.raises(ConfigError, match=r"objective.flow_shift set flow matching, which model 'qwen3' does not"):
        build_objective(load_config(["--config", "debug_qwen3", "--objective.flow_shift", "3"]), qwen,
                        qwen.flavor("debug"))


def test_patchify_round_trip():
    x = torch.randn(2, 3, 4, 6, 8)
    p, grid = patchify(x, (2, 2, 2))
    assert p.shape == (2, 2 * 3 * 4, 24) and grid[0, -1].tolist() == [1, 2, 3]
    assert torch.equal(unpatchify(p, (2, 3, 4), (2, 2, 2)), x)
    with pytest.raises(ValueError, match="does not divide into patches"):
        patchify(torch.zeros(1, 3, 3, 6, 8), (2, 2, 2))


def test_diffusers_folder_round_trip_is_exact(tmp_path):
    ref, model, cfg = _pair(TINY, tmp_path / "in")
    save_hf(model, cfg, tmp_path / "out")
    back = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out")
    assert dict(back.config) | {} and all(back.config[k] == ref.config[k] for k in TINY)
    want = ref.state_dict()
    assert set(back.state_dict()) == set(want)
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    assert (tmp_path / "out" / DIFFUSERS_SINGLE).is_file()
    assert WanConfig.from_hf(tmp_path / "out") == cfg


def test_config_and_folder_mistakes_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="num_layers = 2.5 is a float; it must be a positive int"):
        WanConfig.from_hf_dict({"_class_name": "WanTransformer3DModel", "num_layers": 2.5})
    with pytest.raises(ValueError, match="_class_name='UNet3D'"):
        WanConfig.from_hf_dict({"_class_name": "UNet3D"})
    with pytest.raises(ValueError, match="Wan2.1 I2V"):
        WanConfig.from_hf_dict({"_class_name": "WanTransformer3DModel", "image_dim": 1280, "added_kv_proj_dim": 32})
    cfg = _pair(TINY, tmp_path)[2]
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), "ffn_dim": 48}))
    with pytest.raises(HFCheckpointError, match="wrong shape for blocks.0.ffn.net.0.proj.weight"):
        load_hf(WanModel(WanConfig.from_hf(tmp_path)), tmp_path)


# ---- training: flow matching on synthetic latents through the real train step ----

class ClipFlow(FlowMatching):
    """Flow matching with every clip's patches attending each other fully (Wan's self-attention)."""

    mask_kind = "bidirectional"


def _clips(seed: int, cfg: WanConfig, rows: int = 2):
    """Batches forever of clips whose latents are a fixed function of their text states (learnable)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cfg.text_dim, cfg.in_channels, generator=torch.Generator().manual_seed(7))
    while True:
        text = torch.randn(rows, L, cfg.text_dim, generator=g)
        x = torch.tanh(text.mean(1) @ mix)[:, :, None, None, None].expand(rows, -1, FR, H, W)
        x = x + 0.1 * torch.randn(x.shape, generator=g)
        patches, grid = patchify(x.contiguous(), cfg.patch_size)
        S = patches.shape[1]
        yield {"latents": patches, "latent_mask": torch.ones(rows, S, dtype=torch.bool),
               "noise_unit": torch.zeros(rows, S, dtype=torch.long), "grid_fhw": grid,
               "doc_ids": torch.zeros(rows, S, dtype=torch.int32), "position_ids": torch.zeros(rows, S, dtype=torch.long),
               "text_states": text}


def test_wan_trains_with_flow_matching():
    spec = get_model_spec("wan")  # registered by importing titan_mm.models.wan
    cfg = spec.flavor("debug")
    torch.manual_seed(0)
    model = spec.build(cfg)
    ctx = StepContext(device=torch.device("cpu"), objective=ClipFlow(sampler="uniform", seed=1),
                      seq_keys=spec.schema().seq)
    held_out = [next(_clips(99, cfg))]

    def held_out_mse():
        sums, counts = eval_loss_sums(model, held_out, ctx)
        return sums["mse"] / counts["mse"]

    before = held_out_mse()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    data = _clips(0, cfg)
    results = [train_step(state, [next(data)], ctx) for _ in range(200)]
    after = held_out_mse()
    assert all(set(r.terms) == {"mse"} and r.counts["mse"] > 0 for r in results)
    # untrained: about E|eps - x0|^2 = 1 + E x0^2 per element; a model that reads the text knows x0, and from x_t
    # then eps, up to the clips' 0.1 noise; 1.81 -> 0.75 here
    assert after < 0.5 * before, (before, after)


# ---- the launcher: train_configs/debug_wan.toml on synthetic clips, checkpoints, exact resume ----

RUN = ["--config", "debug_wan", "--metrics.enable_tensorboard", "False", "--training.deterministic", "True",
       "--checkpoint.async_mode", "disabled"]


def _losses(run_dir):
    return {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items()}


def test_debug_wan_trains_and_resumes_exactly(tmp_path):
    """python -m titan_mm.launch.train --config debug_wan.toml: the flow-matching loss falls over the run; stopped
    at a checkpoint and resumed, the run's later losses are the straight run's, bit for bit."""
    assert main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", "full"]) == 0
    full = _losses(tmp_path / "full")
    first, last = sum(full[s] for s in range(1, 11)) / 10, sum(full[s] for s in range(51, 61)) / 10
    assert last < 0.75 * first, (first, last)  # 1.4 -> 0.9 here: the latents follow the text states

    def short(steps: int, name: str) -> int:  # a constant lr: a 4-step run's schedule is the 8-step one's start
        return main([*RUN, "--job.dump_folder", str(tmp_path), "--training.steps", str(steps), "--checkpoint.interval",
                     "4", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.name", "constant", "--job.name", name])

    assert short(8, "straight") == 0
    assert short(4, "stopped") == 0 and short(8, "stopped") == 0  # the second run resumes at the step-4 checkpoint
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "stopped")
    assert sorted(b) == list(range(1, 9)) and all(a[s] == b[s] for s in range(1, 9)), (a, b)


def test_debug_wan_starts_from_a_diffusers_folder(tmp_path):
    """model.hf_path at a diffusers transformer folder, or at the pipeline folder holding it (model_index.json +
    transformer/): the run takes its config and weights (its first loss is the one the folder's model gives on the
    run's first batch, not the random init's)."""
    cfg = get_model_spec("wan").flavor("debug")
    torch.manual_seed(3)
    ref = diffusers.WanTransformer3DModel(**{k: list(v) if isinstance(v, tuple) else v
                                             for k, v in cfg.to_hf_dict().items() if not k.startswith("_")})
    ref.save_pretrained(tmp_path / "pipe" / "transformer")
    args = [*RUN, "--job.dump_folder", str(tmp_path), "--training.steps", "1"]
    assert main([*args, "--job.name", "hf", "--model.hf_path", str(tmp_path / "pipe" / "transformer")]) == 0
    assert main([*args, "--job.name", "random"]) == 0
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    assert main([*args, "--job.name", "root", "--model.hf_path", str(tmp_path / "pipe")]) == 0
    model = WanModel(cfg)
    load_hf(model, tmp_path / "pipe")
    ctx = StepContext(device=torch.device("cpu"), objective=FlowMatching(seed=0, mask="bidirectional"),
                      seq_keys=get_model_spec("wan").schema().seq)
    batch = SyntheticLoader(vocab_size=0, seq_len=48, micro_batch_size=4, seed=0,
                            make_batch=get_model_spec("wan").synthetic(cfg, 48)).batch(0)  # the run's first batch
    want = eval_loss_sums(model, [batch], ctx)
    hf, rnd = _losses(tmp_path / "hf")[1], _losses(tmp_path / "random")[1]
    assert hf != rnd and hf == pytest.approx(float(want[0]["mse"] / want[1]["mse"]), rel=1e-6)
    assert _losses(tmp_path / "root")[1] == hf


def test_debug_wan_mistakes_are_one_line(tmp_path, capsys):
    assert main([*RUN, "--job.dump_folder", str(tmp_path), "--data.seq_len", "40"]) == 2
    assert "data.seq_len = 40: synthetic Wan clips are frames of 4x4 patches" in capsys.readouterr().err


def test_export_of_a_wan_run_is_a_diffusers_folder(tmp_path):
    """python -m titan_mm.export on a wan run (the CLI's main) writes a transformer folder and nothing
    else (no tokenizer: Wan has no tokens); diffusers reads it with the run's weights bit for bit and predicts what
    the run's model predicts."""
    assert main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", "run", "--training.steps", "2",
                 "--checkpoint.interval", "2"]) == 0
    out = tmp_path / "pipe" / "transformer"
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", DIFFUSERS_SINGLE]
    got = load_model(tmp_path / "run")
    back = diffusers.WanTransformer3DModel.from_pretrained(out).float()
    assert all(torch.equal(v, got.model.state_dict()[k]) for k, v in back.state_dict().items())
    cfg = got.model_cfg
    g = torch.Generator().manual_seed(4)
    x, text = torch.randn(2, cfg.in_channels, 3, 8, 8, generator=g), torch.randn(2, 8, cfg.text_dim, generator=g)
    t = torch.rand(2, generator=g)
    patches, grid = patchify(x, cfg.patch_size)
    meta = build_attn_meta({"doc_ids": torch.zeros(patches.shape[:2], dtype=torch.int32)}, "sdpa", "cpu",
                           kind="bidirectional")
    with torch.no_grad():
        want = back(x, t * 1000, text).sample
        pred = got.model.predict_velocity(got.model(attn=meta, noisy_latents=patches, clip_timesteps=t,
                                                    text_states=text, grid_fhw=grid), {})
    torch.testing.assert_close(unpatchify(pred, (3, 4, 4), cfg.patch_size), want, atol=1e-5, rtol=1e-5)  # parity

