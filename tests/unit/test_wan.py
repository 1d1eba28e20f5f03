"""The wan family against diffusers' WanTransformer3DModel on tiny random configs, fp32 on CPU: predictions and
gradients (Wan2.1 T2V: one t per clip; Wan2.2 TI2V: a t per patch, the first frame clean), and diffusers folders
in and out, bit for bit."""

import dataclasses
import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")  # the optional extra [diffusers]

from tests.resume_check import RESUME_ARGS, assert_resumes_exactly  # noqa: E402
from titan_mm.config import ConfigError, load_config  # noqa: E402
from titan_mm.export import main as export_main  # noqa: E402
from titan_mm.launch.train import main  # noqa: E402
from titan_mm.loader import load_model  # noqa: E402
from titan_mm.models.hf_io import HFCheckpointError  # noqa: E402
from titan_mm.models.wan import WanConfig, WanModel, patchify, unpatchify  # noqa: E402
from titan_mm.models.wan.data import latent_batch  # noqa: E402
from titan_mm.models.wan.flops import matmul_params  # noqa: E402
from titan_mm.models.wan.hf import DIFFUSERS_SINGLE, from_diffusers, load_hf, save_hf, to_diffusers  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.objectives import FlowMatching, build_objective  # noqa: E402
from titan_mm.objectives.base import noise_generator  # noqa: E402
from titan_mm.observe.metrics import read_metrics  # noqa: E402
from titan_mm.registry import SpecError, get_model_spec, resolve_model  # noqa: E402
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


def _pair(hf: dict, tmp_path, seed: int = 0, subfolder: str = "transformer"):
    torch.manual_seed(seed)
    ref = diffusers.WanTransformer3DModel(**hf).float()
    for p in ref.parameters():  # diffusers zero-inits no bias here, but make every weight matter
        torch.nn.init.normal_(p, std=0.2)
    ref.save_pretrained(tmp_path / subfolder)
    if subfolder != "transformer":  # A14B's low-noise expert: the config and weights of transformer_2/
        cfg = dataclasses.replace(WanConfig.from_hf(tmp_path / subfolder), expert="low_noise", boundary_ratio=0.5)
        model = WanModel(cfg)
        load_hf(model, tmp_path / subfolder)
        return ref, model, cfg
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
    grads = to_diffusers(dict(model.named_parameters()))
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

    assert_resumes_exactly(lambda name, steps: main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", name,
                                                     "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2",
                                                     *RESUME_ARGS]), tmp_path)


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
    assert all(torch.equal(v, got.model.state_dict()[k]) for k, v in from_diffusers(back.state_dict()).items())
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


