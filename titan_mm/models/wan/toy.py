"""Random frozen encoders saved as a diffusers Wan pipeline folder, and generated clips, for tests and benches
(tests/unit/test_wan_data.py, bench/wan_data.py): nothing downloads. Needs the diffusers extra."""

from __future__ import annotations

import json
import os

import av
import numpy as np
import torch

WORDS = "a red green blue ball cube disc rolls falls moves left right up down fast slow".split()


def save_random_encoders(folder: str, *, text_dim: int, z_dim: int, text_layers: int = 2, text_heads: int = 2,
                         vae_dim: int = 8, vae_mult: tuple[int, ...] = (1, 2), temporal: tuple[bool, ...] = (True,),
                         seed: int = 0) -> None:
    """tokenizer/ (a word-level tokenizer over WORDS that appends </s>, as T5's does), text_encoder/ (UMT5 of width
    ``text_dim``) and vae/ (AutoencoderKLWan with ``z_dim`` channels; its scale factors follow ``vae_mult`` /
    ``temporal``, so 2^(len(vae_mult) - 1) spatially and 2^(temporal downsamplings) in time)."""
    # the optional diffusers extra (with transformers and tokenizers): only tests and benches build these
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(os.path.join(folder, "tokenizer"))
    UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), d_model=text_dim, d_kv=text_dim // text_heads,
                                d_ff=2 * text_dim, num_layers=text_layers, num_heads=text_heads,
                                relative_attention_num_buckets=8)).save_pretrained(os.path.join(folder, "text_encoder"))
    g = torch.Generator().manual_seed(seed)
    AutoencoderKLWan(base_dim=vae_dim, z_dim=z_dim, dim_mult=list(vae_mult), num_res_blocks=1,
                     temperal_downsample=list(temporal), latents_mean=torch.randn(z_dim, generator=g).tolist(),
                     latents_std=(0.5 + torch.rand(z_dim, generator=g)).tolist(),
                     scale_factor_temporal=2 ** sum(temporal),
                     scale_factor_spatial=2 ** (len(vae_mult) - 1)).save_pretrained(os.path.join(folder, "vae"))


def moving_square(rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
    """n uint8 RGB frames [n, h, w, 3]: a bright 4x4 square moving over a dark frame."""
    out = np.full((n, h, w, 3), 20, np.uint8)
    for t in range(n):
        y, x = (2 * t) % (h - 4), (3 * t) % (w - 4)
        out[t, y:y + 4, x:x + 4] = rng.integers(128, 256, 3)
    return out


def write_mp4(path: str, frames: np.ndarray, fps: int = 8) -> None:
    """uint8 RGB frames [T, H, W, 3] (even H, W) as an MPEG-4 file."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.height, s.width, s.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode())


def write_clip_rows(folder: str, n: int, frames: int, sizes: tuple[tuple[int, int], ...], seed: int = 0) -> str:
    """``n`` mp4 clips of ``frames`` frames (clip i at sizes[i % len(sizes)]) with 8-word captions from WORDS, and
    rows.jsonl naming them in lmms-engine's format; returns the JSONL's path."""
    rng = np.random.default_rng(seed)
    path = os.path.join(folder, "rows.jsonl")
    with open(path, "w") as fh:
        for i in range(n):
            write_mp4(os.path.join(folder, f"{i}.mp4"), moving_square(rng, frames, *sizes[i % len(sizes)]))
            content = [{"type": "video", "video": f"{i}.mp4"}, {"type": "text", "text": " ".join(rng.choice(WORDS, 8))}]
            fh.write(json.dumps({"messages": [{"role": "user", "content": content}]}) + "\n")
    return path
