"""Qwen3-VL / Qwen3-VL-MoE configuration: a frozen vision config + the Qwen3 text config + VL fields.

Read from an HF ``config.json`` (``Qwen3VLConfig`` / ``Qwen3VLMoeConfig``: ``text_config`` +
``vision_config``) with :func:`config_from_hf`, or pick a named flavor from :data:`FLAVORS` /
:data:`MOE_FLAVORS` (real HF numbers for the released sizes, plus tiny debug flavors).

Training-mode fields (freezing, separate learning rates) live here too, so a TOML can set them through
``--model.overrides '{"freeze_vision": true, "vision_lr": 2e-6}'``; :func:`titan_mm.models.qwen3_vl.model.param_groups`
reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import check_hf, hf_types, within
from titan_mm.models.hf_io import read_hf_config
from titan_mm.models.qwen3.config import HF_TYPES as TEXT_HF_TYPES
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.registry import override

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    """Number of ViT blocks."""
    hidden_size: int = 1152
    """ViT width."""
    intermediate_size: int = 4304
    """ViT MLP width."""
    num_heads: int = 16
    """ViT attention heads."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 16
    """Spatial patch size in pixels."""
    temporal_patch_size: int = 2
    """Frames per temporal patch (an image is repeated to fill it)."""
    spatial_merge_size: int = 2
    """merge x merge patches become one LLM token."""
    out_hidden_size: int = 4096
    """Merger output width (= the LLM hidden size)."""
    num_position_embeddings: int = 2304
    """Learned position table size (a square grid, 48 x 48 for the released models)."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """ViT blocks whose outputs feed the DeepStack mergers, added into LLM layers 0, 1, 2, ..."""
    hidden_act: str = "gelu_pytorch_tanh"
    """ViT MLP activation."""
    rope_theta: float = 10000.0
    """2-D rotary base."""
    layer_norm_eps: float = 1e-6
    """LayerNorm epsilon (fixed at 1e-6 in HF)."""
    initializer_range: float = 0.02
    """Std of the random init."""

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class VLFields:
    """The fields of every Qwen vision-language config besides its text / vision parts and rope layout (Qwen3-VL,
    Qwen3.5, Qwen2.5-VL): the visual token ids, the tied head, and the runtime and training-mode fields the trainer
    sets (titan_mm only, never exported). A subclass holds ``text`` and calls :meth:`_push_into_text` first in its
    ``__post_init__``."""

    image_token_id: int = 151655
    """<|image_pad|>: one per merged image token in input_ids."""
    video_token_id: int = 151656
    """<|video_pad|>: one per merged video token."""
    vision_start_token_id: int = 151652
    """<|vision_start|>."""
    vision_end_token_id: int = 151653
    """<|vision_end|>."""
    tie_word_embeddings: bool = False
    """Output head shares the token embedding. Pushed into ``text``."""
    # ---- runtime (pushed into ``text``) ----
    attn_backend: str = "sdpa"
    """LLM attention backend: "sdpa" | "flex" | "varlen" (the trainer sets it from model.attn_backend)."""
    vision_attn_backend: str = "auto"
    """Vision attention: auto (varlen on CUDA when torch has it, else flex; sdpa on CPU), sdpa, flex or varlen."""
    vision_bucket: int = 0
    """The ViT runs on each micro-batch's patch count rounded up to a multiple of this (a multiple of
    spatial_merge_size**2): zero patches in attention segments of their own, their tokens dropped, so compiled
    blocks and kernel configs see repeating shapes while the image sizes vary; the loss and gradients are the
    unpadded ones. 0 (default): off, since the padding is extra work and only a compiled tower (compile.enable,
    off by default) can gain from repeating shapes; on the GPU set it with compile on, e.g. 4096
    (docs/efficiency.md)."""
    kernels: bool | str = False
    """titan_mm.kernels Triton ops in the LLM (as the text config's kernels) and the ViT MLPs."""
    moe_float8: bool = False
    """The text model's MoE experts in float8 (as Qwen3Config.moe_float8; pushed into a text config that has it)."""
    # ---- training modes (titan_mm/models/qwen3_vl/model.py: apply_freeze, param_groups) ----
    freeze_vision: bool = False
    """Freeze the ViT (patch embed, position embed, blocks); the mergers follow freeze_merger."""
    freeze_merger: bool = False
    """Freeze the patch merger (and DeepStack's mergers where there are)."""
    freeze_llm: bool = False
    """Freeze the language model (embeddings, blocks, final norm, output head)."""
    vision_lr: float | None = None
    """Learning rate of the ViT parameters (None: the optimizer's lr)."""
    merger_lr: float | None = None
    """Learning rate of the mergers (None: vision_lr if set, else the optimizer's lr)."""
    llm_lr: float | None = None
    """Learning rate of the language model (None: the optimizer's lr)."""

    RUNTIME_FIELDS = ("attn_backend", "vision_attn_backend", "vision_bucket", "kernels", "moe_float8",
                      "freeze_vision", "freeze_merger", "freeze_llm", "vision_lr", "merger_lr", "llm_lr")

    TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

    @property
    def attn_sliding_window(self) -> None:
        return None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **runtime):
        """The config of an HF folder's config.json (through the family's ``from_hf_dict``)."""
        return cls.from_hf_dict(read_hf_config(hf_dir), **runtime)

    @classmethod
    def hf_token_ids(cls, d: dict) -> dict[str, int]:
        """The visual token ids an HF config.json sets (the rest keep the family's defaults)."""
        return {k: d[k] for k in cls.TOKEN_FIELDS if k in d}

    def _push_into_text(self) -> None:
        want = dict(attn_backend=self.attn_backend, kernels=self.kernels, tie_word_embeddings=self.tie_word_embeddings)
        if self.moe_float8:  # only a MoE text config has the field (titan_mm.registry.resolve_model checks it)
            want["moe_float8"] = True
        if any(getattr(self.text, k) != v for k, v in want.items()):
            object.__setattr__(self, "text", dataclasses.replace(self.text, **want))
        if self.vision_attn_backend not in ("auto", "sdpa", "flex", "varlen"):
            raise ValueError(f"vision_attn_backend={self.vision_attn_backend!r}; choose auto, sdpa, flex or varlen.")
        m2 = self.vision.spatial_merge_size**2
        b = self.vision_bucket
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b % m2:
            raise ValueError(f"vision_bucket={b!r} must be 0 (off) or a positive multiple of spatial_merge_size**2="
                             f"{m2} (padded patches merge into whole tokens), e.g. {1024 * m2}.")


