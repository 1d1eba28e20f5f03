"""Qwen2 / Qwen2.5 configuration: a frozen dataclass with HF's Qwen2 field names, read from a config.json.

The Qwen2 decoder is the Qwen3 decoder without qk-norm, with a bias on the q / k / v projections (none on
o_proj) and head_dim = hidden_size // num_attention_heads. So the family's model is Qwen3Model, built from
the Qwen3Config that :meth:`Qwen2Config.decoder` derives; nothing of the model is re-implemented here.

Sliding windows follow HF: with ``use_sliding_window`` the layers ``i >= max_window_layers`` (or the
"sliding_attention" entries of ``layer_types``) attend to the last ``sliding_window`` keys; without it every
layer attends fully (HF then sets sliding_window to None; we keep the number, which is what config.json says).
Runtime options (``attn_backend``, ``kernels``, ``loss_chunk_size``, ``z_loss_weight``) are titan_mm-only and
never exported to config.json.
"""

from __future__ import annotations

import dataclasses
import difflib
import os  # noqa: F401  (type hints)
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import PositiveInt, check_hf, hf_types
from titan_mm.models.hf_io import read_hf_config
from titan_mm.models.qwen3.config import Qwen3Config

MODEL_TYPE = "qwen2"

# HF keys that do not change the training math (read and dropped on purpose).
_IGNORED_HF_KEYS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "pad_token_id",
    "attention_dropout", "model_type", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "use_return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class",
}
# keys that HF Qwen2 reads in another form (rope) or derives (head_dim, checked in from_hf_dict)
_DERIVED_HF_KEYS = {"rope_parameters", "head_dim"}
# keys that HF's Qwen2ForCausalLM ignores; any other value than this one means another model (Qwen2-VL's
# M-RoPE text model, a decoder without q/k/v bias), which this family must not load silently
_FIXED_HF_KEYS = {"use_mrope": False, "attention_bias": True}


