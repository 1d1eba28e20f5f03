"""Processors: a parsed :class:`~titan_mm.data.schema.Sample` -> a packed-ready :class:`~titan_mm.data.packing.Doc`.

Text: ``tokens + <|endoftext|>``, every token a target. Chat: the Qwen3 chat template, labels only on
assistant turns (their content and the closing ``<|im_end|>``). Media: see :mod:`titan_mm.data.vision`
(images and video as the family's HF processor makes them: DataNeeds.vision_layout) and
:mod:`titan_mm.data.audio` (16 kHz log-mel, clips padded and counted by the family's DataNeeds.audio).

Sizes (patch, temporal patch, merge), the positions kind (1-D or M-RoPE) and the special token ids come from
the model family's :class:`~titan_mm.registry.DataNeeds`; every other setting from the ``[data]`` section.

Two chat templates (the family's DataNeeds.chat_template, unless ``data.chat_template`` names one):
- ``chatml``: ChatML as Qwen3-VL Instruct's template writes it; media parts render as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per merged patch after expansion), audio parts as
  ``<|audio_start|><|audio_pad|><|audio_end|>``. Each token is written by the tokenizer's own name for its role
  (Tokenizer.names: Qwen2.5-Omni's ``<|vision_bos|><|IMAGE|><|vision_eos|>``, ``<|audio_bos|><|AUDIO|><|audio_eos|>``).
- ``chatml_think``: Qwen3's hybrid-thinking template (the Qwen3 tokenizer's own); the last assistant turn after the
  last user query gets an (empty unless given) ``<think>...</think>`` block, exactly as HF's ``apply_chat_template``
  renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from titan_mm.config import Data
from titan_mm.data import audio, vision
from titan_mm.data.packing import IGNORE_INDEX, Doc
from titan_mm.data.schema import Sample
from titan_mm.data.sources import SkipSample, Unit, media_bytes
from titan_mm.data.tokenizer import Tokenizer, builtin_names, load_tokenizer
from titan_mm.nn.media import AudioFrontEnd, VisionLayout
from titan_mm.registry import POSITION_AXES, DataNeeds

CHAT_TEMPLATES = ("chatml", "chatml_think")


@dataclass(frozen=True)
class ProcessorConfig:
    """What the processors read: the ``[data]`` section, the model family's data needs (patch / merge sizes,
    positions kind, special tokens, chat template) and the settings neither of them holds."""

    data: Data = field(default_factory=Data)
    needs: DataNeeds = field(default_factory=DataNeeds)
    lazy_images: bool = False  # image patches computed at collate time (the loader turns this on)
    audio_sample_rate: int = 16000
    audio_n_mels: int = 128

    def __post_init__(self):
        if self.needs.positions not in POSITION_AXES:
            raise ValueError(f"DataNeeds.positions must be one of {tuple(POSITION_AXES)}, got {self.needs.positions!r}")
        if self.needs.patch_size and not isinstance(self.needs.vision_layout, VisionLayout):
            raise ValueError(f"DataNeeds.vision_layout must be a titan_mm.nn.media.VisionLayout when patch_size is "
                             f"set (the family's image / video processing), got {self.needs.vision_layout!r}")
        if (self.needs.positions != "1d") != (self.needs.doc_positions is not None):
            raise ValueError(f"DataNeeds.positions {self.needs.positions!r} and DataNeeds.doc_positions "
                             f"{self.needs.doc_positions!r} disagree: a family with positions other than '1d' gives "
                             "the builder of a document's positions, and only such a family")
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"data.chat_template must be empty (the model's), 'chatml' (no think block) or "
                             f"'chatml_think' (Qwen3's template), got {self.chat_template!r}")
        if self.needs.audio is not None and not isinstance(self.needs.audio, AudioFrontEnd):
            raise ValueError(f"DataNeeds.audio must be None (no audio) or a titan_mm.nn.media.AudioFrontEnd, "
                             f"got {self.needs.audio!r}")

    # the family's sizes, by the names vision.py reads
    @property
    def patch_size(self) -> int:
        return self.needs.patch_size

    @property
    def temporal_patch_size(self) -> int:
        return self.needs.temporal_patch_size

    @property
    def merge_size(self) -> int:
        return self.needs.merge_size

    @property
    def position_axes(self) -> int:
        return self.needs.position_axes

    @property
    def chat_template(self) -> str:
        return self.data.chat_template or self.needs.chat_template


def _builtin_hint(needs: DataNeeds) -> str:
    """ " (or builtin:NAME, ...)" for the built-in tokenizers that give every role the family's id."""
    fits = [f"builtin:{name}" for name in builtin_names() if all(
        getattr(load_tokenizer(f"builtin:{name}"), f"{role}_id") == i for role, i in needs.special_tokens.items())]
    return f" (or {' / '.join(fits)}, a built-in one with these ids)" if fits else ""


