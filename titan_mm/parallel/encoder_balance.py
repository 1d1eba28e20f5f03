"""Encoder balance (``parallel.encoder_balance``): the vision tower's images are spread over the data-parallel ranks
by all-to-all before the encoder and its outputs sent back after it, so that every rank's ViT work is about equal
even when its LLM rows (balanced by ``data.balance`` for the decoder) carry very different images.

Host side, once per micro-batch, inside the family's ``prepare_batch`` (:func:`plan_encoder_balance`): every rank
all-gathers the ``(t, h, w)`` grids of its patch stream (a few ints per image, ``dist.all_gather_object`` over the
"batch" group), and every rank computes the same assignment (:func:`assign`, deterministic) from the same lists:

    cost(image) = patches + attn_weight * sum over its segments (image / video frame) of patches^2

    1. each rank keeps its own images, largest first, while its load stays <= the mean load;
    2. the rest, largest first, go to the least-loaded rank (ties: the owner, then the lower rank);
    and the same without step 1 (plain LPT, most images move); the plan with the lower largest load is used
    (ties: the first, which moves fewer images).

Either way the largest load is at most mean + the largest image's cost. The plan (:class:`EncoderBalance`) holds
the split sizes (Python ints), the send / restore orders (index tensors on the device) and the group; the family
builds its vision metadata for the grids this rank *receives*. No rank with images anywhere: no plan (the batch is
text only on every rank, the same decision everywhere).

Forward (:meth:`EncoderBalance.encode`, no host syncs): pixels -> ``all_to_all_single`` (no grad) -> encoder on the
received images -> merged tokens and DeepStack features concatenated -> autograd all-to-all back -> original
order. The backward of that all-to-all sends each embedding's gradient to the rank that computed it, which runs
the encoder's backward; encoder weight gradients are sums over the images each rank computed, and the usual FSDP
SUM reduce-scatter over dp adds them up, so the result equals the unbalanced run (docs/parallel.md, "Encoder
balance"). Every rank of the group takes part whenever any rank has images, with zero-size splits where it
sends or receives nothing; a rank with no images of its own keeps the (empty) returned features in its graph
(:meth:`EncoderBalance.keep_in_graph`) so that its backward reaches the all-to-all and the encoder like everyone
else's.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titan_mm.config import ConfigError

ATTN_WEIGHT = 1.5e-4
"""Per-segment attention cost relative to one patch's matmuls: v_attn / v_patch of ``qwen3_vl:2b`` in
titan_mm/data/cost_coefficients.json (7.37e-10 / 4.93e-6, FLOP-derived)."""


def image_cost(t: int, h: int, w: int, attn_weight: float = ATTN_WEIGHT) -> float:
    """The encoder cost of one image / video of ``t`` segments of ``h x w`` patches (see the module docstring)."""
    p = h * w
    return float(t * p + attn_weight * t * p * p)


def assign(costs: list[list[float]]) -> list[list[int]]:
    """Destination rank of every image, ``[rank][image]``, from the per-rank image costs: the better (lower largest
    load; ties: the first) of keep-then-LPT and plain LPT (see the module docstring). Deterministic: the same
    lists give the same answer on every rank."""
    keep, lpt = _place(costs, keep=True), _place(costs, keep=False)
    return lpt if _loads(costs, lpt)[0] < _loads(costs, keep)[0] * (1 - 1e-9) else keep


def _place(costs: list[list[float]], keep: bool) -> list[list[int]]:
    n = len(costs)
    target = sum(map(sum, costs)) / n * (1 + 1e-12)
    load = [0.0] * n
    dest = [[-1] * len(cs) for cs in costs]
    for r, cs in enumerate(costs if keep else ()):  # own images, largest first, while the load stays <= the mean
        for i in sorted(range(len(cs)), key=lambda i: (-cs[i], i)):
            if load[r] + cs[i] <= target:
                dest[r][i] = r
                load[r] += cs[i]
    rest = sorted((-c, r, i) for r, cs in enumerate(costs) for i, c in enumerate(cs) if dest[r][i] < 0)
    for neg_c, r, i in rest:  # the rest, largest first, onto the least-loaded rank (ties: the owner, the lower)
        d = min(range(n), key=lambda k: (load[k], k != r, k))
        dest[r][i] = d
        load[d] -= neg_c
    return dest


def _loads(costs: list[list[float]], dest: list[list[int]]) -> tuple[float, list[float]]:
    load = [0.0] * len(costs)
    for cs, ds in zip(costs, dest):
        for c, d in zip(cs, ds):
            load[d] += c
    return max(load), load


class EncoderBalance(NamedTuple):
    """One micro-batch's exchange plan on one rank (host-built by :func:`plan_encoder_balance`)."""

    group: Any
    """The process group the images are spread over (the data-parallel "batch" ranks)."""
    send_splits: list[int]
    """Patches this rank sends to each rank (its own images, by destination)."""
    recv_splits: list[int]
    """Patches this rank receives from each rank (the images it encodes, by source)."""
    merge: int
    """Patches per merged token (spatial_merge_size ** 2): the returned rows per rank are the splits / merge."""
    send_index: torch.Tensor | None
    """[patches] rows of the local patch stream in send order (device); None: already in order."""
    restore_index: torch.Tensor | None
    """[merged tokens] rows of the returned features in the original order (device); None: already in order."""
    moves: bool
    """Some image of some rank changes rank (False: every rank encodes its own images, no all-to-all)."""
    cost_before: tuple[float, ...] = ()
    """Per-rank encoder cost without the exchange (for logging and benchmarks)."""
    cost_after: tuple[float, ...] = ()
    """Per-rank encoder cost with it."""

    def encode(self, encoder: Callable, pixels_NP: torch.Tensor, meta):
        """``encoder(pixels, meta) -> (merged [M, O], [DeepStack features [M, O], ...])`` run on the images this plan
        assigns to the rank (``meta``: the family's vision metadata of the received grids), the results returned
        to their owners in the original order. ``pixels_NP``: this rank's patch stream ([0, P] without images;
        every rank must use the same dtype). No host syncs: the split sizes are the plan's Python ints."""
        if not self.moves:
            return encoder(pixels_NP, meta)
        x = pixels_NP if self.send_index is None else pixels_NP.index_select(0, self.send_index)
        recv = x.new_empty((sum(self.recv_splits), x.shape[1]))
        dist.all_to_all_single(recv, x.contiguous(), self.recv_splits, self.send_splits, group=self.group)
        merged, deepstack = encoder(recv, meta)
        widths = [merged.shape[1]] + [d.shape[1] for d in deepstack]
        feats = torch.cat([merged, *deepstack], 1) if deepstack else merged
        back = all_to_all_single_autograd(feats.contiguous(), [s // self.merge for s in self.send_splits],
                                          [s // self.merge for s in self.recv_splits], self.group)
        if self.restore_index is not None:
            back = back.index_select(0, self.restore_index)
        merged, *deepstack = back.split(widths, 1)
        return merged, list(deepstack)

    @staticmethod
    def keep_in_graph(h: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
        """``h`` plus the (empty) ``features`` summed, i.e. ``h``: on a rank without images of its own the returned
        features place nothing, but its backward must still run the all-to-all and the encoder (collectives, FSDP
        reductions) as on every other rank."""
        for f in features:
            h = h + f.sum().to(h.dtype)
        return h


def plan_encoder_balance(grid_thw: torch.Tensor | None, group, merge: int, device: torch.device | str,
                         attn_weight: float = ATTN_WEIGHT) -> tuple[EncoderBalance, torch.Tensor] | None:
    """Host side: ``(plan, grids this rank encodes [m, 3])`` for the local patch stream's ``grid_thw`` ([n, 3] CPU,
    in patch-stream order; None or empty: no images here), or None when no rank of ``group`` has images.
    Collective over ``group``: every rank calls it for every micro-batch."""
    local = [] if grid_thw is None else [tuple(int(x) for x in g) for g in grid_thw.tolist()]
    grids: list[list[tuple[int, int, int]]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(grids, local, group=group)
    return plan_from_grids(grids, dist.get_rank(group), merge, device, attn_weight, group)


def plan_from_grids(grids: list[list[tuple[int, int, int]]], me: int, merge: int, device: torch.device | str = "cpu",
                    attn_weight: float = ATTN_WEIGHT, group=None) -> tuple[EncoderBalance, torch.Tensor] | None:
    """:func:`plan_encoder_balance` after the all-gather: rank ``me``'s plan from every rank's grid list (pure)."""
    if not any(grids):
        return None
    n, local = len(grids), grids[me]
    costs = [[image_cost(*g, attn_weight) for g in gl] for gl in grids]
    dest = assign(costs)
    patches = [t * h * w for t, h, w in local]
    starts = [sum(patches[:i]) for i in range(len(patches))]
    mine = [[i for i in range(len(local)) if dest[me][i] == d] for d in range(n)]
    send_splits = [sum(patches[i] for i in ids) for ids in mine]
    order = [i for ids in mine for i in ids]  # local images in send order
    recv = [grids[s][i] for s in range(n) for i in range(len(grids[s])) if dest[s][i] == me]
    recv_splits = [sum(t * h * w for (t, h, w), d in zip(grids[s], dest[s]) if d == me) for s in range(n)]
    send_index = restore_index = None
    if order != sorted(order):
        send_index = torch.cat([torch.arange(starts[i], starts[i] + patches[i]) for i in order]).to(device)
        tok = torch.cat([torch.arange(starts[i] // merge, (starts[i] + patches[i]) // merge) for i in order])
        restore_index = torch.argsort(tok).to(device)  # returned row j holds token tok[j]
    before, after = tuple(map(sum, costs)), _loads(costs, dest)[1]
    plan = EncoderBalance(group, send_splits, recv_splits, merge, send_index, restore_index,
                          moves=any(d != r for r, ds in enumerate(dest) for d in ds), cost_before=before,
                          cost_after=tuple(after))
    return plan, torch.tensor(recv, dtype=torch.int64).reshape(-1, 3)


# ---------------------------------------------------------------- set-up (called once by the trainer)
def balance_group(pd) -> Any:
    """The process group of ``parallel.encoder_balance``: the data-parallel ranks that read different rows (the
    "batch" mesh); None with one such rank (nothing to balance)."""
    mesh = pd.mesh("batch") if pd is not None else None
    return mesh.get_group() if mesh is not None and mesh.size() > 1 else None


def balance_planner(group) -> Callable | None:
    """What the train step hands the family's prepare_batch as ``encoder_balance`` (the models import nothing
    from parallel/): ``planner(grid_thw, merge, device)`` -> :func:`plan_encoder_balance` over ``group``."""
    if group is None:
        return None
    return lambda grid_thw, merge, device: plan_encoder_balance(grid_thw, group, merge, device)


def check_family(spec, model_cfg) -> None:
    """Refuse ``parallel.encoder_balance`` for a model without a vision tower or whose family does not plan the
    exchange (ModelSpec.encoder_balance)."""
    if spec.dims(model_cfg).vision is None:
        raise ConfigError(f"[parallel] encoder_balance: model {spec.name!r} has no vision tower to balance; set "
                          "parallel.encoder_balance = false")
    if not spec.encoder_balance:
        raise ConfigError(f"[parallel] encoder_balance is not implemented for {spec.name!r} yet (Qwen3-VL's "
                          "prepare_batch is the example); set parallel.encoder_balance = false")