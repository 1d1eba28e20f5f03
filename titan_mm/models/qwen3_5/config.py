"""Qwen3.5 / Qwen3.5-MoE configuration: the hybrid text decoder (Gated DeltaNet and gated full attention, dense or
MoE with a shared expert), the Qwen3-VL vision tower without DeepStack, and the VL fields.

Read from an HF ``config.json`` (``Qwen3_5Config`` / ``Qwen3_5MoeConfig``: ``text_config`` + ``vision_config``) with
:meth:`Qwen3_5Config.from_hf`, or pick a flavor from :data:`FLAVORS` / :data:`MOE_FLAVORS`. One config class covers
both: ``text.num_experts == 0`` is dense (model_type "qwen3_5"), ``> 0`` MoE ("qwen3_5_moe"). The text fields keep
HF's names; runtime fields are titan_mm's and never exported.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import PositiveInt, check_hf, hf_types, within
from titan_mm.models.qwen3_vl.config import VISION_HF_TYPES, VisionConfig, VLFields

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LAYER_KINDS = ("linear_attention", "full_attention")

# text_config keys that do not change the training math (read and dropped on purpose)
_IGNORED_TEXT_KEYS = {
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "attention_dropout",
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "full_attention_interval",
    "attn_output_gate", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "_name_or_path",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "norm_topk_prob", "mlp_only_layers",
    "decoder_sparse_step", "layer_types", "tie_word_embeddings", "pad_token_id",
}


@dataclass(frozen=True)
class Qwen3_5TextConfig:
    # --- math (HF text_config) ---
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    """Dense MLP width (dense models; 0 for MoE models)."""
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    """Query heads of the full-attention layers."""
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    """Share of each full-attention head that is rotated (the first head_dim * factor channels)."""
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    """Interleaved M-RoPE frequency pairs per axis (t, h, w), as Qwen3-VL's; sums to the rotated channels / 2."""
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] | None = None
    """Per layer "linear_attention" (Gated DeltaNet) or "full_attention"; None: every 4th layer is full (HF)."""
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # --- MoE (num_experts == 0: dense); every layer of a MoE model is MoE, with a gated shared expert ---
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    """HF adds the aux loss to its loss only when this is true; titan_mm uses ``moe_aux_loss``."""
    # --- runtime (titan_mm only; never exported) ---
    attn_backend: str = "sdpa"
    """Full-attention layers: "sdpa" | "flex" | "varlen" (titan_mm/nn/attention.py)."""
    linear_attn_backend: str = "auto"
    """Gated DeltaNet layers: "auto" (fla-core's Triton kernel on CUDA, the PyTorch reference elsewhere), "fla" or
    "torch" (titan_mm/nn/linear_attention.py)."""
    loss_chunk_size: int = 2048
    """Tokens per cross-entropy chunk (as Qwen3Config.loss_chunk_size)."""
    z_loss_weight: float = 0.0
    kernels: bool | str = False
    """titan_mm.kernels ops (as Qwen3Config.kernels)."""
    moe_aux_loss: bool = True
    """Return router_aux_loss_coef * load-balancing loss in ModelOutput.aux_loss (MoE)."""
    moe_float8: bool = False
    """The routed experts' grouped GEMMs in float8 (as Qwen3Config.moe_float8)."""

    RUNTIME_FIELDS = ("attn_backend", "linear_attn_backend", "loss_chunk_size", "z_loss_weight", "kernels",
                      "moe_aux_loss", "moe_float8")

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen3.5 hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.is_moe:  # every layer is MoE: no dense MLP width (HF's MoE config has none)
            object.__setattr__(self, "intermediate_size", 0)
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"layer_types has {bad}; Qwen3.5 layers are {LAYER_KINDS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(f"mrope_section={self.mrope_section} must sum to half the rotated channels "
                             f"(head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} = "
                             f"{self.rotary_dim}); fix one of them")
        if self.attn_backend not in ("sdpa", "flex", "varlen"):
            raise ValueError(f"attn_backend={self.attn_backend!r}; choose 'sdpa', 'flex' or 'varlen'")
        if self.linear_attn_backend not in ("auto", "fla", "torch"):
            raise ValueError(f"linear_attn_backend={self.linear_attn_backend!r}; choose 'auto', 'fla' or 'torch'")

    # --- derived ---
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_sliding_window(self) -> None:
        return None

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe

    @property
    def n_linear(self) -> int:
        return sum(self.is_linear(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], moe: bool) -> Qwen3_5TextConfig:
        check_hf(d, TEXT_HF_TYPES)
        d = dict(d)
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})  # transformers' precedence
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"Qwen3.5 text rope {rope} is not the default M-RoPE; only rope_type 'default' is "
                             "supported")
        if rope.get("mrope_interleaved", True) is False:
            raise ValueError("mrope_interleaved=false (Qwen2-VL style chunked M-RoPE) is not Qwen3.5's; not supported")
        if d.get("attn_output_gate", True) is False:
            raise ValueError("attn_output_gate=false: Qwen3.5's full attention is gated; this config is not Qwen3.5")
        if moe and (d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1):
            raise ValueError("Qwen3.5-MoE has an MoE block in every layer; mlp_only_layers / decoder_sparse_step "
                             "other than [] / 1 are not supported")
        kw: dict[str, Any] = {
            "rope_theta": float(rope.get("rope_theta", d.get("rope_theta", 10_000.0))),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            "mrope_section": tuple(rope.get("mrope_section", (11, 11, 10))),
        }
        names = {f.name for f in dataclasses.fields(cls)} - set(cls.RUNTIME_FIELDS)
        for k, v in d.items():
            if k in names and k not in kw and k != "layer_types":
                kw[k] = v
        n = d["num_hidden_layers"]
        if d.get("layer_types") is not None:
            kw["layer_types"] = tuple(d["layer_types"])
        else:
            every = int(d.get("full_attention_interval", 4))
            kw["layer_types"] = tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(n))
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = d["num_attention_heads"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        if moe:
            if not d.get("num_experts"):
                raise ValueError("config.json says qwen3_5_moe but text_config.num_experts is missing or 0")
        else:
            kw["num_experts"] = 0
        moe_keys = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "router_aux_loss_coef", "output_router_logits"}
        unknown = sorted(set(d) - names - _IGNORED_TEXT_KEYS - moe_keys)
        if unknown:
            logger.warning("Qwen3.5 text_config keys not used by titan_mm (check they do not change the math): %s",
                           unknown)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        skip = set(self.RUNTIME_FIELDS) | {"rope_theta", "partial_rotary_factor", "mrope_section", "layer_types"}
        moe_keys = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "router_aux_loss_coef", "output_router_logits"}
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in skip and (self.is_moe or f.name not in moe_keys)}
        d["model_type"] = self.model_type
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor,
                                "mrope_section": list(self.mrope_section), "mrope_interleaved": True}
        if self.is_moe:
            d.pop("intermediate_size")  # HF Qwen3.5-MoE has no dense MLP width
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d


