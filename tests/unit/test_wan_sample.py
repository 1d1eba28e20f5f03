"""Wan sampling through the training forward against diffusers, fp32 on CPU on tiny random configs: the sigmas of
FlowMatchEulerDiscreteScheduler (and flow matching's training shift), the Euler + classifier-free-guidance loop of
WanPipeline with the same WanTransformer3DModel weights and noise, the decode through a tiny random AutoencoderKLWan
(latents_mean / latents_std), and the command line python -m titan_mm.tools.wan_sample."""

import json

import av
import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

diffusers = pytest.importorskip("diffusers")  # the optional extra [diffusers]

from diffusers import (  # noqa: E402
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
)
from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: E402

from tests.unit.test_wan import TINY, _pair  # noqa: E402
from titan_mm.models.wan.sample import decode, flow_sigmas, sample  # noqa: E402
from titan_mm.models.wan.toy import save_random_encoders  # noqa: E402
from titan_mm.objectives import FlowMatching  # noqa: E402
from titan_mm.objectives.flow_matching import WEIGHTINGS  # noqa: E402
from titan_mm.tools.wan_sample import main  # noqa: E402

B, L, LATENT = 2, 5, (2, 4, 4)  # 2 latent frames of 4x4: 5 frames of 32x32 through the VAE (4x in time, 8x in space)


def _vae() -> AutoencoderKLWan:
    torch.manual_seed(5)
    return AutoencoderKLWan(base_dim=3, z_dim=TINY["in_channels"], dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                            latents_std=[0.5, 2.0, 1.5, 1.0]).float().eval()


def _states(seed: int, length: int = L) -> torch.Tensor:
    return torch.randn(B, length, TINY["text_dim"], generator=torch.Generator().manual_seed(seed))


def _noise() -> torch.Tensor:
    return torch.randn(B, TINY["in_channels"], *LATENT, generator=torch.Generator().manual_seed(3))


def test_sigmas_and_the_training_shift_are_diffusers_schedulers():
    for steps, shift in [(1, 1.0), (6, 3.0), (50, 5.0), (7, 0.5)]:
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        table = sched.sigmas.clone()  # the training table: the shifted sigmas of the 1000 timesteps
        sched.set_timesteps(steps)
        assert torch.equal(flow_sigmas(steps, shift), sched.sigmas), (steps, shift)
        # flow matching's "uniform" t with the same shift: diffusers' training sigma of a uniform timestep
        base = torch.linspace(1, 1000, 1000).flip(0) / 1000
        assert torch.equal(shift * base / (1 + (shift - 1) * base), table)
        obj = FlowMatching(sampler="uniform", shift=shift)
        u = torch.rand(64, generator=torch.Generator().manual_seed(0))
        want = u if shift == 1 else shift * u / (1 + (shift - 1) * u)
        assert torch.equal(obj.sample_t((64,), torch.Generator().manual_seed(0)), want)


def test_bell_weighting_is_diffsynths():
    """weighting "bell" at DiffSynth-Studio's 1000 shifted training sigmas is its table (written out here as its
    FlowMatchScheduler.set_timesteps(1000, training=True) computes it, in fp32 on sigma x 1000: so fp32 rounding of
    O(1) values apart), and flow matching's prepare weighs each unit by it."""
    for shift in (1.0, 3.0, 5.0):
        sig = torch.linspace(1.0, 0.003 / 1.002, 1000)
        sig = shift * sig / (1 + (shift - 1) * sig)
        y = torch.exp(-2 * ((sig * 1000 - 500) / 1000) ** 2)
        table = (y - y.min()) * (1000 / (y - y.min()).sum())
        torch.testing.assert_close(WEIGHTINGS["bell"](sig, shift), table, atol=1e-5, rtol=1e-5)
    obj = FlowMatching(sampler="uniform", shift=5.0, weighting="bell", seed=3)
    S = 6
    batch = {"latents": torch.randn(2, S, 4), "latent_mask": torch.ones(2, S, dtype=torch.bool),
             "noise_unit": torch.zeros(2, S, dtype=torch.long)}
    out = obj.prepare([batch], 0)[0]
    assert torch.equal(out["flow_weight"], WEIGHTINGS["bell"](out["timesteps"], 5.0))


@pytest.mark.parametrize("steps,shift,scale,neg_len", [(6, 3.0, 5.0, L), (4, 5.0, 4.0, 3), (3, 1.0, 1.0, None)],
                         ids=["cfg_batched", "cfg_two_forwards", "no_cfg"])
