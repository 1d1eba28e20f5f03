"""Qwen2.5-Omni audio encoder (HF Qwen2_5OmniAudioEncoder): per chunk of 2 * n_window mel frames, conv1 (k3) ->
GELU -> conv2 (k3, stride 2) -> GELU -> + sinusoidal positions (restarting per chunk); pre-LN Whisper blocks with
bidirectional attention inside each chunk; then per clip an average pool of 2, LayerNorm and a projection to the
LLM width.

Everything that depends on the clip lengths is built on the host by :func:`build_audio_meta` (the frame gather
that cuts the clips into padded chunks, the conv mask, the valid-token and pooling indices, the chunks' attention
metadata), so the forward has no host syncs. The attention core is the ViT's (qwen3_vl/vision.py), over one
segment per chunk.

Legend: T mel frames of all clips, C chunks, L frames per padded chunk, L2 = (L - 1) // 2 + 1 tokens per padded
chunk after conv2, N valid tokens, P pooled tokens (= the <|AUDIO|> pads), D d_model, O output_dim.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm.nn import init
from titan_mm.models.qwen2_5_omni.config import AudioConfig
from titan_mm.models.qwen2_5_vl.vision import segments_config
from titan_mm.models.qwen3_vl.vision import VisionMeta, build_vision_meta, move_vision_meta, vision_attention_core

DUMMY_FRAMES = 4
"""Frames of the stand-in clip of a batch without audio (the fewest that give one output token)."""


def conv_lengths(frames):
    """(tokens after conv2, tokens after the pool) of clips or chunks of ``frames`` mel frames (HF's
    _get_feat_extract_output_lengths); ints or integer arrays."""
    after_conv = (frames - 1) // 2 + 1
    return after_conv, (after_conv - 2) // 2 + 1


def audio_tokens(frames: int) -> int:
    """<|AUDIO|> placeholders of a clip of ``frames`` mel frames: the encoder's output tokens (after the pool)."""
    return int(conv_lengths(frames)[1])


class AudioMeta(NamedTuple):
    """Host-built metadata of one audio-encoder forward (see :func:`build_audio_meta`)."""

    frame_index: torch.Tensor
    """[C, L] int64: the mel frame at each chunk position; T (one past the last frame) on padding."""
    conv_mask: torch.Tensor
    """[C, 1, L] float: 1 on a chunk's frames, 0 on its padding (applied after conv1, as HF does)."""
    valid: torch.Tensor
    """[N] int64: rows of the flattened [C * L2] conv output that are real tokens, chunk by chunk."""
    pool: torch.Tensor
    """[P] int64: the first row (of the valid tokens) of each averaged pair, clip by clip."""
    attn: VisionMeta
    """Bidirectional attention within each chunk (one segment per chunk, N tokens)."""


def build_audio_meta(lengths, cfg: AudioConfig, backend: str = "sdpa",
                     device: torch.device | str | None = None, groups=None) -> AudioMeta:
    """Host side, from the clips' mel-frame counts (``audio_feature_lengths``, [n_clips]) in the order their frames
    are concatenated in ``input_features``. Each clip is cut into chunks of 2 * n_window frames (the last one
    shorter); chunks are padded to the longest chunk, and the convs mask the padding, so a clip's tokens do not
    depend on the other clips: ``groups`` (thinker.OmniAudio.build_meta's) changes nothing here."""
    lens = np.asarray(torch.as_tensor(lengths).cpu(), dtype=np.int64).reshape(-1)
    if len(lens) == 0 or (lens < 3).any():
        raise ValueError(f"audio_feature_lengths {lens.tolist()}: every clip needs >= 3 mel frames (one token).")
    w2 = 2 * cfg.n_window
    chunks, starts = [], []  # frames per chunk, first frame of each chunk
    base = 0
    for n in lens.tolist():
        for s in range(0, n, w2):
            chunks.append(min(w2, n - s))
            starts.append(base + s)
        base += n
    chunks_a, starts_a = np.asarray(chunks), np.asarray(starts)
    L = int(chunks_a.max())
    pos = np.arange(L)
    inside = pos[None, :] < chunks_a[:, None]
    frame_index = np.where(inside, starts_a[:, None] + pos[None, :], base)
    tok, _ = conv_lengths(chunks_a)
    L2 = (L - 1) // 2 + 1
    valid = (np.arange(len(chunks))[:, None] * L2 + np.arange(L2)[None, :])[np.arange(L2)[None, :] < tok[:, None]]
    clip_tok, clip_out = conv_lengths(lens)
    first = np.concatenate([[0], np.cumsum(clip_tok)[:-1]])
    pool = np.concatenate([f + 2 * np.arange(p) for f, p in zip(first.tolist(), clip_out.tolist())])
    seg = torch.tensor([[1, 1, int(n)] for n in tok.tolist()])
    attn = build_vision_meta(seg, segments_config(1), backend, device)  # on device: flex masks do not move
    empty = torch.zeros(0, 4, dtype=torch.int64)
    attn = attn._replace(pos_idx=empty, pos_w=empty.float(), rope_hw=empty[:, :2])  # no ViT tables here
    meta = AudioMeta(torch.from_numpy(frame_index), torch.from_numpy(inside[:, None, :].astype(np.float32)),
                     torch.from_numpy(valid.astype(np.int64)), torch.from_numpy(pool.astype(np.int64)), attn)
    return meta if device is None else move_audio_meta(meta, device)