@dataclass(frozen=True)
class Qwen3VLConfig(VLFields):
    text: Qwen3Config = field(default_factory=Qwen3Config)
    """The LLM (dense or MoE Qwen3 text config); its rope is interleaved M-RoPE over ``mrope_section``."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision tower."""
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    """Rotary frequency pairs per axis (t, h, w); sums to head_dim / 2. Interleaved as in HF Qwen3-VL:
    frequency j rotates by h if j % 3 == 1 and j < 3 * sec_h, by w if j % 3 == 2 and j < 3 * sec_w, else by t."""

    def __post_init__(self):
        self._push_into_text()
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        hd = self.text.head_dim
        if sum(self.mrope_section) * 2 != hd:
            raise ValueError(
                f"mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}, but head_dim/2 = {hd // 2}; "
                "fix mrope_section (t, h, w frequency pairs) or head_dim."
            )
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size={self.vision.out_hidden_size} must equal the LLM hidden_size "
                f"{self.text.hidden_size}; fix one of them."
            )
        if self.text.use_sliding_window:
            raise ValueError("Qwen3-VL text models have no sliding window; set use_sliding_window=False.")

    # --- derived ---
    @property
    def is_moe(self) -> bool:
        return self.text.is_moe

    @property
    def model_type(self) -> str:
        return "qwen3_vl_moe" if self.is_moe else "qwen3_vl"

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> "Qwen3VLConfig":
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type={mt!r}, but the qwen3_vl family reads {MODEL_TYPES}; use the "
                "registry entry for that model type (titan_mm.registry.spec_for_hf_dir)."
            )
        if "text_config" not in d or "vision_config" not in d:
            raise ValueError("a Qwen3-VL config.json needs text_config and vision_config; is the file complete?")
        check_hf(d, HF_TYPES)
        with within("text_config"):
            check_hf(d["text_config"], TEXT_HF_TYPES)
        with within("vision_config"):
            check_hf(d["vision_config"], VISION_HF_TYPES)
        td = dict(d["text_config"])
        rope = dict(td.pop("rope_scaling", None) or td.pop("rope_parameters", None) or {})  # transformers' precedence
        td.pop("rope_parameters", None)
        mrope = tuple(rope.pop("mrope_section", (24, 20, 20)))
        if rope.pop("mrope_interleaved", True) is False:
            raise ValueError("mrope_interleaved=false (Qwen2-VL style chunked M-RoPE) is not Qwen3-VL; not supported.")
        if "rope_theta" in rope:
            td["rope_theta"] = rope.pop("rope_theta")
        rope.pop("type", None)
        if rope.get("rope_type", "default") != "default" or len(rope) > 1:
            raise ValueError(f"Qwen3-VL text rope {rope} is not the default M-RoPE; only default is supported.")
        if "num_local_experts" in td and "num_experts" not in td:
            td["num_experts"] = td.pop("num_local_experts")  # transformers 5 writes this alias
        td.pop("num_local_experts", None)
        moe = mt == "qwen3_vl_moe"
        td["model_type"] = "qwen3_moe" if moe else "qwen3"
        if moe:
            td["norm_topk_prob"] = True  # HF Qwen3-VL-MoE's router always renormalizes the top-k weights
        for k in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "pad_token_id",
                  "tie_word_embeddings", "dtype", "torch_dtype"):
            td.pop(k, None)
        with within("text_config"):
            text = Qwen3Config.from_hf_dict(td)
        vd = d["vision_config"]
        vnames = {f.name for f in dataclasses.fields(VisionConfig)}
        vkw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in vd.items() if k in vnames}
        vrope = vd.get("rope_parameters") or {}
        if "rope_theta" in vrope:
            vkw["rope_theta"] = float(vrope["rope_theta"])
        for k in ("patch_size", "temporal_patch_size"):
            if isinstance(vkw.get(k), tuple):
                if len(set(vkw[k])) != 1:
                    raise ValueError(f"vision {k}={vkw[k]}: non-square patches are not supported.")
                vkw[k] = vkw[k][0]
        generic = {"model_type", "rope_parameters", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                   "architectures", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                   "output_attentions", "output_hidden_states", "problem_type", "return_dict", "embed_dim"}
        unknown = sorted(set(vd) - vnames - generic)
        if unknown:
            logger.warning("Qwen3-VL vision_config keys not used by titan_mm (check they do not change the math): %s",
                           unknown)
        top_tie = d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings", False))
        kw = dict(text=text, vision=VisionConfig(**vkw), mrope_section=mrope, tie_word_embeddings=bool(top_tie))
        kw.update(cls.hf_token_ids(d))
        kw.update(runtime)
        return cls(**kw)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        td = self.text.to_hf_dict(dtype=dtype)
        for k in ("architectures", "rope_scaling", "rope_theta", "bos_token_id", "eos_token_id",
                  "max_window_layers", "use_sliding_window", "sliding_window", "torch_dtype", "layer_types"):
            td.pop(k, None)
        td["model_type"] = "qwen3_vl_moe_text" if self.is_moe else "qwen3_vl_text"
        td["rope_parameters"] = {"rope_type": "default", "rope_theta": self.text.rope_theta,
                                 "mrope_section": list(self.mrope_section), "mrope_interleaved": True}
        if self.is_moe:
            td.pop("norm_topk_prob", None)
        vd = {f.name: getattr(self.vision, f.name) for f in dataclasses.fields(self.vision)}
        vd["deepstack_visual_indexes"] = list(self.vision.deepstack_visual_indexes)
        vd.pop("layer_norm_eps")
        vd["rope_parameters"] = {"rope_type": "axial", "rope_theta": vd.pop("rope_theta")}
        vd["model_type"] = "qwen3_vl_moe_vision" if self.is_moe else "qwen3_vl_vision"
        out = {
            "architectures": ["Qwen3VLMoeForConditionalGeneration" if self.is_moe else "Qwen3VLForConditionalGeneration"],
            "model_type": self.model_type,
            "text_config": td,
            "vision_config": vd,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if dtype is not None:
            out["dtype"] = dtype
        return out


# config.json key -> JSON type (titan_mm.models.hf_config); the text_config's are Qwen3's
HF_TYPES = hf_types(Qwen3VLConfig, skip=Qwen3VLConfig.RUNTIME_FIELDS + ("text", "vision", "mrope_section"),
                    text_config=dict, vision_config=dict)
VISION_HF_TYPES = hf_types(VisionConfig, patch_size=int | list[int], temporal_patch_size=int | list[int])


def with_overrides(cfg: Qwen3VLConfig, overrides: dict[str, Any]) -> Qwen3VLConfig:
    """A copy of ``cfg`` with fields replaced; ``{"text": {...}, "vision": {...}}`` reach inside (the registry's
    one override rule). Unknown keys raise with the closest valid names."""
    return override(cfg, overrides, "Qwen3-VL config")


# ---- flavors: real HF numbers (Qwen/Qwen3-VL-*/config.json) + tiny debug flavors ----
_TXT = dict(vocab_size=151936, head_dim=128, rope_theta=5_000_000.0, max_position_embeddings=262144,
            rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
_VIS_SMALL = VisionConfig(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                          deepstack_visual_indexes=(5, 11, 17))
_VIS_LARGE = VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                          deepstack_visual_indexes=(8, 16, 24))


def vl_config(text: Qwen3Config, vision: VisionConfig, tie: bool, **kw) -> Qwen3VLConfig:
    """A flavor: the text config, the ViT's (its output width set to the text's) and the head tying."""
    return Qwen3VLConfig(text=text, vision=dataclasses.replace(vision, out_hidden_size=text.hidden_size),
                         tie_word_embeddings=tie, **kw)


def debug_text(moe: bool, vocab: int = 151936) -> Qwen3Config:
    """The debug flavors' decoder: 4 x 128, dense or 8 experts (``moe``)."""
    kw = dict(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, rope_theta=5_000_000.0, max_position_embeddings=32768)
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)
    return Qwen3Config(**kw)


