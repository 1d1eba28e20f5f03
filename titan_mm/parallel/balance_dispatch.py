"""Re-place each optimizer step's global batch across data-parallel ranks and micro-batches (``data.balance``;
docs/data.md, "Workload balancing"). The rows move after the loader gave them, so the loader, its state and exact
resume are untouched; the batch content and the loss normalization (the global label count) do not change.

    rebalance = Rebalancer.for_run(cfg.data.balance, run, cfg.model.flavor)   # None: nothing to do
    micro = rebalance(micro)                         # the same n_micro x B rows per rank, other rows
    m.update(rebalance.metrics(step_seconds, measure=True))

Each rank cuts its micro-batches into rows along the family's BatchSchema (:func:`split_rows`; a batch need not hold
tokens), prices them on the host
(:func:`row_cost` -> titan_mm.data.balance), the costs are all-gathered, every rank computes the same
placement (titan_mm.data.balance.place), and the rows travel in one ``all_to_all_single`` of pickled row
slices (byte tensors: gloo on the CPU, NCCL on the GPU), then are re-collated into micro-batches of B rows
(:func:`join_rows`). Only the ranks of one "batch" group (the ranks that read different rows) exchange; tp / cp /
pp peers hold the same rows and do the same exchange in their own group.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from titan_mm.config import ConfigError
from titan_mm.data.balance import RowCost, coefficients_for, place, rank_loads
from titan_mm.data.packing import IGNORE_INDEX
from titan_mm.nn.attention import batch_rows
from titan_mm.registry import BatchSchema

DERIVED = ("cu_seqlens", "max_seqlen", "num_label_tokens")  # rebuilt from the rows
# (patches, grids, pad role, per-item keys split with the grids)
MEDIA = (("pixel_values", "image_grid_thw", "image_pad", ()),
         ("pixel_values_videos", "video_grid_thw", "video_pad", ("video_second_per_grid",)))
MEDIA_KEYS = {k for m in MEDIA for k in (*m[:2], *m[3])}


# ---------------------------------------------------------------- rows of a micro-batch
def _row_axes(batch: dict, schema: BatchSchema) -> dict[str, int]:
    """{key: its row axis (B)} of the batch keys cut into rows: the schema's sequence keys ([..., B, S, *trailing]:
    position_ids [3, B, S] too) and its per-row keys ([B, ...])."""
    seq = {k.name: k for k in schema.seq_keys}
    extra = sorted(set(batch) - set(seq) - set(schema.row) - set(DERIVED) - MEDIA_KEYS)
    if extra:
        raise ValueError(f"data.balance: micro-batch keys {extra} have no row split (neither keys of the family's "
                         "BatchSchema nor images / videos); set --data.balance none, or declare them in the schema")
    B, S = batch_rows(batch)
    axes = {}
    for k, v in batch.items():
        if k in seq:
            ax = seq[k].axis(v) - 1
            if ax < 0 or tuple(v.shape[ax:ax + 2]) != (B, S):
                raise ValueError(f"data.balance: batch[{k!r}] of shape {list(v.shape)} is not [..., {B}, {S}] before "
                                 f"its declared trailing dims {seq[k].trailing}; declare them in the family's "
                                 "BatchSchema")
            axes[k] = ax
        elif k in schema.row:
            if v.dim() == 0 or v.shape[0] != B:
                raise ValueError(f"data.balance: per-row batch[{k!r}] of shape {list(v.shape)} has no {B} rows")
            axes[k] = 0
    return axes


def split_rows(batch: dict, pads: dict[str, int], merge: int,
               schema: BatchSchema | None = None) -> list[dict[str, np.ndarray]]:
    """The B rows of a collated micro-batch (titan_mm.data.packing.collate_rows) as numpy slices: every key of the
    family's ``schema`` (default: a token batch) cut at its row axis, ``segments`` (the row's cu_seqlens lengths, its
    padding segment included) and the row's images / videos (grids and patches; they are in row order, and a row
    holds as many as its pad tokens cover, one pad per merged token). A batch without tokens (``input_ids``) is cut
    the same way. ``pads``: the pad token ids by role (DataNeeds.special_tokens); ``merge``: merge size."""
    schema = schema or BatchSchema()
    axes = _row_axes(batch, schema)
    B, S = batch_rows(batch)
    rows: list[dict[str, np.ndarray]] = [{} for _ in range(B)]
    for k, ax in axes.items():
        a = batch[k].numpy()
        for b in range(B):
            rows[b][k] = a[(slice(None),) * ax + (b,)]
    cu = batch["cu_seqlens"].numpy().astype(np.int64)
    cuts = np.searchsorted(cu, np.arange(B + 1) * S)  # every row ends on a segment boundary
    if (cu[cuts] != np.arange(B + 1) * S).any() or cuts[-1] != len(cu) - 1:
        raise ValueError(f"data.balance: cu_seqlens {cu.tolist()} does not end a segment at every row end (S={S})")
    for b in range(B):
        rows[b]["segments"] = np.diff(cu[cuts[b]:cuts[b + 1] + 1])
    for pix_key, grid_key, role, per_item in MEDIA:
        if pix_key not in batch:
            continue
        if role not in pads or "input_ids" not in batch:
            raise ValueError(f"data.balance: the batch has {pix_key} but no {role} tokens to place them by (the "
                             "family names no such token, or the batch has no input_ids)")
        ids = batch["input_ids"].numpy()
        grids, pix = batch[grid_key].numpy(), batch[pix_key].numpy()
        patches = grids.prod(-1)
        tok_cum = np.concatenate([[0], np.cumsum(patches // merge**2)])
        row_end = np.concatenate([[0], np.cumsum((ids == pads[role]).sum(1))])
        g = np.searchsorted(tok_cum, row_end)  # first grid of each row, and the end
        p = np.concatenate([[0], np.cumsum(patches)])[np.minimum(g, len(patches))]
        if g[-1] != len(grids) or (tok_cum[g] != row_end).any() or p[-1] != len(pix):
            raise ValueError(f"data.balance: {grid_key} ({len(grids)} items, {len(pix)} patches) does not match the "
                             f"rows' {role} tokens {np.diff(row_end).tolist()}")
        for b in range(B):
            rows[b][grid_key], rows[b][pix_key] = grids[g[b]:g[b + 1]], pix[p[b]:p[b + 1]]
            for k in per_item:
                if k in batch:
                    rows[b][k] = batch[k].numpy()[g[b]:g[b + 1]]
    return rows


def join_rows(rows: list[dict[str, np.ndarray]], schema: BatchSchema | None = None) -> dict[str, torch.Tensor]:
    """The micro-batch of these rows, as collate_rows builds it (media keys only where a row has media;
    ``num_label_tokens`` where the rows hold labels). ``schema``: the one the rows were split with."""
    schema = schema or BatchSchema()
    seq = {k.name: k for k in schema.seq_keys}
    out = {}
    for k, a in rows[0].items():
        if k in seq:  # the row lost its B axis just before S: it comes back there
            out[k] = torch.from_numpy(np.stack([r[k] for r in rows], axis=a.ndim - 1 - len(seq[k].trailing)))
        elif k in schema.row:
            out[k] = torch.from_numpy(np.stack([r[k] for r in rows]))
    segs = np.concatenate([r["segments"] for r in rows])
    out["cu_seqlens"] = torch.from_numpy(np.concatenate([[0], np.cumsum(segs)]).astype(np.int32))
    out["max_seqlen"] = torch.tensor(int(segs.max()) if segs.size else 0, dtype=torch.int64)
    if "labels" in out:
        out["num_label_tokens"] = torch.tensor(int((out["labels"] != IGNORE_INDEX).sum()), dtype=torch.int64)
    for pix_key, grid_key, _, per_item in MEDIA:
        have = [r for r in rows if grid_key in r and len(r[grid_key])]
        if have:
            for k in (pix_key, grid_key, *(k for k in per_item if k in have[0])):
                out[k] = torch.from_numpy(np.concatenate([r[k] for r in have]))
    return out


def row_cost(row: dict[str, np.ndarray]) -> RowCost:
    """The row's cost terms: its documents (the segments before the padding, counted by doc_ids) and grids."""
    n_docs = int(row["doc_ids"].max()) + 1 if row["doc_ids"].size else 0
    return RowCost.from_grids(row["segments"][:n_docs].tolist(), row.get("image_grid_thw"),
                              row.get("video_grid_thw"))


