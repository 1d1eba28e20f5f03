"""Synthetic BAGEL rows for ``data.dataset = "synthetic"`` (ModelSpec.synthetic): packed rows of the three kinds of
BAGEL sample, about a class c in 0..9 whose image is a fixed random pattern (plus noise), so both losses can fall:

  understanding  [bos what eos] causal | [vs, ViT patches of c's image, ve] full | [bos c eos] causal, CE on "c eos"
  generation     [bos draw c eos] causal | [vs, noised latents of c's image, ve] noise (the MSE)
  editing        [bos c eos] causal | [vs, clean latents of c's image, ve] full (t = 0, no loss) |
                 [bos draw c' eos] causal | [vs, noised latents of c' = c + 1's image, ve] noise

Positions as BAGEL's packer gives them: text counts up, every token of an image split (its vs / ve included) shares one
position, and the next split starts one further, except after a noised image. Rows go through the data pipeline's
collator (titan_mm.data.packing.collate_rows). Row r of step t is drawn from a generator seeded by (seed, t, r) alone
(titan_mm.train.synthetic), so the global batch is the same on any dp world and exact on resume."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from titan_mm.data.packing import IGNORE_INDEX, Doc, collate_rows
from titan_mm.models.bagel.config import BagelConfig
from titan_mm.models.bagel.model import flat_positions, patchify
from titan_mm.models.bagel.spec import SCHEMA, TEXT, VAE, VIT

BOS, EOS, VISION_START, VISION_END, WHAT, DRAW, DIGIT0 = 1, 2, 3, 4, 5, 6, 10


class Specials(NamedTuple):
    """The ids BAGEL's packer puts around a text split (``bos`` / ``eos``: <|im_start|> / <|im_end|>) and an image
    split (<|vision_start|> / <|vision_end|>), as data_utils.add_special_tokens names them."""

    bos: int
    eos: int
    vision_start: int
    vision_end: int


DEBUG_SPECIALS = Specials(BOS, EOS, VISION_START, VISION_END)
"""The synthetic rows' and the debug vocabulary's."""
DEBUG_IMAGE_PAD = 9
"""The debug vocabulary's token standing for an image in a served prompt (no synthetic row uses it)."""

IMAGE_PATCHES = 2
"""ViT patches and latent patches per side of a synthetic image."""
ROW_TOKENS = 3 + (IMAGE_PATCHES**2 + 2) + 3 + 4 + (IMAGE_PATCHES**2 + 2) + 3 + 2 * (IMAGE_PATCHES**2 + 2) + 4
"""Tokens of one row's three samples (understanding, generation, editing)."""


