"""Workload balancing across data-parallel ranks: a cost model of one packed row, and the placement of a global
batch's rows onto (dp ranks x micro-batches per rank) slots that evens out the ranks' step times.

Cost model (:class:`RowCost`, :class:`CostCoefficients`), in seconds of forward + backward on one GPU:

    cost = a_tok * tokens + a_attn * sum_docs L^2                       decoder: matmuls, causal attention
         + v_patch * patches + v_attn * sum_segments P^2                vision tower: matmuls, per-image attention
         + audio_frame * frames + audio_attn * sum_clips F^2            audio encoder (0 until a family has one)

A segment is one image or one temporal slice of a video (the vision tower attends within it), P its patches
before the merge; L counts every token of a document, visual tokens included. The coefficients come from
``cost_coefficients.json`` (keyed ``"<family>:<flavor>"``: the spec's name and flavor), else from the family's FLOP
counter (:func:`coefficients_from_flops`: ``spec.flops`` probed at a few shapes, divided by an assumed 400 TFLOP/s).
The shipped values are those FLOP-derived ones, marked provisional until they are fitted on the H200.

Placement (:func:`place`): a rank's step time is the sum of its micro-batches' costs, so the rows are split into
``n_ranks`` groups of equal size (``n_micro x B`` rows each) minimizing the largest group's cost, then each group
into its ``n_micro`` micro-batches of B rows. Methods: ``"none"`` (rows in order, as the loader reads them),
``"lpt"`` (largest row first onto the least-loaded rank with room) and ``"kk"`` (balanced Karmarkar-Karp: the
largest-differencing method over rounds of ``n_ranks`` rows, every rank taking one row of each round). Both are
deterministic: ties go to the lower row or rank index. bench/balance_sim.py measures them (docs/data.md).

    coeffs = coefficients_for(spec, model_cfg, "2b")
    costs = coeffs.costs([RowCost.from_grids(doc_lens, image_grid_thw, video_grid_thw) for each row])
    slots = place(costs, n_ranks=W, n_micro=grad_accum)   # [W, n_micro, B] row indices
"""

from __future__ import annotations

import dataclasses
import difflib
import heapq
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_mm.registry import get_model_spec

COEFFICIENTS_FILE = Path(__file__).with_name("cost_coefficients.json")
ASSUMED_TFLOPS = 400.0
PROVISIONAL = "flops-derived, not yet fitted on the H200"
METHODS = ("none", "lpt", "kk")
DEFAULT_METHOD = "kk"  # the lower max cost in bench/balance_sim.py on every mix (docs/data.md)


@dataclass(frozen=True)
class RowCost:
    """What the cost of one packed row depends on (sums over its documents, vision segments and audio clips)."""

    tokens: int = 0
    doc_sq: int = 0
    """sum of L^2 over the row's documents."""
    patches: int = 0
    patch_sq: int = 0
    """sum of P^2 over the row's images and video temporal slices."""
    audio_frames: int = 0
    audio_sq: int = 0

    @classmethod
    def of(cls, doc_lens: Iterable[int], patch_segments: Iterable[int] = (),
           audio_frames: Iterable[int] = ()) -> "RowCost":
        d, p, a = (np.asarray(list(x), dtype=np.int64) for x in (doc_lens, patch_segments, audio_frames))
        if (d < 0).any() or (p < 0).any() or (a < 0).any():
            raise ValueError("RowCost: document lengths, patch counts and audio frames must be >= 0")
        return cls(int(d.sum()), int((d * d).sum()), int(p.sum()), int((p * p).sum()), int(a.sum()),
                   int((a * a).sum()))

    @classmethod
    def from_grids(cls, doc_lens: Iterable[int], image_grid_thw=None, video_grid_thw=None,
                   audio_frames: Iterable[int] = ()) -> "RowCost":
        """From a row's (t, h, w) patch grids as the batch carries them: an image is one segment of h*w patches,
        a video t segments of h*w."""
        segs = [int(h * w) for grid in (image_grid_thw, video_grid_thw) if grid is not None
                for t, h, w in (grid.tolist() if hasattr(grid, "tolist") else grid) for _ in range(int(t))]
        return cls.of(doc_lens, segs, audio_frames)