@dataclass(frozen=True)
class Qwen2Config:
    # --- math (from / to HF config.json; defaults are transformers' Qwen2Config defaults) ---
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    """HF rope dict without rope_theta ({"rope_type": "yarn", "factor": 4.0, ...}); None = default RoPE."""
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    """Per-layer "full_attention" / "sliding_attention"; None = derived as HF does (i >= max_window_layers)."""
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # --- runtime (titan_mm only; never exported) ---
    attn_backend: str = "sdpa"
    """"sdpa" | "flex" | "varlen" (see titan_mm/nn/attention.py)."""
    kernels: bool | str = False
    """titan_mm.kernels ops (True / "all", or a per-op spec such as "all,-linear_cross_entropy"); False: the
    PyTorch references of titan_mm.nn."""
    loss_chunk_size: int = 2048
    """Tokens per chunk of the cross-entropy, fused kernel or PyTorch: a [chunk, vocab] logits buffer, and the head's
    weight gradient read and written once per chunk (1.2 GB in bf16 at 151,936 x 4096), so small chunks save memory
    and cost time."""
    z_loss_weight: float = 0.0

    RUNTIME_FIELDS = ("attn_backend", "kernels", "loss_chunk_size", "z_loss_weight")

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen2 hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be a multiple of "
                             f"num_attention_heads={self.num_attention_heads} (Qwen2 head_dim = hidden // heads)")
        self.decoder()  # the decoder's own checks (heads vs kv heads, backend, layer_types length)

    # --- derived ---
    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def decoder(self) -> Qwen3Config:
        """The Qwen3 decoder config this model is built from: no qk-norm, q/k/v bias, no o_proj bias."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Qwen3Config(**kw, head_dim=self.head_dim, attention_bias=True, attention_output_bias=False,
                           qk_norm=False, num_experts=0)

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i (None = full causal), following HF's rules."""
        return self.decoder().layer_window(i)

    @property
    def attn_sliding_window(self) -> int | None:
        """The window to pass to build_attn_meta (None when no layer uses one)."""
        return self.decoder().attn_sliding_window

    def replace(self, **kw) -> Qwen2Config:
        return dataclasses.replace(self, **kw)

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> Qwen2Config:
        """Read an HF Qwen2 config.json dict. Keys that would change the math but that this family does not
        implement raise (with the closest known names); missing keys take transformers' defaults."""
        mt = d.get("model_type")
        if mt != MODEL_TYPE:
            raise ValueError(f"config.json has model_type={mt!r}, but the qwen2 family reads {MODEL_TYPE!r}; "
                             "use the registry entry for that model type (titan_mm.registry.spec_for_hf_dir)")
        check_hf(d, HF_TYPES)
        names = {f.name for f in dataclasses.fields(cls)} - set(cls.RUNTIME_FIELDS)
        known = names | _IGNORED_HF_KEYS | _DERIVED_HF_KEYS | set(_FIXED_HF_KEYS)
        unknown = sorted(set(d) - known)
        if unknown:
            hints = {k: difflib.get_close_matches(k, sorted(known), n=2) for k in unknown}
            raise ValueError(f"Qwen2 config.json has keys titan_mm does not implement (they may change the math): "
                             f"{hints} (key: closest known names)")
        for k, want in _FIXED_HF_KEYS.items():
            if k in d and d[k] != want:
                raise ValueError(f"Qwen2 config.json has {k}={d[k]!r}; the qwen2 family (HF Qwen2ForCausalLM) "
                                 f"implements only {k}={want!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in names}
        full = {**defaults, **{k: v for k, v in d.items() if k not in _FIXED_HF_KEYS}}
        head_dim = full["hidden_size"] // full["num_attention_heads"]
        if full.pop("head_dim", None) not in (None, head_dim):
            raise ValueError(f"Qwen2 config.json has head_dim={d['head_dim']}, but Qwen2's head_dim is "
                             f"hidden_size // num_attention_heads = {head_dim}")
        # rope_parameters / rope_scaling, layer_types compaction, kv-heads default, eos lists: read as the
        # Qwen3 decoder reads them (its dense rules for windows and layer_types are Qwen2's)
        dec = Qwen3Config.from_hf_dict({**full, "model_type": "qwen3"})
        kw = {k: getattr(dec, k) for k in names}
        kw.update(runtime)  # runtime options (attn_backend, ...) and explicit overrides win
        return cls(**kw)

    @classmethod
    def from_hf(cls, hf_dir: str | os.PathLike, **runtime) -> Qwen2Config:
        return cls.from_hf_dict(read_hf_config(hf_dir), **runtime)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """config.json for transformers' Qwen2ForCausalLM (the decoder's export, with Qwen2's keys only)."""
        keep = ({f.name for f in dataclasses.fields(self)} - set(self.RUNTIME_FIELDS)) | _IGNORED_HF_KEYS | {
            "rope_parameters"}
        d = {k: v for k, v in self.decoder().to_hf_dict(dtype=dtype).items() if k in keep}
        d.update(architectures=["Qwen2ForCausalLM"], model_type=MODEL_TYPE)
        return d


# config.json key -> JSON type (titan_mm.models.hf_config): the fields, and the keys HF may write as null or derives
HF_TYPES = hf_types(Qwen2Config, skip=Qwen2Config.RUNTIME_FIELDS, head_dim=PositiveInt | None,
                    num_key_value_heads=PositiveInt | None, use_mrope=bool, attention_bias=bool)


def as_decoder(cfg: Qwen2Config | Qwen3Config) -> Qwen3Config:
    """The decoder config of a Qwen2Config; a built model's ``cfg`` (already the decoder) as it is."""
    return cfg.decoder() if isinstance(cfg, Qwen2Config) else cfg


# ---- flavors: Qwen/Qwen2.5-* config.json numbers (base models) + a tiny debug flavor ----

_BASE = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
             use_sliding_window=False)

FLAVORS: dict[str, Qwen2Config] = {
    # the real vocabulary, so that the debug config trains with the real tokenizer on built-in text
    "debug": Qwen2Config(**_BASE, vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=4096, sliding_window=4096, max_window_layers=2),
    "0.5B": Qwen2Config(**_BASE, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                        max_position_embeddings=32768, sliding_window=32768, max_window_layers=24),
    "1.5B": Qwen2Config(**_BASE, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                        max_position_embeddings=131072, sliding_window=131072, max_window_layers=21),
    "3B": Qwen2Config(**_BASE, vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                      num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=32768, sliding_window=32768, max_window_layers=36),
    # 7B and larger use the padded 152064-token embedding
    "7B": Qwen2Config(**_BASE, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                      max_position_embeddings=131072, sliding_window=131072, max_window_layers=28),
}
