"""BAGEL config (ByteDance-Seed/Bagel's ``BagelConfig``): the Qwen2 backbone with QK-norm and the
Mixture-of-Transformers split (``llm_config``), the SigLIP NaViT vision tower (``vit_config``), the VAE's latent
shape (``vae_config``) and the generation path's sizes. The released BAGEL-7B-MoT folder holds ``llm_config.json``
and ``vit_config.json``; :meth:`BagelConfig.from_hf` reads them, typed (titan_mm/models/hf_config.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import PositiveInt, check_hf, hf_types, within
from titan_mm.models.hf_io import HFCheckpointError

LAYER_MODULES = ("Qwen2MoTDecoderLayer", "Qwen2MoEDecoderLayer")
"""BAGEL's two-expert decoder layers: every per-token weight split (MoT), or the MLP only (model.py's ``LAYERS``)."""


@dataclass(frozen=True)
class BagelLLMConfig:
    """The Qwen2 decoder (``llm_config.json``: Qwen2Config plus BAGEL's ``qk_norm`` and ``layer_module``)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    layer_module: str = "Qwen2MoTDecoderLayer"

    def __post_init__(self):
        if self.layer_module not in LAYER_MODULES or not self.qk_norm:
            raise ValueError(f"llm_config.layer_module {self.layer_module!r}, qk_norm {self.qk_norm}: titan_mm's bagel "
                             f"builds {' or '.join(LAYER_MODULES)} (the MLP-only split), with QK-norm (true)")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"llm_config: hidden_size {self.hidden_size} must divide by num_attention_heads "
                             f"{self.num_attention_heads}, and that by num_key_value_heads {self.num_key_value_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class BagelViTConfig:
    """The SigLIP vision tower (``vit_config.json``: SiglipVisionConfig; BAGEL turns its RoPE off and drops its last
    layer)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 980
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"vit_config.hidden_act {self.hidden_act!r}: SigLIP uses 'gelu_pytorch_tanh'")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vit_config: hidden_size {self.hidden_size} must divide by num_attention_heads "
                             f"{self.num_attention_heads}")

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch, in (row, column, channel) order (BAGEL's patchify)."""
        return self.patch_size * self.patch_size * self.num_channels

    @property
    def positions(self) -> int:
        """Rows of the learned position table: (image_size / patch_size)^2."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class BagelVAEConfig:
    """The FLUX autoencoder's latent shape (BAGEL's ``vae_config``): ``z_channels`` per latent pixel, ``downsample``
    pixels per latent pixel along each side."""

    z_channels: int = 16
    downsample: int = 8


@dataclass(frozen=True)
class BagelConfig:
    llm_config: BagelLLMConfig = field(default_factory=BagelLLMConfig)
    vit_config: BagelViTConfig = field(default_factory=BagelViTConfig)
    vae_config: BagelVAEConfig = field(default_factory=BagelVAEConfig)
    visual_gen: bool = True
    visual_und: bool = True
    latent_patch_size: int = 2
    max_latent_size: int = 64
    """Latent patches per side of the latent position table (64 in BAGEL-7B-MoT)."""
    vit_max_num_patch_per_side: int = 70
    """ViT patches per side of the flattened ViT positions (row x this + column) and of the connector's table."""
    connector_act: str = "gelu_pytorch_tanh"
    interpolate_pos: bool = False
    timestep_shift: float = 1.0
    attn_backend: str = "sdpa"
    kernels: bool | str = False
    """The titan_mm.kernels ops spec (titan_mm.kernels.resolve_ops): "linear_cross_entropy" runs the LM loss as the
    fused Triton kernel (no fp32 [rows, vocab] logits); the other ops run their PyTorch references, which inductor
    fuses inside the compiled layers."""
    loss_chunk_size: int = 4096
    # ---- training modes (spec.py: param_part, param_groups) ----
    freeze_und: bool = False
    """BAGEL's ``freeze_und``: the understanding side (each layer's ``und`` expert, the final ``norm``, the token
    embeddings, the LM head and the ViT connector) takes no gradient and sits out of the optimizer; the generation
    expert trains, and so does the MLP-only split's shared attention."""
    freeze_vit: bool = False
    """BAGEL's ``freeze_vit``: the SigLIP tower takes no gradient and sits out of the optimizer."""

    RUNTIME_FIELDS = ("attn_backend", "kernels", "loss_chunk_size", "freeze_und", "freeze_vit")

    def __post_init__(self):
        if not (self.visual_gen and self.visual_und):
            raise ValueError("titan_mm's bagel builds both paths (visual_gen and visual_und true); a text-only or "
                             "one-path BAGEL is later")
        if self.connector_act != "gelu_pytorch_tanh" or self.interpolate_pos:
            raise ValueError(f"connector_act {self.connector_act!r}, interpolate_pos {self.interpolate_pos}: BAGEL-7B-"
                             "MoT's 'gelu_pytorch_tanh' and extrapolated positions are built; the others are later")
        if self.llm_config.hidden_size % 4:
            raise ValueError(f"llm_config.hidden_size {self.llm_config.hidden_size} must divide by 4 (the 2-D "
                             "sin-cos position tables)")
        side = self.vit_config.image_size // self.vit_config.patch_size
        if self.vit_max_num_patch_per_side > side:
            raise ValueError(f"vit_max_num_patch_per_side {self.vit_max_num_patch_per_side} exceeds the ViT's position "
                             f"table of {side} x {side} (image_size / patch_size); use at most {side}")
        if self.timestep_shift <= 0:
            raise ValueError(f"timestep_shift must be > 0, got {self.timestep_shift}")

    @property
    def patch_latent_dim(self) -> int:
        """Values per latent patch: latent_patch_size^2 x z_channels, in (row, column, channel) order."""
        return self.latent_patch_size**2 * self.vae_config.z_channels

    @classmethod
    def from_hf_dicts(cls, llm: dict[str, Any], vit: dict[str, Any], **kw) -> BagelConfig:
        """From the released folder's ``llm_config.json`` / ``vit_config.json`` dicts (typed) and BAGEL's own fields
        (``kw``). BAGEL runs the ViT one layer short (its inference and training scripts drop the last): so does
        this."""
        parts = {}
        for name, d, sub, types in (("llm_config", llm, BagelLLMConfig, LLM_TYPES),
                                    ("vit_config", vit, BagelViTConfig, VIT_TYPES)):
            with within(name):
                check_hf(d, types)
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: v for k, v in d.items() if k in names})
        vit_cfg = parts["vit_config"]
        parts["vit_config"] = dataclasses.replace(vit_cfg, num_hidden_layers=vit_cfg.num_hidden_layers - 1)
        return cls(**parts, **kw)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **kw) -> BagelConfig:
        return cls.from_hf_dicts(read_json(hf_dir, "llm_config.json"), read_json(hf_dir, "vit_config.json"), **kw)


