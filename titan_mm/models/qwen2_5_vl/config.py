"""Qwen2.5-VL configuration: a frozen vision config + the Qwen2 text config + VL fields.

Read from an HF ``config.json`` (transformers ``Qwen2_5_VLConfig``: ``text_config`` + ``vision_config``, or the
released hub files' flat layout, text keys at the top level) with :meth:`Qwen2_5_VLConfig.from_hf`, or pick a
flavor from :data:`FLAVORS`. The text model is the Qwen2 decoder (``Qwen2Config.decoder()``: q/k/v bias, no
qk-norm) with chunked (not interleaved) M-RoPE over ``mrope_section``. Training-mode fields (freezing, per-part
learning rates) are Qwen3-VL's, read by qwen3_vl.model.apply_freeze / param_groups.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import check_hf, hf_types, within
from titan_mm.models.qwen2.config import HF_TYPES as TEXT_HF_TYPES
from titan_mm.models.qwen2.config import Qwen2Config
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3_vl.config import VLFields

logger = logging.getLogger(__name__)

MODEL_TYPE = "qwen2_5_vl"
# top-level keys of a flat (hub) config.json that are not the text model's
_VL_KEYS = {"vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
            "vision_token_id", "tie_word_embeddings", "architectures", "model_type", "transformers_version",
            "torch_dtype", "dtype", "_name_or_path", "text_config"}
# keys any HF sub-config may carry that change no math (Qwen2.5-Omni's audio config reads them too)
GENERIC_KEYS = {"model_type", "rope_parameters", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                "architectures", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                "output_attentions", "output_hidden_states", "problem_type", "return_dict", "in_chans",
                "spatial_patch_size", "embed_dim"}
_TEXT_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0}


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    """Number of ViT blocks."""
    hidden_size: int = 3584
    """ViT width (transformers' default; the released models use 1280)."""
    intermediate_size: int = 3420
    """ViT SwiGLU width."""
    num_heads: int = 16
    """ViT attention heads."""
    in_channels: int = 3
    patch_size: int = 14
    """Spatial patch size in pixels."""
    temporal_patch_size: int = 2
    """Frames per temporal patch (an image is repeated to fill it)."""
    spatial_merge_size: int = 2
    """merge x merge patches become one LLM token."""
    out_hidden_size: int = 3584
    """Merger output width (= the LLM hidden size)."""
    window_size: int = 112
    """Window side in pixels: window attention runs over window_size / patch_size patches per side."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """ViT blocks with full attention (per image / video frame); the others attend within windows."""
    tokens_per_second: int = 4
    """Video: temporal M-RoPE positions advance by tokens_per_second * second_per_grid_t per temporal patch."""
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    """2-D rotary base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (fixed at 1e-6 in HF)."""
    initializer_range: float = 0.02

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_merged(self) -> int:
        """Window side in merged tokens (HF's vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True)
class Qwen2_5_VLConfig(VLFields):
    text: Qwen2Config = field(default_factory=Qwen2Config)
    """The LLM (the Qwen2 decoder, HF Qwen2 field names)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    """Rotary frequency pairs per axis (t, h, w), in chunks: the first section[0] frequencies rotate by t, the
    next section[1] by h, the last section[2] by w (HF Qwen2.5-VL; Qwen3-VL interleaves them)."""

    def __post_init__(self):
        self._push_into_text()
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        v = self.vision
        object.__setattr__(self, "vision", dataclasses.replace(v, fullatt_block_indexes=tuple(v.fullatt_block_indexes)))
        if sum(self.mrope_section) * 2 != self.text.head_dim:
            raise ValueError(f"mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}, but head_dim/2 = "
                             f"{self.text.head_dim // 2}; fix mrope_section or the text model's heads.")
        if v.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision out_hidden_size={v.out_hidden_size} must equal the LLM hidden_size "
                             f"{self.text.hidden_size}; fix one of them.")
        if v.hidden_act != "silu":
            raise ValueError(f"vision hidden_act={v.hidden_act!r}: Qwen2.5-VL's ViT MLP is SwiGLU (silu).")
        if v.window_merged < 1 or v.window_size % (v.patch_size * v.spatial_merge_size):
            raise ValueError(f"vision window_size={v.window_size} must be a positive multiple of patch_size * "
                             f"spatial_merge_size = {v.patch_size * v.spatial_merge_size}.")
        if any(not 0 <= i < v.depth for i in v.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes={v.fullatt_block_indexes} has blocks outside depth {v.depth}.")
        if self.vision_attn_backend not in ("auto", "sdpa", "flex", "varlen"):
            raise ValueError(f"vision_attn_backend={self.vision_attn_backend!r}; choose auto, sdpa, flex or varlen.")
        if self.text.use_sliding_window:
            raise ValueError("Qwen2.5-VL's text model has no sliding window here; set use_sliding_window=False.")

    # --- derived ---
    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def decoder(self) -> Qwen3Config:
        """The Qwen3 decoder config the language model is built from (Qwen2's switches)."""
        return self.text.decoder()

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> Qwen2_5_VLConfig:
        mt = d.get("model_type")
        if mt != MODEL_TYPE:
            raise ValueError(f"config.json has model_type={mt!r}, but the qwen2_5_vl family reads {MODEL_TYPE!r}; use "
                             "the registry entry for that model type (titan_mm.registry.spec_for_hf_dir).")
        if "vision_config" not in d:
            raise ValueError("a Qwen2.5-VL config.json needs vision_config; is the file complete?")
        check_hf(d, HF_TYPES)
        text_key = "text_config" if d.get("text_config") else ""  # the released files are flat: text keys on top
        td = dict(d.get("text_config") or {k: v for k, v in d.items() if k not in _VL_KEYS})
        with within(text_key):
            check_hf(td, TEXT_HF_TYPES)
        rope = dict(td.pop("rope_scaling", None) or td.pop("rope_parameters", None) or {})  # transformers' precedence
        td.pop("rope_parameters", None)
        mrope = tuple(rope.pop("mrope_section", (16, 24, 24)))
        if rope.pop("mrope_interleaved", False):
            raise ValueError("mrope_interleaved=true is Qwen3-VL's layout; use the qwen3_vl family.")
        if "rope_theta" in rope:
            td["rope_theta"] = rope.pop("rope_theta")
        if rope.pop("type", rope.pop("rope_type", "default")) not in ("default", "mrope") or rope:
            raise ValueError(f"Qwen2.5-VL text rope {rope} is not the default M-RoPE; only default is supported.")
        for k in ("pad_token_id", "tie_word_embeddings", "layer_types", "sliding_window", "max_window_layers",
                  "attention_dropout", "use_cache", "vision_token_id"):
            td.pop(k, None)
        keep = {f.name for f in dataclasses.fields(Qwen2Config)} - set(Qwen2Config.RUNTIME_FIELDS)
        dropped = sorted(k for k in td if k not in keep and k not in GENERIC_KEYS)
        if dropped:
            raise ValueError(f"Qwen2.5-VL text config keys titan_mm does not implement: {dropped}")
        td = {**_TEXT_DEFAULTS, **{k: v for k, v in td.items() if k in keep}}  # HF Qwen2.5-VL's, where not Qwen2's
        with within(text_key):
            text = Qwen2Config.from_hf_dict({**td, "model_type": "qwen2"})
        vd = d["vision_config"]
        with within("vision_config"):
            check_hf(vd, VISION_HF_TYPES)
        vnames = {f.name for f in dataclasses.fields(VisionConfig)}
        vkw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in vd.items() if k in vnames}
        if "in_chans" in vd and "in_channels" not in vd:
            vkw["in_channels"] = vd["in_chans"]  # the released files' spelling
        if "rope_theta" in (vd.get("rope_parameters") or {}):
            vkw["rope_theta"] = float(vd["rope_parameters"]["rope_theta"])
        unknown = sorted(set(vd) - vnames - GENERIC_KEYS)
        if unknown:
            logger.warning("Qwen2.5-VL vision_config keys not used by titan_mm (check they do not change the math): %s",
                           unknown)
        tie = d.get("tie_word_embeddings", (d.get("text_config") or {}).get("tie_word_embeddings", False))
        kw = dict(text=text, vision=VisionConfig(**vkw), mrope_section=mrope, tie_word_embeddings=bool(tie))
        kw.update(cls.hf_token_ids(d))
        kw.update(runtime)
        return cls(**kw)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        td = self.text.to_hf_dict(dtype=dtype)
        for k in ("architectures", "rope_scaling", "rope_theta", "rope_parameters", "torch_dtype", "layer_types",
                  "tie_word_embeddings", "use_sliding_window", "sliding_window", "max_window_layers"):
            td.pop(k, None)
        td["model_type"] = "qwen2_5_vl_text"
        td["rope_parameters"] = {"rope_type": "default", "rope_theta": self.text.rope_theta,
                                 "mrope_section": list(self.mrope_section)}
        vd = {f.name: getattr(self.vision, f.name) for f in dataclasses.fields(self.vision)}
        vd["fullatt_block_indexes"] = list(self.vision.fullatt_block_indexes)
        vd.pop("rms_norm_eps")
        vd["rope_parameters"] = {"rope_type": "axial", "rope_theta": vd.pop("rope_theta")}
        vd["model_type"] = "qwen2_5_vl_vision"
        out = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": MODEL_TYPE,
               "text_config": td, "vision_config": vd, "image_token_id": self.image_token_id,
               "video_token_id": self.video_token_id, "vision_start_token_id": self.vision_start_token_id,
               "vision_end_token_id": self.vision_end_token_id, "tie_word_embeddings": self.tie_word_embeddings}
        if dtype is not None:
            out["dtype"] = dtype
        return out


# config.json key -> JSON type (titan_mm.models.hf_config); the text model's are Qwen2's
HF_TYPES = hf_types(Qwen2_5_VLConfig, skip=Qwen2_5_VLConfig.RUNTIME_FIELDS + ("text", "vision", "mrope_section"),
                    text_config=dict | None, vision_config=dict, vision_token_id=int)
VISION_HF_TYPES = hf_types(VisionConfig, in_chans=int, spatial_patch_size=int)


# ---- flavors: Qwen/Qwen2.5-VL-{3B,7B}-Instruct config.json numbers + a tiny debug flavor ----
_TXT = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
            max_position_embeddings=128000, use_sliding_window=False, sliding_window=32768)
_VIS = VisionConfig(hidden_size=1280, tokens_per_second=2)  # the released ViT (intermediate 3420, depth 32)


def _vl(text: Qwen2Config, vision: VisionConfig, **kw) -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(text=text, vision=dataclasses.replace(vision, out_hidden_size=text.hidden_size),
                            tie_word_embeddings=text.tie_word_embeddings, **kw)


FLAVORS: dict[str, Qwen2_5_VLConfig] = {
    # real vocab (trains with the real tokenizer); window 28 px = one merged token, so the 56x56-px digits
    # images (2 x 2 merged tokens) run window attention in block 0 and full attention in block 1
    "debug": _vl(Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             rope_theta=1_000_000.0, max_position_embeddings=32768, bos_token_id=151643,
                             eos_token_id=151645),
                 VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, window_size=28,
                              fullatt_block_indexes=(1,), tokens_per_second=2), mrope_section=(4, 6, 6)),
    "3B": _vl(Qwen2Config(**_TXT, vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                          max_window_layers=70), _VIS),
    "7B": _vl(Qwen2Config(**_TXT, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                          max_window_layers=28), _VIS),
}
