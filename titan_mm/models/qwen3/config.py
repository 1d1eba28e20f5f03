"""Qwen3 / Qwen3-MoE configuration: a frozen dataclass read straight from an HF config.json.

One config class covers both: ``num_experts == 0`` is dense Qwen3 (HF model_type "qwen3"),
``num_experts > 0`` is Qwen3-MoE ("qwen3_moe"). Field names follow HF so config.json maps 1:1.
Runtime options (``attn_backend``, ``loss_chunk_size``, ``z_loss_weight``, ``kernels``, ``moe_aux_loss``)
are titan_mm-only and never exported to config.json.
"""

from __future__ import annotations

import dataclasses
import logging
import os  # noqa: F401  (type hints)
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import PositiveInt, check_hf, hf_types
from titan_mm.models.hf_io import read_hf_config

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3", "qwen3_moe")

# HF keys that do not change the training math (read and dropped on purpose).
_IGNORED_HF_KEYS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "attention_dropout", "initializer_range", "output_router_logits",
    "model_type", "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "layer_types",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "tokenizer_class", "quantization_config", "use_return_dict", "partial_rotary_factor",
    "titan_mm_objective",  # a diffusion LM's training objective (titan_mm.train.objective): same weights and shapes
}


@dataclass(frozen=True)
class Qwen3Config:
    # --- math (from / to HF config.json) ---
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    """HF rope dict without rope_theta ({"rope_type": "yarn", "factor": 4.0, ...}); None = default RoPE."""
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    """Per-layer "full_attention" / "sliding_attention" (dense Qwen3); None = derived as HF does."""
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    # --- MoE (num_experts == 0: dense) ---
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    """HF adds the aux loss to its training loss only when this is true; titan_mm uses ``moe_aux_loss``."""
    # --- runtime (titan_mm only; never exported) ---
    attn_backend: str = "sdpa"
    """"sdpa" | "flex" | "varlen" (see titan_mm/nn/attention.py)."""
    loss_chunk_size: int = 2048
    """Tokens per chunk of the cross-entropy, fused kernel or PyTorch: a [chunk, vocab] logits buffer, and the head's
    weight gradient read and written once per chunk (1.2 GB in bf16 at 151,936 x 4096), so small chunks save memory
    and cost time."""
    z_loss_weight: float = 0.0
    kernels: bool = False
    """Use titan_mm.kernels ops (Triton on CUDA SM>=80, references elsewhere): RMSNorm, residual add + RMSNorm,
    SwiGLU, RoPE, fused linear cross-entropy. Off: the PyTorch ops in titan_mm.nn. Also a per-op spec
    such as "all,-linear_cross_entropy" (titan_mm.kernels.resolve_ops)."""
    moe_aux_loss: bool = True
    """Return router_aux_loss_coef * load-balancing loss in ModelOutput.aux_loss (MoE)."""
    moe_float8: bool = False
    """The MoE experts' grouped GEMMs in float8 (torchao, rowwise scales; CUDA SM>=90, bf16): the trainer's
    float8.moe_experts (titan_mm/nn/moe.py)."""
    # --- decoder variants of other families built on this decoder (never in a Qwen3 config.json) ---
    qk_norm: bool = True
    """Per-head RMSNorm on q and k (Qwen3); False for decoders without it (Qwen2)."""
    attention_output_bias: bool | None = None
    """Bias on the attention output projection; None: as ``attention_bias`` (Qwen3). Qwen2: False."""

    RUNTIME_FIELDS = ("attn_backend", "loss_chunk_size", "z_loss_weight", "kernels", "moe_aux_loss", "moe_float8",
                      "qk_norm", "attention_output_bias")

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen3 hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.loss_chunk_size < 1:
            raise ValueError(f"loss_chunk_size={self.loss_chunk_size}: tokens per cross-entropy chunk must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.attn_backend not in ("sdpa", "flex", "varlen"):
            raise ValueError(f"attn_backend={self.attn_backend!r}; choose 'sdpa', 'flex' or 'varlen'")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")

    # --- derived ---
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    def is_moe_layer(self, i: int) -> bool:
        """HF rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i (None = full causal), following HF's rules."""
        if not self.use_sliding_window or self.sliding_window is None:
            return None
        if self.is_moe:  # HF Qwen3-MoE applies the window to every layer
            return self.sliding_window
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window if i >= self.max_window_layers else None

    @property
    def attn_sliding_window(self) -> int | None:
        """The window to pass to build_attn_meta (None when no layer uses one)."""
        return next((w for i in range(self.num_hidden_layers) if (w := self.layer_window(i)) is not None), None)

    def replace(self, **kw) -> Qwen3Config:
        return dataclasses.replace(self, **kw)

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> Qwen3Config:
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type={mt!r}, but the qwen3 family reads {MODEL_TYPES}; "
                "use the registry entry for that model type (titan_mm.registry.get_model_spec)"
            )
        if "text_config" in d:
            raise ValueError("config.json has a text_config (a VL model?); load it with the qwen3_vl family")
        check_hf(d, HF_TYPES)
        d = dict(d)
        if "num_local_experts" in d and "num_experts" not in d:  # transformers >= 5 spelling
            d["num_experts"] = d.pop("num_local_experts")
        # as transformers: a legacy rope_scaling dict replaces rope_parameters; its rope_theta, else the top one
        rp = d.get("rope_scaling") or d.get("rope_parameters") or {}
        theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"} or None
        if scaling is not None:
            if "type" in scaling and "rope_type" not in scaling:
                scaling["rope_type"] = scaling.pop("type")
            if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
                scaling = None
        kw: dict[str, Any] = {"rope_theta": theta, "rope_scaling": scaling}
        names = {f.name for f in dataclasses.fields(cls)} - set(cls.RUNTIME_FIELDS)
        for k, v in d.items():
            if k in names and k not in kw:
                kw[k] = v
        kw["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = d["num_attention_heads"]
        if d.get("layer_types") is not None and mt == "qwen3":
            lt = tuple(d["layer_types"])
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
            derived = tuple(
                "sliding_attention" if window is not None and i >= d.get("max_window_layers", 28) else "full_attention"
                for i in range(d["num_hidden_layers"])
            )
            kw["layer_types"] = None if lt == derived else lt  # keep only what HF would not derive itself
        else:
            kw.pop("layer_types", None)
        kw["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
        if isinstance(kw.get("eos_token_id"), list):  # HF's several EOS ids: the first is the model's
            kw["eos_token_id"] = kw["eos_token_id"][0] if kw["eos_token_id"] else None
        if mt == "qwen3":
            kw["num_experts"] = 0
        elif not d.get("num_experts"):
            raise ValueError("config.json says qwen3_moe but num_experts is missing or 0")
        unknown = sorted(set(d) - names - _IGNORED_HF_KEYS)
        if unknown:
            logger.warning("Qwen3 config.json keys not used by titan_mm (check they do not change the math): %s", unknown)
        if d.get("attention_dropout"):
            logger.warning("attention_dropout=%s in config.json is ignored (titan_mm trains without dropout)",
                           d["attention_dropout"])
        kw.update(runtime)  # runtime options (attn_backend, ...) and explicit overrides win
        return cls(**kw)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **runtime) -> Qwen3Config:
        return cls.from_hf_dict(read_hf_config(hf_dir), **runtime)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
        }
        skip = set(self.RUNTIME_FIELDS) | {"rope_scaling", "layer_types", "mlp_only_layers"}
        moe_keys = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                    "decoder_sparse_step", "router_aux_loss_coef", "output_router_logits"}
        for f in dataclasses.fields(self):
            if f.name in skip or (not self.is_moe and f.name in moe_keys):
                continue
            d[f.name] = getattr(self, f.name)
        if self.is_moe:
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        elif self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d["rope_parameters"] = rope
        d["rope_theta"] = self.rope_theta
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        if dtype is not None:
            d["torch_dtype"] = dtype
            d["dtype"] = dtype
        return d