# text_config key -> JSON type (titan_mm.models.hf_config): the fields, and the keys HF writes that are not fields
TEXT_HF_TYPES = hf_types(Qwen3_5TextConfig, skip=Qwen3_5TextConfig.RUNTIME_FIELDS,
                         num_key_value_heads=PositiveInt | None,
                         full_attention_interval=int, attn_output_gate=bool, mlp_only_layers=list[int] | None,
                         decoder_sparse_step=int, norm_topk_prob=bool, mtp_num_hidden_layers=int,
                         mtp_use_dedicated_embeddings=bool, mamba_ssm_dtype=str)

# HF vision_config keys; Qwen3.5's tower is Qwen3-VL's without DeepStack mergers
_VISION_HF_KEYS = ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
                   "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings",
                   "initializer_range")


@dataclass(frozen=True)
class Qwen3_5Config(VLFields):
    text: Qwen3_5TextConfig = field(default_factory=Qwen3_5TextConfig)
    """The hybrid decoder (dense or MoE)."""
    vision: VisionConfig = field(default_factory=lambda: VisionConfig(deepstack_visual_indexes=()))
    """The vision tower: Qwen3-VL's (titan_mm/models/qwen3_vl/vision.py) without DeepStack."""
    image_token_id: int = 248056  # Qwen3.5's tokenizer
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    def __post_init__(self):
        self._push_into_text()
        if self.vision.deepstack_visual_indexes:
            raise ValueError(f"vision deepstack_visual_indexes={self.vision.deepstack_visual_indexes}: Qwen3.5's "
                             "vision tower has no DeepStack mergers; set it to ()")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"vision out_hidden_size={self.vision.out_hidden_size} must equal the text hidden_size "
                             f"{self.text.hidden_size}; fix one of them")

    @property
    def is_moe(self) -> bool:
        return self.text.is_moe

    @property
    def model_type(self) -> str:
        return "qwen3_5_moe" if self.is_moe else "qwen3_5"

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> Qwen3_5Config:
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            near = difflib.get_close_matches(str(mt), MODEL_TYPES, n=1)
            raise ValueError(f"config.json has model_type={mt!r}, but the qwen3_5 family reads {MODEL_TYPES}"
                             f"{f' (did you mean {near[0]!r}?)' if near else ''}; use the registry entry for that "
                             "model type (titan_mm.registry.spec_for_hf_dir)")
        if "text_config" not in d or "vision_config" not in d:
            raise ValueError("a Qwen3.5 config.json needs text_config and vision_config (text-only qwen3_5_text "
                             "checkpoints are not read); is the file complete?")
        check_hf(d, HF_TYPES)
        with within("text_config"):
            text = Qwen3_5TextConfig.from_hf_dict(d["text_config"], moe=mt == "qwen3_5_moe")
        vd = d["vision_config"]
        with within("vision_config"):
            check_hf(vd, VISION_HF_TYPES)
        if vd.get("deepstack_visual_indexes"):
            raise ValueError(f"vision_config.deepstack_visual_indexes={vd['deepstack_visual_indexes']}: Qwen3.5 has "
                             "no DeepStack; is this a Qwen3-VL config.json?")
        vkw = {k: vd[k] for k in _VISION_HF_KEYS if k in vd}
        for k in ("patch_size", "temporal_patch_size"):
            if isinstance(vkw.get(k), (list, tuple)):
                if len(set(vkw[k])) != 1:
                    raise ValueError(f"vision {k}={vkw[k]}: non-square patches are not supported")
                vkw[k] = vkw[k][0]
        vrope = vd.get("rope_parameters") or {}
        if "rope_theta" in vrope:
            vkw["rope_theta"] = float(vrope["rope_theta"])
        generic = {"model_type", "rope_parameters", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                   "architectures", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                   "output_attentions", "output_hidden_states", "problem_type", "return_dict",
                   "deepstack_visual_indexes"}
        unknown = sorted(set(vd) - set(_VISION_HF_KEYS) - generic)
        if unknown:
            logger.warning("Qwen3.5 vision_config keys not used by titan_mm (check they do not change the math): %s",
                           unknown)
        tie = d.get("tie_word_embeddings", d["text_config"].get("tie_word_embeddings", False))
        kw: dict[str, Any] = dict(text=text, vision=VisionConfig(**vkw, deepstack_visual_indexes=()),
                                  tie_word_embeddings=bool(tie))
        kw.update(cls.hf_token_ids(d))
        kw.update(runtime)
        return cls(**kw)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        td = self.text.to_hf_dict()
        vd = {k: getattr(self.vision, k) for k in _VISION_HF_KEYS}
        vd["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.vision.rope_theta}
        vd["model_type"] = "qwen3_5_moe_vision" if self.is_moe else "qwen3_5_vision"
        out = {
            "architectures": [f"Qwen3_5{'Moe' if self.is_moe else ''}ForConditionalGeneration"],
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
            td["dtype"] = dtype
        return out


# config.json key -> JSON type at the top (the nested configs' are above)
HF_TYPES = hf_types(Qwen3_5Config, skip=Qwen3_5Config.RUNTIME_FIELDS + ("text", "vision"), text_config=dict,
                    vision_config=dict)


# ---- flavors ----
# 35B-A3B: the numbers of the released Qwen3.5-35B-A3B / Qwen3.6-35B-A3B config.json. 9B: transformers' defaults,
# which its docs call "Qwen3.5-9B style" (the vision tower as 35B-A3B's). debug: tiny, with the real Qwen3 vocab and
# Qwen3-VL's special-token ids, so it trains on a CPU with the built-in Qwen3 tokenizer.
_TXT = dict(vocab_size=248320, head_dim=256, rope_theta=10_000_000.0, max_position_embeddings=262144,
            partial_rotary_factor=0.25, mrope_section=(11, 11, 10), linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, eos_token_id=248044, bos_token_id=248044)
_VIS = VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=())
_DEBUG_TOK = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                  vision_end_token_id=151653)
_VIS_DEBUG = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                          num_position_embeddings=256, deepstack_visual_indexes=(), out_hidden_size=128)