def check_special_tokens(tok: Tokenizer, needs: DataNeeds) -> None:
    """The tokenizer must give every special token the family names the id the model was trained with."""
    for role, expected in needs.special_tokens.items():
        if not hasattr(tok, f"{role}_id"):
            known = sorted(k[:-3] for k in vars(tok) if k.endswith("_id"))
            raise ValueError(f"DataNeeds.special_tokens names an unknown role {role!r}; the processors know {known}")
        got = getattr(tok, f"{role}_id")
        if got != expected:
            raise ValueError(f"the tokenizer ({tok.path}) gives {role} the id {got}, the model expects {expected}; "
                             f"set data.tokenizer_path to the model's tokenizer{_builtin_hint(needs)}")


def shift_labels(ids: np.ndarray, target: np.ndarray) -> np.ndarray:
    """labels[t] = ids[t+1] where token t+1 is a target, else -100; the last token gets -100."""
    labels = np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64)
    nxt = target[1:]
    labels[:-1][nxt] = ids[1:][nxt]
    return labels


class Processor:
    def __init__(self, tokenizer: Tokenizer, cfg: ProcessorConfig | None = None):
        self.tok = tokenizer
        self.cfg = cfg or ProcessorConfig()
        check_special_tokens(tokenizer, self.cfg.needs)

    # ------------------------------------------------------------------ text
    def text_doc(self, text: str, sample_id: str = "") -> Doc:
        ids = np.asarray(self.tok.encode(text) + [self.tok.endoftext_id], dtype=np.int64)
        target = np.ones(ids.shape[0], dtype=bool)
        return self._finish(ids, target, sample_id, [], [])

    # ------------------------------------------------------------------ chat
    def render(self, sample: Sample, add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]], list]:
        """Render a chat to (text with one pad per media item, assistant char spans, media parts in order)."""
        msgs = sample.messages or []
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        media: list = []
        pos = 0

        def emit(s: str) -> None:
            nonlocal pos
            out.append(s)
            pos += len(s)

        def audio_tokens() -> dict:
            """The tokenizer's names, once audio is known to be usable (an audio part, or a video's own track)."""
            if self.cfg.needs.audio is None:
                raise SkipSample("unknown_modality", "audio part, but this model family takes no audio "
                                 "(its data needs have no audio front end)")
            n = self.tok.names
            if None in (n["audio_start"], n["audio_pad"], n["audio_end"]):
                raise SkipSample("unknown_modality", "audio part, but the tokenizer has no <|audio_pad|> / "
                                 "<|AUDIO|> tokens (audio needs an Omni tokenizer)")
            return n

        def content_str(parts) -> str:
            s = []
            for p in parts:
                if p.type == "text":
                    s.append(p.text)
                elif p.type in ("image", "video"):
                    if not self.cfg.patch_size:
                        raise SkipSample("unknown_modality", f"{p.type} part, but the model takes no vision input "
                                         "(its data needs have no patch size)")
                    if p.type == "video" and not self.cfg.needs.video:
                        raise SkipSample("unknown_modality", "video part, but this model family does not train on "
                                         "video (its data needs say video=False)")
                    if p.use_audio_in_video:
                        if not self.cfg.needs.vision_layout.audio_in_video:
                            raise SkipSample("unknown_modality", "video part with use_audio_in_video, but this model "
                                             "family does not interleave audio with video (its vision layout's "
                                             "audio_in_video is empty)")
                        audio_tokens()
                    n = self.tok.names
                    s.append(n["vision_start"] + n[f"{p.type}_pad"] + n["vision_end"])
                    media.append(p)
                elif p.type == "audio":
                    n = audio_tokens()
                    s.append(n["audio_start"] + n["audio_pad"] + n["audio_end"])
                    media.append(p)
                else:
                    raise SkipSample("unknown_modality", f"part type {p.type!r}")
            return "".join(s)

        think = self.cfg.chat_template == "chatml_think"
        last_query = len(msgs) - 1
        for i in range(len(msgs) - 1, -1, -1):
            if msgs[i].role == "user":
                last_query = i
                break
        for i, m in enumerate(msgs):
            c = content_str(m.parts)
            if m.role in ("user", "system", "tool"):
                role = "user" if m.role == "tool" else m.role
                if m.role == "tool":
                    c = f"<tool_response>\n{c}\n</tool_response>"
                emit(f"<|im_start|>{role}\n{c}<|im_end|>\n")
            elif m.role == "assistant":
                emit("<|im_start|>assistant\n")
                start = pos
                if think:
                    reasoning = ""
                    if "</think>" in c:
                        reasoning = c.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                        c = c.split("</think>")[-1].lstrip("\n")
                    if i > last_query and (i == len(msgs) - 1 or reasoning):
                        c = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + c.lstrip("\n")
                emit(c + "<|im_end|>")
                spans.append((start, pos))
                emit("\n")
        if add_generation_prompt:
            emit("<|im_start|>assistant\n")
        return "".join(out), spans, media

    def chat_doc(self, sample: Sample, rec: dict | None = None, unit: Unit | None = None,
                 sample_id: str = "") -> Doc:
        text, spans, media = self.render(sample)
        if not spans:
            raise SkipSample("empty", "chat without an assistant turn (nothing to learn)")
        enc = self.tok._tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
        target = np.zeros(ids.shape[0], dtype=bool)
        for a, b in spans:
            target |= (starts >= a) & (starts < b)
        return self._expand_media(ids, target, media, rec or {}, unit, sample_id)

    def prompt_doc(self, sample: Sample) -> Doc:
        """The prompt of a chat for generation: its messages with the assistant's turn opened, media expanded as in
        training (in-memory or inline media only: no record to resolve paths against), no labels."""
        text, _, media = self.render(sample, add_generation_prompt=True)
        ids = np.asarray(self.tok.encode(text), dtype=np.int64)
        return self._expand_media(ids, np.zeros(ids.shape[0], dtype=bool), media, {}, None, "")

    def _expand_media(self, ids, target, media, rec, unit, sample_id) -> Doc:
        if not media:
            return self._finish(ids, target, sample_id, [], [])
        pad_ids = {self.tok.image_pad_id, self.tok.video_pad_id, self.tok.audio_pad_id} - {None}
        where = [i for i, t in enumerate(ids.tolist()) if t in pad_ids]
        if len(where) != len(media):
            raise SkipSample("bad_schema", "the text itself contains image / video / audio pad tokens")
        pieces_ids, pieces_tgt, items = [], [], []
        prev = 0
        for w, part in zip(where, media):
            pieces_ids.append(ids[prev:w])
            pieces_tgt.append(target[prev:w])
            # an in-memory waveform (built-in audio) needs no resolving
            resolve = unit is not None and not isinstance(part.ref, np.ndarray)
            payload = media_bytes(part.ref, rec, unit, self.cfg.data.media_root) if resolve else part.ref
            if part.type == "image":
                item = vision.process_image(payload, self.cfg, lazy=self.cfg.lazy_images)
                tok = np.full(item.n_tokens, self.tok.image_pad_id, dtype=np.int64)
            elif part.type == "video":
                item = vision.process_video(payload, self.cfg)
                # like HF's processors, only the <|video_pad|> is replaced (the template's
                # <|vision_start|> / <|vision_end|> around it stay)
                if part.use_audio_in_video:
                    item = audio.add_video_audio(item, payload, self.cfg)
                    tok = vision.audio_in_video_ids(item, self.tok, self.cfg)
                else:
                    tok = vision.video_placeholder_ids(item, self.tok)
            else:
                item = audio.process_audio(payload, self.cfg)
                tok = np.full(item.n_tokens, self.tok.audio_pad_id, dtype=np.int64)
            items.append(item)
            pieces_ids.append(tok)
            pieces_tgt.append(np.zeros(tok.shape[0], dtype=bool))
            prev = w + 1
        pieces_ids.append(ids[prev:])
        pieces_tgt.append(target[prev:])
        ids = np.concatenate(pieces_ids)
        target = np.concatenate(pieces_tgt)
        return self._finish(ids, target, sample_id, items, media)

    def _finish(self, ids, target, sample_id, items, media) -> Doc:
        doc = Doc(ids, shift_labels(ids, target), sample_id)
        for it in items:
            for k, v in it.tensors.items():
                doc.media.setdefault(k, []).append(v)
            doc.n_patches += it.n_patches
        build = self.cfg.needs.doc_positions  # None: 1-D, restarting per doc at collate
        if build is not None:
            doc.positions = build(ids, items, self.tok, self.cfg)
        return doc

    def __call__(self, sample: Sample, rec: dict | None = None, unit: Unit | None = None, sample_id: str = "") -> Doc:
        if sample.text is not None:
            return self.text_doc(sample.text, sample_id)
        return self.chat_doc(sample, rec, unit, sample_id)
