"""Sample schema: plain text, or OpenAI-style chat messages mixing text / image / video / audio parts.

Accepted record layouts (one JSON object per JSONL line, Parquet row, or tar ``.json`` member):

    {"text": "a pretraining document"}
    {"messages": [
        {"role": "system", "content": "You are ..."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "imgs/0001.jpg"}},   # OpenAI / lmms-engine
            {"type": "image", "image": "https://.../a.png"},                 # HF processor style
            {"type": "video_url", "video_url": {"url": "clips/a.mp4"}},
            {"type": "video", "video": "clips/b.mp4", "use_audio_in_video": true},  # with its own audio track
            {"type": "audio_url", "audio_url": {"url": "a.wav"}},
            {"type": "input_audio", "input_audio": {"data": "<base64 of a.wav>", "format": "wav"}},  # OpenAI
            {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    {"conversations": [{"from": "human", "value": "<image>\\nWhat is it?"}, {"from": "gpt", "value": "A cat."}],
     "image": "imgs/0001.jpg"}                                            # LLaVA style

``messages`` / ``conversations`` may also be a JSON string of the list (any format; lmms-engine accepts
this); a string that is not JSON is skipped as ``malformed_json``, one that is not a list as ``bad_schema``.

A media reference is a relative path (to ``media_root`` or the shard's folder), an absolute path or URL,
a ``data:`` URI, raw bytes (Parquet binary column), ``{"bytes": ...}``, or the name of a member of the
same tar shard; audio may also be an in-memory waveform (a 1-D float numpy array at 16 kHz, as the built-in
DTMF data gives it: ``{"type": "audio", "audio": wave}``). An unknown part type is skipped with reason
``unknown_modality``.

``"use_audio_in_video": true`` on a video part (HF's Omni flag, per video): the video's own audio track is decoded
from the same file and interleaved with its frames (families whose DataNeeds.vision_layout has an audio_in_video
order, the Omni thinkers; elsewhere the sample is skipped, ``unknown_modality``; a video without an audio track is
``no_audio_track``).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

from titan_mm.data.sources import SkipSample

MEDIA_TYPES = {
    "image": "image", "image_url": "image", "input_image": "image",
    "video": "video", "video_url": "video",
    "audio": "audio", "audio_url": "audio", "input_audio": "audio",
}
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "model": "assistant",
         "system": "system", "tool": "tool"}


@dataclass
class Part:
    type: str  # "text" | "image" | "video" | "audio"
    text: str = ""
    ref: Any = None  # media reference (path / URL / bytes / dict)
    use_audio_in_video: bool = False  # video: its own audio track is interleaved with it


@dataclass
class Message:
    role: str
    parts: list[Part] = field(default_factory=list)


@dataclass
class Sample:
    text: str | None = None  # plain pretraining text
    messages: list[Message] | None = None

    @property
    def modalities(self) -> set[str]:
        return {p.type for m in self.messages or [] for p in m.parts}


def _input_audio(v: dict) -> Any:
    """OpenAI's ``{"data": <base64 of the file>, "format": "wav"}``; bytes, a data: URI or a waveform array pass."""
    data = v.get("data")
    if data is None:
        raise SkipSample("bad_schema", f"input_audio without data: {v!r}"[:300])
    if not isinstance(data, str) or data.startswith("data:"):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise SkipSample("bad_audio", f"input_audio data is not base64 ({e})") from None


def _media_ref(part: dict, kind: str) -> Any:
    for key in (part["type"], kind, f"{kind}_url", "url", "path", "data", "bytes"):
        v = part.get(key)
        if v is not None:
            if isinstance(v, dict) and key == "input_audio":
                return _input_audio(v)
            return v
    raise SkipSample("bad_schema", f"{kind} part without a reference: {part!r}"[:300])


def _audio_in_video(part: dict, kind: str, where: str) -> bool:
    flag = part.get("use_audio_in_video", False)
    if not isinstance(flag, bool):
        raise SkipSample("bad_schema", f"{where}: use_audio_in_video must be true or false, got {flag!r}"[:300])
    if flag and kind != "video":
        raise SkipSample("bad_schema", f"{where}: use_audio_in_video is set on a {kind} part; it belongs on a video "
                         "part (whose own audio track is used)")
    return flag