def test_sampler_equals_wan_pipeline(steps, shift, scale, neg_len, tmp_path):
    """The latents of our sampler and of WanPipeline (FlowMatchEulerDiscreteScheduler, the same transformer weights,
    text states and noise), and the decoded frames. The pipeline runs the cond and uncond forwards apart; ours
    batches them when the states agree in shape, or not (a negative prompt of another length)."""
    ref, model, _ = _pair(TINY, tmp_path)
    vae = _vae()
    text = _states(1)
    neg = None if neg_len is None else _states(2, neg_len)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched, transformer=ref)
    pipe.set_progress_bar_config(disable=True)
    kw = {"prompt_embeds": text, "negative_prompt_embeds": neg, "num_frames": 5, "height": 32, "width": 32,
          "num_inference_steps": steps, "guidance_scale": scale}
    want = pipe(latents=_noise(), output_type="latent", **kw).frames
    frames = torch.from_numpy(pipe(latents=_noise(), output_type="np", **kw).frames)
    got = sample(model, text, _noise(), steps=steps, shift=shift, guidance_scale=scale, negative_states=neg)
    # each step's velocity is within the forward's parity bound (1e-5, fp32 sums in other orders) of diffusers',
    # guidance multiplies a difference of two by up to 1 + 2 x scale, and the sigmas' steps add up to 1
    torch.testing.assert_close(got, want, atol=(1 + 2 * scale) * 1e-5, rtol=1e-5)
    assert torch.equal(decode(want, vae), frames)  # the same de-normalization and post-processing arithmetic
    assert frames.shape == (B, 5, 32, 32, 3)
    if neg is not None:  # one negative prompt serves every row
        one = {"steps": 1, "shift": shift, "guidance_scale": scale}
        assert torch.equal(sample(model, text, _noise(), negative_states=neg[:1], **one),
                           sample(model, text, _noise(), negative_states=neg[:1].expand(B, -1, -1).clone(), **one))
        with pytest.raises(ValueError, match="do not fit the text states"):
            sample(model, text, _noise(), negative_states=torch.cat([neg, neg[:1]]), **one)


def test_a14b_pair_equals_wan_pipeline(tmp_path):
    """Wan2.2 A14B's two transformers: WanPipeline(transformer, transformer_2, boundary_ratio) switches from the first
    (high noise) to the second at the boundary timestep and guides the second with guidance_scale_2; sample() with
    low_noise_model and boundary_ratio gives its latents (the bound of the one-transformer test). The boundary falls
    between steps 2 and 3 here (shift 3, 6 steps: sigmas 1, 0.95, 0.89, 0.80, ...), so both experts run."""
    ref, model, _ = _pair(TINY, tmp_path)
    ref2, model2, _ = _pair(TINY, tmp_path, seed=1, subfolder="transformer_2")
    text, neg, noise = _states(1), _states(2), _noise()
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=_vae(), scheduler=sched, transformer=ref,
                       transformer_2=ref2, boundary_ratio=0.85)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt_embeds=text, negative_prompt_embeds=neg, latents=noise.clone(), num_frames=5, height=32,
                width=32, num_inference_steps=6, guidance_scale=5.0, guidance_scale_2=3.0, output_type="latent").frames
    kw = dict(steps=6, shift=3.0, guidance_scale=5.0, negative_states=neg)
    got = sample(model, text, noise, low_noise_model=model2, boundary_ratio=0.85, guidance_scale_2=3.0, **kw)
    torch.testing.assert_close(got, want, atol=(1 + 2 * 5.0) * 1e-5, rtol=1e-5)
    for one in (model, model2):  # neither expert alone gives the pair's latents
        assert (sample(one, text, noise, **kw) - want).abs().max() > 1e-2
    with pytest.raises(ValueError, match="needs both low_noise_model and boundary_ratio"):
        sample(model, text, noise, low_noise_model=model2, **kw)


def test_ti2v_first_frame_equals_image_to_video_pipeline(tmp_path):
    """Wan2.2 TI2V's image-to-video sampling: WanImageToVideoPipeline(expand_timesteps=True) feeds the transformer
    the image's latent at the first frame with timestep 0 there at every step and returns it as the first frame;
    sample(first_frame=that latent) gives its latents (the guided bound)."""
    ref, model, _ = _pair(TINY, tmp_path)
    text, neg, noise = _states(1), _states(2), _noise()
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=_vae(), scheduler=
                                   FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=ref, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray((torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(4)) * 255).byte().numpy())
    pixels = pipe.video_processor.preprocess(image, height=32, width=32).float()
    cond = pipe.prepare_latents(pixels, B, TINY["in_channels"], 32, 32, 5, torch.float32, "cpu", None, noise)[1]
    want = pipe(image=image, prompt_embeds=text, negative_prompt_embeds=neg, latents=noise.clone(), num_frames=5,
                height=32, width=32, num_inference_steps=4, guidance_scale=4.0, output_type="latent").frames
    got = sample(model, text, noise, steps=4, shift=3.0, guidance_scale=4.0, negative_states=neg, first_frame=cond)
    torch.testing.assert_close(got, want, atol=(1 + 2 * 4.0) * 1e-5, rtol=1e-5)
    assert torch.equal(got[:, :, :1], cond.expand(B, -1, -1, -1, -1))
    with pytest.raises(ValueError, match="does not fit the noise"):
        sample(model, text, noise, steps=1, first_frame=cond[:, :, :, :2])