# config.json key -> JSON type (titan_mm.models.hf_config): the fields, and the keys HF may write as null or a list
HF_TYPES = hf_types(Qwen3Config, skip=Qwen3Config.RUNTIME_FIELDS, head_dim=PositiveInt | None,
                    num_key_value_heads=PositiveInt | None, mlp_only_layers=tuple[int, ...] | None,
                    num_local_experts=int)


# ---- flavors: real HF numbers (Qwen/Qwen3-*) + tiny debug flavors ----

_BASE = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6)

FLAVORS: dict[str, Qwen3Config] = {
    "debug": Qwen3Config(
        vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    "debug_moe": Qwen3Config(
        vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, max_position_embeddings=4096,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, router_aux_loss_coef=0.001,
    ),
    "0.6B": Qwen3Config(**_BASE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True, max_window_layers=28),
    "1.7B": Qwen3Config(**_BASE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True, max_window_layers=28),
    "4B": Qwen3Config(**_BASE, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, max_window_layers=36),
    "8B": Qwen3Config(**_BASE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=36),
    "14B": Qwen3Config(**_BASE, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=40),
    "32B": Qwen3Config(**_BASE, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                       num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=64),
    "30B-A3B": Qwen3Config(**_BASE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                           max_window_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=0.001),
    "235B-A22B": Qwen3Config(**_BASE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                             num_attention_heads=64, num_key_value_heads=4, tie_word_embeddings=False,
                             max_window_layers=94, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=1536, norm_topk_prob=True, decoder_sparse_step=1,
                             router_aux_loss_coef=0.001),
}