@dataclass(frozen=True)
class CostCoefficients:
    """Seconds (forward + backward, one GPU) per unit of each :class:`RowCost` term."""

    a_tok: float
    a_attn: float
    v_patch: float = 0.0
    v_attn: float = 0.0
    audio_frame: float = 0.0
    audio_attn: float = 0.0
    source: str = PROVISIONAL

    def __post_init__(self):
        terms = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        bad = [k for k, v in terms.items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"cost coefficients {bad} must be finite numbers >= 0")

    def cost(self, row: RowCost) -> float:
        return float(self.costs([row])[0])

    def costs(self, rows: Sequence[RowCost]) -> np.ndarray:
        """[len(rows)] costs in seconds, in one vectorized pass."""
        x = np.array([(r.tokens, r.doc_sq, r.patches, r.patch_sq, r.audio_frames, r.audio_sq) for r in rows],
                     dtype=np.float64).reshape(-1, 6)
        w = np.array([self.a_tok, self.a_attn, self.v_patch, self.v_attn, self.audio_frame, self.audio_attn])
        return x @ w


def _fit_quadratic(f, x1: int, x2: int) -> tuple[float, float]:
    """(a, b) with f(x) = a x + b x^2 through x1 and x2, checked at a third point (the FLOP counters are exact
    quadratics unless a sliding window bends them)."""
    f1, f2 = f(x1), f(x2)
    b = (f2 / x2 - f1 / x1) / (x2 - x1)
    a = f1 / x1 - b * x1
    x3 = (x1 + x2) // 2
    if abs(a * x3 + b * x3 * x3 - f(x3)) > 1e-6 * f(x3):
        raise ValueError("the FLOP counter is not a x + b x^2 in the length (sliding-window layers?); fit the "
                         "coefficients on the device and add them to cost_coefficients.json")
    return a, b