def _pipeline_folder(tmp_path):
    """A diffusers pipeline folder: model_index.json, transformer/ and vae/."""
    model = _pair(TINY, tmp_path / "pipe")[1]
    _vae().save_pretrained(tmp_path / "pipe" / "vae")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    torch.save(_states(1)[0], tmp_path / "prompt.pt")
    torch.save(_states(2)[:1], tmp_path / "negative.pt")
    return model, tmp_path / "pipe"


def test_cli_samples_latents_and_gifs(tmp_path, capsys):
    """python -m titan_mm.tools.wan_sample on a pipeline folder: the latents are sample()'s on the seed's noise, and
    with --vae the decoded frames come out as an animated GIF."""
    model, pipe = _pipeline_folder(tmp_path)
    args = ["--model", str(pipe), "--text-states", str(tmp_path / "prompt.pt"), "--negative-states",
            str(tmp_path / "negative.pt"), "--latent-frames", "2", "--latent-height", "4", "--latent-width", "4",
            "--steps", "3", "--shift", "3", "--guidance-scale", "4", "--seed", "7"]
    assert main([*args, "--out", str(tmp_path / "z.pt")]) == 0
    noise = torch.randn(1, 4, *LATENT, generator=torch.Generator().manual_seed(7))
    want = sample(model, _states(1)[:1], noise, steps=3, shift=3.0, guidance_scale=4.0, negative_states=_states(2)[:1])
    assert torch.equal(torch.load(tmp_path / "z.pt"), want)
    assert main([*args, "--vae", str(pipe), "--fps", "10", "--out", str(tmp_path / "clip.gif")]) == 0
    with Image.open(tmp_path / "clip.gif") as gif:
        assert (gif.n_frames, gif.size, gif.info["duration"], gif.info["loop"]) == (5, (32, 32), 100, 0)  # GIF keeps centiseconds
        gif_frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)]
    assert main([*args, "--vae", str(pipe), "--fps", "10", "--out", str(tmp_path / "clip.mp4")]) == 0
    with av.open(str(tmp_path / "clip.mp4")) as mp4:
        assert mp4.streams.video[0].average_rate == 10
        got = [f.to_ndarray(format="rgb24") for f in mp4.decode(video=0)]
    assert [f.shape for f in got] == [(32, 32, 3)] * 5
    # the same decoded frames: the GIF's palette and the codec's YUV 4:2:0 each lose a few levels of 255
    assert np.abs(np.stack(got).astype(int) - np.stack(gif_frames).astype(int)).mean() < 12
    assert "sampled 1 clip(s)" in capsys.readouterr().out


def test_cli_prompt_through_umt5_equals_wan_pipeline(tmp_path):
    """--prompt / --negative-prompt text through the frozen UMT5 of --encoders (the data pipeline's encoding), padded
    to 512 states: the latents equal WanPipeline's from the same text, tokenizer, UMT5, transformer and noise, and
    the GIF is decoded by the folder's VAE."""
    pipe = tmp_path / "pipe"
    ref = _pair(TINY, pipe)[0]
    save_random_encoders(str(pipe), text_dim=TINY["text_dim"], z_dim=TINY["in_channels"])  # 2x space, 2x time
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    prompt, negative = "a red ball rolls left", "a green cube"
    args = ["--model", str(pipe), "--encoders", str(pipe), "--prompt", prompt, "--negative-prompt", negative,
            "--latent-frames", "2", "--latent-height", "8", "--latent-width", "8", "--steps", "3", "--shift", "3",
            "--guidance-scale", "4", "--seed", "7"]
    assert main([*args, "--out", str(tmp_path / "z.pt")]) == 0
    wan = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(pipe / "tokenizer"),
                      text_encoder=UMT5EncoderModel.from_pretrained(pipe / "text_encoder"),
                      vae=AutoencoderKLWan.from_pretrained(pipe / "vae"),
                      scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=ref)
    wan.set_progress_bar_config(disable=True)
    noise = torch.randn(1, TINY["in_channels"], 2, 8, 8, generator=torch.Generator().manual_seed(7))
    want = wan(prompt=prompt, negative_prompt=negative, latents=noise, num_frames=3, height=16, width=16,
               num_inference_steps=3, guidance_scale=4.0, output_type="latent").frames
    torch.testing.assert_close(torch.load(tmp_path / "z.pt"), want, atol=(1 + 2 * 4.0) * 1e-5, rtol=1e-5)
    assert main([*args, "--out", str(tmp_path / "clip.gif")]) == 0
    with Image.open(tmp_path / "clip.gif") as gif:
        assert (gif.n_frames, gif.size) == (3, (16, 16))


