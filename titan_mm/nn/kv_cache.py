"""KV caches for decoding: every layer's key/value storage plus the host-built metadata of one step.

Legend: B sequences in the step, S new tokens per sequence (rows padded to the longest), G kv heads, K head_dim,
L keys per sequence after the step (the longest), N real (unpadded) new tokens.

Two layouts of one idea. Every layer's storage is seen flat as ``[slots, G, K]``; a *slot* is where one token's
k/v lives, and only the host-side slot arithmetic differs:

  * :class:`ContiguousKVCache`: per layer ``[B, max_len, G, K]``; row b's position p is slot ``b * max_len + p``.
  * :class:`PagedKVCache` (vLLM's paged layout): per layer a pool ``[num_blocks, block_size, G, K]``; sequence b's
    position p is slot ``block_tables[b, p // block_size] * block_size + p % block_size``. Which blocks a
    sequence owns (``block_tables`` [B, max_blocks]) is the serving block manager's choice, passed in per step.

A step (prefill of a prompt, a chunk of it, or one decode token per sequence: the same path):

    cache = alloc_paged_cache(cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim, dtype, dev)
    cache = plan_step(cache, new_lens=[7, 5], block_tables=tables)   # host: positions, slots, masks
    meta = build_attn_meta({"input_ids": ids}, "sdpa", dev, kv_cache=cache)
    out = model(ids, position_ids=cache.step.positions, attn=meta)  # out.kv_cache is cache, now holding k/v
    cache = plan_step(out.kv_cache, new_lens=[1, 1], block_tables=tables)  # next step: one token each

Linear-attention layers (Gated DeltaNet) keep no k/v but a fixed-size state per sequence: the last W - 1 inputs
of their causal conv and the delta rule's [HV, K, V] matrix. A paged cache then also holds a :class:`StatePool`
(one *state slot* per running sequence, ``alloc_state_pool``), its k/v pools of those layers are zero-width, and a
step names each row's slot (``plan_step(..., state_slots=)``). A row whose first position is 0 starts from a zero
state; every row writes its state after its last real token back to its slot (:meth:`KVCache.linear_state`,
:meth:`KVCache.write_linear_state`).

A *packed* step (``plan_step(..., packed=True)``: the serving engine's prefill chunks) lays every sequence's new
tokens back to back in one row [1, N], so chunks of 100 and 1,000 tokens cost 1,100 rows of GEMMs, not 2,000;
attention then sees each sequence's keys through ``cu_seqlens`` (the varlen kernel on CUDA) or a block-diagonal
causal mask (elsewhere).

The forward (``KVCache.update``, called by titan_mm.nn.attention) copies the new k/v into their slots
(``index_copy_``, in place: the storage is donated to the step) and gathers every cached key of each sequence
(``index_select``); the mask built here says which of them each new query sees (causal by absolute position,
optionally a sliding window; among the step's own new tokens, as a caller's ``see_new`` says). Index tensors and
masks are built on the host before the forward, so the forward does no ``.item()``, no ``nonzero`` and no host
sync. The gather is the simple correct path; the serving engine's
paged decode kernels read the blocks in place later.

The storage may hold k/v in a narrower dtype than the model computes in (the serving engine's
``serve.kv_cache_dtype = "fp8_e4m3"``): writes round to it, reads come back in the new
k/v's dtype. torch's index kernels lack float8, so rows go in and out through byte views
(:func:`copy_rows`, :func:`take_rows`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (torch's index kernels lack float8), any other as it is."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def copy_rows(store: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``store[index] = rows`` along dim 0, in place, ``rows`` rounded to ``store``'s dtype."""
    _bytes(store).index_copy_(0, index, _bytes(rows.to(store.dtype)))