def _debug_text(moe: bool) -> Qwen3_5TextConfig:
    kw = dict(vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, mrope_section=(2, 1, 1),
              rope_theta=5_000_000.0, max_position_embeddings=32768, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              bos_token_id=151643, eos_token_id=151645)
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=96)
    return Qwen3_5TextConfig(**kw)


def _cfg(text: Qwen3_5TextConfig, vision: VisionConfig, tie: bool, **kw) -> Qwen3_5Config:
    return Qwen3_5Config(text=text, vision=dataclasses.replace(vision, out_hidden_size=text.hidden_size),
                         tie_word_embeddings=tie, **kw)


FLAVORS: dict[str, Qwen3_5Config] = {
    "debug": _cfg(_debug_text(False), _VIS_DEBUG, tie=True, **_DEBUG_TOK),
    "9B": _cfg(Qwen3_5TextConfig(**_TXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                 num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
                                 linear_num_value_heads=32), _VIS, tie=False),
}

MOE_FLAVORS: dict[str, Qwen3_5Config] = {
    "debug": _cfg(_debug_text(True), _VIS_DEBUG, tie=False, **_DEBUG_TOK),
    "35B-A3B": _cfg(Qwen3_5TextConfig(**_TXT, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                      num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                                      num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                      shared_expert_intermediate_size=512), _VIS, tie=False),
}