# ---------------------------------------------------------------- the exchange
class Rebalancer:
    """One step's placement and row exchange over the data-parallel ``group`` (rank ``rank`` of ``world``)."""

    def __init__(self, method: str, coeffs, pads: dict[str, int], merge: int, group, rank: int, world: int,
                 comm_device: torch.device, schema: BatchSchema | None = None):
        self.method, self.coeffs, self.pads, self.merge = method, coeffs, pads, merge
        self.schema = schema or BatchSchema()
        self.group, self.rank, self.world, self.comm = group, rank, world, comm_device
        self.last: dict[str, float] = {}

    @classmethod
    def for_run(cls, method: str, run, flavor: str = "") -> "Rebalancer | None":
        """From titan_mm.train.setup.Run; None where placement cannot gain (``"none"``, one dp rank) or would mix
        shapes (a family's clips, DataNeeds.clips: each micro-batch is one bucket of frames x height x width)."""
        needs = run.spec.data_needs(run.model_cfg)
        if method == "none" or run.dp_world == 1 or needs.clips is not None:  # clips: a micro-batch is one bucket
            return None
        group = run.ctx.count_group  # the "batch" mesh: the ranks that read different rows
        comm = run.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        try:
            coeffs = coefficients_for(run.spec, run.model_cfg, flavor)
        except ValueError as e:  # e.g. a FLOP counter the cost model cannot fit: say which flag turns it off
            raise ConfigError(f"data.balance={method!r}: {e}; or run with --data.balance none") from None
        return cls(method, coeffs, dict(needs.special_tokens), needs.merge_size or 1, group, run.dp_rank,
                   run.dp_world, comm, run.spec.schema())

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x, device=self.comm) for _ in range(self.world)]
        dist.all_gather(out, x.to(self.comm), group=self.group)
        return torch.cat(out).cpu()

    def __call__(self, micro: list[dict]) -> list[dict]:
        """This rank's micro-batches after the placement: the same count and shapes, other rows."""
        t0, n_micro = time.perf_counter(), len(micro)
        rows = [r for mb in micro for r in split_rows(mb, self.pads, self.merge, self.schema)]
        local = torch.from_numpy(self.coeffs.costs([row_cost(r) for r in rows]))
        costs = self._all_gather(local).numpy()
        slots = place(costs, self.world, n_micro, self.method)  # [world, n_micro, B] global row indices
        before = rank_loads(costs, place(costs, self.world, n_micro, "none"))
        after = rank_loads(costs, slots)
        self.last = {"balance/pred_imbalance_before": float(before.max() / max(before.mean(), 1e-30)),
                     "balance/pred_imbalance_after": float(after.max() / max(after.mean(), 1e-30))}
        mine = self._exchange(rows, slots.reshape(self.world, -1))
        out = [join_rows([mine[int(i)] for i in slots[self.rank, m]], self.schema) for m in range(n_micro)]
        self.last["balance/dispatch_s"] = time.perf_counter() - t0
        return out

    def _exchange(self, rows: list[dict], dest: np.ndarray) -> dict[int, dict]:
        """Global row index -> row, for this rank's placed rows (``dest[d]``: rank d's rows in order)."""
        n = len(rows)
        lo = self.rank * n
        mine = {int(i): rows[int(i) - lo] for i in dest[self.rank] if lo <= i < lo + n}
        payload = [b"" if d == self.rank else
                   pickle.dumps([rows[int(i) - lo] for i in dest[d] if lo <= i < lo + n], protocol=5)
                   for d in range(self.world)]
        send = [len(p) for p in payload]
        recv = torch.empty(self.world, dtype=torch.int64, device=self.comm)
        dist.all_to_all_single(recv, torch.tensor(send, device=self.comm), group=self.group)
        recv_sizes = recv.tolist()
        buf = torch.frombuffer(bytearray(b"".join(payload)) or bytearray(1), dtype=torch.uint8)[:sum(send)]
        out = torch.empty(int(sum(recv_sizes)), dtype=torch.uint8, device=self.comm)
        dist.all_to_all_single(out, buf.to(self.comm), output_split_sizes=recv_sizes,
                               input_split_sizes=send, group=self.group)
        data = out.cpu().numpy().tobytes()
        off = 0
        for s, size in enumerate(recv_sizes):
            if s != self.rank and size:
                got = pickle.loads(data[off:off + size])
                ids = [int(i) for i in dest[self.rank] if s * n <= i < (s + 1) * n]
                mine.update(zip(ids, got))
            off += size
        return mine

    def metrics(self, seconds: float, measure: bool) -> dict[str, float]:
        """The last placement's predicted max / mean rank cost, before and after; where ``measure`` (the same on
        every rank: it is a collective), also the spread of the ranks' ``seconds`` (their step times)."""
        out = dict(self.last)
        if measure:
            t = self._all_gather(torch.tensor([seconds], dtype=torch.float64))
            out["balance/measured_max_over_mean"] = float(t.max() / max(float(t.mean()), 1e-30))
            out["balance/straggler_wait_s"] = float(t.max() - t.min())
        return out