def take_rows(store: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``store[index]`` along dim 0, in ``store``'s dtype."""
    return _bytes(store).index_select(0, index).view(store.dtype)


@dataclass(frozen=True, eq=False)
class KVStep:
    """One forward's cache metadata, built on the host by :func:`plan_step`, on the cache's device."""

    positions: torch.Tensor
    """[B, S] int64 absolute position of each new token (the RoPE position_ids; padding continues the count)."""
    valid: torch.Tensor
    """[B, S] bool, False on the padding of rows with fewer new tokens."""
    new_tokens: torch.Tensor
    """[N] int64 indices into the step's flattened B*S tokens of the real new tokens."""
    slot_mapping: torch.Tensor
    """[N] int64 slot each of them is written to."""
    kv_slots: torch.Tensor | None = None
    """[B, L] int64 slots of positions 0 .. L-1 of every sequence (past its length: slot 0, masked); None on a
    ``decode_attention`` step, which reads the blocks in place."""
    mask: torch.Tensor | None = None
    """[B, 1, S, L] bool, True = attend: key j <= the query's position and j < the sequence's length (None with
    ``decode_attention``)."""
    mask_swa: torch.Tensor | None = None
    """``mask`` and the sliding window (query position - j < window); None when planned without a window."""
    sliding_window: int | None = None
    decode_attention: Callable | None = None
    """Set on a one-token step of a paged cache planned with ``decode_attention`` (titan_mm.kernels'
    paged_decode_attention): attention reads the keys in place through ``block_tables`` / ``seq_lens`` below
    instead of gathering them (``kv_slots`` and the masks are then unused)."""
    block_tables: torch.Tensor | None = None
    """[B, blocks of the longest sequence] int32 on the device, with ``decode_attention``."""
    seq_lens: torch.Tensor | None = None
    """[B] int32 on the device: keys per sequence after the step, with ``decode_attention``."""
    state_slots: torch.Tensor | None = None
    """[B] int64: each row's slot in the cache's :class:`StatePool` (linear-attention layers); None without one."""
    cu_seqlens_q: torch.Tensor | None = None
    """[B + 1] int32 on the device, on a *packed* step (one row holding every sequence's new tokens back to back):
    where each sequence's new tokens start in the row. None on a step of rows."""
    cu_seqlens_k: torch.Tensor | None = None
    """[B + 1] int32, packed: where each sequence's keys (cached, then new) start in the gathered ``kv_slots``."""
    max_seqlen_q: int = 0
    """Packed: the most new tokens of one sequence (host int, for the varlen kernel)."""
    max_seqlen_k: int = 0
    """Packed: the most keys of one sequence."""
    varlen: bool = False
    """Packed, on CUDA in bf16 / fp16: attention runs the varlen kernel over ``cu_seqlens_*`` (the masks are not
    built); otherwise SDPA reads ``mask`` [1, 1, T, sum of keys]."""
    paged_attention: Callable | None = None
    """Set on a packed step of a paged cache planned with ``paged_attention`` (titan_mm.kernels' paged_attention):
    attention reads every sequence's keys in place through ``block_tables`` / ``seq_lens`` / ``cu_seqlens_q``
    (decode rows and prefill chunks in one call) instead of gathering them (``kv_slots``, ``cu_seqlens_k`` and
    the masks are then unset)."""


@dataclass(frozen=True, eq=False)
class StatePool:
    """The linear-attention layers' per-sequence state, one slot per sequence: per such layer ``conv[layer]``
    [slots, W-1, C] (the conv's last inputs, in the model dtype) and ``rec[layer]`` [slots, HV, K, V] (fp32)."""

    conv: dict[int, torch.Tensor]
    rec: dict[int, torch.Tensor]

    @property
    def num_slots(self) -> int:
        return next(iter(self.rec.values())).shape[0]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots ``dst`` get the states of slots ``src`` in every layer (a forked sequence's)."""
        for store in (*self.conv.values(), *self.rec.values()):
            store.index_copy_(0, dst, store.index_select(0, src))


@dataclass(frozen=True, eq=False, kw_only=True)
class KVCache(abc.ABC):
    """Storage of every layer (``k[layer]``, ``v[layer]``) and the lengths of the sequences it holds."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    seq_lens: torch.Tensor | None = None
    """[B] int64 (host): tokens cached per sequence, the planned step included; None: nothing cached yet."""
    step: KVStep | None = None
    """The planned step (plan_step); the forward reads only this."""
    state: StatePool | None = None
    """The linear-attention layers' state slots (None: every layer keeps k/v)."""

    @abc.abstractmethod
    def _slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Slot of position ``pos`` of sequence ``rows`` (host tensors of one shape): the layout's arithmetic."""

    @abc.abstractmethod
    def _check_capacity(self, total: torch.Tensor) -> None:
        """Raise when ``total`` [B] tokens per sequence do not fit the layout."""

    def update(self, layer: int, k_BSGK: torch.Tensor, v_BSGK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's new k/v of ``layer`` into their slots; -> every cached k, v of each sequence
        [B, L, G, K] (in the new k/v's dtype). Shape checks only: no host sync."""
        self.write(layer, k_BSGK, v_BSGK)
        B = k_BSGK.shape[0]
        G, K = k_BSGK.shape[2:]
        slots = self.step.kv_slots.reshape(-1)
        return tuple(take_rows(store.view(-1, G, K), slots).view(B, -1, G, K).to(new.dtype)
                     for store, new in ((self.k[layer], k_BSGK), (self.v[layer], v_BSGK)))

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv state [B, W-1, C] and recurrent state [B, HV, K, V] of the step's rows at linear-attention
        ``layer``; zeros for a row that starts at position 0 (device ops only)."""
        st = self.step
        if self.state is None or layer not in self.state.rec or st.state_slots is None:
            raise ValueError(f"layer {layer} keeps a linear-attention state but the cache has no state slot for it; "
                             "allocate it with alloc_state_pool(linear layers, ...) and plan_step(..., state_slots=)")
        fresh = st.positions[:, 0] == 0
        return tuple(torch.where(fresh.view(-1, *[1] * (store.dim() - 1)), 0, store.index_select(0, st.state_slots))
                     for store in (self.state.conv[layer], self.state.rec[layer]))

    def write_linear_state(self, layer: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Store the rows' states after the step into their slots (in place)."""
        for store, new in ((self.state.conv[layer], conv), (self.state.rec[layer], rec)):
            store.index_copy_(0, self.step.state_slots, new.to(store.dtype))

    def write(self, layer: int, k_BSGK: torch.Tensor, v_BSGK: torch.Tensor) -> None:
        """Copy this step's new k/v of ``layer`` into their slots (in place)."""
        if not 0 <= layer < len(self.k):
            raise ValueError(f"layer {layer} has no KV cache: the cache holds {len(self.k)} layers; allocate it with "
                             "num_layers = the model's layer count and pass layer_id=i to Attention")
        B, S, G, K = k_BSGK.shape
        if tuple(self.k[layer].shape[-2:]) != (G, K):
            raise ValueError(f"the cache stores [G, K] = {list(self.k[layer].shape[-2:])} per token but layer {layer} "
                             f"has {G} kv heads of dim {K}; allocate it with the model's num_key_value_heads, head_dim")
        for store, new in ((self.k[layer], k_BSGK), (self.v[layer], v_BSGK)):
            copy_rows(store.view(-1, G, K), self.step.slot_mapping,
                      new.reshape(B * S, G, K).index_select(0, self.step.new_tokens))


@dataclass(frozen=True, eq=False, kw_only=True)
class ContiguousKVCache(KVCache):
    """Per layer ``[B, max_len, G, K]``: row b holds sequence b; ``seq_lens`` [B] says how much of it is filled."""

    def _slots(self, rows, pos):
        return rows * self.k[0].shape[1] + pos

    def _check_capacity(self, total):
        max_len = self.k[0].shape[1]
        if total.numel() != self.k[0].shape[0]:  # cached_lens given for another batch size
            raise ValueError(f"the contiguous cache has {self.k[0].shape[0]} rows but the step has {total.numel()} "
                             "sequences; plan one new_lens entry per row (0 for an idle row)")
        if int(total.max()) > max_len:
            b = int(total.argmax())
            raise ValueError(f"row {b} would hold {int(total[b])} tokens but the cache holds max_len={max_len} per "
                             f"row; allocate it with max_len >= {int(total.max())}")


@dataclass(frozen=True, eq=False, kw_only=True)
class PagedKVCache(KVCache):
    """Per layer a pool ``[num_blocks, block_size, G, K]``; sequence b owns blocks ``block_tables[b]`` in order."""

    block_tables: torch.Tensor | None = None
    """[B, max_blocks] int64 (host): the pool blocks of each sequence, logical block i at column i."""

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[N] slots of the planned step's new tokens (on the cache's device)."""
        return self.step.slot_mapping

    def _slots(self, rows, pos):
        bs = self.block_size
        return self.block_tables[rows, pos // bs] * bs + pos % bs

    def _check_capacity(self, total):
        bt, bs, nb = self.block_tables, self.block_size, self.k[0].shape[0]
        if bt is None:
            raise ValueError("a paged cache step needs block_tables [B, max_blocks]: plan_step(..., block_tables=...)")
        if bt.dim() != 2 or bt.shape[0] != total.numel():
            raise ValueError(f"block_tables has shape {list(bt.shape)} but the step has {total.numel()} sequences; "
                             "pass one row of block ids per sequence, [B, max_blocks]")
        need = (total + bs - 1) // bs
        if int(need.max()) > bt.shape[1]:
            b = int(need.argmax())
            raise ValueError(f"sequence {b} needs {int(need[b])} blocks of {bs} tokens for {int(total[b])} tokens but "
                             f"block_tables has {bt.shape[1]} columns; give it more blocks")
        used = torch.arange(bt.shape[1])[None] < need[:, None]
        if bool(((bt < 0) | (bt >= nb))[used].any()):
            raise ValueError(f"block_tables names a block outside the pool of {nb} blocks (0 .. {nb - 1}) among the "
                             "blocks the step uses; allocate more blocks or fix the table")


def _storage(num_layers: int, shape: tuple[int, ...], dtype, device, stateful=()) -> tuple[tuple, tuple]:
    if num_layers < 1 or min(shape) < 1:
        raise ValueError(f"a KV cache needs num_layers >= 1 and positive sizes, got num_layers={num_layers}, "
                         f"per-layer shape {list(shape)}")
    # zeros: slots never written are still finite where a mask lets a query read them (an empty row's slot 0);
    # the layers of ``stateful`` keep no k/v: zero-width pools keep every layer's index (and copies) uniform
    return tuple(tuple(torch.zeros((*shape[:-1], 0) if i in stateful else shape, dtype=dtype, device=device)
                       for i in range(num_layers)) for _ in "kv")


def alloc_contiguous_cache(num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> ContiguousKVCache:
    """An empty contiguous cache: per layer k and v of ``[batch_size, max_len, num_kv_heads, head_dim]``."""
    k, v = _storage(num_layers, (batch_size, max_len, num_kv_heads, head_dim), dtype, device)
    return ContiguousKVCache(k=k, v=v, seq_lens=torch.zeros(batch_size, dtype=torch.int64))


def alloc_paged_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      state: StatePool | None = None) -> PagedKVCache:
    """An empty paged cache: per layer k and v pools of ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (zero-width for the linear-attention layers of ``state``, which keep their state there instead)."""
    stateful = () if state is None else tuple(state.rec)
    k, v = _storage(num_layers, (num_blocks, block_size, num_kv_heads, head_dim), dtype, device, stateful)
    return PagedKVCache(k=k, v=v, state=state)


def state_shapes(conv_channels: int, conv_kernel: int, value_heads: int, key_dim: int,
                 value_dim: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per slot and layer: the conv state [W-1, C] and the recurrent state [HV, K, V]."""
    return (conv_kernel - 1, conv_channels), (value_heads, key_dim, value_dim)


def alloc_state_pool(layers: Sequence[int], num_slots: int, conv_shape: tuple[int, int],
                     rec_shape: tuple[int, int, int], dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> StatePool:
    """Zeroed state slots of the linear-attention ``layers`` (shapes per slot from :func:`state_shapes`): conv
    states in ``dtype``, recurrent states in fp32."""
    if not layers or num_slots < 1 or min(conv_shape + rec_shape) < 1:
        raise ValueError(f"a state pool needs linear layers, num_slots >= 1 and positive shapes, got {list(layers)}, "
                         f"{num_slots}, {list(conv_shape)}, {list(rec_shape)}")
    return StatePool(conv={i: torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device) for i in layers},
                     rec={i: torch.zeros(num_slots, *rec_shape, dtype=torch.float32, device=device) for i in layers})


def plan_step(cache: KVCache, new_lens: Sequence[int] | torch.Tensor, *, cached_lens: Sequence[int] | None = None,
              block_tables: torch.Tensor | Sequence[Sequence[int]] | None = None,
              sliding_window: int | None = None, width: int | None = None,
              decode_attention: Callable | None = None, into: KVStep | None = None,
              state_slots: Sequence[int] | None = None, packed: bool = False, varlen: bool = False,
              paged_attention: Callable | None = None, see_new: torch.Tensor | None = None,
              spans: torch.Tensor | None = None) -> KVCache:
    """Host side: -> ``cache`` with this step's :class:`KVStep` and the lengths after it (storage shared).

    ``new_lens`` [B]: new tokens per sequence this step (the batch's rows hold them first, then padding).
    ``cached_lens`` [B]: tokens already cached per sequence (default: ``cache.seq_lens``, zeros when empty).
    ``block_tables`` [B, max_blocks]: paged layout only (default: the cache's current ones).
    ``sliding_window``: the model config's ``attn_sliding_window`` when any layer uses one.
    ``width``: S, the padded row length of the step's input_ids (default: max(new_lens)).
    ``decode_attention``: paged_decode_attention(q [B, H, K], k_pool, v_pool, block_tables, seq_lens, window),
    used when the step is one token per row of a paged cache (others gather, as without it).
    ``into``: a decode step's device tensors to fill instead of allocating new ones (CUDA graphs replay fixed
    addresses); its block_tables may be wider than this step's tables (the kernel reads the used columns only).
    ``state_slots`` [B]: each row's slot of ``cache.state`` (needed when the cache has one).
    ``packed``: the step's input_ids are one row [1, sum(new_lens)], sequence after sequence, with no padding
    (prefill chunks of mixed lengths); ``varlen``: its attention runs the varlen kernel instead of a dense mask;
    ``paged_attention``: paged_attention(q [T, H, K], k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window)
    reads the keys of a packed step of a paged cache in place instead (rows of any length, one call).
    ``see_new`` [B, S, S] bool: which of the step's new tokens each new token sees, instead of causal by position
    (every cached key stays visible): a prefill with bidirectional spans (an image split seeing all of itself).
    ``spans`` [B, S] (or packed [1, sum(new_lens)]) int64: a span id per new token (0: none); a sequence's new
    tokens that share an id see each other, the rest stays causal (rows: the ``see_new`` it makes; packed: its
    dense mask, so neither the varlen kernel nor ``paged_attention``).
    """
    new = torch.as_tensor(new_lens, dtype=torch.int64).reshape(-1).cpu()  # host metadata, whatever was passed
    B = new.numel()
    if cached_lens is not None:
        cached = torch.as_tensor(cached_lens, dtype=torch.int64).reshape(-1).cpu()
    else:
        cached = cache.seq_lens if cache.seq_lens is not None else torch.zeros(B, dtype=torch.int64)
    if cached.numel() != B:
        fix = ("plan one new_lens entry per row (0 for an idle row)" if isinstance(cache, ContiguousKVCache) else
               "pass cached_lens (tokens already cached per sequence) for a new batch")
        raise ValueError(f"new_lens has {B} sequences but the cache holds {cached.numel()}; {fix}")
    if bool((new < 0).any()) or int(new.sum()) == 0:
        raise ValueError(f"new_lens must be >= 0 with at least one new token, got {new.tolist()}")
    S = int(new.max()) if width is None else width
    if S < int(new.max()):
        raise ValueError(f"width={S} is shorter than the longest row of new tokens ({int(new.max())})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if isinstance(cache, PagedKVCache):
        bt = cache.block_tables if block_tables is None else torch.as_tensor(block_tables, dtype=torch.int64).cpu()
        cache = dataclasses.replace(cache, block_tables=bt)
    elif block_tables is not None:
        raise ValueError("block_tables apply to a PagedKVCache only; a contiguous cache maps rows to sequences")
    total = cached + new
    cache._check_capacity(total)
    slots = None
    if cache.state is not None:
        if state_slots is None or len(state_slots) != B:
            raise ValueError(f"the cache holds linear-attention states: pass state_slots, one slot per sequence "
                             f"({B}), to plan_step")
        slots = torch.as_tensor(state_slots, dtype=torch.int64).cpu()
        if bool(((slots < 0) | (slots >= cache.state.num_slots)).any()):
            raise ValueError(f"state_slots {slots.tolist()} name a slot outside the pool of {cache.state.num_slots}")

    if spans is not None and see_new is not None:
        raise ValueError("plan_step takes spans (which make see_new) or see_new, not both; pass one")
    if spans is not None and not packed:
        sp = torch.as_tensor(spans).cpu().reshape(B, S)
        i = torch.arange(S)
        see_new = (i[:, None] >= i[None])[None] | ((sp[:, :, None] == sp[:, None, :]) & (sp[:, :, None] > 0))
    if see_new is not None and (packed or decode_attention is not None):
        raise ValueError("plan_step(see_new=...) plans a step of rows that gathers its keys: drop packed / "
                         "decode_attention")
    if packed:
        if cache.state is not None or decode_attention is not None or into is not None:
            raise ValueError("a packed step carries no linear-attention states, decode_attention or into: plan "
                             "those steps as rows")
        if paged_attention is not None and not isinstance(cache, PagedKVCache):
            raise ValueError("plan_step(paged_attention=...) reads a PagedKVCache's blocks; a contiguous cache gathers")
        if spans is not None and (varlen or paged_attention is not None):
            raise ValueError("plan_step(spans=...) of a packed step builds a dense mask: drop varlen / paged_attention")
        return dataclasses.replace(cache, seq_lens=total, step=_packed_step(cache, new, cached, total, sliding_window,
                                                                            varlen, paged_attention, spans))
    if paged_attention is not None:
        raise ValueError("plan_step(paged_attention=...) plans a packed step: pass packed=True")
    i = torch.arange(S)
    positions = cached[:, None] + i[None]  # [B, S]
    valid = i[None] < new[:, None]
    rows = torch.arange(B)[:, None].expand(B, S)
    new_tokens = valid.reshape(-1).nonzero().squeeze(1)
    slot_mapping = cache._slots(rows.reshape(-1)[new_tokens], positions.reshape(-1)[new_tokens])
    L = int(total.max())
    dev = cache.k[0].device
    if decode_attention is not None and isinstance(cache, PagedKVCache) and S == 1:
        width_blocks = -(-L // cache.block_size)  # the kernel loops over these columns: the longest sequence's
        host = dict(positions=positions, valid=valid, new_tokens=new_tokens, slot_mapping=slot_mapping,
                    block_tables=cache.block_tables[:, :width_blocks].to(torch.int32), seq_lens=total.to(torch.int32))
        if slots is not None:
            host["state_slots"] = slots
        if into is None:
            step = KVStep(**{n: t.to(dev, non_blocking=True) for n, t in host.items()},
                          sliding_window=sliding_window, decode_attention=decode_attention)
        else:
            for n, t in host.items():
                dst = getattr(into, n)
                (dst[:, : t.shape[1]] if n == "block_tables" else dst).copy_(t, non_blocking=True)
            step = into
        return dataclasses.replace(cache, seq_lens=total, step=step)
    if into is not None:
        raise ValueError("plan_step(into=...) fills a one-token paged step with decode_attention only")
    j = torch.arange(L)
    has = j[None] < total[:, None]  # [B, L]: key j exists in sequence b
    kv_slots = torch.where(has, cache._slots(torch.arange(B)[:, None].expand(B, L), torch.where(has, j, 0)), 0)
    # padding queries look from their row's last key (and an empty row at its slot 0), so no query row is
    # fully masked (no NaN), not even inside a window
    qpos = torch.where(valid, positions, (total - 1).clamp(min=0)[:, None])[:, :, None]  # [B, S, 1]
    mask = (j <= qpos) & (has | (j == 0))[:, None, :]
    if see_new is not None:
        if tuple(see_new.shape) != (B, S, S) or sliding_window is not None:
            raise ValueError(f"see_new has shape {list(see_new.shape)}; give [B, S, S] = [{B}, {S}, {S}] bool (which "
                             "new tokens each new token sees), without a sliding window")
        rel = (j[None] - cached[:, None]).clamp(0, S - 1)  # [B, L]: key j's index among the new tokens
        new_key = ((j[None] >= cached[:, None]) & has)[:, None, :]
        mask = torch.where(new_key, see_new.cpu().bool().gather(2, rel[:, None].expand(B, S, L)), mask)
    mask_swa = None if sliding_window is None else mask & (qpos - j < sliding_window)
    host = dict(positions=positions, valid=valid, new_tokens=new_tokens, slot_mapping=slot_mapping, kv_slots=kv_slots,
                mask=mask[:, None], mask_swa=None if mask_swa is None else mask_swa[:, None], state_slots=slots)
    step = KVStep(**{n: None if t is None else t.to(dev, non_blocking=True) for n, t in host.items()},
                  sliding_window=sliding_window)
    return dataclasses.replace(cache, seq_lens=total, step=step)


def _packed_step(cache: KVCache, new: torch.Tensor, cached: torch.Tensor, total: torch.Tensor,
                 sliding_window: int | None, varlen: bool, paged_attention: Callable | None = None,
                 spans: torch.Tensor | None = None) -> KVStep:
    """A packed step's metadata: query t belongs to sequence ``q_seq[t]``, key j to ``k_seq[j]``; a query sees
    the keys of its own sequence up to its position (FlashAttention's bottom-right causal alignment), and the new
    keys of its own span (``spans``, plan_step's). With ``paged_attention`` the keys stay in the pool: the step
    carries the tables and lengths instead."""
    B = new.numel()
    q_seq = torch.repeat_interleave(torch.arange(B), new)  # [T]
    cu_q = torch.nn.functional.pad(new.cumsum(0), (1, 0))
    q_pos = cached[q_seq] + torch.arange(q_seq.numel()) - cu_q[q_seq]
    dev = cache.k[0].device
    if paged_attention is not None:
        width_blocks = max(-(-int(total.max()) // cache.block_size), 1)
        host = dict(positions=q_pos[None], valid=torch.ones(1, q_seq.numel(), dtype=torch.bool),
                    new_tokens=torch.arange(q_seq.numel()), slot_mapping=cache._slots(q_seq, q_pos),
                    block_tables=cache.block_tables[:, :width_blocks].to(torch.int32), seq_lens=total.to(torch.int32),
                    cu_seqlens_q=cu_q.to(torch.int32))
        return KVStep(**{n: t.to(dev, non_blocking=True) for n, t in host.items()}, sliding_window=sliding_window,
                      max_seqlen_q=int(new.max()), max_seqlen_k=int(total.max()), paged_attention=paged_attention)
    k_seq = torch.repeat_interleave(torch.arange(B), total)  # [Tk]
    cu_k = torch.nn.functional.pad(total.cumsum(0), (1, 0))
    k_pos = torch.arange(k_seq.numel()) - cu_k[k_seq]
    mask = mask_swa = None
    if not varlen:
        mask = (q_seq[:, None] == k_seq[None]) & (k_pos[None] <= q_pos[:, None])  # [T, Tk]
        if spans is not None:  # a new key's span is its new token's; a cached key is in none
            sp_q = torch.as_tensor(spans).cpu().reshape(-1)
            fresh = k_pos >= cached[k_seq]
            at = (cu_q[k_seq] + k_pos - cached[k_seq]).clamp(0, sp_q.numel() - 1)
            sp_k = torch.where(fresh, sp_q[at], 0)
            mask |= (q_seq[:, None] == k_seq[None]) & (sp_q[:, None] == sp_k[None]) & (sp_q[:, None] > 0)
        if sliding_window is not None:
            mask_swa = mask & (q_pos[:, None] - k_pos[None] < sliding_window)
    host = dict(positions=q_pos[None], valid=torch.ones(1, q_seq.numel(), dtype=torch.bool),
                new_tokens=torch.arange(q_seq.numel()), slot_mapping=cache._slots(q_seq, q_pos),
                kv_slots=cache._slots(k_seq, k_pos)[None], mask=None if mask is None else mask[None, None],
                mask_swa=None if mask_swa is None else mask_swa[None, None],
                cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32))
    return KVStep(**{n: None if t is None else t.to(dev, non_blocking=True) for n, t in host.items()},
                  sliding_window=sliding_window, max_seqlen_q=int(new.max()), max_seqlen_k=int(total.max()),
                  varlen=varlen)


def paged_decode_reference(q_BHK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The reference of titan_mm.kernels.paged_decode_attention: :func:`paged_attention_reference` with one query
    per sequence (at its last position). A sequence of length 0 gets zeros."""
    cu = torch.arange(q_BHK.shape[0] + 1, device=q_BHK.device, dtype=torch.int32)
    return paged_attention_reference(q_BHK, k_pool, v_pool, block_tables, seq_lens, cu, window)


def paged_attention_reference(q_THK: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              window: int | None = None) -> torch.Tensor:
    """The reference of titan_mm.kernels.paged_attention (device ops, no host sync): the T new queries of B
    sequences packed by ``cu_seqlens_q`` [B + 1], sequence b's ending its ``seq_lens[b]`` keys; every key its table
    row names, kept at or before the query's position (and inside the window), fp32 softmax. A query with no key
    (of a sequence of length 0) gets zeros. Memory T x keys of a table row x G x K: small batches (tests, CPU)."""
    T, H, K = q_THK.shape
    NB, BS, G, _ = k_pool.shape
    MB = block_tables.shape[1]
    dev = q_THK.device
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True).clamp(max=block_tables.shape[0] - 1)
    qpos = seq_lens.long()[seq] - (cu_seqlens_q.long()[seq + 1] - t)  # [T]
    slots = (block_tables.long().clamp(0, NB - 1)[seq][:, :, None] * BS + torch.arange(BS, device=dev)).reshape(
        T, MB * BS)
    k, v = (take_rows(pool.reshape(NB * BS, G, K), slots.reshape(-1)).view(T, MB * BS, G, K).float()
            for pool in (k_pool, v_pool))  # [T, L, G, K]
    pos = torch.arange(MB * BS, device=dev)[None]
    ok = pos <= qpos[:, None]
    if window is not None:
        ok = ok & (qpos[:, None] - pos < window)
    s = torch.einsum("tgjk,tlgk->tgjl", q_THK.float().view(T, G, H // G, K), k) * K ** -0.5
    p = torch.softmax(s.masked_fill(~ok[:, None, None, :], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("tgjl,tlgk->tgjk", p, v).reshape(T, H, K).to(q_THK.dtype)
