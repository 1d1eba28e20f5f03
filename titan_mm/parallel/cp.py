"""Context parallelism: the sequence of every activation is split over the ``cp`` mesh axis.

CP acts through the *batch* and the attention metadata, not by changing modules: the train step calls
:func:`prepare_cp_batch` instead of ``build_attn_meta``. It

  1. builds the attention metadata for the *full* (local-rows) sequence, so packed-document masks
     (``doc_ids``), causality and sliding windows are exactly those of the unsplit batch;
  2. keeps this rank's tokens of every ``[B, S]`` tensor (``input_ids``, ``labels``, ``position_ids``,
     ``doc_ids``) with **load-balanced** sharding: S is cut into 2*cp chunks and rank r keeps chunks
     r and 2*cp-1-r, so every rank gets the same amount of causal-attention work;
  3. puts a :class:`CPAttention` in ``AttnMeta.cp``; ``titan_mm.nn.attention.attention``
     delegates to it, everything else in the model (embeddings, norms, MLP/MoE, RoPE with the local
     ``position_ids``, the loss over the local labels) simply runs on the local tokens.
  4. cuts the family's own sequence keys (its ``BatchSchema``, titan_mm.registry: keys host-built by its
     ``prepare_batch`` before this split, Qwen3-VL's ``visual_index``; latents [B, S, C]) the same way, on the
     axis before their declared trailing dims, and leaves every other key whole (pixels: every cp rank runs the
     vision tower on all of the micro-batch's images and keeps the embeddings of its own positions). M-RoPE
     ``position_ids`` [3, B, S] are sliced on their last axis like [B, S] ones. A sequence key whose axis does
     not hold the rows' S tokens is refused by name.

Modes (``parallel.cp_mode``):

  * ``"ulysses"``: all-to-all q/k/v from (sequence shard, all heads) to (full sequence, H/cp heads), attend
    with the full-sequence masks, all-to-all back. Needs cp (x tp) to divide the query and kv heads.
  * ``"allgather"``: all-gather k/v over cp (backward: reduce-scatter), attend the local queries against the
    full keys with the rows of the full mask that belong to the local queries. Works for any head count;
    k/v memory is that of the full sequence.

  * ``"ring"``: k/v blocks travel around the cp ranks (p2p send/recv), each rank attends its local
    queries to one block at a time with the matching rows/columns of the full mask and merges the partial
    results by log-sum-exp (online softmax); the backward sends the k/v blocks around again together with
    their gradient accumulators, which arrive complete at their owner after cp hops. Holds one remote k/v
    block at a time. The block math is plain PyTorch (fp32 scores of one [S/cp, S/cp] block per head),
    not a fused flash kernel: correct everywhere, meant for long sequences where memory matters more.

Not done yet: a ring variant on fused flash kernels, overlap of the ring p2p with compute, ``varlen``
attention under CP.

Loss and gradients: each cp rank's ``loss_sum`` covers its own tokens; the train step divides by the
global label count as usual, FSDP's mesh includes cp (``fsdp = dp_shard x cp``) so gradients are summed
over cp, and the reported loss is summed over the ``loss`` mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd
from torch.nn.attention.flex_attention import create_block_mask

from titan_mm.config import Parallel
from titan_mm.nn.attention import KINDS, attention, batch_rows, build_attn_meta, check_kind
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.parallel.plan import ParallelizePlan, match_modules
from titan_mm.registry import ATTN_KEYS, TOKEN_KEYS, SeqKey

MODES = ("ulysses", "allgather", "ring")
# Attention mask kinds (titan_mm.nn.attention.KINDS) each mode runs. Every mode attends with the
# metadata of the full sequence (ulysses) or with blocks cut from its dense mask (allgather, ring), so every kind
# works (tests/unit/test_attention_kinds.py); a mode on fused kernels that cannot (a flash ring) lists fewer.
MODE_KINDS = dict.fromkeys(MODES, KINDS)


def load_balanced_index(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (in the full sequence) that rank ``rank`` of ``cp`` keeps: chunks r and 2cp-1-r of 2cp."""
    if S % (2 * cp):
        raise ValueError(f"seq_len({S}) is not a multiple of 2 * cp({cp}) = {2 * cp}; pad rows to a multiple.")
    c = S // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]).to(device)


