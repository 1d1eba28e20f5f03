"""Wan 2.1 / 2.2 transformer config, read from a diffusers ``transformer/config.json`` (WanTransformer3DModel)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from titan_mm.models.hf_config import PositiveInt, check_hf, hf_types
from titan_mm.models.hf_io import component_dir, read_hf_config

CLASS_NAME = "WanTransformer3DModel"
NUM_TRAIN_TIMESTEPS = 1000
"""diffusers' FlowMatchEulerDiscreteScheduler: timestep = sigma x 1000; flow matching's t is sigma."""
EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}
"""Wan2.2 A14B's experts -> the pipeline's subfolder (WanPipeline's ``transformer`` / ``transformer_2``)."""


@dataclass(frozen=True)
class WanConfig:
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 8960
    num_layers: int = 30
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    pos_embed_seq_len: int | None = None
    attn_backend: str = "sdpa"
    kernels: bool | str = False
    """The titan_mm.kernels ops spec (titan_mm.kernels.resolve_ops): "rms_norm" runs the q / k norms, "bias_gelu" the
    FFN's bias + GELU; the other ops are the text models' (the modulated LayerNorms stay compiled PyTorch)."""

    boundary_ratio: float | None = None
    """Wan2.2 A14B: the pipeline's (model_index.json) switch between its two transformers: ``transformer`` (the
    high-noise expert) denoises t >= boundary_ratio, ``transformer_2`` (low noise) below. Read from a pipeline
    folder; None: one transformer."""
    expert: str = ""
    """Wan2.2 A14B trains one expert at a time: "high_noise" (``transformer/``, t sampled in [boundary_ratio, 1]) or
    "low_noise" (``transformer_2/``, t in [0, boundary_ratio)); "": the one transformer, every t. Set it in
    model.overrides, e.g. '{"expert": "low_noise"}'."""

    first_frame_clean: bool = False
    """Wan2.2 TI2V's image-to-video training: each clip's first latent frame is its conditioning image, kept clean
    (t = 0 on its patches, as WanImageToVideoPipeline with expand_timesteps) and no target. model.overrides:
    '{"first_frame_clean": true}'."""

    synthetic: str = ""
    """What ``data.dataset = "synthetic"`` draws: "" clips that are a function of random text states (synthetic.py),
    "digits" the moving-digits debug task (digits.py; the "digits" flavor)."""

    RUNTIME_FIELDS = ("attn_backend", "kernels")
    PIPELINE_FIELDS = ("boundary_ratio", "expert", "first_frame_clean", "synthetic")
    """Not in the transformer's config.json: the pipeline's and the job's."""
    SYNTHETIC = ("", "digits")

    def __post_init__(self):
        if self.image_dim is not None or self.added_kv_proj_dim is not None or self.pos_embed_seq_len is not None:
            raise ValueError("this Wan config conditions on an image encoder (image_dim / added_kv_proj_dim: the "
                             "Wan2.1 I2V models); titan_mm's wan family reads the T2V and TI2V transformers only")
        if self.qk_norm not in ("rms_norm_across_heads", None):
            raise ValueError(f"qk_norm {self.qk_norm!r} is unknown; Wan uses 'rms_norm_across_heads' or null")
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise ValueError(f"attention_head_dim {self.attention_head_dim} must be even and >= 6 (3-D RoPE)")
        if self.synthetic not in self.SYNTHETIC:
            raise ValueError(f"synthetic {self.synthetic!r} is unknown; use one of {list(self.SYNTHETIC)}")
        if self.expert and self.expert not in EXPERTS:
            raise ValueError(f"expert {self.expert!r} is unknown; use one of {sorted(EXPERTS)} ('': one transformer)")
        if self.boundary_ratio is not None and not 0 < self.boundary_ratio < 1:
            raise ValueError(f"boundary_ratio {self.boundary_ratio} must lie in (0, 1) (Wan2.2-T2V-A14B's is 0.875)")
        if self.first_frame_clean and self.patch_size[0] != 1:
            raise ValueError(f"first_frame_clean keeps the first latent frame clean, which a temporal patch of "
                             f"{self.patch_size[0]} frames mixes with the next; use it with patch_size [1, h, w]")
        if self.expert and self.boundary_ratio is None:
            raise ValueError(f"expert {self.expert!r} trains on one side of the pipeline's boundary_ratio, which is "
                             "unset: point model.hf_path at the A14B pipeline folder (its model_index.json) or add "
                             "boundary_ratio to model.overrides")

    def t_range(self) -> tuple[float, float]:
        """The flow-matching t this config's expert denoises in WanPipeline (sigma = timestep / 1000)."""
        if not self.expert:
            return 0.0, 1.0
        return (self.boundary_ratio, 1.0) if self.expert == "high_noise" else (0.0, self.boundary_ratio)

    def subfolder(self) -> str | None:
        """The pipeline folder's transformer of this expert; None: one transformer (the folder given)."""
        return EXPERTS.get(self.expert)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_dim(self) -> int:
        """Values per patch of the output (and of a target latent): pt x ph x pw x out_channels."""
        pt, ph, pw = self.patch_size
        return pt * ph * pw * self.out_channels

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Head-dim split of the 3-D RoPE over (frame, height, width), as diffusers' WanRotaryPosEmbed."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> WanConfig:
        if d.get("_class_name") != CLASS_NAME:
            raise ValueError(f"config.json has _class_name={d.get('_class_name')!r}; the wan family reads a diffusers "
                             f"{CLASS_NAME} config (a Wan pipeline's transformer/ folder)")
        check_hf(d, HF_TYPES)
        names = {f.name for f in dataclasses.fields(cls)} - set(cls.RUNTIME_FIELDS + cls.PIPELINE_FIELDS)
        kw = {k: v for k, v in d.items() if k in names}
        if "patch_size" in kw:
            kw["patch_size"] = tuple(kw["patch_size"])
        if kw.get("out_channels") is None:  # diffusers: out_channels or in_channels
            kw["out_channels"] = kw.get("in_channels", cls.in_channels)
        return cls(**kw, **runtime)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **runtime) -> WanConfig:
        cfg = cls.from_hf_dict(read_hf_config(transformer_dir(hf_dir)), **runtime)
        pipe = pipeline_dir(hf_dir)  # A14B's boundary is the pipeline's
        if pipe is None:
            return cfg
        with open(os.path.join(pipe, "model_index.json")) as f:
            ratio = json.load(f).get("boundary_ratio")
        return cfg if ratio is None else dataclasses.replace(cfg, boundary_ratio=float(ratio))

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"_class_name": CLASS_NAME}
        for f in dataclasses.fields(self):
            if f.name not in self.RUNTIME_FIELDS + self.PIPELINE_FIELDS:
                v = getattr(self, f.name)
                d[f.name] = list(v) if isinstance(v, tuple) else v
        if dtype is not None:
            d["torch_dtype"] = dtype
        return d