def read_json(hf_dir: str | os.PathLike, name: str) -> dict[str, Any]:
    """One json config of the folder as a dict; missing, unreadable or not an object is one HFCheckpointError line."""
    path = os.path.join(hf_dir, name)
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise HFCheckpointError(f"{path} cannot be read ({e.strerror or e}); a BAGEL folder holds llm_config.json "
                                "and vit_config.json") from None
    except ValueError as e:
        raise HFCheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    if not isinstance(d, dict):
        raise HFCheckpointError(f"{path} holds {type(d).__name__}, not a JSON object; re-download it")
    return d


LLM_TYPES = hf_types(BagelLLMConfig, intermediate_size=PositiveInt, max_position_embeddings=PositiveInt)
VIT_TYPES = hf_types(BagelViTConfig, intermediate_size=PositiveInt, patch_size=PositiveInt, image_size=PositiveInt,
                     num_channels=PositiveInt)

FLAVORS = {
    # BAGEL-7B-MoT: Qwen2.5-7B-Instruct with QK-norm, SigLIP2-so400m/14 (27 layers, the last dropped), FLUX VAE
    "7B-MoT": BagelConfig(),
    "debug": BagelConfig(
        llm_config=BagelLLMConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
        vit_config=BagelViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=4),
        vae_config=BagelVAEConfig(z_channels=4, downsample=4), max_latent_size=8, vit_max_num_patch_per_side=8),
}
