"""Qwen2.5-Omni thinker configuration: Qwen2.5-VL's (text = the Qwen2 decoder, the window-attention ViT, chunked
M-RoPE; titan_mm/models/qwen2_5_vl/config.py) plus the Whisper-style audio encoder and the TMRoPE fields.

Read from an HF ``config.json`` with :meth:`Qwen2_5OmniConfig.from_hf`: a thinker folder (model_type
``qwen2_5_omni_thinker``: ``text_config`` + ``vision_config`` + ``audio_config``) or a full Omni folder (model_type
``qwen2_5_omni``, whose ``thinker_config`` is read; the talker and token2wav are not this family's). The text and
vision parts are parsed by Qwen2.5-VL's reader; :meth:`to_hf_dict` writes a thinker config.json.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from titan_mm.models.hf_config import check_hf, hf_types, part_of, within
from titan_mm.models.qwen2.config import Qwen2Config
from titan_mm.models.qwen2_5_vl.config import GENERIC_KEYS, Qwen2_5_VLConfig, VisionConfig

logger = logging.getLogger(__name__)

MODEL_TYPE = "qwen2_5_omni_thinker"
FULL_MODEL_TYPE = "qwen2_5_omni"  # thinker + talker + token2wav; only thinker_config is read
# transformers' Qwen2_5OmniTextConfig defaults, where they differ from Qwen2's (HF writes them all; a hand-written
# config.json may not)
_TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
_AUDIO_IGNORED = GENERIC_KEYS | {"dropout", "attention_dropout", "activation_dropout"}  # dropouts: checked to be 0
# thinker-level keys with no effect on the thinker's math
_THINKER_IGNORED = {"model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
                    "initializer_range", "text_config", "vision_config", "audio_config", "pad_token_id",
                    "bos_token_id", "eos_token_id"}


@dataclass(frozen=True)
class AudioConfig:
    """HF Qwen2_5OmniAudioEncoderConfig's fields (transformers' defaults = the released encoder)."""

    num_mel_bins: int = 128
    """Log-mel bins per frame (conv1 input channels)."""
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    activation_function: str = "gelu"
    max_source_positions: int = 1500
    """Rows of the sinusoidal position table (positions restart in every chunk, so n_window <= this)."""
    n_window: int = 100
    """Chunks of 2 * n_window frames: the convs and the attention run per chunk (n_window tokens after conv2)."""
    output_dim: int = 3584
    """Projection width (= the LLM hidden size)."""
    scale_embedding: bool = False
    """Kept for config.json only: HF's encoder computes embed_scale but never applies it, nor do we."""
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


