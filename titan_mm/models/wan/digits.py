"""The moving-digits debug task (docs/wan.md "Digits debug task"): built-in clips of a scikit-learn digit moving
left, right, up or down across a small grayscale frame, captioned with the digit and the direction, learned by a tiny
Wan transformer on a CPU and scored on held-out digits.

- **Clips**: FRAMES frames of SIDE x SIDE pixels; the 8x8 digit (values 0-16) crosses the frame edge to edge,
  STEP pixels (one 4-pixel patch) a frame, on a line at a random whole-patch offset across the motion
  (ACROSS_STEP). Whole-patch steps and random offsets make the task one of relative positions (frame f + 1's
  patches are frame f's moved by one), which Wan's RoPE-only attention reads directly; sub-patch steps on a fixed line (8 frames, 1 pixel a frame) asked each
  patch where it sits in absolute terms, which the tiny model learnt far more slowly (docs/wan.md). The latents are the pixels themselves, x / 8 - 1 in [-1, 1], one channel:
  the patchifier (model.patchify) stands in the VAE's place, and :func:`to_frames` is the decode.
- **Text**: the caption "<digit> moving <direction>" (e.g. "three moving left") as one state per word from a
  frozen random table (WORDS, seeded: no UMT5); the model's own text embedder learns to read them. A row's states are
  zeroed with probability PROMPT_DROPOUT so that the empty prompt (zeros) guides sampling.
- **Split**: scikit-learn's digits with index % 5 == 0 are held out (360 images, as titan_mm.data.builtin.images'
  digits_records splits them); training clips draw the other 1437 only.
- **Score** (:func:`evaluate`): a clip sampled for a (digit, direction) prompt is right when the frames' digit (an SVC
  trained on the training split's 8x8 images, applied to each frame's brightest 8x8 window, majority over the frames)
  and the direction of the intensity centroid's least-squares slope (at least MIN_SPEED pixels a frame on the
  dominant axis) are both the prompt's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch

from titan_mm.data.builtin.images import digits_data
from titan_mm.models.wan.config import WanConfig
from titan_mm.models.wan.data import latent_batch
from titan_mm.models.wan.model import WanModel
from titan_mm.models.wan.sample import sample

FRAMES = 4
SIDE = 20
"""Frame side in pixels."""
DIGIT = 8
"""scikit-learn's digits are 8x8."""
STEP = 4
"""Pixels a frame: one patch of the digits flavor."""
ALONG = SIDE - DIGIT - (FRAMES - 1) * STEP
"""The largest start offset along the motion (the path stays inside the frame; 0: edge to edge)."""
ACROSS_STEP = 4
"""The across offsets' step: 4 (a patch) cuts every digit into the same 2x2 patches wherever it runs."""
DIRECTIONS = ("left", "right", "up", "down")
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS = (*NUMBERS, "moving", *DIRECTIONS)
TEXT_DIM = 32
"""Width of the frozen word states (the digits flavor's text_dim)."""
TEXT_SEED = 4829
PROMPT_DROPOUT = 0.1
MIN_SPEED = 0.5
"""Pixels a frame the centroid must move along its dominant axis for a clip to have a direction (the clips' is STEP)."""


def held_out(index: int) -> bool:
    """scikit-learn digit ``index`` is in the held-out split (never in a training clip)."""
    return index % 5 == 0


def split(test: bool) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8] in [0, 16], labels [N]) of the training (``test`` False) or held-out split."""
    images, labels = digits_data()
    keep = np.array([held_out(i) == test for i in range(len(labels))])
    return images[keep], labels[keep]


def caption(digit: int, direction: str) -> str:
    return f"{NUMBERS[digit]} moving {direction}"


@functools.lru_cache(maxsize=1)
def word_table() -> dict[str, torch.Tensor]:
    """The frozen state [TEXT_DIM] of each word, N(0, 1) from a fixed seed."""
    states = torch.randn(len(WORDS), TEXT_DIM, generator=torch.Generator().manual_seed(TEXT_SEED))
    return dict(zip(WORDS, states))


def text_states(prompt: str) -> torch.Tensor:
    """[words, TEXT_DIM] of a caption; one ValueError line for a word outside the task's vocabulary."""
    table = word_table()
    unknown = [w for w in prompt.split() if w not in table]
    if unknown or not prompt.split():
        raise ValueError(f"prompt {prompt!r}: the digits task knows the words {', '.join(WORDS)}; write e.g. "
                         f"{caption(3, 'left')!r}")
    return torch.stack([table[w] for w in prompt.split()])