class _Sample:
    """One sample's tokens, per-token arrays and splits, built split by split as BAGEL's packer does."""

    def __init__(self, cfg: BagelConfig, specials: Specials = DEBUG_SPECIALS):
        self.sp, self.cfg, self.ids, self.labels, self.pos, self.kind, self.segs = specials, cfg, [], [], [], [], []
        self.P = cfg.patch_latent_dim
        self.latents, self.cond, self.lat_mask, self.unit, self.lat_pos, self.media = [], [], [], [], [], {}
        self.rope = 0

    def _tokens(self, ids, labels, kinds, lat=None, cond=None, mask=None, unit=-1, lat_pos=None):
        n = len(ids)
        self.ids += ids
        self.labels += labels
        self.kind += kinds
        self.latents.append(np.zeros((n, self.P), np.float32) if lat is None else lat)
        self.cond.append(np.zeros((n, self.P), np.float32) if cond is None else cond)
        self.lat_mask += [False] * n if mask is None else mask
        self.unit += [unit] * n
        self.lat_pos += [0] * n if lat_pos is None else lat_pos

    def text(self, ids, loss: bool):
        """A causal split: ``ids`` with their next-token labels (the last one's is IGNORE) when ``loss``."""
        labels = ids[1:] + [IGNORE_INDEX] if loss else [IGNORE_INDEX] * len(ids)
        self._tokens(ids, labels, [TEXT] * len(ids))
        self.pos += range(self.rope, self.rope + len(ids))
        self.rope += len(ids)
        self.segs.append((len(ids), "causal"))

    def vit_image(self, image_CHW: torch.Tensor):
        p = self.cfg.vit_config.patch_size
        patches = patchify(image_CHW, p).numpy()
        n = patches.shape[0]
        pos = flat_positions(image_CHW.shape[1] // p, image_CHW.shape[2] // p, self.cfg.vit_max_num_patch_per_side)
        self._tokens(self._image_ids(n), [IGNORE_INDEX] * (n + 2), [TEXT] + [VIT] * n + [TEXT])
        for key, a in (("vit_patches", patches), ("vit_pos", pos.numpy()), ("vit_lens", np.array([n]))):
            self.media.setdefault(key, []).append(a)
        self._image_split(n, "full", next_rope=1)

    def vae_image(self, latent_CHW: torch.Tensor, noised: bool, unit: int):
        patches = patchify(latent_CHW, self.cfg.latent_patch_size).numpy()
        n = patches.shape[0]
        lp = self.cfg.latent_patch_size
        pos = flat_positions(latent_CHW.shape[1] // lp, latent_CHW.shape[2] // lp, self.cfg.max_latent_size).tolist()
        zero = np.zeros((1, self.P), np.float32)
        body = np.concatenate([zero, patches, zero])
        self._tokens(self._image_ids(n), [IGNORE_INDEX] * (n + 2), [TEXT] + [VAE] * n + [TEXT],
                     lat=body if noised else None, cond=None if noised else body,
                     mask=[False] + [noised] * n + [False], unit=unit if noised else -1, lat_pos=[0] + pos + [0])
        self._image_split(n, "noise" if noised else "full", next_rope=0 if noised else 1)

    def _image_ids(self, n: int) -> list[int]:
        return [self.sp.vision_start] + [0] * n + [self.sp.vision_end]

    def dropped_image(self):
        """A conditioning image left out (classifier-free guidance's training half): BAGEL's packer still gives it
        its position, so the next split starts one further."""
        self.rope += 1

    def _image_split(self, n: int, kind: str, next_rope: int):
        self.pos += [self.rope] * (n + 2)
        self.rope += next_rope
        self.segs.append((n + 2, kind))

    def doc(self) -> Doc:
        seq = {"token_kind": np.array(self.kind, np.int8), "latents": np.concatenate(self.latents),
               "latent_mask": np.array(self.lat_mask), "noise_unit": np.array(self.unit, np.int64),
               "cond_latents": np.concatenate(self.cond), "latent_pos": np.array(self.lat_pos, np.int64)}
        return Doc(np.array(self.ids, np.int64), np.array(self.labels, np.int64),
                   positions=np.array(self.pos, np.int64)[None], media=self.media, seq=seq, segments=tuple(self.segs))


def class_images(cfg: BagelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels [10, C, h, w], latents [10, z, h', w']): each class's fixed pattern (IMAGE_PATCHES per side)."""
    g = torch.Generator().manual_seed(4321)
    side_px = IMAGE_PATCHES * cfg.vit_config.patch_size
    side_lat = IMAGE_PATCHES * cfg.latent_patch_size
    pixels = torch.randn(10, cfg.vit_config.num_channels, side_px, side_px, generator=g)
    latents = torch.tanh(torch.randn(10, cfg.vae_config.z_channels, side_lat, side_lat, generator=g))
    return pixels, latents


def row(cfg: BagelConfig, g: torch.Generator, pixels: torch.Tensor, latents: torch.Tensor) -> list[Doc]:
    """The three samples of one row (module docstring), classes and noise drawn from ``g``."""
    c = torch.randint(0, 10, (3,), generator=g).tolist()
    und = _Sample(cfg)
    und.text([BOS, WHAT, EOS], loss=False)
    und.vit_image(pixels[c[0]] + 0.3 * torch.randn(pixels.shape[1:], generator=g))
    und.text([BOS, DIGIT0 + c[0], EOS], loss=True)
    gen = _Sample(cfg)
    gen.text([BOS, DRAW, DIGIT0 + c[1], EOS], loss=False)
    gen.vae_image(latents[c[1]] + 0.1 * torch.randn(latents.shape[1:], generator=g), noised=True, unit=0)
    edit = _Sample(cfg)
    edit.text([BOS, DIGIT0 + c[2], EOS], loss=False)
    edit.vae_image(latents[c[2]], noised=False, unit=-1)
    edit.text([BOS, DRAW, DIGIT0 + (c[2] + 1) % 10, EOS], loss=False)
    edit.vae_image(latents[(c[2] + 1) % 10] + 0.1 * torch.randn(latents.shape[1:], generator=g), noised=True, unit=1)
    return [und.doc(), gen.doc(), edit.doc()]


def make_batch(cfg: BagelConfig, seq_len: int, gens: list[torch.Generator]) -> dict:
    pixels, latents = class_images(cfg)
    return collate_rows([row(cfg, g, pixels, latents) for g in gens], seq_len, pad_id=0, position_axes=1,
                        multiple=1, schema=SCHEMA)


def synthetic(cfg: BagelConfig, seq_len: int) -> Callable[[list[torch.Generator]], dict]:
    """ModelSpec.synthetic: rows of ``seq_len`` tokens, each the three samples of the module docstring."""
    if seq_len < ROW_TOKENS:
        raise ValueError(f"data.seq_len = {seq_len}: a synthetic BAGEL row holds {ROW_TOKENS} tokens (three samples); "
                         f"use at least {ROW_TOKENS}")
    if cfg.llm_config.vocab_size < DIGIT0 + 10:
        raise ValueError(f"synthetic BAGEL rows use token ids below {DIGIT0 + 10}; the vocabulary has "
                         f"{cfg.llm_config.vocab_size}")
    return functools.partial(make_batch, cfg, seq_len)


def bench_rows(cfg: BagelConfig, rows: int, seq_len: int, image: tuple[int, int] = (32, 32),
               latent: tuple[int, int] = (32, 32), prompt: int = 64, answer: int = 256, seed: int = 0) -> dict:
    """Packed rows of ``seq_len`` tokens for bench/mfu.py: understanding samples (``prompt`` tokens, a ViT image of
    ``image`` = (h, w) patches, an ``answer`` with CE) and generation samples (``prompt`` tokens, a noised VAE image of
    ``latent`` = (h, w) latent patches) in turn while the next one fits, then one text sample (CE) on the rest; random
    token ids, pixels and latents."""
    g = torch.Generator().manual_seed(seed)
    vit, lp = cfg.vit_config, cfg.latent_patch_size
    need = (prompt + image[0] * image[1] + 2 + answer, prompt + latent[0] * latent[1] + 2)  # understanding, generation
    ids = lambda n: torch.randint(0, cfg.llm_config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for _ in range(rows):
        docs, left = [], seq_len
        while need[len(docs) % 2] <= left:
            s = _Sample(cfg)
            s.text(ids(prompt), loss=False)
            if len(docs) % 2 == 0:
                s.vit_image(torch.randn(vit.num_channels, image[0] * vit.patch_size, image[1] * vit.patch_size,
                                        generator=g))
                s.text(ids(answer), loss=True)
            else:
                s.vae_image(torch.randn(cfg.vae_config.z_channels, latent[0] * lp, latent[1] * lp, generator=g),
                            noised=True, unit=len(docs) // 2)
            docs.append(s.doc())
            left -= need[(len(docs) - 1) % 2]
        if left:
            s = _Sample(cfg)
            s.text(ids(left), loss=True)
            docs.append(s.doc())
        out.append(docs)
    return collate_rows(out, seq_len, pad_id=0, position_axes=1, multiple=1, schema=SCHEMA)