def test_a14b_expert_trains_its_side_of_the_boundary(tmp_path):
    """Wan2.2 A14B (a pipeline folder with transformer/ and transformer_2/, model_index.json's boundary_ratio):
    model.overrides' expert picks the transformer the run loads and the t range flow matching samples (the side
    WanPipeline gives that transformer); the export stays a diffusers transformer config."""
    pipe = tmp_path / "pipe"
    high = _pair(TINY, pipe)[0]
    low = _pair(TINY, pipe, seed=1, subfolder="transformer_2")[0]
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))
    spec = get_model_spec("wan")
    S = 24
    batch = {"latents": torch.randn(64, S, 16), "latent_mask": torch.ones(64, S, dtype=torch.bool),
             "noise_unit": torch.zeros(64, S, dtype=torch.long)}
    for expert, ref, lo, hi in [("high_noise", high, 0.875, 1.0), ("low_noise", low, 0.0, 0.875),
                                ("", high, 0.0, 1.0)]:
        _, cfg = resolve_model("wan", "debug", hf_path=str(pipe), overrides={"expert": expert} if expert else {})
        assert (cfg.boundary_ratio, cfg.expert, cfg.t_range()) == (0.875, expert, (lo, hi))
        model = WanModel(cfg)
        load_hf(model, pipe)
        want = from_diffusers(ref.state_dict())
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
        assert "expert" not in cfg.to_hf_dict() and "boundary_ratio" not in cfg.to_hf_dict()
        for sampler in ("logit_normal", "uniform"):
            obj = build_objective(load_config(["--model.name", "wan", "--objective.flow_sampler", sampler,
                                               "--objective.flow_shift", "3"]), spec, cfg)
            t = obj.prepare([batch], 0)[0]["timesteps"]
            assert lo <= float(t.min()) and float(t.max()) <= hi, (expert, sampler)
            assert float(t.max()) - float(t.min()) > 0.5 * (hi - lo)  # spread over the range, not one end of it
    # the launcher: model.hf_path at the pipeline, the low-noise expert; its first loss is transformer_2's on the
    # run's first batch with t below the boundary
    cfg = spec.flavor("debug")
    hf = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.to_hf_dict().items() if not k.startswith("_")}
    run = tmp_path / "run_pipe"
    for seed, sub in ((3, "transformer"), (4, "transformer_2")):
        torch.manual_seed(seed)
        diffusers.WanTransformer3DModel(**hf).save_pretrained(run / sub)
    (run / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))
    args = [*RUN, "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--model.hf_path", str(run),
            "--model.overrides", json.dumps({"expert": "low_noise"})]
    assert main([*args, "--job.name", "low"]) == 0
    _, cfg = resolve_model("wan", "debug", hf_path=str(run), overrides={"expert": "low_noise"})
    model = WanModel(cfg)
    load_hf(model, run)
    ctx = StepContext(device=torch.device("cpu"), objective=build_objective(load_config(args), spec, cfg),
                      seq_keys=spec.schema().seq)
    first = SyntheticLoader(vocab_size=0, seq_len=48, micro_batch_size=4, seed=0,
                            make_batch=spec.synthetic(cfg, 48)).batch(0)
    sums, counts = eval_loss_sums(model, [first], ctx)
    assert _losses(tmp_path / "low")[1] == pytest.approx(sums["mse"] / counts["mse"], rel=1e-6)
    with pytest.raises(SpecError, match="boundary_ratio, which is unset: point model.hf_path at the A14B"):
        resolve_model("wan", "debug", overrides={"expert": "low_noise"})
    with pytest.raises(SpecError, match="expert 'middle' is unknown"):
        resolve_model("wan", "debug", overrides={"expert": "middle", "boundary_ratio": 0.5})
    (tmp_path / "t2v").mkdir()
    _pair(TINY, tmp_path / "t2v")
    (tmp_path / "t2v" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    _, cfg = resolve_model("wan", "debug", hf_path=str(tmp_path / "t2v"),
                           overrides={"expert": "low_noise", "boundary_ratio": 0.9})
    with pytest.raises(ValueError, match="has no transformer_2/"):
        load_hf(WanModel(cfg), tmp_path / "t2v")


def test_truncated_t_is_the_samplers_restricted():
    """t_range draws the sampler's shifted t conditioned on [lo, hi]: its quantiles are the unrestricted draw's
    above the bound (Monte Carlo: 2e5 draws, quantiles within 0.01)."""
    for sampler in ("uniform", "logit_normal", "shifted"):
        full = FlowMatching(sampler=sampler, shift=3.0, mean=0.3, std=1.2)
        part = dataclasses.replace(full, t_range=(0.7, 1.0))
        a = full.sample_t((200_000,), torch.Generator().manual_seed(0))
        b = part.sample_t((200_000,), torch.Generator().manual_seed(1))
        q = torch.tensor([0.1, 0.5, 0.9])
        torch.testing.assert_close(torch.quantile(b, q), torch.quantile(a[a >= 0.7], q), atol=0.01, rtol=0)
    with pytest.raises(ValueError, match="t_range"):
        FlowMatching(t_range=(0.5, 0.5))


def test_ti2v_first_frame_is_the_clean_condition(tmp_path):
    """model.overrides' first_frame_clean (Wan2.2 TI2V's image-to-video training): the batch builder marks the first
    latent frame's patches as the clean condition, and flow matching gives the model what WanImageToVideoPipeline
    (expand_timesteps) gives diffusers' transformer: (1 - first_frame_mask) x condition + first_frame_mask x x_t,
    timestep first_frame_mask[0][0][:, ::2, ::2] x t per patch (0 on the first frame). The predictions agree within
    the parity bound; the loss is the MSE over the other frames only."""
    hf = {**TI2V, "patch_size": [1, 2, 2]}  # TI2V-5B's patch
    ref, _, cfg = _pair(hf, tmp_path)
    cfg = dataclasses.replace(cfg, first_frame_clean=True)
    model = WanModel(cfg)
    load_hf(model, tmp_path)
    x0, text = _inputs(cfg, per_patch=False)[:2]
    batch = latent_batch(cfg, x0, text)
    obj = FlowMatching(seed=0, mask="bidirectional")
    mb = obj.prepare([batch], 0)[0]
    t_B, eps = obj.noise(batch, noise_generator(0, 0, 0, "/flow_matching"))  # the draws prepare made
    first = batch["grid_fhw"][..., 0] == 0
    assert torch.equal(mb["noisy_latents"][first], batch["latents"][first]) and not mb["timesteps"][first].any()
    assert int(mb["num_latent_elements"]) == int((~first).sum()) * cfg.patch_dim
    tb = get_model_spec("wan").prepare_batch(cfg, mb, "cpu")
    assert "timesteps" in tb  # a t per patch: the time MLP's per-patch path

    # WanImageToVideoPipeline's first-frame handling (expand_timesteps), per row's t
    ffm = torch.ones(B, 1, FR, H, W)
    ffm[:, :, 0] = 0
    cond = x0[:, :, :1]  # the conditioning image's latent frame
    t5 = t_B[:, 0].view(B, 1, 1, 1, 1)
    x_t = (1 - t5) * x0 + t5 * unpatchify(eps, (FR, H // 2, W // 2), cfg.patch_size)
    timestep = ffm[:, 0, :, ::2, ::2].flatten(1) * t_B[:, :1] * 1000
    with torch.no_grad():
        want = ref((1 - ffm) * cond + ffm * x_t, timestep, text).sample
        meta = build_attn_meta({"doc_ids": torch.zeros(B, first.shape[1], dtype=torch.int32)}, "sdpa", "cpu",
                               kind="bidirectional")
        out = model(attn=meta, noisy_latents=tb["noisy_latents"], text_states=text, grid_fhw=tb["grid_fhw"],
                    timesteps=tb["timesteps"], latent_mask=tb["latent_mask"])
        pred = model.predict_velocity(out, tb)
        sums = obj.loss_sums(model, out, tb)
    torch.testing.assert_close(unpatchify(pred, (FR, H // 2, W // 2), cfg.patch_size), want, atol=1e-5, rtol=1e-5)
    target = unpatchify(mb["flow_target"], (FR, H // 2, W // 2), cfg.patch_size)
    assert not target[:, :, 0].any()  # no target on the condition
    mse = ((want - target).square() * ffm).sum()
    torch.testing.assert_close(sums["mse"], mse, atol=1e-4, rtol=1e-5)