class CPAttention:
    """Callable stored in ``AttnMeta.cp``: attention over the full sequence from local sequence shards."""

    def __init__(self, mode: str, mesh, full_meta, S: int, device):
        self.mode, self.mesh, self.cp = mode, mesh, mesh.size()
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.S = S
        self.inner = full_meta  # metadata of the full sequence, cp=None
        gathered = torch.cat([load_balanced_index(S, self.cp, r) for r in range(self.cp)])
        self.gathered = gathered.to(device)  # gathered order -> original position
        self.to_orig = torch.argsort(gathered).to(device)  # original position -> index in gathered order
        self.local = load_balanced_index(S, self.cp, self.rank, device)
        if mode == "allgather":
            self.local_meta = self._local_rows_meta(full_meta)
        if mode == "ring":
            self.ring_masks = self._ring_masks(full_meta)

    def _local_rows_meta(self, m):
        """Metadata whose masks keep only the rows of this rank's queries (kv stays the full sequence)."""
        _check_dense(m, "allgather")
        B = None
        lm = dataclasses.replace(m, cp=None)
        rows = self.local
        if m.backend in ("sdpa", "flex"):
            dense = m.sdpa_mask
            if dense is None:  # unpacked, no window: plain causal over original positions
                q = torch.arange(self.S, device=rows.device)
                dense = (q[:, None] >= q[None, :])[None, None]
            lm.sdpa_mask = dense[:, :, rows, :]
            if m.sliding_window is not None:
                lm.sdpa_mask_swa = m.sdpa_mask_swa[:, :, rows, :]
            if m.backend == "flex" and rows.device.type != "cpu":
                lm.block_mask, lm.block_mask_swa = _local_block_masks(lm, B)
        else:
            raise ValueError(f"context parallelism supports the sdpa and flex backends, not {m.backend!r}.")
        return lm

    def _ring_masks(self, m):
        """{window or None: [mask block of my queries x rank j's keys for j in range(cp)]}."""
        if m.backend not in ("sdpa", "flex"):
            raise ValueError(f"context parallelism supports the sdpa and flex backends, not {m.backend!r}.")
        _check_dense(m, "ring")
        dense = m.sdpa_mask
        if dense is None:
            q = torch.arange(self.S, device=self.local.device)
            dense = (q[:, None] >= q[None, :])[None, None]
        out = {None: dense}
        if m.sliding_window is not None:
            out[m.sliding_window] = m.sdpa_mask_swa
        cols = [load_balanced_index(self.S, self.cp, j, self.local.device) for j in range(self.cp)]
        return {w: [d[:, :, self.local][:, :, :, c].contiguous() for c in cols] for w, d in out.items()}

    def __call__(self, q_BSHK, k_BSGK, v_BSGK, window):
        if self.mode == "ulysses":
            q, k, v = (self._seq_to_heads(t) for t in (q_BSHK, k_BSGK, v_BSGK))
            o = attention(q, k, v, self.inner, window)
            return self._heads_to_seq(o)
        if self.mode == "ring":
            if window not in self.ring_masks:
                raise ValueError(f"ring CP: no mask for sliding window {window}; build the metadata with it.")
            q, k, v = (t.transpose(1, 2) for t in (q_BSHK, k_BSGK, v_BSGK))
            o = _RingAttention.apply(q, k, v, self.ring_masks[window], self.group, self.cp, self.rank)
            return o.transpose(1, 2)
        # allgather: full k/v (original order), local queries with their mask rows
        k, v = (all_gather_tensor_autograd(t.contiguous(), 1, self.group)[:, self.to_orig] for t in (k_BSGK, v_BSGK))
        return attention(q_BSHK, k, v, self.local_meta, window)

    def _seq_to_heads(self, x):  # [B, S/cp, H, K] -> [B, S, H/cp, K] (original order)
        B, Sl, H, K = x.shape
        if H % self.cp:
            raise ValueError(f"Ulysses CP: cp({self.cp}) does not divide the local head count ({H}); "
                             "use parallel.cp_mode='allgather'.")
        x = x.reshape(B, Sl, self.cp, H // self.cp, K).permute(2, 0, 1, 3, 4).contiguous()
        x = all_to_all_single_autograd(x, None, None, self.group)  # [cp(src seq shard), B, Sl, Hc, K]
        x = x.permute(1, 0, 2, 3, 4).reshape(B, self.cp * Sl, H // self.cp, K)
        return x[:, self.to_orig]

    def _heads_to_seq(self, o):  # [B, S, Hc, K] (original order) -> [B, S/cp, H, K]
        B, S, Hc, K = o.shape
        o = o[:, self.gathered].reshape(B, self.cp, S // self.cp, Hc, K).permute(1, 0, 2, 3, 4).contiguous()
        o = all_to_all_single_autograd(o, None, None, self.group)  # [cp(head group), B, Sl, Hc, K]
        return o.permute(1, 2, 0, 3, 4).reshape(B, S // self.cp, self.cp * Hc, K)


def _check_dense(m, mode: str) -> None:
    """Ring / allgather read the document mask densely; a packed batch's metadata without it (flex on CUDA
    builds only block masks) would silently attend across documents (and fall back to causal for other kinds)."""
    if (m.packed or m.sliding_window is not None or m.kind != "causal") and m.sdpa_mask is None:
        raise ValueError(f"{mode} context parallelism needs the dense document mask of this packed batch; build "
                         "the metadata with build_attn_meta(..., dense_mask=True) (prepare_cp_batch does).")


def _ring_shift(t: torch.Tensor, group, rank: int, cp: int) -> torch.Tensor:
    """Send ``t`` to the next cp rank and return what the previous one sent (p2p, waits for both)."""
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


def _expand_kv(x, rep):  # [B, G, S, K] -> [B, G*rep, S, K] (query head h uses kv head h // rep, as SDPA's GQA)
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_kv(x, rep):  # [B, G*rep, S, K] -> [B, G, S, K]
    if rep == 1:
        return x
    B, H, S, K = x.shape
    return x.view(B, H // rep, rep, S, K).sum(2)


class _RingAttention(torch.autograd.Function):
    """Ring attention over cp ranks with explicit forward/backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, masks, group, cp, rank):
        B, H, Sl, K = q.shape
        rep = H // k.shape[1]
        scale = 1.0 / (K**0.5)
        qf = q.float()
        out = torch.zeros(B, H, Sl, K, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, Sl), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for t in range(cp):
            src = (rank - t) % cp
            nxt_kv = _ring_shift(kv, group, rank, cp) if t < cp - 1 else None
            kk, vv = (_expand_kv(x, rep).float() for x in (kv[0], kv[1]))
            s = (qf @ kk.transpose(-1, -2)) * scale
            s = s.masked_fill(~masks[src], float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(s - m)
            l = p.sum(-1)
            blk_lse = torch.log(l) + m.squeeze(-1)
            blk_out = (p @ vv) / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
            new_lse = torch.logaddexp(lse, blk_lse)
            safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
            out = out * torch.exp(lse - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
            lse = new_lse
            if nxt_kv is not None:
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.group, ctx.cp, ctx.rank = masks, group, cp, rank
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        masks, group, cp, rank = ctx.masks, ctx.group, ctx.cp, ctx.rank
        B, H, Sl, K = q.shape
        rep = H // k.shape[1]
        scale = 1.0 / (K**0.5)
        qf, do = q.float(), dout.float()
        D = (do * out).sum(-1, keepdim=True)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
        for t in range(cp):
            src = (rank - t) % cp
            kk, vv = (_expand_kv(x, rep).float() for x in (kv[0], kv[1]))
            s = (qf @ kk.transpose(-1, -2)) * scale
            p = torch.exp(s - safe_lse).masked_fill(~masks[src], 0.0)
            dv = p.transpose(-1, -2) @ do
            ds = p * (do @ vv.transpose(-1, -2) - D)
            dq += (ds @ kk) * scale
            dk = (ds.transpose(-1, -2) @ qf) * scale
            dkv = dkv + torch.stack([_reduce_kv(dk, rep), _reduce_kv(dv, rep)])
            if t < cp - 1:
                kv = _ring_shift(kv, group, rank, cp)
            dkv = _ring_shift(dkv, group, rank, cp)  # after the last hop: my own complete gradients
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _local_block_masks(lm, B):  # pragma: no cover - CUDA path (flex kernels)
    out = []
    for dense in (lm.sdpa_mask, lm.sdpa_mask_swa):
        if dense is None:
            out.append(None)
            continue
        d = dense[:, 0]

        def mask_mod(b, h, q_idx, kv_idx, d=d):
            return d[b, q_idx, kv_idx]

        out.append(create_block_mask(mask_mod, d.shape[0], None, d.shape[1], d.shape[2], device=d.device))
    return out[0], out[1]


def prepare_cp_batch(
    batch: dict[str, torch.Tensor],
    parallel_dims: ParallelDims,
    backend: str,
    device,
    sliding_window: int | None = None,
    mode: str = "ulysses",
    seq_keys: tuple[str | SeqKey, ...] = (),
    kind: str = "causal",
    block_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """-> (this rank's sequence shard of ``batch``, AttnMeta with ``cp`` set). Without CP: (batch, build_attn_meta).
    ``seq_keys``: the family's keys laid out along the sequence (``BatchSchema.seq``; a bare name is a [..., B, S]
    key), cut like input_ids; the tokens and the attention keys (titan_mm.registry TOKEN_KEYS, ATTN_KEYS) always.
    ``kind`` / ``block_size``: the attention mask kind, passed to build_attn_meta (MODE_KINDS says which run)."""
    if mode not in MODES:
        raise ValueError(f"parallel.cp_mode must be one of {MODES}, got {mode!r}.")
    if not parallel_dims.cp_enabled:
        return batch, build_attn_meta(batch, backend, device, sliding_window, kind=kind, block_size=block_size)
    check_kind(backend, kind, sliding_window, block_size)
    if kind not in MODE_KINDS[mode]:
        able = [m for m in MODES if kind in MODE_KINDS[m]]
        raise ValueError(f"context parallelism mode {mode!r} cannot run attention kind {kind!r}; use "
                         f"parallel.cp_mode in {able}.")
    if backend == "varlen":
        raise ValueError("context parallelism does not support attn_backend='varlen' yet; use 'flex' or 'sdpa'.")
    mesh = parallel_dims.mesh("cp")
    S = batch_rows(batch)[1]
    axes = _seq_axes(batch, seq_keys, S)
    idx = load_balanced_index(S, parallel_dims.cp, mesh.get_local_rank())
    # ring / allgather cut their mask blocks from the dense document mask, which flex on CUDA leaves out
    meta = build_attn_meta(batch, backend, device, sliding_window, dense_mask=mode != "ulysses", kind=kind,
                           block_size=block_size)
    full = dataclasses.replace(meta, cp=None)
    local = {k: v.index_select(axes[k], idx.to(v.device)) if k in axes else v for k, v in batch.items()}
    if "num_label_tokens" in batch and "labels" in batch:
        local["num_label_tokens"] = (local["labels"] != -100).sum()
    local.pop("cu_seqlens", None)
    local.pop("max_seqlen", None)
    meta.cp = CPAttention(mode, mesh, full, S, torch.device(device))
    if meta.valid_BS is not None:
        meta.valid_BS = meta.valid_BS[:, idx.to(meta.valid_BS.device)]
    return local, meta


def _seq_axes(batch: dict, seq_keys: tuple[str | SeqKey, ...], S: int) -> dict[str, int]:
    """{key: its sequence axis} of the batch keys the split cuts; a key whose axis does not hold S is refused."""
    specs = {k.name: k for k in TOKEN_KEYS + ATTN_KEYS}
    specs.update((k, SeqKey(k)) if isinstance(k, str) else (k.name, k) for k in seq_keys)
    axes = {}
    for k, v in batch.items():
        if k in specs:
            ax = specs[k].axis(v)
            if ax < 0 or v.shape[ax] != S:
                raise ValueError(f"context parallelism cannot cut batch[{k!r}] of shape {list(v.shape)}: dim {ax} "
                                 f"(before its declared trailing dims {specs[k].trailing}) is not the rows' {S} "
                                 "tokens; declare the key's trailing dims in the family's BatchSchema")
            axes[k] = ax
    return axes


def apply_cp(model: nn.Module, plan: ParallelizePlan, pd: ParallelDims, par: Parallel) -> None:
    """CP changes no module; check that the family's plan declares its attention modules CP-capable."""
    if not plan.cp:
        raise ValueError(
            f"parallel.cp={pd.cp} but this model's plan has no cp entries: its attention does not take "
            "titan_mm.parallel.cp metadata. Set parallel.cp = 1."
        )
    for pattern, role in plan.cp.items():
        if role != "attention":
            raise ValueError(f"unknown CP role {role!r} for {pattern!r}; the only role is 'attention'.")
        if not match_modules(model, (pattern,)):
            raise ValueError(f"CP plan entry {pattern!r} matches no module of {type(model).__name__}.")
    if par.cp_mode not in MODES:
        raise ValueError(f"parallel.cp_mode must be one of {MODES}, got {par.cp_mode!r}.")
