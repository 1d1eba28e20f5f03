"""Sampling through the training forward: an Euler flow sampler with classifier-free guidance whose sigmas are the
ones diffusers' ``FlowMatchEulerDiscreteScheduler(shift=...).set_timesteps(steps)`` computes, as ``WanPipeline``
steps it (one t per clip: the time MLP runs once per row), then the decode of the latents through a diffusers
``AutoencoderKLWan`` (de-normalized by its ``latents_mean`` / ``latents_std``, as the pipeline does) and an animated
GIF or an MP4 (H.264 through PyAV) of the frames. The command line is ``python -m titan_mm.tools.wan_sample`` (docs/wan.md "Sampling").
"""

from __future__ import annotations

import os

import av
import numpy as np
import torch
from PIL import Image

from titan_mm.models.wan.config import NUM_TRAIN_TIMESTEPS
from titan_mm.models.wan.model import WanModel, patchify, unpatchify
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.flow import time_shift


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """[steps + 1] fp32, 1 -> 0: diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps)``
    sigmas, in its arithmetic: the training table's shifted sigma_max / sigma_min (fp32), a float64 linspace of
    timesteps between them, shifted again, then a final 0."""
    n = NUM_TRAIN_TIMESTEPS
    table = time_shift(torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy()) / n, shift)
    sigmas = time_shift(np.linspace(table[0].item() * n, table[-1].item() * n, steps) / n, shift)
    return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])


def check_sampling(steps: int, shift: float, guidance_scale: float) -> None:
    """One ValueError line for sampling settings that cannot run."""
    if steps < 1:
        raise ValueError(f"steps = {steps}: sampling needs at least 1 step")
    if shift <= 0:
        raise ValueError(f"shift = {shift}: the timestep shift must be > 0 (Wan uses 3 to 5 at 480p)")
    if guidance_scale < 0:
        raise ValueError(f"guidance_scale = {guidance_scale}: use >= 0 (1 or less turns guidance off)")