@dataclass(frozen=True)
class Qwen2_5OmniConfig(Qwen2_5_VLConfig):
    audio: AudioConfig = field(default_factory=AudioConfig)
    audio_token_id: int = 151646
    """<|AUDIO|> (HF ``audio_token_index``): one per audio-encoder output token in input_ids."""
    audio_start_token_id: int = 151647
    audio_end_token_id: int = 151648
    position_id_per_seconds: int = 25
    """TMRoPE: temporal positions per second (video t = grid_t * second_per_grid * this; audio: 1 token = 40 ms)."""
    seconds_per_chunk: int = 2
    """use_audio_in_video: video and audio tokens interleave in chunks of this many seconds."""
    user_token_id: int = 872
    """Written back to config.json (the thinker does not use it)."""
    # ---- training modes (thinker.py: apply_freeze, param_groups) ----
    freeze_audio: bool = False
    """Freeze the audio encoder (convs, blocks, ln_post, proj)."""
    audio_lr: float | None = None
    """Learning rate of the audio encoder (None: the optimizer's lr)."""

    RUNTIME_FIELDS = Qwen2_5_VLConfig.RUNTIME_FIELDS + ("freeze_audio", "audio_lr")

    def __post_init__(self):
        super().__post_init__()
        a = self.audio
        if a.output_dim != self.text.hidden_size:
            raise ValueError(f"audio output_dim={a.output_dim} must equal the LLM hidden_size {self.text.hidden_size}.")
        if a.d_model % a.encoder_attention_heads:
            raise ValueError(f"audio d_model={a.d_model} is not divisible by encoder_attention_heads="
                             f"{a.encoder_attention_heads}.")
        if a.activation_function != "gelu":
            raise ValueError(f"audio activation_function={a.activation_function!r}: the Omni encoder uses gelu.")
        if not 0 < a.n_window <= a.max_source_positions:
            raise ValueError(f"audio n_window={a.n_window} must be in 1 .. max_source_positions="
                             f"{a.max_source_positions} (the position table is read per chunk).")

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    # --- HF config.json ---
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **runtime) -> Qwen2_5OmniConfig:
        with part_of(d, FULL_MODEL_TYPE, "thinker_config", MODEL_TYPE) as thinker:
            return cls._from_thinker_dict(thinker, **runtime)

    @classmethod
    def _from_thinker_dict(cls, d: dict[str, Any], **runtime) -> Qwen2_5OmniConfig:
        mt = d.get("model_type")
        if mt != MODEL_TYPE:
            raise ValueError(f"config.json has model_type={mt!r}, but the qwen2_5_omni family reads {MODEL_TYPE!r} "
                             f"or {FULL_MODEL_TYPE!r}; use the registry entry for that model type (spec_for_hf_dir).")
        check_hf(d, HF_TYPES)
        text = {**_TEXT_DEFAULTS, **(d.get("text_config") or {})}
        vl = Qwen2_5_VLConfig.from_hf_dict({
            "model_type": "qwen2_5_vl", "text_config": text, "vision_config": d.get("vision_config") or {},
            "tie_word_embeddings": d.get("tie_word_embeddings", False),  # the thinker's key decides, not text_config's
            "image_token_id": d.get("image_token_index", 151655), "video_token_id": d.get("video_token_index", 151656),
            "vision_start_token_id": d.get("vision_start_token_id", 151652),
            "vision_end_token_id": d.get("vision_end_token_id", 151653)})
        ad = dict(d.get("audio_config") or {})
        with within("audio_config"):
            check_hf(ad, AUDIO_HF_TYPES)
        for k in ("dropout", "attention_dropout", "activation_dropout"):
            if ad.get(k, 0.0):
                raise ValueError(f"audio_config {k}={ad[k]}: titan_mm's audio encoder has no dropout; set it to 0.")
        anames = {f.name for f in dataclasses.fields(AudioConfig)}
        unknown = sorted(set(ad) - anames - _AUDIO_IGNORED)
        if unknown:
            raise ValueError(f"Qwen2.5-Omni audio_config keys titan_mm does not implement: {unknown}")
        own = {"audio_token_index": "audio_token_id", "audio_start_token_id": "audio_start_token_id",
               "audio_end_token_id": "audio_end_token_id", "position_id_per_seconds": "position_id_per_seconds",
               "seconds_per_chunk": "seconds_per_chunk", "user_token_id": "user_token_id"}
        vl_keys = {"tie_word_embeddings", "image_token_index", "video_token_index", "vision_start_token_id",
                   "vision_end_token_id"}
        unknown = sorted(set(d) - set(own) - vl_keys - _THINKER_IGNORED)
        if unknown:
            logger.warning("Qwen2.5-Omni thinker config keys not used by titan_mm (check they do not change the math): "
                           "%s", unknown)
        kw = {f.name: getattr(vl, f.name) for f in dataclasses.fields(Qwen2_5_VLConfig)}
        kw.update({ours: d[hf] for hf, ours in own.items() if hf in d})
        kw["audio"] = AudioConfig(**{k: v for k, v in ad.items() if k in anames})
        kw.update(runtime)
        return cls(**kw)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """A thinker config.json (transformers' Qwen2_5OmniThinkerConfig)."""
        vl = super().to_hf_dict(dtype)
        vl["text_config"]["model_type"] = "qwen2_5_omni_text"
        vd = vl["vision_config"]
        vd.pop("tokens_per_second")  # Qwen2.5-VL's; the thinker times videos with position_id_per_seconds
        vd["model_type"] = "qwen2_5_omni_vision_encoder"
        ad = {f.name: getattr(self.audio, f.name) for f in dataclasses.fields(self.audio)}
        ad["model_type"] = "qwen2_5_omni_audio_encoder"
        out = {"architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"], "model_type": MODEL_TYPE,
               "text_config": vl["text_config"], "vision_config": vd, "audio_config": ad,
               "tie_word_embeddings": self.tie_word_embeddings, "image_token_index": self.image_token_id,
               "video_token_index": self.video_token_id, "audio_token_index": self.audio_token_id,
               "vision_start_token_id": self.vision_start_token_id, "vision_end_token_id": self.vision_end_token_id,
               "audio_start_token_id": self.audio_start_token_id, "audio_end_token_id": self.audio_end_token_id,
               "position_id_per_seconds": self.position_id_per_seconds, "seconds_per_chunk": self.seconds_per_chunk,
               "user_token_id": self.user_token_id}
        if dtype is not None:
            out["dtype"] = dtype
        return out


# config.json key -> JSON type (titan_mm.models.hf_config) of the thinker's keys; its text and vision configs are
# checked by Qwen2.5-VL's reader
HF_TYPES = hf_types(Qwen2_5OmniConfig, skip=Qwen2_5OmniConfig.RUNTIME_FIELDS + ("text", "vision", "audio",
                                                                              "mrope_section"),
                    text_config=dict | None, vision_config=dict | None, audio_config=dict | None,
                    image_token_index=int, video_token_index=int, audio_token_index=int)
AUDIO_HF_TYPES = hf_types(AudioConfig, dropout=float, activation_dropout=float)


# ---- flavors: Qwen/Qwen2.5-Omni-{3B,7B} thinker_config numbers + a tiny debug flavor ----
_TXT = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151644, eos_token_id=151645,
            max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768)
_VIS = VisionConfig(hidden_size=1280)  # the released ViT: depth 32, intermediate 3420, window 112, fullatt 7/15/23/31


def _omni(text: Qwen2Config, vision: VisionConfig, audio: AudioConfig, **kw) -> Qwen2_5OmniConfig:
    d = text.hidden_size
    return Qwen2_5OmniConfig(text=text, vision=dataclasses.replace(vision, out_hidden_size=d),
                             audio=dataclasses.replace(audio, output_dim=d),
                             tie_word_embeddings=text.tie_word_embeddings, **kw)


FLAVORS: dict[str, Qwen2_5OmniConfig] = {
    # real vocab and 128 mel bins (the data pipeline's log-mel), so it runs on real tokenizer / audio output
    "debug": _omni(Qwen2Config(vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                               rope_theta=1_000_000.0, max_position_embeddings=32768, bos_token_id=151644,
                               eos_token_id=151645),
                   VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, window_size=28,
                                fullatt_block_indexes=(1,)),
                   AudioConfig(encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, d_model=64),
                   mrope_section=(4, 6, 6)),
    "3B": _omni(Qwen2Config(**_TXT, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                            tie_word_embeddings=False, max_window_layers=70), _VIS, AudioConfig()),
    "7B": _omni(Qwen2Config(**_TXT, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            tie_word_embeddings=False, max_window_layers=28), _VIS, AudioConfig()),
}
