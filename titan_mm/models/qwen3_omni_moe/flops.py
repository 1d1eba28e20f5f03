"""Training FLOPs of the Qwen3-Omni-MoE thinker: Qwen3-VL-MoE's (qwen3_vl/flops.py: the Qwen3-MoE decoder, the ViT
and its mergers) plus the audio encoder, per batch (training = 3 x forward; an m x k by k x n matmul is 2mkn
forward FLOPs):
  6 * C * (L1*F1*9*Ch + (L2*F2 + L3*F3)*9*Ch^2 + L3*Ch*F3*D)    the three 3x3 stride-2 convs and conv_out, over the
                                                                padded chunks (C chunks of L frames; Li x Fi the
                                                                output grid of conv i, Ch channels)
  + 6 * N * layers * (4*D^2 + 2*D*Fa) + 12 * layers * D * sum_windows n^2   blocks: q/k/v/out, fc1/fc2; attention
  + 6 * N * (D^2 + D*O)                                                     proj1, proj2
  N valid tokens, D d_model, Fa encoder_ffn_dim, O output_dim. ``audio_feature_lengths`` (frames per clip) gives
  the chunks and windows exactly as the encoder cuts them (audio.build_audio_meta).
"""

from __future__ import annotations

import torch

from titan_mm.models.qwen2_5_omni.flops import thinker_flops
from titan_mm.models.qwen3_omni_moe.audio import build_audio_meta
from titan_mm.models.qwen3_omni_moe.config import AudioConfig
from titan_mm.models.qwen3_vl import flops as vl_flops


def _half(n: int) -> int:
    return (n - 1) // 2 + 1


def audio_flops(acfg: AudioConfig, audio_feature_lengths) -> float:
    """Training FLOPs of the audio encoder over clips of these mel-frame counts."""
    if audio_feature_lengths is None or not len(torch.as_tensor(audio_feature_lengths).reshape(-1)):
        return 0.0
    meta = build_audio_meta(audio_feature_lengths, acfg)
    C, L = meta.frame_index.shape
    Ch, D = acfg.downsample_hidden_size, acfg.d_model
    L1, F1 = _half(L), _half(acfg.num_mel_bins)
    L2, F2 = _half(L1), _half(F1)
    L3, F3 = _half(L2), _half(F2)
    conv = C * (L1 * F1 * 9 * Ch + (L2 * F2 + L3 * F3) * 9 * Ch * Ch + L3 * Ch * F3 * D)
    N = int(meta.valid.numel())
    seg = (meta.attn.cu_seqlens[1:] - meta.attn.cu_seqlens[:-1]).double()
    mm = conv + N * acfg.encoder_layers * (4 * D * D + 2 * D * acfg.encoder_ffn_dim) + N * (D * D + D * acfg.output_dim)
    return 6.0 * mm + 12.0 * acfg.encoder_layers * D * float((seg**2).sum())


flops_breakdown, flops = thinker_flops(vl_flops.flops_breakdown, audio_flops)