@torch.no_grad()
def sample(model: WanModel, text_states: torch.Tensor, noise: torch.Tensor, *, steps: int = 50, shift: float = 5.0,
           guidance_scale: float = 5.0, negative_states: torch.Tensor | None = None,
           attn_backend: str = "sdpa", low_noise_model: WanModel | None = None, boundary_ratio: float | None = None,
           guidance_scale_2: float | None = None, first_frame: torch.Tensor | None = None) -> torch.Tensor:
    """Latents [B, C, F, H, W] fp32 from ``noise`` [B, C, F, H, W] (sigma 1) conditioned on ``text_states``
    [B, L, text_dim]: Euler steps x += (sigma_next - sigma) v over :func:`flow_sigmas`. With ``guidance_scale`` > 1,
    v = v_neg + g (v - v_neg) with ``negative_states`` [1 or B, L', text_dim] (the negative prompt's states; None:
    zeros, the empty prompt of data.prompt_dropout), both in one forward of 2B rows when their shapes agree.

    Wan2.2 A14B's pair, as WanPipeline(transformer, transformer_2, boundary_ratio) switches: ``model`` (the high-noise
    expert) at the steps whose timestep sigma x 1000 is >= boundary_ratio x 1000, ``low_noise_model`` below, guided
    there by ``guidance_scale_2`` (None: ``guidance_scale``); whether to guide at all is ``guidance_scale``'s call.

    Wan2.2 TI2V: ``first_frame`` [1 or B, C, 1, H, W] (the conditioning image's normalized latent) is what the model
    sees at the first latent frame, at t = 0 (a t per patch), at every step, and the returned first frame, as
    WanImageToVideoPipeline with expand_timesteps does (the training side: WanConfig.first_frame_clean)."""
    check_sampling(steps, shift, guidance_scale)
    if (low_noise_model is None) != (boundary_ratio is None):
        raise ValueError("the A14B pair needs both low_noise_model and boundary_ratio (or neither: one transformer)")
    if boundary_ratio is not None and not 0 < boundary_ratio < 1:
        raise ValueError(f"boundary_ratio = {boundary_ratio}: use a value in (0, 1) (Wan2.2-T2V-A14B's is 0.875)")
    cfg = model.cfg
    if noise.dim() != 5 or noise.shape[1] != cfg.in_channels or noise.shape[0] != text_states.shape[0]:
        raise ValueError(f"noise of shape {list(noise.shape)} is not [B={text_states.shape[0]}, C={cfg.in_channels}, "
                         "F, H, W] latents for the text states' B rows and the model's channels")
    guided = guidance_scale > 1.0
    B = text_states.shape[0]
    neg = torch.zeros_like(text_states) if negative_states is None else negative_states.to(text_states)
    if neg.dim() != 3 or neg.shape[0] not in (1, B) or neg.shape[-1] != text_states.shape[-1]:
        raise ValueError(f"negative states of shape {list(neg.shape)} do not fit the text states "
                         f"{list(text_states.shape)}: [1 or B, L', text_dim]")
    neg = neg.expand(B, -1, -1)  # one negative prompt for every row
    batched = guided and neg.shape == text_states.shape
    text = torch.cat([text_states, neg]) if batched else text_states
    fhw = tuple(n // p for n, p in zip(noise.shape[2:], cfg.patch_size))
    x, grid = patchify(noise.float(), cfg.patch_size)
    cond = None
    if first_frame is not None:
        if cfg.patch_size[0] != 1 or first_frame.shape[0] not in (1, B) or \
                first_frame.shape[1:] != (noise.shape[1], 1, *noise.shape[3:]):
            raise ValueError(f"first_frame of shape {list(first_frame.shape)} does not fit the noise "
                             f"{list(noise.shape)} (or a temporal patch > 1): [1 or B, C, 1, H, W]")
        clip = torch.cat([first_frame.float().expand(B, -1, -1, -1, -1), noise[:, :, 1:].float()], 2)
        cond = patchify(clip, cfg.patch_size)[0]
        first = (grid[..., 0] == 0)[..., None]  # [B, S, 1]: the first latent frame's patches
    metas = {}  # rows -> the attention metadata, built once on the host: one full segment per clip

    def forward(x_RSP, t, states, model):
        R, S = x_RSP.shape[:2]  # R: B rows, or 2B with the negative prompt's
        if R not in metas:
            metas[R] = build_attn_meta({"doc_ids": torch.zeros(R, S, dtype=torch.int32)}, attn_backend, x.device,
                                       kind="bidirectional")
        kw = {"clip_timesteps": t.expand(R)}
        if cond is not None:  # the clean first frame at t = 0: a t per patch
            x_RSP = torch.where(first.repeat(R // B, 1, 1), cond.repeat(R // B, 1, 1), x_RSP)
            kw = {"timesteps": torch.where(first[:1, :, 0], 0.0, t).expand(R, -1)}
        out = model(attn=metas[R], noisy_latents=x_RSP, text_states=states, grid_fhw=grid[:1].expand(R, -1, -1), **kw)
        return model.predict_velocity(out, {}).float()

    sigmas = flow_sigmas(steps, shift).to(x.device)
    high, scale_2 = model, guidance_scale if guidance_scale_2 is None else guidance_scale_2
    for i in range(steps):
        t = sigmas[i]
        # the pipeline compares its fp32 timestep (sigma x 1000) with boundary_ratio x 1000
        low = boundary_ratio is not None and float(t * NUM_TRAIN_TIMESTEPS) < boundary_ratio * NUM_TRAIN_TIMESTEPS
        model, scale = (low_noise_model, scale_2) if low else (high, guidance_scale)
        if batched:
            v, v_neg = forward(x.repeat(2, 1, 1), t, text, model).chunk(2)
        else:
            v = forward(x, t, text, model)
            v_neg = forward(x, t, neg, model) if guided else None
        if guided:  # WanPipeline's order of operations
            v = v_neg + scale * (v - v_neg)
        x = x + (sigmas[i + 1] - t) * v
    if cond is not None:
        x = torch.where(first, cond, x)
    return unpatchify(x, fhw, cfg.patch_size)


@torch.no_grad()
def decode(latents: torch.Tensor, vae) -> torch.Tensor:
    """Frames [B, F, H, W, 3] in [0, 1] of ``latents`` [B, C, F, H, W] through a diffusers ``AutoencoderKLWan``
    (its config's latents_mean / latents_std undo the normalization the latents were trained in), as WanPipeline
    and its VideoProcessor compute them."""
    c = vae.config
    x = latents.to(vae.dtype)
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(x)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(x)
    video = vae.decode(x / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)


def write_gif(frames: torch.Tensor, path: str | os.PathLike, fps: int = 16) -> None:
    """An animated GIF of ``frames`` [F, H, W, 3] in [0, 1] (rounded to 8 bits as diffusers' numpy_to_pil), looped."""
    images = [Image.fromarray(f) for f in (frames * 255).round().to(torch.uint8).cpu().numpy()]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)


# H.264 where this FFmpeg build has an encoder for it, else MPEG-4 part 2 (every FFmpeg build has that one)
MP4_CODECS = ("libx264", "h264", "mpeg4")


def mp4_codec() -> str:
    """The first of MP4_CODECS this PyAV's FFmpeg can encode."""
    for name in MP4_CODECS:
        try:
            av.Codec(name, "w")
            return name
        except (av.codec.codec.UnknownCodecError, ValueError):
            continue
    raise RuntimeError(f"PyAV's FFmpeg encodes none of {MP4_CODECS}; write a GIF instead (--out clip.gif)")


def write_mp4(frames: torch.Tensor, path: str | os.PathLike, fps: int = 16) -> str:
    """An MP4 of ``frames`` [F, H, W, 3] in [0, 1] (rounded to 8 bits as write_gif), one video frame per sampled
    frame, yuv420p (what players decode). 4:2:0 needs even sides: an odd last row / column is repeated once.
    Returns the codec used."""
    rgb = (frames * 255).round().to(torch.uint8).cpu().numpy()
    h, w = rgb.shape[1:3]
    rgb = np.pad(rgb, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    codec = mp4_codec()
    with av.open(os.fspath(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = rgb.shape[2], rgb.shape[1], "yuv420p"
        # near-transparent quality: a sampled clip is small, and libx264's default crf 23 blurs fine detail
        stream.options = {"crf": "12"} if codec == "libx264" else {"qscale": "2"}
        for f in rgb:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode(None))
    return codec