def _parse_content(content: Any, where: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Part("text", content)]
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise SkipSample("bad_schema", f"{where}: content must be a string or a list of parts")
    parts = []
    for p in content:
        if isinstance(p, str):
            parts.append(Part("text", p))
            continue
        t = p.get("type") if isinstance(p, dict) else None
        if t == "text":
            parts.append(Part("text", str(p.get("text", ""))))
        elif t in MEDIA_TYPES:
            kind = MEDIA_TYPES[t]
            parts.append(Part(kind, ref=_media_ref(p, kind), use_audio_in_video=_audio_in_video(p, kind, where)))
        else:
            raise SkipSample("unknown_modality", f"{where}: part type {t!r} (known: text, {', '.join(MEDIA_TYPES)})")
    return parts


def _from_llava(rec: dict) -> list[Message]:
    media = {"image": [], "video": []}
    for kind in ("image", "video"):
        v = rec.get(kind, rec.get(kind + "s"))
        if v is not None:
            media[kind] = v if isinstance(v, list) else [v]
    msgs = []
    used = {"image": 0, "video": 0}
    for i, turn in enumerate(rec["conversations"]):
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        if role is None:
            raise SkipSample("bad_schema", f"conversations[{i}]: unknown speaker {turn.get('from')!r}")
        text = str(turn.get("value", turn.get("content", "")))
        parts: list[Part] = []
        while True:
            cut = [(text.find(f"<{k}>"), k) for k in ("image", "video") if f"<{k}>" in text]
            if not cut:
                break
            pos, k = min(cut)
            if pos:
                parts.append(Part("text", text[:pos]))
            if used[k] >= len(media[k]):
                raise SkipSample("bad_schema", f"conversations[{i}]: more <{k}> tags than {k}s given")
            parts.append(Part(k, ref=media[k][used[k]]))
            used[k] += 1
            text = text[pos + len(k) + 2 :].lstrip("\n")
        if text:
            parts.append(Part("text", text))
        msgs.append(Message(role, parts))
    return msgs


def _json_list(value: Any, key: str) -> list:
    """A record's turn list, given as a list or as a JSON string of one (lmms-engine datasets)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SkipSample("malformed_json", f"'{key}' is a string but not valid JSON ({e})") from None
    if not isinstance(value, list):
        raise SkipSample("bad_schema", f"'{key}' must be a list (or a JSON string of one), got {type(value).__name__}")
    return value


def parse_record(rec: Any) -> Sample:
    """Normalize one record into a :class:`Sample`; raises SkipSample for unusable records."""
    if isinstance(rec, SkipSample):
        raise rec
    if not isinstance(rec, dict):
        raise SkipSample("bad_schema", f"a record must be an object, got {type(rec).__name__}")
    rec = {k: v for k, v in rec.items() if v is not None}  # Parquet rows: null columns are absent
    if "messages" in rec:
        msgs = []
        messages = _json_list(rec["messages"], "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise SkipSample("bad_schema", f"messages[{i}] must be an object")
            role = ROLES.get(str(m.get("role", "")).lower())
            if role is None:
                raise SkipSample("bad_schema", f"messages[{i}]: unknown role {m.get('role')!r}")
            msgs.append(Message(role, _parse_content(m.get("content"), f"messages[{i}]")))
        if not msgs:
            raise SkipSample("empty", "no messages")
        return Sample(messages=msgs)
    if "conversations" in rec:
        return Sample(messages=_from_llava({**rec, "conversations": _json_list(rec["conversations"], "conversations")}))
    if "text" in rec:
        if not isinstance(rec["text"], str) or not rec["text"]:
            raise SkipSample("empty", "'text' is empty or not a string")
        return Sample(text=rec["text"])
    keys = sorted(k for k in rec if not k.startswith("__"))
    raise SkipSample("bad_schema", f"record has none of 'text', 'messages', 'conversations' (keys: {keys[:8]})")
