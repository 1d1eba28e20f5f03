"""BAGEL's samples from records, as BAGEL's datasets (``T2IIterableDataset``, the edit and VLM SFT datasets) and
``PackedDataset`` build them; packed best-fit into rows (titan_mm.data.packing) and collated by the one collator
into the batch the family's loss reads (spec.SCHEMA).

The trainer's source (DataNeeds.docs: titan_mm.data.loader reads, mixes, shards, packs and resumes the rows) takes
``data.dataset`` / ``data.mixture`` records of four kinds, told apart by their keys; images are encoded by the image
codec of ``data.encoders`` (titan_mm.models.bagel.vae: ``"pixels"`` or a FLUX VAE), either where the rows are built
or, deferred (``BagelDocs(defer=True)``, the trainer's loader), by :class:`BagelEncoder` in the trainer's process on
its device (DocLayout.encoder; docs/bagel.md "Data"):

  text-to-image  {"image": IMG, "caption": TEXT}: [bos caption eos] causal, no loss | the image's noised VAE split;
                 or BAGEL's t2i parquet row {"image": bytes, "captions": JSON of several}, one drawn per epoch
  editing        {"source": IMG, "instruction": TEXT, "target": IMG} (or "source_image" / "target_image", as the
                 EditJSONLIterableDataset of BAGEL's forks): the source's clean VAE split (t = 0) and its ViT split,
                 both full | [bos instruction eos] causal, no loss | the target's noised VAE split; or BAGEL's edit
                 parquet row {"image_list": [IMG, ...], "instruction_list": [[TEXT, ...], ...]}, a chain of edits of
                 which a span of one or two is drawn per epoch as its UnifiedEditIterableDataset draws it
  VLM chat       {"messages": [...]} (or LLaVA "conversations"; titan_mm.data.schema): per message, each image a
                 ViT split and each run of text [bos text eos] causal, CE on the assistant's
  builtin:digits the chat "<image> What digit is this?" -> "7" (CE on the answer), or "Draw the digit 7." -> the
                 image's noised VAE split; each image is asked one way in an epoch and the other in the next (the
                 first way drawn from (seed, image)). Its held-out split, builtin:digits_test (every 5th image), is
                 never read by builtin:digits; given to [eval] (eval.dataset) it is asked both ways too.

IMG is a path (relative to the file's folder, or data.media_root), a URL or bytes. An image is resized (bicubic)
to an area within data.image_min_pixels / image_max_pixels, with sides multiples of the codec's stride (VAE
splits), of the ViT patch (ViT splits) or of both, and within the latent / ViT position tables. ``prompt_dropout``
is BAGEL's ``text_cond_dropout_prob``: a caption or instruction is left out, drawn from (seed, sample, epoch);
``vit_cond_dropout`` / ``vae_cond_dropout`` (``vit_cond_dropout_prob`` / ``vae_cond_dropout_prob``) leave out an
editing source's ViT / clean VAE split the same way, its position still taken, as BAGEL's packer does.
A record that fits no kind, or whose image cannot be read, is skipped and counted by the loader.

:class:`T2IData` is the library form of the text-to-image rows (``read_t2i``'s JSONL, ``drop_text`` drawn per sample
index and seed), kept for the sampler's tests; the trainer reads :class:`BagelDocs`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from titan_mm.data.loader import resolve_sources
from titan_mm.data.packing import BestFitPacker, Doc, collate_rows
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import READERS, SkipSample, Unit, hash_ints, list_units, media_bytes
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.model import patchify
from titan_mm.models.bagel.spec import SCHEMA, VAE
from titan_mm.models.bagel.synthetic import DEBUG_IMAGE_PAD, DEBUG_SPECIALS, Specials, _Sample
from titan_mm.models.bagel.vae import (
    CACHE_FORMAT,
    CACHE_INDEX,
    PIXELS,
    CachedCodec,
    FluxVAE,
    PixelCodec,
    check_codec,
    image_key,
    is_latent_cache,
    latent_stride,
    load_codec,
)
from titan_mm.nn.media import Bound, DocLayout
from titan_mm.registry import DataNeeds, ImageSplit, SplitLayout

DIGITS = ("builtin:digits", "builtin:digits_test")
"""The digits sources asked both ways (the training split, and the held-out one for [eval]'s held-out loss)."""
DRAW_DIGIT = "Draw the digit {}."
# own hash streams: the digits way, the prompt / source-ViT / source-VAE dropouts, the caption drawn
_WAY_SALT, _DROP_SALT, _VIT_SALT, _VAE_SALT, _CAPTION_SALT, _CHAIN_SALT = 0xD1617, 0xD40F, 0xD417, 0xDAE0, 0xCA9, 0xED17
DEFERRED = ("vae_pixels", "vae_sizes")
"""A deferred batch's media keys: the VAE splits' images as uint8 RGB, flat and side by side in token order, and their
(height, width); :class:`BagelEncoder` takes them out."""
ENCODE_PIXELS = 4 * 512 * 512
"""Pixels per encoder call on the device: a batch's images of one size go in together up to this many (at least
one each call)."""


@dataclass(frozen=True)
class T2IRow:
    image: str
    """The image file's path (absolute, or as the JSONL gives it joined to the file's folder)."""
    caption: str


def read_t2i(path: str | os.PathLike) -> list[T2IRow]:
    """The rows of a JSONL file; a line that is not ``{"image": str, "caption": str}`` is one ValueError line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); give a JSONL file of image + caption "
                         "rows") from None
    root, rows = os.path.dirname(os.path.abspath(path)), []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{i} is not JSON; each line is {{\"image\": PATH, \"caption\": TEXT}}") from None
        if not (isinstance(rec, dict) and isinstance(rec.get("image"), str) and isinstance(rec.get("caption"), str)):
            raise ValueError(f"{path}:{i} has no string \"image\" and \"caption\"; each line is "
                             "{\"image\": PATH, \"caption\": TEXT}")
        rows.append(T2IRow(os.path.join(root, rec["image"]), rec["caption"]))
    if not rows:
        raise ValueError(f"{path} holds no rows; each line is {{\"image\": PATH, \"caption\": TEXT}}")
    return rows


def load_image(path: str, stride: int) -> torch.Tensor:
    """[3, H, W] fp32 in [-1, 1] (BAGEL's ToTensor + Normalize(0.5, 0.5)), RGB; sides must be multiples of
    ``stride`` (the VAE's downsampling x the latent patch)."""
    try:
        with Image.open(path) as im:
            a = np.asarray(im.convert("RGB"), dtype=np.float32)
    except OSError as e:
        raise ValueError(f"image {path} cannot be read ({e}); give a PNG / JPEG file") from None
    H, W = a.shape[:2]
    if H % stride or W % stride:
        raise ValueError(f"image {path} is {H}x{W}; its sides must be multiples of {stride} (VAE downsampling x "
                         "latent patch): resize or crop it")
    return _unit_range(a)


def _unit_range(rgb_HWC: np.ndarray) -> torch.Tensor:
    """[3, H, W] fp32 in [-1, 1] of uint8-valued RGB (BAGEL's ToTensor + Normalize(0.5, 0.5))."""
    return torch.from_numpy(np.ascontiguousarray(rgb_HWC, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1


def source_image(path: str, vae: FluxVAE, cfg: BagelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """An editing source: (its clean latent [z, h, w], its ViT pixels [3, H', W'] in [-1, 1]): the image's sides
    must be multiples of ``vae.stride``; the ViT's copy is resized down to multiples of the ViT patch where they are
    not (bicubic, as BAGEL's vit_transform resizes)."""
    img = load_image(path, vae.stride)
    p, (H, W) = cfg.vit_config.patch_size, img.shape[1:]
    vit = img
    if H % p or W % p:
        vit = F.interpolate(img[None], size=(max(p, H // p * p), max(p, W // p * p)), mode="bicubic")[0]
    return vae.encode(img[None])[0], vit


def specials_for(tokenizer, cfg: BagelConfig) -> Specials:
    """BAGEL's special ids in ``tokenizer`` (titan_mm.data.tokenizer.Tokenizer: <|im_start|>, <|im_end|>,
    <|vision_start|>, <|vision_end|>) when it has them all inside the model's vocabulary; else the debug
    vocabulary's (a debug model trains on synthetic ids whatever its run's tokenizer)."""
    ids = (tokenizer.im_start_id, tokenizer.im_end_id, tokenizer.vision_start_id, tokenizer.vision_end_id)
    if all(i is not None and i < cfg.llm_config.vocab_size for i in ids):
        return Specials(*ids)
    return DEBUG_SPECIALS


def generation_doc(cfg: BagelConfig, prompt_ids: list[int] | None, latent_CHW: torch.Tensor,
                   specials: Specials = DEBUG_SPECIALS, source: tuple[torch.Tensor, torch.Tensor] | None = None) -> Doc:
    """One generation sample: ``[bos prompt eos]`` causal (no loss; left out when None) then the image's noised
    latent split (unit 0; :func:`batches` numbers the units of a packed row). ``source`` (editing: the source
    image's clean latent [z, h, w] and its ViT pixels [3, H, W]) comes first, as BAGEL's inferencer puts it in
    the context: its VAE split (t = 0), then its ViT split, both full."""
    s = _Sample(cfg, specials)
    if source is not None:
        s.vae_image(source[0], noised=False, unit=-1)
        s.vit_image(source[1])
    if prompt_ids is not None:
        s.text([specials.bos, *prompt_ids, specials.eos], loss=False)
    s.vae_image(latent_CHW, noised=True, unit=0)
    return s.doc()


def collate(rows: list[list[Doc]], seq_len: int) -> dict:
    """DocLayout.collate: packed rows into the family's batch, each row's noised images numbered 0, 1, ..."""
    return collate_rows([_units_numbered(r) for r in rows], seq_len, pad_id=0, position_axes=1, multiple=1,
                        schema=SCHEMA)


def _units_numbered(docs: list[Doc]) -> list[Doc]:
    """The row's docs with their noised images numbered 0, 1, ... in token order (one t per image)."""
    out, base = [], 0
    for d in docs:
        unit = d.seq["noise_unit"]
        n = int(unit.max()) + 1 if unit.size else 0
        out.append(dataclasses.replace(d, seq={**d.seq, "noise_unit": np.where(unit >= 0, unit + base, unit)}))
        base += max(n, 0)
    return out


class T2IData:
    """Text-to-image samples of ``rows``: each image encoded by ``vae``, each caption by ``tokenize`` (text -> ids,
    no special tokens; ``specials``' BOS / EOS around it as BAGEL's packer)."""

    def __init__(self, cfg: BagelConfig, rows: list[T2IRow], vae: FluxVAE, tokenize: Callable[[str], list[int]],
                 drop_text: float = 0.0, seed: int = 0, specials: Specials = DEBUG_SPECIALS):
        if not 0.0 <= drop_text < 1.0:
            raise ValueError(f"drop_text = {drop_text}: the caption dropout (BAGEL's text_cond_dropout_prob) must "
                             "be in [0, 1)")
        self.cfg, self.rows, self.vae, self.tokenize = cfg, rows, vae, tokenize
        self.drop_text, self.seed, self.specials = drop_text, seed, specials

    def doc(self, i: int) -> Doc:
        r = self.rows[i]
        latent = self.vae.encode(load_image(r.image, self.vae.stride)[None])[0]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        drop = self.drop_text > 0 and float(torch.rand((), generator=g)) < self.drop_text
        return dataclasses.replace(generation_doc(self.cfg, None if drop else self.tokenize(r.caption), latent,
                                                  self.specials),
                                   sample_id=f"t2i:{i}")

    def batches(self, seq_len: int, rows_per_batch: int, order: list[int] | None = None) -> Iterator[dict]:
        """Collated batches of ``rows_per_batch`` rows of ``seq_len`` tokens, the samples of ``order`` (default:
        file order) packed best-fit; the last rows flushed (a short final batch is dropped)."""
        packer = BestFitPacker(seq_len)
        idx = range(len(self.rows)) if order is None else order
        collated = functools.partial(collate, seq_len=seq_len)
        for i in idx:
            d = self.doc(i)
            if not packer.fits(d):
                raise ValueError(f"sample {i} ({self.rows[i].image}) is {len(d)} tokens; data.seq_len {seq_len} "
                                 "must hold it: raise it or use smaller images")
            packer.add(d)
            while (rows := packer.pop_rows(rows_per_batch)) is not None:
                yield collated(rows)
        packer.flush()
        while (rows := packer.pop_rows(rows_per_batch)) is not None:
            yield collated(rows)


# ------------------------------------------------------------------------------------- the trainer's source
def fit_size(H: int, W: int, multiple: int, max_side: int, data) -> tuple[int, int]:
    """(h, w): H x W scaled to an area within data.image_min_pixels / image_max_pixels and a longer side of at
    most ``max_side``, each side then a multiple of ``multiple``: rounded up when scaled up (to stay above the
    smallest area), else down; at least one multiple, at most ``max_side``'s."""
    area = H * W
    s = min(max(1.0, math.sqrt(data.image_min_pixels / area)), math.sqrt(data.image_max_pixels / area),
            max_side / max(H, W))
    top = max(multiple, max_side // multiple * multiple)

    def side(x: float) -> int:
        n = math.ceil(x / multiple - 1e-9) if s > 1 else int(x) // multiple
        return min(top, max(multiple, n * multiple))

    return side(H * s), side(W * s)


class BagelDocs:
    """DocLayout.builder: ``build(record, unit, sample id, epoch)`` is the record's Doc (module docstring)."""

    def __init__(self, cfg: BagelConfig, data, tokenizer, seed: int, defer: bool = False):
        """``data``: the [data] section (titan_mm.config.Data); ``tokenizer``: titan_mm.data.tokenizer.Tokenizer;
        ``defer``: the VAE splits hold zero latents and their images ride along (:data:`DEFERRED`) for
        :class:`BagelEncoder`; the codec is not loaded here then (its name and shape are checked), unless it is a
        latent cache, whose reads cost little anywhere and whose missing image is then a counted skip here rather
        than an error in the trainer's step."""
        if not data.encoders:
            raise ValueError("data.encoders is empty: BAGEL's rows encode their images with an image codec; set it to "
                             "\"pixels\" (the pixels as latents) or a FLUX VAE (BFL's ae.safetensors, or a diffusers "
                             "AutoencoderKL folder)")
        for name, p in (("prompt_dropout", data.prompt_dropout), ("vit_cond_dropout", data.vit_cond_dropout),
                        ("vae_cond_dropout", data.vae_cond_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"data.{name} = {p}: a dropout probability (BAGEL's *_cond_dropout_prob) must be in "
                                 "[0, 1)")
        self.cfg, self.data, self.tok, self.seed = cfg, data, tokenizer, seed
        self.codec: FluxVAE | PixelCodec | CachedCodec | None = None
        if not defer or is_latent_cache(data.encoders):
            self.codec = load_codec(data.encoders, cfg)
        else:
            check_codec(data.encoders, cfg)  # BagelEncoder loads it
        self.specials = specials_for(tokenizer, cfg)
        p, s = cfg.vit_config.patch_size, latent_stride(cfg)
        self.vit_fit = vit_fit(cfg)
        self.vae_fit = (s, cfg.max_latent_size * s)
        self.both_fit = (math.lcm(p, s), min(self.vit_fit[1], self.vae_fit[1]))

    def __call__(self, rec: Any, unit: Unit, sid: str, epoch: int = 0) -> Doc:
        if isinstance(rec, SkipSample):  # an unreadable unit
            raise rec
        if not isinstance(rec, dict):
            raise SkipSample("bad_schema", f"a record must be an object, got {type(rec).__name__}")
        key = (self.seed, zlib.crc32(sid.encode()), epoch)
        if "caption" in rec or "captions" in rec:
            s = self._generation(rec, unit, key, rec.get("image"), _caption(rec, key))
        elif "image_list" in rec:
            s = self._edit_chain(rec, unit, key)
        elif "instruction" in rec:
            source = rec.get("source", rec.get("source_image"))
            if source is None:
                raise SkipSample("missing_media", "an editing record names no \"source\" (or \"source_image\")")
            s = self._generation(rec, unit, key, rec.get("target", rec.get("target_image")), rec["instruction"], source)
        elif "messages" in rec or "conversations" in rec:
            sample = parse_record(rec)
            if unit.url in DIGITS and hash_ints(self.seed, int(rec["index"]), _WAY_SALT) % 2 != epoch % 2:
                s = self._generation(rec, unit, key, _first_image(sample), DRAW_DIGIT.format(rec["answer"]))
            else:
                s = self._chat(sample, rec, unit)
        else:
            raise SkipSample("bad_schema", f"a BAGEL record has \"caption\" (text-to-image), \"instruction\" or "
                             f"\"image_list\" (editing) or \"messages\" / \"conversations\" (chat); keys: "
                             f"{sorted(rec)[:8]}")
        n_vit = int(sum(n.sum() for n in s.media.get("vit_lens", [])))
        return dataclasses.replace(s.doc(), sample_id=sid, n_patches=n_vit)

    def _ids(self, text: Any, what: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise SkipSample("empty", f"the {what} is not a non-empty string")
        return [self.specials.bos, *self.tok.encode(text), self.specials.eos]

    def _image(self, ref: Any, rec: dict, unit: Unit, fit: tuple[int, int]) -> np.ndarray:
        """[h, w, 3] uint8 RGB: the image of ``ref`` resized by :func:`fit_size` to ``fit`` (multiple, max side)."""
        if ref is None:
            raise SkipSample("missing_media", "the record names no image")
        try:
            with Image.open(io.BytesIO(media_bytes(ref, rec, unit, self.data.media_root))) as im:
                return fitted(im, fit, self.data)
        except OSError as e:  # PIL's error for bytes that are no image
            raise SkipSample("corrupt_image", f"{str(ref)[:200]}: {e}") from None

    def _vae_image(self, s: _Sample, rgb_HWC: np.ndarray, noised: bool, unit: int) -> None:
        """The image's VAE split: its latents encoded here, or (deferred) zeros with the image carried for
        :class:`BagelEncoder`."""
        if self.codec is not None:
            s.vae_image(self.codec.encode(_unit_range(rgb_HWC)[None])[0], noised=noised, unit=unit)
            return
        H, W = rgb_HWC.shape[:2]
        down = self.cfg.vae_config.downsample
        s.vae_image(torch.zeros(self.cfg.vae_config.z_channels, H // down, W // down), noised=noised, unit=unit)
        s.media.setdefault("vae_pixels", []).append(np.ascontiguousarray(rgb_HWC, dtype=np.uint8).reshape(-1))
        s.media.setdefault("vae_sizes", []).append(np.array([[H, W]], np.int64))

    def _generation(self, rec: dict, unit: Unit, key: tuple, target: Any, prompt: Any, source: Any = None) -> _Sample:
        """[source's VAE + ViT splits] [bos prompt eos] | target's noised VAE split; the prompt, the source's VAE and
        ViT splits each dropped with their data.*_dropout probability."""
        s, d = _Sample(self.cfg, self.specials), self.data
        ids = self._ids(prompt, "caption / instruction / prompt")
        if source is not None:
            self._condition(s, key, self._image(source, rec, unit, self.both_fit))
        if _kept(key, _DROP_SALT, d.prompt_dropout):
            s.text(ids, loss=False)
        self._vae_image(s, self._image(target, rec, unit, self.vae_fit), noised=True, unit=0)
        return s

    def _condition(self, s: _Sample, key: tuple, rgb_HWC: np.ndarray) -> None:
        """A conditioning image: its clean VAE split and its ViT split, each dropped with data.vae_cond_dropout /
        vit_cond_dropout (the position still taken)."""
        if _kept(key, _VAE_SALT, self.data.vae_cond_dropout):
            self._vae_image(s, rgb_HWC, noised=False, unit=-1)
        else:
            s.dropped_image()
        if _kept(key, _VIT_SALT, self.data.vit_cond_dropout):
            s.vit_image(_unit_range(rgb_HWC))
        else:
            s.dropped_image()

    def _edit_chain(self, rec: dict, unit: Unit, key: tuple) -> _Sample:
        """BAGEL's edit parquet row (its ``UnifiedEditIterableDataset``): ``image_list`` [N >= 2 images, each edited
        into the next] and ``instruction_list`` [N - 1 lists of variants of each edit's instruction]. As BAGEL draws
        them, here from (seed, sample, epoch): a span start .. end of at most two edits; the start image conditions
        (clean VAE + ViT); then either the span's instructions joined ("a. b.", end pulled back one when it is the
        chain's last image) and the end image as the one target, or each edit's instruction followed by its image
        as a target, the images before the end also conditioning what follows. One variant of each instruction."""
        images, instrs = rec["image_list"], rec.get("instruction_list")
        if not isinstance(images, (list, tuple)) or len(images) < 2:
            raise SkipSample("bad_schema", "\"image_list\" must list at least 2 images (a source and its edit)")
        n = len(images)
        if not isinstance(instrs, (list, tuple)) or len(instrs) != n - 1:
            raise SkipSample("bad_schema", f"\"instruction_list\" must hold one entry per edit: {n - 1} for {n} images")

        def draw(salt: int, k: int) -> int:
            return hash_ints(*key, salt) % k

        def variant(i: int) -> str:  # one variant of edit i's instruction (a string is its only one)
            v = [instrs[i]] if isinstance(instrs[i], str) else list(instrs[i])
            if not v:
                raise SkipSample("empty", f"instruction_list[{i}] holds no instruction")
            return v[draw(_CHAIN_SALT + 3 + i, len(v))]

        start = draw(_CHAIN_SALT, n - 1)
        end = start + 1 + draw(_CHAIN_SALT + 1, min(start + 3, n) - start - 1)
        s, targets = _Sample(self.cfg, self.specials), 0
        self._condition(s, (*key, start), self._image(images[start], rec, unit, self.both_fit))
        joined = end - start > 1 and draw(_CHAIN_SALT + 2, 2) == 0
        if joined and end == n - 1:
            end -= 1
        texts = ["".join(variant(i - 1) + ". " for i in range(start + 1, end + 1)).rstrip()] if joined else None
        for i in ([end] if joined else range(start + 1, end + 1)):
            text = texts[0] if joined else variant(i - 1)
            if _kept((*key, i), _DROP_SALT, self.data.prompt_dropout):
                s.text(self._ids(text, "instruction"), loss=False)
            last = i == end
            img = self._image(images[i], rec, unit, self.vae_fit if last else self.both_fit)
            self._vae_image(s, img, noised=True, unit=targets)
            targets += 1
            if not last:  # the next edit starts from this image
                self._condition(s, (*key, i), img)
        return s

    def _chat(self, sample, rec: dict, unit: Unit) -> _Sample:
        """Per message: each image a ViT split, each run of text [bos text eos], CE on the assistant's
        (:func:`chat_runs`)."""
        s, loss = _Sample(self.cfg, self.specials), False
        for kind, x, answer in chat_runs(sample):
            if kind == "image":
                s.vit_image(_unit_range(self._image(x, rec, unit, self.vit_fit)))
                continue
            s.text(self._ids(x, "text"), loss=answer)
            loss |= answer
        if not loss:
            raise SkipSample("empty", "a chat needs an assistant message with text (the CE target)")
        return s


def chat_runs(sample) -> Iterator[tuple[str, Any, bool]]:
    """A parsed chat in BAGEL's layout (SftJSONLIterableDataset.change_format: no roles; the prompt's text around an
    image stripped, the answer as given): per message, ``("text", text, from the assistant)`` for each run of text
    and ``("image", its reference, False)`` for each image part, in order; any other part is SkipSample."""
    for m in sample.messages or []:
        text: list[str] = []
        for part in [*m.parts, None]:  # None: the end of the message closes its last text
            if part is not None and part.type == "text":
                text.append(part.text)
                continue
            said = "".join(text) if m.role == "assistant" else "".join(text).strip()  # as change_format
            if said.strip():
                yield "text", said, m.role == "assistant"
            text = []
            if part is not None and part.type != "image":
                raise SkipSample("unknown_modality", f"a {part.type} part: BAGEL reads text and images")
            if part is not None:
                yield "image", part.ref, False


def fitted(im: Image.Image, fit: tuple[int, int], data) -> np.ndarray:
    """[h, w, 3] uint8: ``im`` in RGB, resized (bicubic) by :func:`fit_size` to ``fit`` (multiple, max side)."""
    im = im.convert("RGB")
    h, w = fit_size(im.height, im.width, *fit, data)
    if (h, w) != (im.height, im.width):
        im = im.resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(im)


def vit_fit(cfg: BagelConfig) -> tuple[int, int]:
    """(multiple, max side) of a ViT split's image: the ViT patch, and the position table's side in pixels."""
    p = cfg.vit_config.patch_size
    return p, cfg.vit_max_num_patch_per_side * p


# ------------------------------------------------------------------------------ the serving engine's image splits
def image_pad(cfg: BagelConfig, tokenizer) -> int:
    """SplitLayout.pad: the prompt token standing for an image: the tokenizer's ``<|image_pad|>`` where BAGEL's
    specials are the tokenizer's (:func:`specials_for`), else the debug vocabulary's."""
    pad = tokenizer.image_pad_id
    if specials_for(tokenizer, cfg) == DEBUG_SPECIALS or pad is None or pad >= cfg.llm_config.vocab_size:
        return DEBUG_IMAGE_PAD
    return pad


def image_split(cfg: BagelConfig, payload: Any, data, tokenizer) -> ImageSplit:
    """SplitLayout.image: an image (a PIL image, encoded bytes or an [H, W(, 3)] uint8 array) as the VLM chat's rows
    give it (:class:`BagelDocs`: :func:`fitted` to the ViT's sizes, then ``_Sample.vit_image``): ``[vision_start,
    a token per patch, vision_end]`` on one position, bidirectional, the next token one position further; the
    token kinds and the ViT's patches, positions and length."""
    try:
        if isinstance(payload, np.ndarray):
            im = Image.fromarray(payload)
        else:
            im = payload if isinstance(payload, Image.Image) else Image.open(io.BytesIO(payload))
        image = _unit_range(fitted(im, vit_fit(cfg), data))
    except (OSError, TypeError, ValueError) as e:  # PIL's errors for bytes or arrays that are no image
        raise SkipSample("corrupt_image", f"cannot read the image ({type(e).__name__}: {e})") from None
    s = _Sample(cfg, specials_for(tokenizer, cfg))
    s.vit_image(image)
    d = s.doc()
    return ImageSplit(ids=d.input_ids.tolist(), positions=(d.positions[0] - d.positions[0, 0]).tolist(),
                      advance=s.rope, seq={"token_kind": d.seq["token_kind"]},
                      flat={k: np.concatenate(v) for k, v in s.media.items()})


def chat_prompt(cfg: BagelConfig, sample, tokenizer) -> list[int]:
    """SplitLayout.chat: a chat's prompt as the VLM chat's rows lay it out (:func:`chat_runs`: each run of text
    ``[bos text eos]``, no roles), an :func:`image_pad` per image part, then the answer's ``bos``."""
    sp, pad = specials_for(tokenizer, cfg), image_pad(cfg, tokenizer)
    ids: list[int] = []
    for kind, x, _ in chat_runs(sample):
        ids += [pad] if kind == "image" else [sp.bos, *tokenizer.encode(x), sp.eos]
    return [*ids, sp.bos]


class BagelEncoder:
    """DocLayout.encoder: the codec of ``data.encoders`` on ``device`` (the trainer's), which fills a deferred
    batch's VAE splits: each image encoded as :class:`BagelDocs` encodes it, images of one size together (up to
    :data:`ENCODE_PIXELS` a call), its latent patches written at its VAE tokens (in token order; ``latents`` for a
    noised split, ``cond_latents`` for a clean one). The latents come back to the host, where the step reads the
    batch."""

    def __init__(self, cfg: BagelConfig, data, device: str | torch.device = "cpu", max_pixels: int = ENCODE_PIXELS):
        self.cfg, self.max_pixels = cfg, max_pixels
        self.codec: FluxVAE | PixelCodec | CachedCodec = load_codec(data.encoders, cfg, device)

    def __call__(self, batch: dict) -> dict:
        if DEFERRED[0] not in batch:
            return batch
        lp = self.cfg.latent_patch_size
        return _place(batch, [patchify(z, lp) for z in self.encode(carried(batch.pop(DEFERRED[0]),
                                                                          batch.pop(DEFERRED[1])))])

    def encode(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """Latents [z, h, w] of uint8 RGB images [H, W, 3], those of one size together (``max_pixels`` a call)."""
        by_size: dict[tuple, list[int]] = {}
        for i, im in enumerate(images):
            by_size.setdefault(im.shape, []).append(i)
        out: list = [None] * len(images)
        for (h, w, _), idx in by_size.items():
            per = max(1, self.max_pixels // (h * w))
            for a in range(0, len(idx), per):
                part = idx[a : a + per]
                z = self.codec.encode(torch.stack([_unit_range(images[i]) for i in part]))
                for i, zi in zip(part, z):
                    out[i] = zi
        return out


def carried(pixels, sizes) -> list[np.ndarray]:
    """The uint8 RGB images [H, W, 3] a deferred batch or doc carries (:data:`DEFERRED`: flat pixels, (H, W) each)."""
    pixels, sizes = np.asarray(pixels), np.asarray(sizes).reshape(-1, 2).tolist()
    ends = np.cumsum([h * w * 3 for h, w in sizes]).tolist()
    return [pixels[e - h * w * 3 : e].reshape(h, w, 3) for (h, w), e in zip(sizes, ends)]


def write_latent_cache(cfg: BagelConfig, data, tokenizer, seed: int, out: str, device: str | torch.device = "cpu",
                       rows_per_shard: int = 256, max_pixels: int = ENCODE_PIXELS) -> dict:
    """DocLayout.cache: every VAE image of data.dataset / data.mixture's records, sized as the rows size them (epochs
    0 and 1, as the digits change ways by epoch; no dropout), encoded once by the codec of ``data.encoders`` on
    ``device`` and written to ``out`` (safetensors shards of ``rows_per_shard`` latents keyed by
    :func:`~titan_mm.models.bagel.vae.image_key`, then the index); ``data.encoders = out`` then reads them
    (CachedCodec). Records that make no sample are counted by reason. Returns the index."""
    if is_latent_cache(data.encoders):
        raise ValueError(f"data.encoders {data.encoders!r} is a latent cache already; give the VAE (or \"pixels\")")
    undropped = dataclasses.replace(data, prompt_dropout=0.0, vit_cond_dropout=0.0, vae_cond_dropout=0.0)
    docs, enc = BagelDocs(cfg, undropped, tokenizer, seed, defer=True), BagelEncoder(cfg, data, device, max_pixels)
    os.makedirs(out, exist_ok=True)
    seen: set[str] = set()
    pending: dict[str, np.ndarray] = {}  # the next shard's images, encoded and written when it is full
    shards: dict[str, list[str]] = {}
    skipped: dict[str, int] = {}

    def write_shard() -> None:
        name = f"latents-{len(shards):05d}.safetensors"
        latents = [z.contiguous().clone() for z in enc.encode(list(pending.values()))]  # own storage each
        save_file(dict(zip(pending, latents)), os.path.join(out, name))
        shards[name] = list(pending)
        pending.clear()

    for spec, _ in resolve_sources(data.dataset, data.mixture):
        for unit in list_units(spec):
            for _, rid, _, rec in READERS[unit.fmt](unit, 0, None):
                for epoch in (0, 1):
                    try:
                        d = docs(rec, unit, f"{unit.source}/{unit.uid}:{rid}", epoch)
                    except SkipSample as e:
                        skipped[e.reason] = skipped.get(e.reason, 0) + (epoch == 0)
                        continue
                    if DEFERRED[0] not in d.media:  # a chat: no VAE split
                        continue
                    for im in carried(np.concatenate(d.media[DEFERRED[0]]), np.concatenate(d.media[DEFERRED[1]])):
                        key = image_key(_unit_range(im))
                        if key not in seen:
                            seen.add(key)
                            pending[key] = im
                            if len(pending) == rows_per_shard:
                                write_shard()
    if pending:
        write_shard()
    idx = {"format": CACHE_FORMAT, "z_channels": cfg.vae_config.z_channels, "downsample": cfg.vae_config.downsample,
           "encoders": data.encoders if data.encoders == PIXELS else os.path.abspath(data.encoders),
           "images": len(seen), "shards": shards, "skipped": skipped}
    with open(os.path.join(out, CACHE_INDEX + ".tmp"), "w") as fh:
        json.dump(idx, fh)
    os.replace(os.path.join(out, CACHE_INDEX + ".tmp"), os.path.join(out, CACHE_INDEX))  # written last: complete
    return idx


def _place(batch: dict, patches: list[torch.Tensor]) -> dict:
    """Each image's latent patches at its VAE tokens, in token order: ``latents`` where the split is noised,
    ``cond_latents`` where it is clean."""
    tokens = (batch["token_kind"].reshape(-1) == VAE).nonzero().squeeze(1)
    lens = [p.shape[0] for p in patches]
    if sum(lens) != tokens.numel():
        raise ValueError(f"a deferred batch has {tokens.numel()} VAE tokens but its {len(lens)} images make "
                         f"{sum(lens)} latent patches; the builder and the encoder disagree")
    P = batch["latents"].shape[-1]
    noised = batch["latent_mask"].reshape(-1)
    lat, cond = batch["latents"].view(-1, P), batch["cond_latents"].view(-1, P)
    for at, p in zip(tokens.split(lens), patches):
        (lat if bool(noised[at[0]]) else cond)[at] = p.to(lat.dtype)
    return batch


def _kept(key: tuple, salt: int, p_drop: float) -> bool:
    """Whether a part survives its dropout ``p_drop``, drawn from (seed, sample, epoch) on its own hash stream."""
    return hash_ints(*key, salt) / 2.0**64 >= p_drop


def _caption(rec: dict, key: tuple) -> Any:
    """The record's caption, or one of its ``captions`` (BAGEL's t2i parquet: a JSON object or list of several, one
    drawn as T2IIterableDataset does, here from (seed, sample, epoch))."""
    if "caption" in rec:
        return rec["caption"]
    caps = rec["captions"]
    try:
        caps = json.loads(caps) if isinstance(caps, str) else caps
    except ValueError:
        raise SkipSample("bad_schema", "\"captions\" is a string but not JSON (an object or list of captions)") from None
    caps = list(caps.values()) if isinstance(caps, dict) else caps
    if not isinstance(caps, list) or not caps:
        raise SkipSample("empty", "\"captions\" holds no caption")
    return caps[hash_ints(*key, _CAPTION_SALT) % len(caps)]


def _first_image(sample) -> Any:
    refs = [p.ref for m in sample.messages or [] for p in m.parts if p.type == "image"]
    if not refs:
        raise SkipSample("missing_media", "a digits record without its image")
    return refs[0]


def data_needs(cfg: BagelConfig) -> DataNeeds:
    """1-D positions, ChatML; the documents built by :class:`BagelDocs` (a record's splits), collated by
    :func:`collate`; served images as ViT splits (:func:`image_split`, :func:`image_pad`, :func:`chat_prompt`)."""
    return DataNeeds(positions="1d", video=False, chat_template="chatml",
                     docs=DocLayout(builder=Bound(BagelDocs, cfg), collate=collate, encoder=Bound(BagelEncoder, cfg),
                                    cache=Bound(write_latent_cache, cfg)),
                     splits=SplitLayout(image=Bound(image_split, cfg), pad=Bound(image_pad, cfg),
                                        chat=Bound(chat_prompt, cfg)))
