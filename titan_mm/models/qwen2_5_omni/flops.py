"""Training FLOPs of the Qwen2.5-Omni thinker: Qwen2.5-VL's (qwen2_5_vl/flops.py: the Qwen2 decoder and the ViT)
plus the audio encoder, per batch (training = 3 x forward; an m x k by k x n matmul is 2mkn forward FLOPs):
  6 * sum_chunks (L * 3*M*D + L2 * 3*D*D)                 conv1 (k3, M mel bins) and conv2 (k3, stride 2)
  + 6 * N * layers * (4*D^2 + 2*D*F) + 12 * layers * D * sum_chunks n^2    blocks: q/k/v/out, fc1/fc2; attention
  + 6 * P * D * O                                           projection
  L frames and n tokens per chunk (n = (L - 1) // 2 + 1), L2 = n, N = sum n, P pooled tokens, D d_model,
  F encoder_ffn_dim, O output_dim. ``audio_feature_lengths`` (frames per clip) gives the chunks.
"""

from __future__ import annotations

import numpy as np

from titan_mm.models.qwen2_5_omni.audio import conv_lengths
from titan_mm.models.qwen2_5_omni.config import AudioConfig
from titan_mm.models.qwen2_5_vl import flops as vl_flops
from titan_mm.models.qwen3 import flops as qwen3_flops


def audio_flops(acfg: AudioConfig, audio_feature_lengths) -> float:
    """Training FLOPs of the audio encoder over clips of these mel-frame counts."""
    if audio_feature_lengths is None:
        return 0.0
    lens = np.asarray(audio_feature_lengths, dtype=np.int64).reshape(-1)
    if not len(lens):
        return 0.0
    w2 = 2 * acfg.n_window
    chunks = np.concatenate([np.minimum(w2, n - np.arange(0, n, w2)) for n in lens.tolist()])
    tok = conv_lengths(chunks)[0]
    M, D, F, O = acfg.num_mel_bins, acfg.d_model, acfg.encoder_ffn_dim, acfg.output_dim
    N, P = int(tok.sum()), int(conv_lengths(lens)[1].sum())
    mm = int(chunks.sum()) * 3 * M * D + N * 3 * D * D + N * acfg.encoder_layers * (4 * D * D + 2 * D * F) + P * D * O
    return 6.0 * mm + 12.0 * acfg.encoder_layers * D * float((tok.astype(np.float64) ** 2).sum())


def thinker_flops(vl_breakdown, audio_flops):
    """(flops_breakdown, flops) of an Omni thinker: its vision-language model's FLOPs plus its audio encoder's."""

    def flops_breakdown(cfg, doc_lens, image_grid_thw=None, video_grid_thw=None, audio_feature_lengths=None) -> dict:
        """{"llm", "vision", "audio", "total"} training FLOPs of one batch."""
        out = vl_breakdown(cfg, doc_lens, image_grid_thw, video_grid_thw)
        audio = audio_flops(cfg.audio, audio_feature_lengths)
        return {**out, "audio": audio, "total": out["total"] + audio}

    def flops(cfg, doc_lens, image_grid_thw=None, video_grid_thw=None, audio_feature_lengths=None, **_) -> float:
        """Total training FLOPs (LLM + ViT + audio encoder); ``doc_lens`` may also be a batch dict."""
        if isinstance(doc_lens, dict):
            b = doc_lens
            return flops_breakdown(cfg, qwen3_flops.doc_lens_from_batch(b), b.get("image_grid_thw"),
                                   b.get("video_grid_thw"), b.get("audio_feature_lengths"))["total"]
        return flops_breakdown(cfg, doc_lens, image_grid_thw, video_grid_thw, audio_feature_lengths)["total"]

    return flops_breakdown, flops


flops_breakdown, flops = thinker_flops(vl_flops.flops_breakdown, audio_flops)