_VIS_DEBUG = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                          num_position_embeddings=256, deepstack_visual_indexes=(0, 1))

FLAVORS: dict[str, Qwen3VLConfig] = {
    "debug": vl_config(debug_text(False), _VIS_DEBUG, tie=True, mrope_section=(6, 5, 5)),
    "2B": vl_config(Qwen3Config(**_TXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8), _VIS_SMALL, tie=True),
    "4B": vl_config(Qwen3Config(**_TXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8), _VIS_SMALL, tie=True),
    "8B": vl_config(Qwen3Config(**_TXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8), _VIS_LARGE, tie=False),
    "32B": vl_config(Qwen3Config(**_TXT, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                           num_attention_heads=64, num_key_value_heads=8), _VIS_LARGE, tie=False),
}

MOE_FLAVORS: dict[str, Qwen3VLConfig] = {
    "debug": vl_config(debug_text(True), _VIS_DEBUG, tie=True, mrope_section=(6, 5, 5)),
    "30B-A3B": vl_config(Qwen3Config(**_TXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                               num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
                   _VIS_LARGE, tie=False),
    "235B-A22B": vl_config(Qwen3Config(**_TXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                 num_attention_heads=64, num_key_value_heads=4, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True),
                     _VIS_LARGE, tie=False),
}
