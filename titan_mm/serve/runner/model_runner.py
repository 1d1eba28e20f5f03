"""One forward of the engine's step through the training model's KV-cache path.

Host side, before the forward: the step's rows (one per sequence: its new tokens; packed back to back in one row,
or right-padded rows for families with linear-attention states or with ``serve.packed_prefill`` off), the paged cache
step (titan_mm.nn.kv_cache.plan_step: positions, slot mapping, gathered slots, masks), M-RoPE positions,
and for a vision family its ``prepare_batch`` metadata over the whole images the rows hold. The forward itself
does no host sync (tests/gpu/test_serve_gpu.py checks it).

A step's one-token rows (decode, and one-token prefill chunks without media) run apart from its longer rows, so a
long prefill chunk never pads hundreds of decode rows to its length. With the paged decode kernel they run as a
*decode step*: padded to the next of a fixed set of batch sizes, their inputs written into static device buffers
(pad rows write their k/v to a scratch block no sequence owns), and on CUDA replayed from a graph captured per
size when the engine starts, which removes the step's hundreds of kernel launches from the host's critical
path. With ``serve.graph_sampling`` the decode step (its graph) ends with the greedy pick of its logits, and the
engine may hand :meth:`ModelRunner.execute` the step's draw (a ``DrawPlan``): a decode step of exactly those rows
returns their tokens in :class:`Executed` (the greedy pick, or for sampled rows a second small graph over static
knob and noise buffers), which the sampler takes instead of drawing after the replay. With
``serve.mixed_attention`` a step that has longer rows runs all its rows as one packed row instead,
whose attention (titan_mm.kernels.paged_attention) reads every row's keys in place: one launch per layer.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from titan_mm.kernels import greedy_pick, paged_attention, paged_decode_attention
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.kv_cache import (KVStep, alloc_paged_cache, alloc_state_pool, copy_rows, plan_step, state_shapes,
                                  take_rows)
from titan_mm.serve.core.scheduler import Row
from titan_mm.serve.core.media import MEDIA_KEYS, audio_inputs, split_inputs
from titan_mm.serve.core.sequence import PENDING, Audio
from titan_mm.serve.runner.sampler import DrawPlan, Picked, StaticDraw, pick


_ROW_FIELDS = ("positions", "valid", "new_tokens", "slot_mapping", "block_tables", "seq_lens", "state_slots")
"""The KVStep fields of a decode step, one row per sequence."""


class Fed(NamedTuple):
    """The previous step's sampled tokens, still on the device (serve.async_scheduling): a row whose token is
    PENDING reads it from ``tokens[row_of[seq_id]]``."""

    tokens: torch.Tensor
    row_of: dict[int, int]


class Executed(NamedTuple):
    """A forward's output: the logits, and ``tokens`` when the step drew its rows itself (a decode step handed a
    :class:`~titan_mm.serve.runner.sampler.DrawPlan` under serve.graph_sampling; else None)."""

    logits: torch.Tensor
    tokens: Picked | None = None


@dataclass
class StepInputs:
    """One forward's inputs, on the device: ids [B, S], positions, attention metadata (the planned cache),
    logits_at [B] and the family's extra inputs; the first ``n_rows`` rows are real. ``packed``: ids are one row
    [1, N] of ``n_rows`` sequences and logits_at [1, n_rows x per_row] indexes it."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    logits_at: torch.Tensor
    extra: dict
    n_rows: int
    packed: bool = False


@dataclass
class _DecodeStep:
    """A decode batch size's static inputs (views of the runner's buffers), its graph, the graph's logits and
    (serve.graph_sampling) their greedy pick, and the graphs of its sampled draw (by :class:`Knobs` branch: the
    sorted pass or plain softmax) with their tokens."""

    ids: torch.Tensor
    positions: torch.Tensor
    step: KVStep
    inputs: StepInputs
    graph: object = None
    out: torch.Tensor | None = None
    picked: Picked | None = None
    draws: dict = dataclasses.field(default_factory=dict)


def decode_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max(max_num_seqs, 1)) for s in sizes} | {max_num_seqs})