def move_audio_meta(meta: AudioMeta, device: torch.device | str) -> AudioMeta:
    def mv(x):
        return x.to(device, non_blocking=True)

    return meta._replace(frame_index=mv(meta.frame_index), conv_mask=mv(meta.conv_mask), valid=mv(meta.valid),
                         pool=mv(meta.pool), attn=move_vision_meta(meta.attn, device))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] fp32: sin then cos (HF's SinusoidsPositionEmbedding, the same float ops)."""
    inc = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class AudioAttention(nn.Module):
    """HF names: q_proj (bias), k_proj (no bias), v_proj (bias), out_proj (bias)."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        D = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(D, D, bias=True)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=True)
        self.out_proj = nn.Linear(D, D, bias=True)

    def forward(self, x_ND, meta: VisionMeta):
        q, k, v = (p(x_ND).unflatten(1, (-1, self.head_dim)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(vision_attention_core(q, k, v, meta).flatten(1))


class AudioBlock(nn.Module):
    """Pre-LN Whisper encoder layer (HF Qwen2_5OmniAudioEncoderLayer names)."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)

    def forward(self, x_ND, meta: VisionMeta):
        x_ND = x_ND + self.self_attn(self.self_attn_layer_norm(x_ND), meta)
        return x_ND + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x_ND))))


class AudioEncoder(nn.Module):
    """input_features [n_mels, T] + AudioMeta -> [P, O], the <|AUDIO|> embeddings of every clip in order.
    ``audio_bos_eos_token`` is HF's (unused by the thinker's forward, as in HF); kept so checkpoints round-trip.
    Layers are named ``blocks`` (HF ``layers``) so that only decoder blocks are ``*.layers.{i}``."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, D, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(D, D, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", torch.empty(cfg.max_source_positions, D), persistent=False)
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim)
        self.blocks = nn.ModuleList([AudioBlock(cfg) for _ in range(cfg.encoder_layers)])
        self.ln_post = nn.LayerNorm(D)
        self.proj = nn.Linear(D, cfg.output_dim)
        if not self.positional_embedding.is_meta:
            self.init_buffers()

    def stand_in_features(self) -> torch.Tensor:
        """[n_mels, DUMMY_FRAMES] zeros: the clip a batch without audio runs the tower on (the same collectives)."""
        return self.conv1.weight.new_zeros(self.cfg.num_mel_bins, DUMMY_FRAMES)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        dev = buffer_device or (self.conv1.weight.device if not self.conv1.weight.is_meta else "cpu")
        self.positional_embedding = sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(dev)

    def forward(self, input_features: torch.Tensor, meta: AudioMeta) -> torch.Tensor:
        w = self.conv1.weight
        C, L = meta.frame_index.shape
        x = F.pad(input_features.to(w.dtype), (0, 1))  # a zero frame at T for the padding
        x = x.index_select(1, meta.frame_index.reshape(-1)).view(-1, C, L).transpose(0, 1)  # [C, n_mels, L]
        h = F.gelu(self.conv1(x)) * meta.conv_mask.to(w.dtype)
        h = F.gelu(self.conv2(h)).transpose(1, 2)  # [C, L2, D]
        h = h + self.positional_embedding[: h.shape[1]].to(h.dtype)
        h = h.reshape(-1, h.shape[-1]).index_select(0, meta.valid)
        for blk in self.blocks:
            h = blk(h, meta.attn)
        h = (h.index_select(0, meta.pool) + h.index_select(0, meta.pool + 1)) / 2
        return self.proj(self.ln_post(h))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d)):
                init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, nn.Embedding):
                init.normal_(m.weight, std=std)
