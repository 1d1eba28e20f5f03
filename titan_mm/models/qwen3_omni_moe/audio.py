"""Qwen3-Omni audio encoder (HF Qwen3OmniMoeAudioEncoder): each clip is cut into chunks of 2 * n_window mel
frames, padded to the longest chunk of the batch; per chunk three stride-2 Conv2d (+ GELU) over (mel, time), a
bias-free linear over (channels x mel) -> d_model, + sinusoidal positions restarting per chunk; the valid tokens go
through pre-LN Whisper blocks with bidirectional attention inside windows of n_window_infer // (2 n_window)
chunks' worth of tokens; then ln_post, proj1, GELU, proj2.

HF's quirks are kept on purpose, since they change the numbers: the chunks are padded to the longest chunk of the
micro-batch and the convs run over the padding unmasked (a short chunk's last tokens see the padding's conv
output), and the attention window is measured in the longest chunk's token count. The serving engine groups a
forward's clips by request (``audio_groups``): each group gets the padding and window of a call of its own (masks
after the convs stand for the shorter tensor's edge), so a request's tokens do not depend on its neighbours.

Everything that depends on the clip lengths is built on the host by :func:`build_audio_meta` (the frame gather,
the valid-token rows, the windows' attention metadata), so the forward has no host syncs. The attention core is
the ViT's (qwen3_vl/vision.py), one segment per window.

Legend: T mel frames of all clips, C chunks, L frames per padded chunk, L3 tokens per padded chunk after the three
convs, N valid tokens (= the <|audio_pad|> placeholders), D d_model, O output_dim.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_mm.nn import init
from titan_mm.models.qwen2_5_omni.audio import AudioBlock as _Qwen2_5AudioBlock
from titan_mm.models.qwen2_5_omni.audio import sinusoids
from titan_mm.models.qwen2_5_vl.vision import segments_config
from titan_mm.models.qwen3_omni_moe.config import AudioConfig
from titan_mm.models.qwen3_vl.vision import VisionMeta, build_vision_meta, move_vision_meta

DUMMY_FRAMES = 1
"""Frames of the stand-in clip of a batch without audio (one frame gives one token)."""


def output_lengths(frames):
    """Encoder output tokens of clips (or chunks) of ``frames`` mel frames, HF's _get_feat_extract_output_lengths:
    13 per full chunk of 100 frames, plus three stride-2 convs over the rest; ints or integer arrays."""
    feat = (frames % 100 - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


class AudioMeta(NamedTuple):
    """Host-built metadata of one audio-encoder forward (see :func:`build_audio_meta`)."""

    frame_index: torch.Tensor
    """[C, L] int64: the mel frame at each chunk position; T (one past the last frame, a zero frame) on padding."""
    valid: torch.Tensor
    """[N] int64: rows of the flattened [C * L3] conv output that are real tokens, chunk by chunk."""
    attn: VisionMeta
    """Bidirectional attention within each window (one segment per window, N tokens)."""
    conv_masks: tuple[torch.Tensor, ...] | None = None
    """Clips in groups (:func:`build_audio_meta`): per conv, [C, 1, 1, length after it] float, 0 past the length a
    chunk would have had in its own group's padded tensor (as that conv's zero padding sees it); None: one group."""


def _chunk_lengths(lens: np.ndarray, w2: int) -> np.ndarray:
    """HF's chunk_and_pad_features: ceil(n / w2) chunks per clip, all w2 long but the last (n % w2, or w2)."""
    out = []
    for n in lens.tolist():
        k = -(-n // w2)
        out += [w2] * (k - 1) + [n - (k - 1) * w2]
    return np.asarray(out, dtype=np.int64)


def build_audio_meta(lengths, cfg: AudioConfig, backend: str = "sdpa",
                     device: torch.device | str | None = None, groups=None) -> AudioMeta:
    """Host side, from the clips' mel-frame counts (``audio_feature_lengths``, [n_clips]) in the order their frames
    are concatenated in ``input_features``. ``groups`` ([n_clips] ints; the serving engine's requests): each group's
    clips are encoded as one HF call of their own would encode them (padded to the group's longest chunk, windows in
    its tokens), whatever else the forward holds; None: one group, HF's batched forward (training)."""
    lens = np.asarray(torch.as_tensor(lengths).cpu(), dtype=np.int64).reshape(-1)
    if len(lens) == 0 or (lens < 1).any():
        raise ValueError(f"audio_feature_lengths {lens.tolist()}: every clip needs at least one mel frame.")
    w2 = 2 * cfg.n_window
    per_clip = [_chunk_lengths(lens[i:i + 1], w2) for i in range(len(lens))]
    chunks = np.concatenate(per_clip)
    group = np.zeros(len(lens), np.int64) if groups is None else np.asarray(torch.as_tensor(groups).cpu()).reshape(-1)
    longest = {g: max(int(c.max()) for c, h in zip(per_clip, group) if h == g) for g in set(group.tolist())}
    chunk_group_len = np.concatenate([np.full(len(c), longest[g]) for c, g in zip(per_clip, group.tolist())])
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    L = int(chunks.max())
    pos = np.arange(L)
    frame_index = np.where(pos[None, :] < chunks[:, None], starts[:, None] + pos[None, :], int(lens.sum()))
    tok = output_lengths(chunks)
    L3 = int(tok.max())  # = _conv3(L): the padded chunk's length after the convs
    valid = (np.arange(len(chunks))[:, None] * L3 + np.arange(L3)[None, :])[np.arange(L3)[None, :] < tok[:, None]]
    seg = []
    for n, g in zip(output_lengths(lens).tolist(), group.tolist()):
        window = int(output_lengths(longest[g])) * (cfg.n_window_infer // w2)  # HF: in its longest chunk's tokens
        seg += [window] * (n // window) + ([n % window] if n % window else [])
    seg_t = torch.tensor([[1, 1, s] for s in seg])
    attn = build_vision_meta(seg_t, segments_config(1), backend, device)  # on device: flex masks do not move
    empty = torch.zeros(0, 4, dtype=torch.int64)
    attn = attn._replace(pos_idx=empty, pos_w=empty.float(), rope_hw=empty[:, :2])  # no ViT tables here
    masks = None
    if (chunk_group_len < L).any():  # a group padded less than the forward: zero what its convs would not see
        lk, gk, masks = L, chunk_group_len, []
        for _ in range(3):
            lk, gk = (lk - 1) // 2 + 1, (gk - 1) // 2 + 1
            masks.append(torch.from_numpy((np.arange(lk)[None, :] < gk[:, None]).astype(np.float32))[:, None, None])
        masks = tuple(masks)
    meta = AudioMeta(torch.from_numpy(frame_index), torch.from_numpy(valid.astype(np.int64)), attn, masks)
    return meta if device is None else move_audio_meta(meta, device)


def move_audio_meta(meta: AudioMeta, device: torch.device | str) -> AudioMeta:
    masks = None if meta.conv_masks is None else tuple(m.to(device, non_blocking=True) for m in meta.conv_masks)
    return meta._replace(frame_index=meta.frame_index.to(device, non_blocking=True),
                         valid=meta.valid.to(device, non_blocking=True), attn=move_vision_meta(meta.attn, device),
                         conv_masks=masks)


class AudioBlock(_Qwen2_5AudioBlock):
    """Qwen2.5-Omni's pre-LN Whisper layer (same HF names), except that k_proj has a bias here."""

    def __init__(self, cfg: AudioConfig):
        super().__init__(cfg)
        self.self_attn.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)


class AudioEncoder(nn.Module):
    """input_features [n_mels, T] + AudioMeta -> [N, O], the <|audio_pad|> embeddings of every clip in order.
    Layers are named ``blocks`` (HF ``layers``) so that only decoder blocks are ``*.layers.{i}``."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        D, Ch = cfg.d_model, cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, Ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(Ch, Ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(Ch, Ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(Ch * cfg.conv_freq, D, bias=False)
        self.register_buffer("positional_embedding", torch.empty(cfg.max_source_positions, D), persistent=False)
        self.blocks = nn.ModuleList([AudioBlock(cfg) for _ in range(cfg.encoder_layers)])
        self.ln_post = nn.LayerNorm(D)
        self.proj1 = nn.Linear(D, D)
        self.proj2 = nn.Linear(D, cfg.output_dim)
        if not self.positional_embedding.is_meta:
            self.init_buffers()

    def stand_in_features(self) -> torch.Tensor:
        """[n_mels, DUMMY_FRAMES] zeros: the clip a batch without audio runs the tower on (the same collectives)."""
        return self.conv2d1.weight.new_zeros(self.cfg.num_mel_bins, DUMMY_FRAMES)

    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        dev = buffer_device or (self.conv_out.weight.device if not self.conv_out.weight.is_meta else "cpu")
        self.positional_embedding = sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(dev)

    def forward(self, input_features: torch.Tensor, meta: AudioMeta) -> torch.Tensor:
        w = self.conv2d1.weight
        C, L = meta.frame_index.shape
        x = F.pad(input_features.to(w.dtype), (0, 1))  # a zero frame at T for the padding
        x = x.index_select(1, meta.frame_index.reshape(-1)).view(-1, C, L).transpose(0, 1)[:, None]  # [C,1,mel,L]
        for k, conv in enumerate((self.conv2d1, self.conv2d2, self.conv2d3)):
            x = F.gelu(conv(x))
            if meta.conv_masks is not None:
                x = x * meta.conv_masks[k].to(x.dtype)
        c, ch, f, t = x.shape
        h = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * f))  # [C, L3, D]
        h = h + self.positional_embedding[:t].to(h.dtype)
        h = h.reshape(-1, h.shape[-1]).index_select(0, meta.valid)
        for blk in self.blocks:
            h = blk(h, meta.attn)
        return self.proj2(F.gelu(self.proj1(self.ln_post(h))))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()


__all__ = ["DUMMY_FRAMES", "AudioEncoder", "AudioMeta", "build_audio_meta", "output_lengths"]