def coefficients_from_flops(spec, cfg, tflops: float = ASSUMED_TFLOPS) -> CostCoefficients:
    """Provisional coefficients from the family's FLOP counter (``spec.flops``) at ``tflops`` TFLOP/s: one
    document of L tokens gives the decoder terms, one image of P patches (no text) the vision terms."""
    s = 1.0 / (tflops * 1e12)
    a_tok, a_attn = _fit_quadratic(lambda n: spec.flops(cfg, [n]), 1024, 4096)
    v_patch = v_attn = 0.0
    vis = spec.dims(cfg).vision
    if vis is not None:
        m = vis.merge_size  # grids are whole merge windows
        image = lambda p: spec.flops(cfg, [], image_grid_thw=torch.tensor([[1, m, p // m]]))  # noqa: E731
        v_patch, v_attn = _fit_quadratic(image, 64 * m, 256 * m)
    return CostCoefficients(a_tok * s, a_attn * s, v_patch * s, v_attn * s, source=PROVISIONAL)


def load_coefficients(key: str, path: Path | str = COEFFICIENTS_FILE) -> CostCoefficients:
    """The coefficients stored under ``key`` ("<family>:<flavor>", lower case) in the coefficient file."""
    entries = json.loads(Path(path).read_text())["entries"]
    if key not in entries:
        near = difflib.get_close_matches(key, list(entries), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
        raise ValueError(f"no cost coefficients for {key!r} in {path}; {hint}known: {', '.join(sorted(entries))}")
    fields = {f.name for f in dataclasses.fields(CostCoefficients)}
    return CostCoefficients(**{k: v for k, v in entries[key].items() if k in fields})


def coefficients_for(spec, cfg, flavor: str = "", path: Path | str = COEFFICIENTS_FILE) -> CostCoefficients:
    """The file's entry for ``spec.name:flavor`` when there is one, else the FLOP-derived coefficients."""
    entries = json.loads(Path(path).read_text())["entries"]
    key = f"{spec.name}:{flavor.lower()}"
    return load_coefficients(key, path) if key in entries else coefficients_from_flops(spec, cfg)


def save_coefficients(entries: dict[str, CostCoefficients], out: Path | str,
                      path: Path | str = COEFFICIENTS_FILE) -> None:
    """Write the coefficient file ``path`` to ``out`` with ``entries`` (key -> coefficients, e.g. fitted by
    bench/cost_model.py) put in; its other entries are kept."""
    doc = json.loads(Path(path).read_text())
    doc["entries"].update({k: dataclasses.asdict(c) for k, c in entries.items()})
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")


# ---------------------------------------------------------------- placement
def _check(costs, n_ranks: int, n_micro: int) -> tuple[np.ndarray, int]:
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"place: costs must be a non-empty 1-D sequence, got shape {c.shape}")
    bad = ~(np.isfinite(c) & (c >= 0))
    if bad.any():
        raise ValueError(f"place: row costs must be finite and >= 0 (row {int(np.argmax(bad))} is {c[bad][0]})")
    if n_ranks < 1 or n_micro < 1 or c.size % (n_ranks * n_micro):
        raise ValueError(f"place: {c.size} rows do not split into {n_ranks} ranks x {n_micro} micro-batches of "
                         "equal size")
    return c, c.size // (n_ranks * n_micro)


def _largest_first(c: np.ndarray) -> np.ndarray:
    return np.argsort(-c, kind="stable")  # stable: equal costs keep index order


def _lpt(c: np.ndarray, k: int, m: int) -> np.ndarray:
    """Largest row first onto the least-loaded rank that has room (ties: lower rank); [k, m] row indices."""
    out = np.empty((k, m), dtype=np.int64)
    fill = [0] * k
    heap = [(0.0, r) for r in range(k)]  # ranks with room, by (load, rank)
    for i in _largest_first(c).tolist():
        load, r = heapq.heappop(heap)
        out[r, fill[r]] = i
        fill[r] += 1
        if fill[r] < m:
            heapq.heappush(heap, (load + c[i], r))
    return out


def _kk(c: np.ndarray, k: int, m: int) -> np.ndarray:
    """Balanced largest differencing: m partial solutions (rounds of k rows, largest first), each k subsets;
    the two with the largest spread (max - min subset cost) are merged, largest subset with smallest, until one
    is left. Every subset keeps one row per round, so all have m rows, and a merge never widens the spread beyond
    the wider of the two: the result is within (largest - smallest row) of perfect balance. [k, m] row indices."""
    rounds = _largest_first(c).reshape(m, k)
    heap = []
    for t, rows in enumerate(rounds):
        sums = c[rows]
        heap.append((-(sums[0] - sums[-1]), t, sums, rows[:, None]))
    heapq.heapify(heap)
    n = m
    while len(heap) > 1:
        _, _, sa, ma = heapq.heappop(heap)
        _, _, sb, mb = heapq.heappop(heap)
        sums, members = sa + sb[::-1], np.concatenate([ma, mb[::-1]], axis=1)
        order = np.argsort(-sums, kind="stable")
        sums, members = sums[order], members[order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), n, sums, members))
        n += 1
    return heap[0][3]


def _split_micro(c: np.ndarray, groups: np.ndarray, n_micro: int) -> np.ndarray:
    """Each rank's rows into n_micro micro-batches of B rows, [k, n_micro, B]: in snake order of cost (so the
    micro-batches are even too), heaviest micro-batch first on every rank (so that, where ranks meet at every
    micro-batch, heavy meets heavy)."""
    k, m = groups.shape
    B = m // n_micro
    by_cost = np.take_along_axis(groups, np.argsort(-c[groups], axis=1, kind="stable"), axis=1)
    snake = np.arange(m).reshape(B, n_micro)
    snake[1::2] = snake[1::2, ::-1]
    out = by_cost[:, snake.T]  # [k, n_micro, B]
    heavy_first = np.argsort(-c[out].sum(axis=2), axis=1, kind="stable")
    return np.take_along_axis(out, heavy_first[:, :, None], axis=1)


def place(costs, n_ranks: int, n_micro: int = 1, method: str = DEFAULT_METHOD) -> np.ndarray:
    """[n_ranks, n_micro, B] row indices (every row once; B = len(costs) / (n_ranks x n_micro)) minimizing the
    largest per-rank total cost. ``method``: "none" (row i to slot i, the loader's order), "lpt" or "kk"."""
    c, B = _check(costs, n_ranks, n_micro)
    if method == "none":
        return np.arange(c.size).reshape(n_ranks, n_micro, B)
    if method not in METHODS:
        raise ValueError(f"place: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    groups = (_lpt if method == "lpt" else _kk)(c, n_ranks, n_micro * B)
    return _split_micro(c, groups, n_micro)


def rank_loads(costs, assignment: np.ndarray) -> np.ndarray:
    """[n_ranks] total cost of each rank's rows (its step time under the cost model)."""
    return np.asarray(costs, dtype=np.float64)[assignment].reshape(assignment.shape[0], -1).sum(axis=1)


def lower_bound(costs, n_ranks: int) -> float:
    """No placement's largest rank cost is below this: the mean rank cost, or the largest row."""
    c = np.asarray(costs, dtype=np.float64)
    return max(float(c.sum()) / n_ranks, float(c.max()))


def _write_flops_derived(path: Path = COEFFICIENTS_FILE) -> None:
    """Recompute every flops-derived entry of the coefficient file (fitted entries are kept)."""
    doc = json.loads(path.read_text())
    for key, entry in doc["entries"].items():
        if entry.get("source") != PROVISIONAL:
            continue
        family, shape = key.split(":")
        spec = get_model_spec(family)
        flavor = {f.lower(): f for f in spec.flavors}[shape]
        doc["entries"][key] = dataclasses.asdict(coefficients_from_flops(spec, spec.flavor(flavor)))
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":  # python -m titan_mm.data.balance: refresh the provisional entries
    _write_flops_derived(Path(sys.argv[1]) if len(sys.argv) > 1 else COEFFICIENTS_FILE)