def test_cli_samples_with_the_a14b_pair(tmp_path, capsys):
    """--model at an A14B pipeline folder (transformer/, transformer_2/, model_index.json's boundary_ratio) samples
    with both experts, as sample() with the pair; --low-noise-model + --boundary-ratio name them by hand."""
    pipe = tmp_path / "pipe"
    model = _pair(TINY, pipe)[1]
    low = _pair(TINY, pipe, seed=1, subfolder="transformer_2")[1]
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.85}))
    torch.save(_states(1)[0], tmp_path / "prompt.pt")
    args = ["--text-states", str(tmp_path / "prompt.pt"), "--latent-frames", "2", "--latent-height", "4",
            "--latent-width", "4", "--steps", "6", "--shift", "3", "--guidance-scale", "4", "--guidance-scale-2", "2",
            "--seed", "7"]
    noise = torch.randn(1, 4, *LATENT, generator=torch.Generator().manual_seed(7))
    want = sample(model, _states(1)[:1], noise, steps=6, shift=3.0, guidance_scale=4.0, low_noise_model=low,
                  boundary_ratio=0.85, guidance_scale_2=2.0)
    assert main(["--model", str(pipe), *args, "--out", str(tmp_path / "z.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "z.pt"), want)
    assert main(["--model", str(pipe / "transformer"), "--low-noise-model", str(pipe / "transformer_2"),
                 "--boundary-ratio", "0.85", *args, "--out", str(tmp_path / "y.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "y.pt"), want)
    capsys.readouterr()
    (tmp_path / "one").mkdir()
    _pair(TINY, tmp_path / "one")
    (tmp_path / "one" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    for extra, msg in [(["--model", str(tmp_path / "one")], "--guidance-scale-2 guides A14B's low-noise expert"),
                       (["--model", str(tmp_path / "one"), "--low-noise-model", str(pipe / "transformer_2")],
                        "pipeline names no boundary_ratio: pass --boundary-ratio"),
                       (["--model", str(pipe), "--boundary-ratio", "0.5"], "--boundary-ratio switches to")]:
        assert main([*extra, *args, "--out", "z.pt"]) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (extra, err)


def test_cli_mistakes_are_one_line(tmp_path, capsys):
    _, pipe = _pipeline_folder(tmp_path)
    base = ["--model", str(pipe), "--text-states", str(tmp_path / "prompt.pt")]
    torch.save({"states": 1}, tmp_path / "dict.pt")
    torch.save(torch.zeros(3, 7), tmp_path / "narrow.pt")
    (tmp_path / "text.pt").write_text("a prompt, not its states")
    cases = [
        (["--out", "z.gif"], "decoding a GIF needs a VAE: pass --vae (or --encoders)"),
        (["--out", "z.mp4"], "decoding a MP4 needs a VAE: pass --vae (or --encoders)"),
        (["--out", "z.avi"], "name a GIF or an MP4 (*.gif, *.mp4: the decoded frames) or a torch file"),
        (["--vae", str(pipe), "--out", "z.pt"], "--vae decodes frames into a GIF or an MP4; name it *.gif or *.mp4"),
        (["--prompt", "a ball", "--out", "z.pt"], "give the prompt as --prompt TEXT (with --encoders) or as"),
        (["--negative-prompt", "a cube", "--out", "z.pt"], "--negative-prompt / --encoders go with --prompt"),
        (["--steps", "0", "--out", "z.pt"], "steps = 0: sampling needs at least 1 step"),
        (["--shift", "0", "--out", "z.pt"], "shift = 0.0: the timestep shift must be > 0"),
        (["--vae", str(tmp_path), "--out", "z.gif"], "no config.json there nor in"),
        (["--latent-height", "3", "--out", "z.pt"], "must be multiples of the model's patch (1, 2, 2)"),
        (["--negative-states", str(tmp_path / "narrow.pt"), "--out", "z.pt"], "does not fit the text states"),
    ]
    for extra, msg in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (extra, err)
    for extra, msg in [(["--prompt", "a ball"], "--prompt needs --encoders"),
                       (["--prompt", "a ball", "--encoders", str(pipe)], "has no tokenizer/, text_encoder/; give")]:
        assert main(["--model", str(pipe), *extra, "--out", "z.pt"]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (extra, err)
    for states, msg in [("missing.pt", "no such file"), ("dict.pt", "holds dict; it must be float text states"),
                        ("text.pt", "is not a torch tensor file"),
                        ("narrow.pt", "text_dim 7; the model's text_dim is 16")]:
        assert main(["--model", str(pipe), "--text-states", str(tmp_path / states), "--out", "z.pt"]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (states, err)