def random_start(g: torch.Generator) -> tuple[int, int]:
    """(along, across): a path's start offset along the motion (0 to ALONG) and across it (0 to SIDE - DIGIT, a
    multiple of ACROSS_STEP)."""
    return (int(torch.randint(ALONG + 1, (1,), generator=g)),
            ACROSS_STEP * int(torch.randint((SIDE - DIGIT) // ACROSS_STEP + 1, (1,), generator=g)))


def positions(direction: str, along: int = 0, across: int = 0) -> list[tuple[int, int]]:
    """(row, column) of the digit's top-left corner in each frame of a path from ``along`` (counted from the edge
    the digit leaves), ``across`` from the top (horizontal motion) or the left (vertical)."""
    ends, far = [along + STEP * f for f in range(FRAMES)], SIDE - DIGIT
    return {"right": [(across, c) for c in ends], "left": [(across, far - c) for c in ends],
            "down": [(r, across) for r in ends], "up": [(far - r, across) for r in ends]}[direction]


def render(image_8x8: np.ndarray, direction: str, along: int = 0, across: int = 0) -> torch.Tensor:
    """Frames [FRAMES, SIDE, SIDE] in [0, 16] of the digit moving along :func:`positions`."""
    out = torch.zeros(FRAMES, SIDE, SIDE)
    img = torch.from_numpy(np.asarray(image_8x8, dtype=np.float32))
    for f, (r, c) in enumerate(positions(direction, along, across)):
        out[f, r: r + DIGIT, c: c + DIGIT] = img
    return out


def to_latents(frames: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 16] -> latents in [-1, 1] (the patchifier's "encode")."""
    return frames / 8 - 1


def to_frames(latents: torch.Tensor) -> torch.Tensor:
    """Latents [..., F, H, W] -> pixels in [0, 16] (the "decode"), clamped."""
    return ((latents + 1) * 8).clamp(0, 16)


def check_config(cfg: WanConfig) -> None:
    if cfg.in_channels != 1 or cfg.out_channels != 1 or cfg.text_dim != TEXT_DIM:
        raise ValueError(f"the digits task's clips are 1-channel pixels with {TEXT_DIM}-wide word states; this Wan "
                         f"config has in/out channels {cfg.in_channels}/{cfg.out_channels} and text_dim "
                         f"{cfg.text_dim}: use model.flavor = \"digits\"")


def clip_batch(cfg: WanConfig, gens: list[torch.Generator]) -> dict:
    """One micro-batch: per row a random training-split digit moving in a random direction from a random start, its
    caption's states (zeros with probability PROMPT_DROPOUT)."""
    images, labels = split(test=False)
    clips, texts = [], []
    for g in gens:
        i = int(torch.randint(len(labels), (1,), generator=g))
        direction = DIRECTIONS[int(torch.randint(len(DIRECTIONS), (1,), generator=g))]
        states = text_states(caption(int(labels[i]), direction))
        drop = float(torch.rand((), generator=g)) < PROMPT_DROPOUT
        texts.append(torch.zeros_like(states) if drop else states)
        clips.append(to_latents(render(images[i], direction, *random_start(g))))
    return latent_batch(cfg, torch.stack(clips)[:, None], torch.stack(texts))


def synthetic(cfg: WanConfig, seq_len: int) -> Callable[[list[torch.Generator]], dict]:
    """ModelSpec.synthetic for ``cfg.synthetic == "digits"``: the micro-batch of a row's generators."""
    check_config(cfg)
    pt, ph, pw = cfg.patch_size
    want = (FRAMES // pt) * (SIDE // ph) * (SIDE // pw)
    if FRAMES % pt or SIDE % ph or SIDE % pw or seq_len != want:
        raise ValueError(f"data.seq_len = {seq_len}: a digits clip of {FRAMES} frames of {SIDE}x{SIDE} pixels is "
                         f"{want} patches of {cfg.patch_size}; set data.seq_len = {want}")
    return functools.partial(clip_batch, cfg)


# ---- scoring -------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def classifier():
    """An SVC on the training split's 8x8 digits (scaled to [0, 1]) and their shifts by up to a pixel each way
    (a digit with empty border columns has several brightest windows), fitted once."""
    # scikit-learn takes seconds to import; only the scorer needs it (as titan_mm.data.builtin.images' digits)
    from sklearn.svm import SVC

    images, labels = split(test=False)
    pad = np.pad(images, ((0, 0), (1, 1), (1, 1)))
    shifted = np.concatenate([pad[:, r: r + DIGIT, c: c + DIGIT] for r in range(3) for c in range(3)])
    return SVC(gamma=0.05, C=10.0).fit(shifted.reshape(len(shifted), -1) / 16, np.tile(labels, 9))


def brightest_windows(frames: torch.Tensor) -> torch.Tensor:
    """[N, 8, 8]: each frame's 8x8 window of the largest pixel sum (frames [N, SIDE, SIDE] in [0, 16])."""
    sums = torch.nn.functional.avg_pool2d(frames[:, None], DIGIT, stride=1)[:, 0].flatten(1)  # [N, positions]
    n = SIDE - DIGIT + 1
    r, c = sums.argmax(1).div(n, rounding_mode="floor"), sums.argmax(1) % n
    return torch.stack([f[i: i + DIGIT, j: j + DIGIT] for f, i, j in zip(frames, r.tolist(), c.tolist())])


def frame_digits(frames: torch.Tensor) -> np.ndarray:
    """The classifier's digit of each frame [N, SIDE, SIDE] (pixels in [0, 16])."""
    w = brightest_windows(frames)
    return classifier().predict(w.reshape(len(w), -1).numpy() / 16)


def direction_of(frames: torch.Tensor) -> str | None:
    """The direction of a clip's frames [F, SIDE, SIDE] from the intensity centroids' least-squares slopes;
    None when the centroid moves less than MIN_SPEED pixels a frame."""
    w = frames.clamp(min=0) + 1e-6
    grid = torch.arange(SIDE, dtype=torch.float32)
    rows = (w.sum(2) * grid).sum(1) / w.sum((1, 2))
    cols = (w.sum(1) * grid).sum(1) / w.sum((1, 2))
    f = torch.arange(len(frames), dtype=torch.float32)
    f = f - f.mean()
    dr, dc = float((f * rows).sum() / (f * f).sum()), float((f * cols).sum() / (f * f).sum())
    if max(abs(dr), abs(dc)) < MIN_SPEED:
        return None
    if abs(dc) >= abs(dr):
        return "right" if dc > 0 else "left"
    return "down" if dr > 0 else "up"


@dataclasses.dataclass
class ClipScore:
    digit: int
    direction: str
    seen_digit: int
    seen_direction: str | None

    @property
    def right(self) -> bool:
        return self.seen_digit == self.digit and self.seen_direction == self.direction


def score_clip(frames: torch.Tensor, digit: int, direction: str) -> ClipScore:
    """A clip's frames [F, SIDE, SIDE] (pixels in [0, 16]) scored against its prompt: the majority digit of its
    frames (ties: the smallest), the centroids' direction."""
    votes = np.bincount(frame_digits(frames), minlength=10)
    return ClipScore(digit, direction, int(votes.argmax()), direction_of(frames))


MAX_PROMPTS = 400
"""10 digits x 4 directions x 10 held-out images of each digit."""


def prompts(n: int) -> list[tuple[int, str]]:
    """``n`` (digit, direction) prompts, the 40 pairs in turn: prompt k asks digit k % 10 moving
    DIRECTIONS[k // 10 % 4]."""
    if not 0 < n <= MAX_PROMPTS:
        raise ValueError(f"{n} prompts: ask for 1 to {MAX_PROMPTS} (40 makes every (digit, direction) pair once)")
    return [(k % 10, DIRECTIONS[k // 10 % 4]) for k in range(n)]


def summary(scores: list[ClipScore]) -> dict:
    n = len(scores)
    return {"clips": n, "accuracy": sum(s.right for s in scores) / n,
            "digit_accuracy": sum(s.seen_digit == s.digit for s in scores) / n,
            "direction_accuracy": sum(s.seen_direction == s.direction for s in scores) / n}


def reference_score(n: int, seed: int = 0) -> dict:
    """The scorer on real clips of the ``n`` prompts: prompt k's clip moves the (k // 40)-th held-out image of its
    digit from a random start (of ``seed``). Its ceiling: clips of digits that neither it nor the model trained on."""
    images, labels = split(test=True)
    g = torch.Generator().manual_seed(seed)
    scores = []
    for k, (digit, direction) in enumerate(prompts(n)):
        image = images[np.flatnonzero(labels == digit)[k // 40]]
        scores.append(score_clip(render(image, direction, *random_start(g)), digit, direction))
    return summary(scores)


@torch.no_grad()
def sample_clips(model: WanModel, asks: list[tuple[int, str]], *, steps: int = 20, shift: float = 1.0,
                 guidance_scale: float = 6.0, seed: int = 0, batch: int = 40) -> torch.Tensor:
    """Frames [len(asks), FRAMES, SIDE, SIDE] (pixels in [0, 16]) sampled by :func:`sample.sample` for (digit,
    direction) prompts, the empty prompt (zeros) as the negative; noise from a CPU generator of ``seed``."""
    check_config(model.cfg)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(asks), batch):
        chunk = asks[i: i + batch]
        text = torch.stack([text_states(caption(d, direction)) for d, direction in chunk])
        noise = torch.randn(len(chunk), 1, FRAMES, SIDE, SIDE, generator=g)
        x = sample(model, text.to(device), noise.to(device), steps=steps, shift=shift, guidance_scale=guidance_scale,
                   attn_backend=model.cfg.attn_backend)
        out.append(to_frames(x[:, 0].float().cpu()))
    return torch.cat(out)


def evaluate(model: WanModel, n: int = 40, **sampling) -> tuple[dict, torch.Tensor]:
    """(summary of the ``n`` held-out prompts' sampled clips, their frames): the task's check, >= 70% right."""
    asks = prompts(n)
    frames = sample_clips(model, asks, **sampling)
    scores = [score_clip(f, d, direction) for f, (d, direction) in zip(frames, asks)]
    return summary(scores), frames


def showcase(n: int) -> list[int]:
    """Up to 8 of the first ``n`` prompts, the four directions in turn: digits 0..7 moving left, right, up, down,
    left, .. (prompt k is digit k % 10, direction k // 10 % 4)."""
    picks = [k for k in (i + 10 * (i % 4) for i in range(8)) if k < n]
    return picks if len(picks) == 8 else list(range(min(n, 8)))


def strip(frames: torch.Tensor, scale: int = 4) -> torch.Tensor:
    """Clips [N, F, SIDE, SIDE] (pixels in [0, 16]) side by side, a 1-pixel gap between them, upscaled ``scale``x:
    [F, H, W, 3] in [0, 1] for sample.write_gif."""
    gap = frames.new_full((frames.shape[1], SIDE, 1), 8.0)
    row = torch.cat([torch.cat([c, gap], -1) for c in frames], -1)[..., :-1] / 16  # [F, SIDE, W]
    row = row.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    return row[..., None].expand(-1, -1, -1, 3)
