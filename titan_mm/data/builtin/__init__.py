"""Built-in datasets that need no download.

- ``text``: the templated text corpus (:mod:`titan_mm.data.builtin.text`), about 2000 short documents.
- ``digits`` / ``digits_test``: scikit-learn's 8x8 handwritten digits upscaled to RGB PNGs, as chats
  "What digit is this?" -> "7". A deterministic split: every 5th image (index % 5 == 0) is held out in
  ``digits_test``; the rest is ``digits``. Records carry ``answer`` (the digit as a string) for scoring.
- ``photos``: a few real photos from scikit-image's data module with short captions.
- ``qa`` / ``qa_test``: text chats "What number comes after 347?" -> "348" (and "before"), three-digit answers
  (:mod:`titan_mm.data.builtin.qa`); every 5th record is held out in ``qa_test``. Records carry ``answer``.
- ``dtmf`` / ``dtmf_test``: telephone key tones (16 kHz waveforms of one key) as chats "<audio> Which key was
  pressed?" -> "4"; ``dtmf_digits`` / ``dtmf_digits_test`` add a digit image before the audio and ask for both;
  ``dtmf_seq`` / ``dtmf_seq_test`` hold 1-6 keys ("4*07") (:mod:`titan_mm.data.builtin.dtmf`). Every 5th record
  is held out; records carry ``answer``. They need an Omni tokenizer (<|audio_pad|>); made when read, not held in
  memory.

Records are plain dicts in the same schema as files on disk (see :mod:`titan_mm.data.schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from titan_mm.data.builtin.dtmf import dtmf_records
from titan_mm.data.builtin.images import digits_records, photo_records
from titan_mm.data.builtin.qa import qa_records
from titan_mm.data.builtin.text import text_corpus

NUM_PARTS = {"text": 16, "digits": 16, "digits_test": 4, "photos": 1, "qa": 8, "qa_test": 2,
             "dtmf": 16, "dtmf_test": 4, "dtmf_digits": 16, "dtmf_digits_test": 4, "dtmf_seq": 16,
             "dtmf_seq_test": 4}


def builtin_num_parts(name: str) -> int:
    if name not in NUM_PARTS:
        raise ValueError(f"unknown built-in dataset {name!r}; choose one of {sorted(NUM_PARTS)} (as builtin:<name>)")
    return NUM_PARTS[name]


@lru_cache(maxsize=8)
def builtin_records(name: str) -> Sequence[dict]:
    if name == "text":
        return [{"text": t} for t in text_corpus()]
    if name in ("digits", "digits_test"):
        return digits_records(test=name == "digits_test")
    if name in ("qa", "qa_test"):
        return qa_records(test=name == "qa_test")
    if name in NUM_PARTS and name.startswith("dtmf"):
        return dtmf_records(name.removesuffix("_test"), test=name.endswith("_test"))
    if name == "photos":
        return photo_records()
    builtin_num_parts(name)  # raises with the list of names
    return []
