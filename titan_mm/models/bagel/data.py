"""BAGEL's text-to-image samples from image + caption rows: the caption a causal split (no loss), the image encoded by
the frozen FLUX VAE (titan_mm.models.bagel.vae) into a noised VAE split (flow matching's x0), as BAGEL's
``T2IIterableDataset`` and ``PackedDataset`` build them; packed best-fit into rows (titan_mm.data.packing) and
collated by the one collator into the batch the family's loss reads (spec.SCHEMA).

The rows are JSONL, one ``{"image": PATH, "caption": TEXT}`` per line, PATH relative to the file's folder: the
nearest simple form of BAGEL's t2i parquet (an ``image`` of encoded bytes and a ``captions`` JSON of several, one
drawn per sample). Classifier-free guidance's training half is BAGEL's ``text_cond_dropout_prob``: with
``drop_text`` the caption split is left out of a sample (drawn per sample index and seed, so a pass is
reproducible), which is the unconditional context the sampler's text guidance runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from titan_mm.data.packing import BestFitPacker, Doc, collate_rows
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.spec import SCHEMA
from titan_mm.models.bagel.synthetic import DEBUG_SPECIALS, Specials, _Sample
from titan_mm.models.bagel.vae import FluxVAE


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
    return torch.from_numpy(a).permute(2, 0, 1) / 127.5 - 1


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

        def collated(rows):
            return collate_rows([_units_numbered(r) for r in rows], seq_len, pad_id=0, position_axes=1, multiple=1,
                                schema=SCHEMA)

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
