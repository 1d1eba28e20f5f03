"""Qwen3-Omni-MoE thinker configuration: Qwen3-VL-MoE's (titan_mm/models/qwen3_vl/config.py: the Qwen3-MoE text
config, the Qwen3-VL vision tower with DeepStack, interleaved M-RoPE) plus the Qwen3-Omni audio encoder and the
omni token / position fields.

Read from an HF ``config.json`` with :meth:`Qwen3OmniMoeConfig.from_hf`: a thinker folder (model_type
``qwen3_omni_moe_thinker``: ``text_config`` + ``vision_config`` + ``audio_config``) or a full Omni folder
(``qwen3_omni_moe``, whose ``thinker_config`` is read; the talker and code2wav are not this family's). The text and
vision parts go through Qwen3-VL's reader; :meth:`to_hf_dict` writes a thinker config.json.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import check_hf, hf_types, part_of, within
from titan_mm.models.qwen3.config import HF_TYPES as TEXT_HF_TYPES
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig, debug_text, vl_config

logger = logging.getLogger(__name__)

MODEL_TYPE = "qwen3_omni_moe_thinker"
FULL_MODEL_TYPE = "qwen3_omni_moe"  # thinker + talker + code2wav; only thinker_config is read
_GENERIC = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
            "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward", "id2label",
            "label2id", "is_encoder_decoder", "problem_type"}
_AUDIO_ZERO = ("dropout", "attention_dropout", "activation_dropout")  # must be 0: titan_mm trains without dropout
_THINKER_IGNORED = _GENERIC | {"initializer_range", "text_config", "vision_config", "audio_config", "pad_token_id",
                               "bos_token_id", "eos_token_id", "tie_word_embeddings"}


@dataclass(frozen=True)
class AudioConfig:
    """HF Qwen3OmniMoeAudioEncoderConfig's fields (transformers' defaults = the released encoder)."""

    num_mel_bins: int = 128
    """Log-mel bins per frame (the conv stem's input height)."""
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    activation_function: str = "gelu"
    max_source_positions: int = 1500
    """Rows of the sinusoidal position table (positions restart in every chunk)."""
    n_window: int = 50
    """Chunks of 2 * n_window mel frames go through the conv stem alone. Must be 50: HF counts 13 tokens per full
    chunk whatever n_window is."""
    n_window_infer: int = 800
    """Attention windows span n_window_infer // (2 * n_window) chunks' worth of tokens (HF's cu_seqlens rule)."""
    conv_chunksize: int = 500
    """HF runs the conv stem over this many chunks at a time (memory only; the result is the same)."""
    downsample_hidden_size: int = 480
    """Channels of the three stride-2 Conv2d layers."""
    output_dim: int = 3584
    """proj2's width (= the LLM hidden size)."""
    scale_embedding: bool = False
    """Kept for config.json only: HF computes embed_scale and never applies it, nor do we."""
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.n_window != 50:
            raise ValueError(f"audio n_window={self.n_window}: HF's Qwen3-Omni encoder counts 13 tokens per full "
                             "chunk, which holds for n_window=50 only.")
        if self.n_window_infer < 2 * self.n_window:  # HF's window is n_window_infer // (2 n_window) chunks
            raise ValueError(f"audio n_window_infer={self.n_window_infer} must be at least 2 * n_window.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def conv_freq(self) -> int:
        """Mel bins left after the three stride-2 convs (conv_out reads channels x this)."""
        return (((self.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2


@dataclass(frozen=True)
class Qwen3OmniMoeConfig(Qwen3VLConfig):
    audio: AudioConfig = field(default_factory=AudioConfig)
    """The audio encoder."""
    audio_token_id: int = 151646
    """<|audio_pad|>: one per audio-encoder output token in input_ids."""
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    position_id_per_seconds: float = 25
    """Temporal M-RoPE positions per second of video (t = frame index * second_per_grid * this)."""
    user_token_id: int = 872
    """Written back to config.json (the thinker does not use it)."""
    # ---- training modes (qwen2_5_omni.thinker: apply_freeze, param_groups) ----
    freeze_audio: bool = False
    """Freeze the audio encoder (conv stem, blocks, ln_post, projections)."""
    audio_lr: float | None = None
    """Learning rate of the audio encoder (None: the optimizer's lr)."""

    RUNTIME_FIELDS = Qwen3VLConfig.RUNTIME_FIELDS + ("freeze_audio", "audio_lr")
    TOKEN_FIELDS = Qwen3VLConfig.TOKEN_FIELDS + ("audio_token_id", "audio_start_token_id", "audio_end_token_id")

    def __post_init__(self):
        super().__post_init__()
        if not self.text.is_moe:
            raise ValueError("the Qwen3-Omni thinker's text model is MoE; set text.num_experts > 0.")
        if self.audio.output_dim != self.text.hidden_size:
            raise ValueError(f"audio output_dim={self.audio.output_dim} must equal the LLM hidden_size "
                             f"{self.text.hidden_size}; fix one of them.")
        if self.audio.activation_function != "gelu":
            raise ValueError(f"audio activation_function={self.audio.activation_function!r}; only 'gelu' (exact, "
                             "as the released encoder) is supported.")
        if self.audio.d_model % self.audio.encoder_attention_heads:
            raise ValueError(f"audio d_model={self.audio.d_model} is not divisible by encoder_attention_heads="
                             f"{self.audio.encoder_attention_heads}.")

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> "Qwen3OmniMoeConfig":
        with part_of(d, FULL_MODEL_TYPE, "thinker_config", MODEL_TYPE) as thinker:
            return cls._from_thinker_dict(thinker, **runtime)

    @classmethod
    def _from_thinker_dict(cls, d: dict[str, Any], **runtime) -> "Qwen3OmniMoeConfig":
        mt = d.get("model_type")
        if mt != MODEL_TYPE:
            raise ValueError(f"config.json has model_type={mt!r}, but the qwen3_omni_moe family reads "
                             f"{(MODEL_TYPE, FULL_MODEL_TYPE)}; use the registry entry for that model type "
                             "(titan_mm.registry.spec_for_hf_dir).")
        for k in ("text_config", "vision_config", "audio_config"):
            if k not in d:
                raise ValueError(f"a Qwen3-Omni thinker config.json needs {k}; is the file complete?")
        check_hf(d, HF_TYPES)
        with within("text_config"):  # before its rope is rewritten (the vision config's: in Qwen3-VL's reader)
            check_hf(d["text_config"], TEXT_HF_TYPES)
        with within("audio_config"):
            check_hf(d["audio_config"], AUDIO_HF_TYPES)
        td = dict(d["text_config"])
        rope_key = "rope_scaling" if td.get("rope_scaling") else "rope_parameters"  # transformers' precedence
        rope = dict(td.get(rope_key) or {})
        if rope.pop("interleaved", True) is False:  # the released files spell it twice (interleaved, mrope_interleaved)
            raise ValueError("text rope interleaved=false is not Qwen3-Omni's M-RoPE; not supported.")
        td[rope_key] = rope
        td.pop("model_type", None)
        norm_topk = td.get("norm_topk_prob", True)  # Qwen3-VL's reader forces True; Omni's router follows the config
        vl_dict = {"model_type": "qwen3_vl_moe", "text_config": td, "vision_config": d["vision_config"],
                   "tie_word_embeddings": d.get("tie_word_embeddings", False), **Qwen3VLConfig.hf_token_ids(d)}
        vl = Qwen3VLConfig.from_hf_dict(vl_dict)
        ad = d["audio_config"]
        anames = {f.name for f in dataclasses.fields(AudioConfig)}
        for k in _AUDIO_ZERO:
            if ad.get(k):
                raise ValueError(f"audio_config {k}={ad[k]}: titan_mm trains without dropout; set it to 0.")
        unknown = sorted(set(ad) - anames - _GENERIC - set(_AUDIO_ZERO))
        if unknown:
            raise ValueError(f"audio_config keys not known to titan_mm (they may change the math): {unknown}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)} - _THINKER_IGNORED)
        if unknown:
            logger.warning("Qwen3-Omni thinker config keys not used by titan_mm: %s", unknown)
        kw = {f.name: getattr(vl, f.name) for f in dataclasses.fields(Qwen3VLConfig)}
        kw["text"] = dataclasses.replace(vl.text, norm_topk_prob=bool(norm_topk))
        kw["audio"] = AudioConfig(**{k: v for k, v in ad.items() if k in anames})
        kw.update(cls.hf_token_ids(d))
        for k in ("position_id_per_seconds", "user_token_id"):
            if k in d:
                kw[k] = d[k]
        kw.update(runtime)
        return cls(**kw)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        out = super().to_hf_dict(dtype)
        td, vd = out["text_config"], out["vision_config"]
        td["model_type"] = "qwen3_omni_moe_text"
        td["norm_topk_prob"] = self.text.norm_topk_prob
        td.update(bos_token_id=self.text.bos_token_id, eos_token_id=self.text.eos_token_id)  # Omni's text keeps them
        td.pop("tie_word_embeddings", None)
        vd["model_type"] = "qwen3_omni_moe_vision_encoder"
        ad = dataclasses.asdict(self.audio)
        ad["model_type"] = "qwen3_omni_moe_audio_encoder"
        out.update(architectures=["Qwen3OmniMoeThinkerForConditionalGeneration"], model_type=MODEL_TYPE,
                   audio_config=ad, audio_token_id=self.audio_token_id,
                   audio_start_token_id=self.audio_start_token_id, audio_end_token_id=self.audio_end_token_id,
                   position_id_per_seconds=self.position_id_per_seconds, user_token_id=self.user_token_id)
        return out


# config.json key -> JSON type (titan_mm.models.hf_config) of the thinker's keys and its audio_config's
HF_TYPES = hf_types(Qwen3OmniMoeConfig, skip=Qwen3OmniMoeConfig.RUNTIME_FIELDS + ("text", "vision", "audio",
                                                                                  "mrope_section"),
                    text_config=dict, vision_config=dict, audio_config=dict)
AUDIO_HF_TYPES = hf_types(AudioConfig, **{k: float for k in _AUDIO_ZERO})


# ---- flavors ----
# 30B-A3B: the numbers of Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker_config (text: Qwen3-30B-A3B's decoder with a
# 152064 vocab and 65536 positions; vision: Qwen3-VL's large tower without its own out width; audio: 32 x 1280).
_TXT_30B = Qwen3Config(vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1_000_000.0,
                       max_position_embeddings=65536, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
                       moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645)
_VIS_30B = VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                        deepstack_visual_indexes=(8, 16, 24))
_OMNI_TOKENS = dict(audio_token_id=151675, audio_start_token_id=151669, audio_end_token_id=151670,
                    position_id_per_seconds=13)


def _omni(vl: Qwen3VLConfig, audio: AudioConfig, **kw) -> Qwen3OmniMoeConfig:
    base = {f.name: getattr(vl, f.name) for f in dataclasses.fields(Qwen3VLConfig)}
    return Qwen3OmniMoeConfig(**base, audio=dataclasses.replace(audio, output_dim=vl.text.hidden_size), **kw)


FLAVORS: dict[str, Qwen3OmniMoeConfig] = {
    # debug: Qwen3-VL-MoE's debug model (real vocab) plus a 2-layer, 64-wide audio encoder on 128 mel bins
    "debug": _omni(Qwen3VLConfig(text=debug_text(True), vision=dataclasses.replace(
        VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
                     num_position_embeddings=256, deepstack_visual_indexes=(0, 1)), out_hidden_size=128),
        tie_word_embeddings=True, mrope_section=(6, 5, 5)),
        AudioConfig(encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, d_model=64,
                    downsample_hidden_size=16)),
    "30B-A3B": _omni(vl_config(_TXT_30B, _VIS_30B, tie=False, mrope_section=(24, 20, 20)),
                     AudioConfig(output_dim=2048), **_OMNI_TOKENS),
}