_SIZES = ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim", "ffn_dim", "num_layers",
          "rope_max_seq_len")
HF_TYPES = hf_types(WanConfig, skip=WanConfig.RUNTIME_FIELDS + WanConfig.PIPELINE_FIELDS, _class_name=str, _diffusers_version=str,
                    out_channels=PositiveInt | None, patch_size=tuple[PositiveInt, PositiveInt, PositiveInt],
                    **dict.fromkeys(_SIZES, PositiveInt))


def pipeline_dir(path: str | os.PathLike) -> str | None:
    """The diffusers pipeline folder (model_index.json) that ``path`` is, or holds ``path`` as one of its
    transformers (the launcher resolves a pipeline's model.hf_path to its ``transformer/``); None: neither."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    parent = os.path.dirname(path)
    if os.path.basename(path) in set(EXPERTS.values()) and os.path.isfile(os.path.join(parent, "model_index.json")):
        return parent
    return None


def transformer_dir(path: str | os.PathLike, subfolder: str | None = None) -> str:
    """The transformer folder to read: with ``subfolder`` None (one transformer) ``path``, or a pipeline folder's
    ``transformer/``; with an A14B expert's ``subfolder`` (``transformer`` / ``transformer_2``) that folder of the
    pipeline ``path`` is or sits in (pipeline_dir), else ``path`` itself (a transformer folder, no pipeline)."""
    if subfolder is None:
        return component_dir(path, "transformer")
    pipe = pipeline_dir(path)
    if pipe is None:
        return str(path)
    if not os.path.isfile(os.path.join(pipe, subfolder, "config.json")):
        raise ValueError(f"{pipe} has no {subfolder}/ (an expert of a Wan2.2 A14B pipeline); point model.hf_path "
                         "at an A14B pipeline folder or drop model.overrides' expert")
    return os.path.join(pipe, subfolder)


FLAVORS = {
    # Wan2.1-T2V-1.3B's transformer (diffusers Wan-AI/Wan2.1-T2V-1.3B-Diffusers)
    "1.3B": WanConfig(),
    # Wan2.2-TI2V-5B's (Wan-AI/Wan2.2-TI2V-5B-Diffusers): 48 latent channels of the Wan2.2 VAE
    "ti2v-5B": WanConfig(num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336),
    "debug": WanConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                       out_channels=4, text_dim=16, freq_dim=16, ffn_dim=48, num_layers=2),
    # the moving-digits debug task (digits.py): 1-channel pixels in 4x4 patches, 32-wide word states
    # 6 heads of 16, not 3 of 32: a third of each head's q / k turns at RoPE's fastest frequency per axis (a sixth
    # with 32), and held-out digits drawn right rose from 0.60 to 0.80 at 1,500 steps (docs/wan.md, the probes)
    "digits": WanConfig(patch_size=(1, 4, 4), num_attention_heads=6, attention_head_dim=16, in_channels=1,
                        out_channels=1, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=4, synthetic="digits"),
}
