"""The digits debug task's held-out evaluation (issue 47 item 5): a BAGEL trained on ``builtin:digits`` asked both
ways (titan_mm.models.bagel.data), scored on ``builtin:digits_test``, the images training never reads.

- Understanding: each held-out image's chat ("<image> What digit is this?") built by the run's own document builder
  (``BagelDocs``, the rows' codec and image sizes), its answer continued greedily: each token by re-running the whole
  batch through the training forward (the serving engine takes BAGEL's text, not its images yet) and taking the
  argmax at the last position.
  Right when the answer is the digit's tokens followed by the end of the turn (exact match).
- Generation: "Draw the digit d." sampled by the image sampler (:func:`titan_mm.models.bagel.sample.sample`: Euler
  steps, text classifier-free guidance), decoded by the run's codec, and read by a scikit-learn SVM trained on the
  digits' training split at 8 x 8, their native size. Right when it reads d.

The command line is python -m titan_mm.tools.bagel_digits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.svm import SVC

from titan_mm.data.builtin.images import digits_data, digits_records
from titan_mm.data.packing import IGNORE_INDEX, Doc
from titan_mm.data.sources import Unit
from titan_mm.models.bagel.data import DRAW_DIGIT, BagelDocs, collate, fit_size
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.sample import sample
from titan_mm.models.bagel.spec import ROUTING_KEYS, prepare_batch
from titan_mm.nn.attention import build_attn_meta

SAMPLER = {"steps": 25, "shift": 1.0, "cfg_text_scale": 4.0}
"""The task's sampler settings: 25 points, no timestep shift (the run trains without one), text guidance 4 in
(0.4, 1] (BAGEL's)."""
CHAT = Unit("digits_eval", "digits_eval", "builtin")
"""The unit the held-out records are built under: not builtin:digits', so each is read as the chat it is."""


def held_out(i: int) -> bool:
    """The built-in digits' held-out split (titan_mm.data.builtin.images.digits_records): index % 5 == 0."""
    return i % 5 == 0


@lru_cache(maxsize=1)
def classifier() -> SVC:
    """An RBF SVM on the 8 x 8 digits of the training split (values 0..16, ink high, as load_digits gives them)."""
    images, target = digits_data()
    train = np.array([not held_out(i) for i in range(len(target))])
    return SVC(gamma=0.001, C=10.0).fit(images[train].reshape(-1, 64), target[train])


def ink_8x8(images_BCHW: torch.Tensor) -> np.ndarray:
    """[B, 64] on load_digits' scale (0..16, ink high) of images [B, C, H, W] in [0, 1] with dark ink on white (the
    built-in digit images' polarity): channels averaged, area-resized to 8 x 8."""
    g = images_BCHW.float().mean(1, keepdim=True)
    if g.shape[-2:] != (8, 8):
        g = F.interpolate(g, size=(8, 8), mode="area")
    return (16.0 * (1.0 - g)).clamp(0, 16).reshape(len(g), 64).numpy()


def classify(images_BCHW: torch.Tensor) -> np.ndarray:
    """The digit [B] the classifier reads in each image."""
    return classifier().predict(ink_8x8(images_BCHW))


def answer_prefix(doc: Doc, answer_len: int, tokens: list[int]) -> Doc:
    """``doc`` (a chat whose last split is its answer ``[bos a... eos]`` of ``answer_len`` tokens) cut to the
    answer's ``bos`` followed by ``tokens`` (the answer so far), with no labels: what greedy decoding runs."""
    if 1 + len(tokens) > answer_len:
        raise ValueError(f"{len(tokens)} answer tokens do not fit the answer split of {answer_len}")
    start = len(doc) - answer_len
    n = start + 1 + len(tokens)
    ids = doc.input_ids[:n].copy()
    ids[start + 1:] = tokens
    segs = (*doc.segments[:-1], (1 + len(tokens), doc.segments[-1][1]))
    return dataclasses.replace(doc, input_ids=ids, labels=np.full(n, IGNORE_INDEX, np.int64),
                               positions=doc.positions[:, :n], seq={k: v[:n] for k, v in doc.seq.items()},
                               segments=segs)


@torch.no_grad()
def greedy(model: BagelModel, docs: list[Doc], answer_len: int, eos: int) -> list[list[int]]:
    """The greedy answers (ids, ``eos`` excluded) of chats ``docs`` whose answers are ``answer_len`` tokens with
    their bos and eos: up to ``answer_len - 1`` tokens, the whole batch re-run per token."""
    dev = model.llm2vae.weight.device
    out: list[list[int]] = [[] for _ in docs]
    done = [False] * len(docs)
    for _ in range(answer_len - 1):
        rows = [[answer_prefix(d, answer_len, a)] for d, a in zip(docs, out)]
        seq = max(len(r[0]) for r in rows)
        b = prepare_batch(model.cfg, collate(rows, seq), dev)
        attn = build_attn_meta(b, model.cfg.attn_backend, dev, kind="segments")
        b = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        last = torch.tensor([len(r[0]) - 1 for r in rows], device=dev)
        logits = model(b["input_ids"], position_ids=b["position_ids"], attn=attn, logits_at=last,
                       **{k: b[k] for k in ROUTING_KEYS}, noisy_latents=b["cond_latents"] * 0,
                       cond_latents=b["cond_latents"], timesteps=torch.zeros(b["input_ids"].shape, device=dev),
                       latent_pos=b["latent_pos"],
                       **{k: b[k] for k in ("vit_patches", "vit_pos", "vit_index", "vit_attn") if k in b}).logits
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            if not done[i]:
                done[i] = tok == eos
                if not done[i]:
                    out[i].append(tok)
    return [a if d else a + [-1] for a, d in zip(out, done)]  # no end of turn: not an exact answer


@dataclass
class Scores:
    understanding: float
    """Held-out images answered exactly (fraction)."""
    generation: float
    """Generated images the classifier reads as the digit asked (fraction)."""
    read: list[list[int]]
    """Per digit asked, the digits the classifier read in its images."""
    images: torch.Tensor
    """The generated images [10, n, 3, H, W] in [0, 1], digit by digit."""


def understanding(model: BagelModel, docs: BagelDocs, limit: int | None = None) -> float:
    """Exact-match accuracy of the greedy answers on the held-out images (the first ``limit``)."""
    recs = digits_records(test=True)[:limit]
    tok, eos = docs.tok, docs.specials.eos
    answers = [tok.encode(r["answer"]) for r in recs]
    right = 0
    for n in sorted({len(a) for a in answers}):  # one batch per answer length (a digit is one token in Qwen's)
        group = [(r, a) for r, a in zip(recs, answers) if len(a) == n]
        chats = [docs(r, CHAT, f"digits_test:{r['index']}") for r, _ in group]
        got = greedy(model, chats, n + 2, eos)
        right += sum(g == a for g, (_, a) in zip(got, group))
    return right / len(recs)


def generation(model: BagelModel, docs: BagelDocs, per_digit: int, size: tuple[int, int], seed: int = 0,
               **sampler) -> tuple[float, list[list[int]], torch.Tensor]:
    """(accuracy, digits read per digit asked, images [10, per_digit, 3, H, W]): ``per_digit`` images of each digit
    at ``size`` pixels, noise drawn from a generator seeded by ``seed``, sampled one by one (``sampler``: the
    sampler's settings) and decoded by the rows' codec."""
    cfg, codec = model.cfg, docs.codec
    down, p = cfg.vae_config.downsample, cfg.latent_patch_size
    hw = (size[0] // down, size[1] // down)
    g = torch.Generator().manual_seed(seed)
    read, images = [], []
    for d in range(10):
        ids = docs.tok.encode(DRAW_DIGIT.format(d))
        lat = [sample(model, ids, torch.randn(hw[0] // p * (hw[1] // p), cfg.patch_latent_dim, generator=g), hw,
                      specials=docs.specials, **sampler) for _ in range(per_digit)]
        images.append(codec.decode(torch.stack(lat)))
        read.append(classify(images[-1]).tolist())
    acc = float(np.mean([r == d for d, rs in enumerate(read) for r in rs]))
    return acc, read, torch.stack(images)


def evaluate(model: BagelModel, docs: BagelDocs, *, limit: int | None = None, per_digit: int = 10,
             size: tuple[int, int] | None = None, seed: int = 0, **sampler) -> Scores:
    """Both scores (module docstring). ``size``: the generated images' pixels (default: the size the rows give a
    digit's 64 x 64 image in a VAE split)."""
    model.eval()
    if size is None:
        size = fit_size(64, 64, *docs.vae_fit, docs.data)
    und = understanding(model, docs, limit)
    acc, read, images = generation(model, docs, per_digit, size, seed, **sampler)
    return Scores(und, acc, read, images)


def grid(images: torch.Tensor, scale: int = 3) -> torch.Tensor:
    """[3, 10 H s, n W s]: images [10, n, 3, H, W] as one picture, a row per digit, each pixel ``scale`` x ``scale``
    (nearest: 16-pixel digits are too small to see)."""
    D, n, C, H, W = images.shape
    g = images.permute(2, 0, 3, 1, 4).reshape(C, D * H, n * W)
    return g.repeat_interleave(scale, 1).repeat_interleave(scale, 2)