def kv_bytes_per_block(dims, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """k and v of every full-attention layer for ``block_size`` tokens, of the kv heads one of ``tp`` ranks holds."""
    layers = dims.num_layers - (len(dims.linear.layers) if dims.linear is not None else 0)
    return 2 * layers * block_size * dims.num_kv_heads // tp * dims.head_dim * torch.finfo(dtype).bits // 8


def _state_shapes(lin, tp: int):
    """One rank's conv and recurrent state shapes per slot and layer (tensor parallel splits the heads)."""
    return state_shapes(lin.conv_channels // tp, lin.conv_kernel, lin.num_value_heads // tp, lin.key_head_dim,
                        lin.value_head_dim)


def state_bytes(dims, num_slots: int, dtype: torch.dtype, tp: int = 1) -> int:
    """The linear-attention state pool of ``num_slots`` slots (0 without linear layers): conv in ``dtype``, fp32."""
    if dims.linear is None:
        return 0
    conv, rec = _state_shapes(dims.linear, tp)
    per = conv[0] * conv[1] * torch.finfo(dtype).bits // 8 + rec[0] * rec[1] * rec[2] * 4
    return num_slots * len(dims.linear.layers) * per


def _host_available() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def pool_blocks(model, cfg, dims, device: torch.device, dtype: torch.dtype, max_model_len: int,
                draft_dims=None) -> int:
    """KV blocks (``cfg``: the ServeConfig) from the memory left after the weights and a profiling forward of
    max_num_batched_tokens; ``draft_dims``: a draft model's, whose pool shares the block layout."""
    act = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        n = min(cfg.max_num_batched_tokens, max_model_len)
        with torch.inference_mode():
            model(torch.zeros(1, n, dtype=torch.long, device=device), logits_at=torch.tensor([n - 1], device=device))
        act = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
    tp, kv = cfg.tensor_parallel_size, cfg.kv_dtype(device)
    act += state_bytes(dims, cfg.max_num_seqs + 1, dtype, tp)
    cap = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
    per = kv_bytes_per_block(dims, cfg.block_size, kv, tp)
    if draft_dims is not None:
        per += kv_bytes_per_block(draft_dims, cfg.block_size, kv, tp)
    return ModelRunner.blocks_from_memory(per, device, cfg.gpu_memory_utilization, act, cap)


class ModelRunner:
    def __init__(self, model, spec, model_cfg, device: torch.device, dtype: torch.dtype, block_size: int,
                 num_blocks: int, max_num_seqs: int, tp: int = 1, paged_decode: bool = True, max_model_len: int = 0,
                 cuda_graphs: bool = True, packed_prefill: bool = False, mixed_attention: bool = False,
                 graph_sampling: bool = False, kv_dtype: torch.dtype | None = None):
        """``kv_dtype``: the KV pools' storage (None: ``dtype``)."""
        self.model, self.spec, self.cfg = model, spec, model_cfg
        self.decode_attention = paged_decode_attention if paged_decode else None
        self.device, self.dtype = device, dtype
        dims = spec.dims(model_cfg)
        rt = spec.runtime(model_cfg)
        self.backend, self.window = rt.attn_backend, rt.sliding_window
        # several position axes (registry.POSITION_AXES), or image splits: the request carries its prompt's positions
        needs = spec.data_needs(model_cfg)
        self.axes = needs.position_axes
        self.own_positions = self.axes > 1 or needs.splits is not None
        self.sizes = decode_sizes(max_num_seqs)
        # tensor parallel: each rank's attention writes only its local kv heads (the plan splits wk / wv by heads);
        # one block more than the block manager hands out: the scratch block of a decode step's pad rows (and
        # one state slot more than the seats: their scratch slot)
        lin = dims.linear
        state = None if lin is None else alloc_state_pool(lin.layers, max_num_seqs + 1, *_state_shapes(lin, tp),
                                                          dtype, device)
        self.scratch_slot = None if lin is None else max_num_seqs
        # linear-attention states are per row: those families prefill through padded rows
        self.mixed = mixed_attention and lin is None
        self.packed = (packed_prefill or self.mixed) and lin is None
        self.varlen = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)  # flash kernels only
        self.cache = alloc_paged_cache(dims.num_layers, num_blocks + 1, block_size, dims.num_kv_heads // tp,
                                       dims.head_dim, kv_dtype or dtype, device, state=state)
        self.scratch_block = num_blocks
        self.max_table = -(-max(max_model_len, block_size) // block_size) + 1  # + a lookahead block
        # bf16 only: the serving dtype; fp32 runs eagerly (its steps are checked sync-free too, on the H200)
        self.graphs = cuda_graphs and device.type == "cuda" and paged_decode and dtype == torch.bfloat16
        self.graph_sampling = graph_sampling
        self._decode: dict[int, _DecodeStep] = {}
        self._static: dict | None = None
        self._draws: StaticDraw | None = None  # serve.graph_sampling's sampled draws, sized as _static

    @staticmethod
    def blocks_from_memory(per_block: int, device: torch.device, utilization: float, activation_bytes: int,
                           cap_blocks: int) -> int:
        """Blocks of ``per_block`` bytes that fit in ``utilization`` of the device's memory besides what is
        allocated now (the weights) and ``activation_bytes`` (the peak of a profiling forward); on CPU, of the
        available host memory, at most ``cap_blocks``."""
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return int((total * utilization - (total - free) - activation_bytes) // per_block)
        return min(int(_host_available() * utilization // per_block), cap_blocks)

    # ---- one step ----
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's k/v in every layer."""
        if not copies:
            return
        src, dst = torch.tensor(copies).T.to(self.device, non_blocking=True)  # torch.tensor(device=) would sync
        for store in self.cache.k + self.cache.v:
            copy_rows(store, dst, take_rows(store, src))

    def copy_state(self, src: int, dst: int) -> None:
        """A forked sequence (slot ``dst``) starts from its parent's linear-attention state (slot ``src``)."""
        src, dst = torch.tensor([[src], [dst]]).to(self.device, non_blocking=True)
        self.cache.state.copy(src, dst)

    def run(self, rows: list[Row], copies: list[tuple[int, int]], per_row: int = 1,
            fed: Fed | None = None) -> torch.Tensor:
        """:meth:`execute`'s logits (a draft model's steps, which hand no draw)."""
        return self.execute(rows, copies, per_row, fed).logits

    def execute(self, rows: list[Row], copies: list[tuple[int, int]], per_row: int = 1, fed: Fed | None = None,
                plan: DrawPlan | None = None) -> Executed:
        """Forward the rows; -> :class:`Executed`: logits [len(rows), V] at each row's last new token, or with
        ``per_row`` > 1 [len(rows), per_row, V] at its token before the guesses and after each guess (the last one
        repeated). ``fed``: where the rows' PENDING tokens are on the device. ``plan``: the draw of exactly these
        rows, which a decode step of all of them makes itself (serve.graph_sampling; its tokens in the result)."""
        self.copy_blocks(copies)
        one = [] if per_row > 1 or self.decode_attention is None else \
            [i for i, r in enumerate(rows) if r.n == 1 and len(r.seq.table.blocks) <= self.max_table
             and not (r.req.media and self._has_media(r))]
        if len(one) == len(rows):
            return self.decode(rows, fed=fed, plan=plan)
        if not one or self.mixed:  # mixed: the decode rows join the packed row (one attention call per layer)
            return Executed(self.forward(self.prepare(rows, per_row, fed)))
        rest = sorted(set(range(len(rows))) - set(one))
        # the longer rows take their pending tokens before the decode step replays: under serve.graph_sampling
        # those tokens may be the previous decode step's own draw, in memory the replay reuses
        longer = self.prepare([rows[i] for i in rest], fed=fed)
        out = torch.cat([self.decode([rows[i] for i in one], fed=fed).logits, self.forward(longer)])
        order = torch.tensor(one + rest).argsort()
        return Executed(out[order.to(out.device, non_blocking=True)])

    def _has_media(self, r: Row) -> bool:
        return any(r.start <= m.start and m.end <= r.start + r.n for m in r.req.media)

    # ---- decode steps: static buffers, CUDA graphs ----
    @torch.inference_mode()
    def decode(self, rows: list[Row], B: int = 0, fed: Fed | None = None, plan: DrawPlan | None = None) -> Executed:
        """One token per row through the paged kernel, the rows padded to the next decode size (or to ``B``);
        -> logits [len(rows), V], and the plan's tokens (:meth:`execute`)."""
        n = len(rows)
        B = B or next((s for s in self.sizes if s >= n), n)
        st = self._decode_step(B)
        width = max((len(r.seq.table.blocks) for r in rows), default=1)
        pad = self.scratch_block
        # lists through numpy: torch.tensor converts a nested list element by element, ~2x slower
        tables = np.full((B, width), pad, dtype=np.int64)
        if n:
            tables[:n] = [r.seq.table.blocks + [pad] * (width - len(r.seq.table.blocks)) for r in rows]
        cached = np.zeros(B, dtype=np.int64)
        cached[:n] = [r.start for r in rows]
        plan_step(self.cache, torch.ones(B, dtype=torch.long), cached_lens=torch.from_numpy(cached),
                  block_tables=torch.from_numpy(tables), sliding_window=self.window, width=1,
                  decode_attention=self.decode_attention, into=st.step, state_slots=self._slots(rows, B))
        ids = np.zeros((B, 1), dtype=np.int64)
        ids[:n, 0] = [r.tokens[0] for r in rows]
        pending = np.flatnonzero(ids[:n, 0] == PENDING)
        ids[pending, 0] = 0
        st.ids.copy_(torch.from_numpy(ids), non_blocking=True)
        self._feed(st.ids, pending, np.zeros_like(pending), [rows[i] for i in pending], fed)
        if self.own_positions:
            st.positions.copy_(self._request_positions(rows, (np.arange(n), np.zeros(n, dtype=np.int64)), B, 1))
        if st.graph is not None:
            st.graph.replay()
            logits, greedy = st.out, st.picked
        else:
            logits, greedy = self._decode_model_step(st.inputs)
            if self.graphs:  # this size's first step ran eagerly (compiling what it needed): capture it
                st.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(st.graph, pool=self._pool()):
                    st.out, st.picked = self._decode_model_step(st.inputs)
        return Executed(logits[:n], self._draw(st, logits, greedy, plan))

    def _decode_model_step(self, x: StepInputs) -> tuple[torch.Tensor, Picked | None]:
        """The model step of a decode step, and with serve.graph_sampling the greedy pick of all its rows (pad rows
        too: each row's pick is its own, and the graph's shapes are fixed)."""
        logits = self._model_step(x)
        return logits, Picked(*greedy_pick(logits)) if self.graph_sampling else None

    def _draw(self, st: _DecodeStep, logits: torch.Tensor, greedy: Picked | None,
              plan: DrawPlan | None) -> Picked | None:
        """The plan's tokens (None without one): plain greedy rows take the step's greedy pick; sampled rows write
        their knobs and noise into the static buffers, then the branch's graph replays (eagerly without graphs).
        The tokens live in the graph pool, which the next replay of the same graph reuses: the draw reads them (and
        copies them out) before the next step launches."""
        if plan is None or greedy is None:
            return None
        n, (B, V) = len(plan.rows), logits.shape
        got = greedy
        if not plan.greedy:
            draws = self._static_draw(V)
            draws.fill(plan, B)
            graph = st.draws.get(plan.truncate) if logits is st.out else None
            if graph is not None:
                graph[0].replay()
                got = graph[1]
            else:
                got = pick(logits, draws.knobs(B, plan.truncate), draws.noise[:B])
        return Picked(got.tokens[:n], got.logprobs[:n])

    def _static_draw(self, V: int) -> StaticDraw:
        if self._draws is None:
            self._draws = StaticDraw(self._static["rows"], V, self.device)
        return self._draws

    @torch.inference_mode()
    def _capture_draws(self, st: _DecodeStep) -> None:
        """A captured decode size's sampled-draw graphs, one per branch (plain softmax, the sorted pass), reading
        the size's graph logits and the static knobs and noise."""
        B, draws = st.out.shape[0], self._static_draw(st.out.shape[1])
        for truncate in (False, True):
            args = (st.out, draws.knobs(B, truncate), draws.noise[:B])
            pick(*args)  # eagerly first, as the model step
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool()):
                st.draws[truncate] = (g, pick(*args))

    def capture_graphs(self) -> None:
        """Capture every decode size's graph now (largest first, so the sizes share one pool's blocks), from
        steps of pad rows only, so that serving never pays a capture; a no-op without CUDA graphs."""
        if self.graphs:
            for B in reversed(self.sizes):
                st = self._decode_step(B)
                if st.graph is None:
                    self.decode([], B)
                if self.graph_sampling and not st.draws:
                    self._capture_draws(st)
            torch.cuda.synchronize(self.device)

    @property
    def captured(self) -> list[int]:
        """The decode batch sizes whose CUDA graph is captured."""
        return sorted(B for B, st in self._decode.items() if st.graph is not None)

    def _pool(self):
        if self._static.get("pool") is None:
            self._static["pool"] = torch.cuda.graph_pool_handle()  # one pool: the sizes never run at once
        return self._static["pool"]

    def _decode_step(self, B: int) -> _DecodeStep:
        """The static inputs of a decode step of B rows: views of buffers sized for the largest decode step."""
        if B in self._decode:
            return self._decode[B]
        if self._static is None or self._static["rows"] < B:
            R, dev = max(B, self.sizes[-1]), self.device
            self._static = dict(
                rows=R, pool=None if self._static is None else self._static["pool"],
                ids=torch.zeros(R, 1, dtype=torch.long, device=dev),
                positions=torch.zeros(self.axes, R, 1, dtype=torch.long, device=dev) if self.own_positions else None,
                at=torch.zeros(R, dtype=torch.long, device=dev),
                step=KVStep(positions=torch.zeros(R, 1, dtype=torch.long, device=dev),
                            valid=torch.ones(R, 1, dtype=torch.bool, device=dev),
                            new_tokens=torch.arange(R, device=dev), slot_mapping=torch.zeros(R, dtype=torch.long,
                                                                                             device=dev),
                            sliding_window=self.window, decode_attention=self.decode_attention,
                            block_tables=torch.zeros(R, self.max_table, dtype=torch.int32, device=dev),
                            seq_lens=torch.zeros(R, dtype=torch.int32, device=dev),
                            state_slots=None if self.cache.state is None else
                            torch.zeros(R, dtype=torch.long, device=dev)))
            self._decode.clear()
            self._draws = None
        s = self._static
        full = s["step"]
        step = dataclasses.replace(full, **{f: getattr(full, f)[:B] for f in _ROW_FIELDS
                                            if getattr(full, f) is not None})
        ids = s["ids"][:B]
        cache = dataclasses.replace(self.cache, step=step)
        meta = build_attn_meta({"input_ids": ids}, self.backend, self.device, sliding_window=self.window,
                               kv_cache=cache)
        positions = step.positions if not self.own_positions else \
            s["positions"][:, :B] if self.axes > 1 else s["positions"][0, :B]
        st = _DecodeStep(ids, positions, step, StepInputs(ids, positions, meta, s["at"][:B], {}, B))
        self._decode[B] = st
        return st

    @torch.inference_mode()
    def prepare(self, rows: list[Row], per_row: int = 1, fed: Fed | None = None) -> StepInputs:
        """Everything the forward reads, built on the host and moved to the device: one packed row of the rows'
        new tokens (``self.packed``), or right-padded rows."""
        n_rows = len(rows)
        new = np.array([r.n for r in rows], dtype=np.int64)
        if self.packed:  # row i's tokens at (0, off[i]) of one row
            B, S = 1, int(new.sum())
            at = np.zeros(n_rows, dtype=np.int64), np.cumsum(new) - new
        else:  # row i's tokens at (i, 0)
            B, S = n_rows, int(new.max())
            at = np.arange(n_rows), np.zeros(n_rows, dtype=np.int64)
        width = max(len(r.seq.table.blocks) for r in rows)
        ids = np.zeros((B, S), dtype=np.int64)
        tables = np.zeros((n_rows, width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[at[0][i], at[1][i]: at[1][i] + r.n] = r.tokens
            tables[i, : len(r.seq.table.blocks)] = r.seq.table.blocks
        pb, pc = np.nonzero(ids == PENDING)
        ids[pb, pc] = 0
        owner = [rows[i] for i in (np.searchsorted(at[1], pc, "right") - 1 if self.packed else pb)]
        spans = self._spans(rows, at, B, S)  # bidirectional spans: a dense mask (no kernel takes them)
        cache = plan_step(self.cache, new, cached_lens=[r.start for r in rows], block_tables=torch.from_numpy(tables),
                          sliding_window=self.window, width=None if self.packed else S,
                          decode_attention=None if self.packed or spans is not None else self.decode_attention,
                          state_slots=self._slots(rows, n_rows), packed=self.packed,
                          varlen=self.packed and self.varlen and spans is None,
                          paged_attention=paged_attention if self.mixed and spans is None else None, spans=spans)
        ids = torch.from_numpy(ids)
        # a draft model of one axis counts its tokens, whatever positions the target's prompt carries
        positions = self._request_positions(rows, at, B, S) if self.own_positions else cache.step.positions
        extra = self._media(rows, ids, at) if self.spec.prepare_batch is not None else {}
        meta = build_attn_meta({"input_ids": ids}, self.backend, self.device, sliding_window=self.window,
                               kv_cache=cache)
        last = new - 1
        if per_row == 1:
            idx = last
        else:  # from the token before the guesses on
            first = np.array([r.n - 1 - len(r.draft) for r in rows])
            idx = np.minimum(first[:, None] + np.arange(per_row)[None], last[:, None])
        if self.packed:  # into the one row: [1, n_rows x per_row]
            idx = (at[1].reshape(-1, *[1] * (idx.ndim - 1)) + idx).reshape(1, -1)
        logits_at = torch.from_numpy(idx).to(self.device, non_blocking=True)
        ids = ids.to(self.device, non_blocking=True)
        self._feed(ids, pb, pc, owner, fed)
        return StepInputs(ids, positions, meta, logits_at, extra, n_rows, self.packed)

    def _feed(self, ids: torch.Tensor, at_b: np.ndarray, at_c: np.ndarray, owners: list[Row],
              fed: Fed | None) -> None:
        """ids[at_b, at_c] (on the device) <- the PENDING tokens of ``owners``' sequences, from the previous
        step's draw."""
        if not len(at_b):
            return
        if fed is None:
            raise RuntimeError("a row holds a pending token but the step was given no previous tokens (a bug)")
        src = [fed.row_of[r.seq.seq_id] for r in owners]
        idx = torch.from_numpy(np.stack([at_b, at_c, np.asarray(src)])).to(self.device, non_blocking=True)
        ids[idx[0], idx[1]] = fed.tokens[idx[2]]

    def _slots(self, rows: list[Row], B: int) -> list[int] | None:
        """Each row's state slot, pad rows in the scratch slot (None without linear-attention layers)."""
        if self.cache.state is None:
            return None
        return [r.seq.state_slot for r in rows] + [self.scratch_slot] * (B - len(rows))

    @torch.inference_mode()
    def forward(self, x: StepInputs) -> torch.Tensor:
        """The model step: no host sync."""
        return self._model_step(x)

    def _model_step(self, x: StepInputs) -> torch.Tensor:
        out = self.model(x.ids, position_ids=x.positions, attn=x.meta, logits_at=x.logits_at, **x.extra)
        # the model's dtype: greedy picks read it as is, the samplers upcast
        if x.packed:  # [1, n_rows x per_row, V]
            return out.logits[0].unflatten(0, (x.n_rows, -1)).squeeze(1)
        return out.logits[: x.n_rows]

    def _request_positions(self, rows: list[Row], at: tuple[np.ndarray, np.ndarray], B: int,
                           S: int) -> torch.Tensor:
        """[axes, B, S] ([B, S] for 1-D positions): the prompt's positions (M-RoPE's, or its image splits'; a
        request without them counts its tokens), then text positions p + rope_delta on every axis; row i's tokens
        start at (at[0][i], at[1][i])."""
        pos = torch.zeros(self.axes, B, S, dtype=torch.long)
        for i, r in enumerate(rows):
            req, a, b = r.req, r.start, r.start + r.n
            row, o = int(at[0][i]), int(at[1][i])
            L = len(req.prompt) if req.positions is not None else 0
            if a < L:
                pos[:, row, o: o + min(b, L) - a] = req.positions[:, a:min(b, L)]
            if b > L:
                lo = max(a, L)
                pos[:, row, o + lo - a: o + b - a] = torch.arange(lo, b) + req.rope_delta
        return (pos if self.axes > 1 else pos[0]).to(self.device, non_blocking=True)

    def _spans(self, rows: list[Row], at: tuple[np.ndarray, np.ndarray], B: int, S: int) -> torch.Tensor | None:
        """[B, S] int64: an id per bidirectional image split inside the rows' chunks on its tokens, 0 elsewhere
        (None: no such split)."""
        spans, k = None, 0
        for i, r in enumerate(rows):
            for m in r.req.images:
                if m.split is not None and m.split.bidirectional and r.start <= m.start and m.end <= r.start + r.n:
                    spans = np.zeros((B, S), dtype=np.int64) if spans is None else spans
                    k += 1
                    o = int(at[1][i]) - r.start
                    spans[int(at[0][i]), o + m.start: o + m.end] = k
        return None if spans is None else torch.from_numpy(spans)

    def _media(self, rows: list[Row], ids: torch.Tensor, at: tuple[np.ndarray, np.ndarray]) -> dict:
        """The family's host-built inputs for the whole images, videos and audio clips inside the rows' chunks (the
        scheduler never cuts one), each kind in row-major order as its pads. The placement sees only their spans'
        tokens: generated tokens that happen to be media pads are text, and a start token whose media the chunk
        does not hold opens no part (the Omni thinkers' prepare_batch reads those tokens for positions, which the
        runner takes from the request instead)."""
        place = torch.zeros_like(ids)
        got: dict[str, tuple[list, list]] = {}
        clips, groups, splits = [], [], []
        for i, r in enumerate(rows):
            row, o = int(at[0][i]), int(at[1][i])
            for m in r.req.media:
                if r.start <= m.start and m.end <= r.start + r.n:
                    a, b = o + m.start - r.start, o + m.end - r.start
                    place[row, a:b] = ids[row, a:b]
                    if isinstance(m, Audio):
                        clips.append(m)
                        groups.append(i)
                        continue
                    if m.split is not None:
                        splits.append((m, row, a))
                        continue
                    pix, grids = got.setdefault(m.kind, ([], []))
                    pix.append(m.pixel_values)
                    grids.append(m.grid_thw)
        if not got and not clips and not splits:
            return {}
        if splits:  # the family's own keys, built on the host: its prepare_batch's outputs go to the device
            batch = self.spec.prepare_batch(self.cfg, {"input_ids": place, **split_inputs(splits, place.shape)},
                                            self.device)
            return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items() if k not in ("input_ids", "position_ids")}
        batch = {"input_ids": place}
        for kind, (pix, grids) in got.items():
            pk, gk = MEDIA_KEYS[kind]
            batch[pk] = torch.cat(pix).to(self.device, self.dtype, non_blocking=True)
            batch[gk] = torch.cat(grids)
        if clips:
            batch.update(audio_inputs(clips, groups, self.device, self.dtype))
        batch = self.spec.prepare_batch(self.cfg, batch, self.device)
        return {k: v for k, v in batch.items() if k not in ("input_ids", "position_ids")}
