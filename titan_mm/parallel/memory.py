"""Per-GPU peak memory estimate for a model config + topology (+ AC), and a topology suggestion.

The command line is ``python -m titan_mm.tools.memory --config <toml>`` (titan_mm/tools/memory.py).

The estimate follows one training step of titan_mm (FSDP2 with bf16 params / fp32 reduce, fp32 master
weights, AdamW, the train step's ``zero_grad(set_to_none=True)``) through the moments where memory can
peak and returns the largest (``estimate``; every moment: ``estimate_phases``). Bytes per GPU, in the
steady state (step >= 2: the AdamW state exists). Shards: fp32 master params, fp32 grads and the two
AdamW states hold TP-sharded matrices / (tp * fsdp), other dense params / fsdp, experts / fsdp (experts
live on [ep_fsdp, ep] = dp_shard x cp ranks); fsdp = dp_shard * cp (HSDP's dp_replicate does not shard).

  forward_end          params + optimizer (no gradients: the previous step freed them)
                       + the root's unsharded params (embedding / head / final norm / encoder stem: FSDP2
                         keeps them from the forward through the backward)
                       + the saved activations of every block (+ the vision encoder) at the loss
                       + the loss's working set: fused Triton CE (kernels on) = a [C, V]
                         logits chunk, grad_h [N, D] and grad_W [V, D] in the weight dtype (V/tp under
                         loss parallel); the PyTorch chunked CE (kernels off) = fp32 grad_W plus up to
                         (16 + a) * C * V bytes of chunk buffers (fp32 logits, exp temp, softmax, grad;
                         the previous chunk's softmax and bf16 grad are still bound when the next
                         chunk's are made).
  backward_block_{j}   the backward of block j (every j is checked): saved activations of blocks <= j
                       (+ one block's recompute under AC), fp32 gradient shards of the blocks already
                       done, the previous block's fp32 reduce-scatter input (FSDP2 keeps one in flight),
                       block j's unsharded bf16 params, the prefetched next block's (the next
                       ``Topology.prefetch`` blocks' with parallel.fsdp_prefetch), block j's bf16
                       gradients, the held head-weight gradient (the CE computes it in the forward), the
                       incoming gradient [N, D] and the block's largest gradient temporaries.
  backward_vision      (with a vision encoder) all decoder gradients + the encoder's saved activations.
  embedding_backward   all block gradients + two [V, D] bf16 gradients (head + embedding) + the root params.
  root_reduce_scatter  all block gradients + the root's bf16 grads -> fp32 input -> fp32 output.
  optimizer_step       params + grads + optimizer.

With ``parallel.fsdp_reshard_after_forward = never`` (``Topology.reshard``) no block frees its gathered params
after its forward: forward_end holds all of them (and the encoder blocks'), backward_block_{j} those of blocks
0..j (nothing is prefetched), in bf16, or 1 byte per param with float8 (tensorwise gathers float8 weights).

Gradient accumulation (``grad_accum`` > 1 micro-batches per step): from the second micro-batch on, the fp32
gradient shards of the whole model exist through its forward and backward, so every phase carries them.

Pipeline parallelism (``Topology.pp`` > 1; ``pp_schedule``, ``pp_virtual``, ``pp_micro``, ``pp_layers``): every pp
rank is estimated on its own and the phases are named ``pp<r>:<phase>``. A rank holds its stages' blocks (their
parameters, optimizer state, and, since FSDP2 syncs gradients only after the step's last micro-batch, their
unsharded fp32 gradients from the first micro-batch on), stage 0's rank the embedding and vision tower, the last
stage's rank the head and the loss. Activations: each local stage holds as many micro-batches as the schedule keeps
in flight there, counted from the schedule's own action list (titan_mm.parallel.pp_schedule.replay: 1F1B's
first stage pp, its last 1; GPipe all of them; interleaved and V schedules in between), each at its blocks' kept
bytes; the first stage's vision activations likewise. :func:`pp_balance` (the trainer's default split) puts the
blocks where the stages' estimated bytes come out most even.

Everything model-specific comes from the family's :class:`titan_mm.registry.ModelSpec`: the shapes from
``dims``, the kernels setting from ``runtime``, the plan from ``plan`` (which parameters are tp-sharded,
experts, FSDP units; an FSDP unit holding a module that the plan's ``encoder_tp`` names is an encoder block),
the parameters from ``build`` on the meta device, and the activation bytes per token / patch of one block
(under the AC mode, tp, sequence parallel, kernels, compile and float8) from ``memory_terms``
(:class:`titan_mm.registry.MemoryTerms`; the formulas sit in each family's ``memory.py``). Selective AC:
matmul / attention outputs kept; full AC: block inputs kept + one block recomputed at a time;
``activation_checkpoint.num_layers = N``: the first N AC units in module order (encoder blocks first)
under AC, the others keep everything. With CP the tokens are divided by cp. Loss parallel (the plan names a
head, tied or not): the head weight, its gradient and the loss's [C, V] chunks are divided by tp (kernels
on: the fused CE's vocab-parallel form; off: the PyTorch vocab-parallel chunked CE).

Not modelled: the CUDA context, cuBLAS / cuDNN workspaces and NCCL buffers (outside
torch.cuda.max_memory_allocated), allocator fragmentation (reserved vs allocated), float8 scales, HSDP's
all-reduce buffers, expert-parallel all-to-all buffers. Checked against measured H200 peaks by
bench/memory_check.py (docs/parallel.md, "Checked against the H200").
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from titan_mm.parallel.pipeline import balanced_split, make_layout
from titan_mm.parallel.pp_schedule import action_lists, replay, virtual_stages
from titan_mm.registry import BlockBytes, MemoryTerms, ModelSpec, spec_for_config

__all__ = ["GiB", "BlockBytes", "MemoryTerms", "ParamCounts", "Topology", "count_params", "estimate",
           "estimate_phases", "format_table", "loss_bytes", "memory_terms", "peak_phase", "pp_balance", "pp_layout",
           "suggest"]

GiB = 1024**3


@dataclass(frozen=True)
class Topology:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    ac: str = "none"
    """none | selective | full"""
    sp: bool = True
    """Sequence parallel (with tp > 1, when the plan has sequence_parallel entries)."""
    encoder_tp: bool = False
    """The modality encoders sharded over tp (parallel.encoder_tp), else replicated."""
    ac_layers: int = 0
    """activation_checkpoint.num_layers: the AC mode on the first N AC units only (0 = all)."""
    reshard: str = "always"
    """parallel.fsdp_reshard_after_forward: always | never."""
    pp: int = 1
    """Pipeline stages' ranks (parallel.pp)."""
    pp_schedule: str = "1F1B"
    pp_virtual: int = 0
    """Stages per rank (parallel.pp_virtual_stages; 0: the schedule's own)."""
    pp_micro: int = 0
    """Micro-batches per step through the pipeline (0: the estimate's grad_accum)."""
    pp_layers: tuple[int, ...] = ()
    """Blocks per stage (parallel.pp_layers_per_stage; empty: pp_split, else :func:`pp_balance`)."""
    pp_split: tuple[int, ...] = ()
    """parallel.pp_split_points."""
    prefetch: int = 0
    """parallel.fsdp_prefetch: blocks gathered ahead (0: FSDP2's own, one)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} ep={self.ep} "
                f"ac={self.ac}" + (f" ac_layers={self.ac_layers}" if self.ac_layers and self.ac != "none" else "")
                + (f" reshard={self.reshard}" if self.reshard != "always" else "")
                + (f" prefetch={self.prefetch}" if self.prefetch else "")
                + (f" pp={self.pp} {self.pp_schedule}" + (f" v={self.pp_virtual}" if self.pp_virtual else "")
                   if self.pp > 1 else ""))


@dataclass(frozen=True)
class ParamCounts:
    tp_sharded: int  # dense params split over tp (colwise / rowwise / embedding_rowwise)
    replicated: int  # dense params replicated over tp
    experts: int
    block_dense: int  # dense params of the largest decoder block (for the FSDP working set)
    block_experts: int
    root: int  # params outside the blocks (embedding, head, final norm; encoder stem: patch embeddings, mergers)
    n_blocks: int = 0  # decoder (LLM) blocks
    vision_blocks: int = 0  # encoder blocks (FSDP units the plan's encoder_tp reaches into)
    vision_block: int = 0  # params of one encoder block

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.experts


def count_params(model_cfg, plan, encoder_tp: bool = False, keep: tuple[str, ...] | None = None) -> ParamCounts:
    """Count by building the model on the meta device and classifying each parameter by the plan: tp-sharded
    are the plan's colwise / rowwise / embedding entries, the loss-parallel head (tied: the embedding) and,
    with ``encoder_tp``, the encoder entries. Blocks are the plan's FSDP units; those holding a module that
    ``plan.encoder_tp`` names are encoder blocks. ``keep``: count only the parameters under these module FQNs (a
    pipeline rank's part)."""
    spec = spec_for_config(model_cfg)
    with torch.device("meta"):
        model = spec.build(model_cfg)
    styles = {**plan.tp, **(plan.encoder_tp if encoder_tp else {})}
    tp_pat = [p for p, s in styles.items() if s in ("colwise", "rowwise", "embedding_rowwise")]
    if plan.loss_parallel:
        tp_pat.append(plan.loss_parallel)
    ep_pat = [p for p, s in plan.ep.items() if s == "experts"]
    modules = [n for n, _ in model.named_modules() if n]
    blocks = [n for n in modules if any(fnmatch.fnmatchcase(n, p) for p in plan.fsdp_units)]
    blocks = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]
    if keep is not None:  # a pipeline rank: only its blocks
        blocks = [b for b in blocks if any(b == k or b.startswith(k + ".") for k in keep)]
    enc_mods = [n for n in modules if any(fnmatch.fnmatchcase(n, p) for p in plan.encoder_tp)]
    encoder = {b for b in blocks if any(n.startswith(b + ".") for n in enc_mods)}
    tp = rep = ex = 0
    per_block: dict[str, list[int]] = {b: [0, 0] for b in blocks}
    root = 0
    for name, p in model.named_parameters():
        if keep is not None and not any(name.startswith(k + ".") for k in keep):
            continue
        mod = name.rsplit(".", 1)[0]
        n = p.numel()
        is_ex = any(fnmatch.fnmatchcase(mod, q) for q in ep_pat)
        is_tp = any(fnmatch.fnmatchcase(mod, q) for q in tp_pat)
        if is_ex:
            ex += n
        elif is_tp:
            tp += n
        else:
            rep += n
        owner = next((b for b in blocks if name.startswith(b + ".")), None)
        if owner is None:
            root += n
        else:
            per_block[owner][1 if is_ex else 0] += n
    vis = {b: v for b, v in per_block.items() if b in encoder}
    dec = {b: v for b, v in per_block.items() if b not in vis}
    vdims = spec.dims(model_cfg).vision
    if vdims is not None and len(vis) != vdims.depth and keep is None:
        raise ValueError(f"{spec.name}: the plan's encoder_tp entries reach into {len(vis)} FSDP units, but the "
                         f"vision encoder has {vdims.depth} blocks; name the encoder blocks' linears in "
                         "plan.encoder_tp so that the estimator can tell them from the decoder blocks")
    bd = max((v[0] for v in dec.values()), default=0)
    be = max((v[1] for v in dec.values()), default=0)
    vb = max((v[0] + v[1] for v in vis.values()), default=0)
    return ParamCounts(tp, rep, ex, bd, be, root, len(dec), len(vis), vb)


# ------------------------------------------------------------------------------------------- activations
def _kernels(spec: ModelSpec, model_cfg, kernels: bool | None) -> bool:
    """``kernels`` as given, else whether the config's runtime uses titan_mm.kernels."""
    return bool(spec.runtime(model_cfg).kernels) if kernels is None else bool(kernels)


def memory_terms(model_cfg, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The family's activation terms (``spec.memory_terms``) of ``model_cfg`` under ``topo``; ``kernels``:
    None = the config's runtime setting."""
    spec = spec_for_config(model_cfg)
    return spec.memory_terms(model_cfg, topo, act_bytes, kernels=_kernels(spec, model_cfg, kernels),
                             compile=compile, float8=float8)


def loss_bytes(model_cfg, plan, topo: Topology, tokens: float, act_bytes: int = 2, *,
               kernels: bool | None = None, loss_chunk: int | None = None) -> tuple[float, float]:
    """(working set of the loss in the forward, what it keeps for the backward: grad_h and grad_W).
    ``loss_chunk``: tokens per chunk of the CE, fused or PyTorch (None: the family's ``MemoryTerms``)."""
    spec = spec_for_config(model_cfg)
    dims = spec.dims(model_cfg)
    a = act_bytes
    V, D = dims.vocab_size, dims.hidden_size
    N = int(tokens)
    kernels = _kernels(spec, model_cfg, kernels)
    vt = topo.tp if (topo.tp > 1 and plan is not None and plan.loss_parallel) else 1
    keep = (a * V * D) / vt + a * N * D  # grad_W (weight dtype) and grad_h (kept until the backward)
    if loss_chunk is None:
        loss_chunk = memory_terms(model_cfg, topo, a, kernels=kernels).loss_chunk
    C = min(int(loss_chunk or 4096), max(N, 1))
    if kernels and N > 0:
        # titan_mm.kernels.linear_cross_entropy (loss parallel: its vocab-parallel form on the V/tp shard): one
        # [C, V/vt] logits buffer in h.dtype
        work = keep + a * C * math.ceil(V / vt) + 4 * N
        return work, keep
    # titan_mm.nn.loss.chunked_cross_entropy (fp32 grad_W accumulator, fp32 chunk buffers)
    sizes = [min(C, N - s) for s in range(0, N, C)] or [0]
    chunk_peak = (12 + a) * sizes[0]
    for prev, cur in zip(sizes, sizes[1:]):
        chunk_peak = max(chunk_peak, (4 + a) * prev + 12 * cur)  # previous softmax + bf16 grad still bound
    work = 4 * V * D / vt + a * N * D + chunk_peak * V / vt
    return work, keep


# ------------------------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class _PPRank:
    """What one pipeline rank holds, for :func:`_phases`."""

    first: bool
    last: bool
    blocks_in_flight: float
    """Block x micro-batch activations held at the schedule's peak (sum over the local stages)."""
    vision_in_flight: int
    """Micro-batches whose vision-encoder activations stage 0 holds at once (0 off its rank)."""


def pp_layout(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
              n_micro: int = 0, **kw):
    """(titan_mm.parallel.pipeline.Layout, replay of the schedule's action list with unit costs) of ``topo``'s
    pipeline: its ``pp_layers``, else :func:`pp_balance`'s split."""
    par = _PPConfig(topo.pp, topo.pp_schedule, topo.pp_virtual, list(topo.pp_layers), list(topo.pp_split))
    M = topo.pp_micro or n_micro
    n_blocks = spec_for_config(model_cfg).dims(model_cfg).num_layers
    layout = make_layout(par, n_blocks, M, balance=lambda n, k: _balance(model_cfg, plan, topo, seq_len, micro_batch,
                                                                         param_dtype_bytes, M, n, k, **kw))
    n = layout.n_stages
    unit = [1.0 / layout.virtual] * n
    return layout, replay(action_lists(layout.schedule, layout.pp, layout.virtual, M), unit, unit, unit)


@dataclass(frozen=True)
class _PPConfig:  # the [parallel] fields titan_mm.parallel.pipeline.make_layout reads
    pp: int
    pp_schedule: str
    pp_virtual_stages: int
    pp_layers_per_stage: list
    pp_split_points: list
    fsdp_reshard_after_forward: str = "never"  # the estimate does not reject a schedule for FSDP's setting


def _pp_parts(model_cfg, plan) -> tuple[int, int]:
    """Parameters of the plan's pp_first and pp_last modules (the first / last stage's extra)."""
    with torch.device("meta"):
        model = spec_for_config(model_cfg).build(model_cfg)
    names = [n for n, _ in model.named_parameters()]
    numel = dict((n, p.numel()) for n, p in model.named_parameters())
    part = lambda fqns: sum(numel[n] for n in names if any(n.startswith(f + ".") for f in fqns))  # noqa: E731
    return part(plan.pp_first), part(plan.pp_last)


def _balance(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, a: int, n_micro: int, n_blocks: int,
             n_stages: int, *, kernels: bool | None = None, compile: bool = True, float8: bool = False,
             vision_patches: int = 0, grad_accum: int = 1) -> list[int]:
    spec = spec_for_config(model_cfg)
    v = virtual_stages(topo.pp_schedule, topo.pp_virtual)
    unit = [1.0 / v] * n_stages
    held = replay(action_lists(topo.pp_schedule, topo.pp, v, n_micro), unit, unit, unit).in_flight
    c = count_params(model_cfg, plan, topo.encoder_tp)
    first, last = _pp_parts(model_cfg, plan)
    t, f, ep = topo.tp, topo.fsdp, max(topo.ep, 1)
    fsdp_on = not (f == 1 and topo.dp_replicate == 1 and a == 4 and ep == 1)
    # per block: fp32 master + AdamW + gradient shards, the unsharded fp32 gradients FSDP accumulates over the
    # micro-batches, and the kept activations of every micro-batch in flight at the stage
    state = 16 * (c.block_dense / (t * f) + c.block_experts / f)
    if fsdp_on:
        state += 4 * (c.block_dense / t + c.block_experts / ep)
    terms = spec.memory_terms(model_cfg, topo, a, kernels=_kernels(spec, model_cfg, kernels), compile=compile,
                              float8=float8)
    tokens = micro_batch * seq_len / topo.cp
    per_block = [state + held[s] * tokens * terms.decoder.kept for s in range(n_stages)]
    fixed = [0.0] * n_stages
    fixed[0] += (16 + (4 if fsdp_on else 0)) * first / (t * f)
    if vision_patches and terms.vision is not None:
        vd = spec.dims(model_cfg).vision
        fixed[0] += held[0] * vision_patches * (vd.depth * terms.vision.kept + terms.vision_stem)
    fixed[-1] += (16 + (4 if fsdp_on else 0)) * last / (t * f)
    fixed[-1] += loss_bytes(model_cfg, plan, topo, tokens, a, kernels=kernels, loss_chunk=terms.loss_chunk)[0]
    return balanced_split(n_blocks, n_stages, per_block, fixed)


def pp_balance(cfg, model_cfg, plan, pd, n_micro: int, n_blocks: int, n_stages: int) -> list[int]:
    """The trainer's default pipeline split (``parallel.pp_layers_per_stage`` and ``pp_split_points`` empty): blocks
    per stage that even out the stages' estimated bytes (parameters, optimizer state and gradients per block, the
    activations the schedule keeps in flight at each stage, the first stage's embedding and the last stage's head
    and loss). ``cfg``: the JobConfig; ``pd``: its ParallelDims."""
    p = cfg.parallel
    topo = Topology(pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.ep, cfg.activation_checkpoint.mode,
                    bool(p.sequence_parallel and plan.sequence_parallel), bool(p.encoder_tp and plan.encoder_tp),
                    int(cfg.activation_checkpoint.num_layers), str(p.fsdp_reshard_after_forward), pd.pp,
                    p.pp_schedule, p.pp_virtual_stages, n_micro)
    a = 4 if cfg.training.param_dtype == "float32" else 2
    return _balance(model_cfg, plan, topo, cfg.data.seq_len, cfg.data.micro_batch_size, a, n_micro, n_blocks,
                    n_stages, compile=bool(cfg.compile.enable), float8=bool(cfg.float8.enable))


def estimate_phases(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
                    counts: ParamCounts | None = None, *, kernels: bool | None = None, compile: bool = True,
                    float8: bool = False, vision_patches: int = 0, grad_accum: int = 1) -> dict[str, dict[str, float]]:
    """Bytes per GPU by category at each moment of the step where memory can peak (module docstring).

    ``vision_patches``: vision-encoder patches per micro-batch (0 = the encoder's activations are not
    counted). ``kernels``: the model uses titan_mm.kernels (default: the config's runtime ``kernels``).
    ``topo.pp`` > 1: every pipeline rank's phases, named ``pp<r>:<phase>`` (``counts`` is then not used)."""
    kw = dict(kernels=kernels, compile=compile, float8=float8, vision_patches=vision_patches)
    if topo.pp == 1:
        return _phases(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, counts, grad_accum=grad_accum,
                       **kw)
    layout, tl = pp_layout(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, grad_accum, **kw)
    out = {}
    for r in range(layout.pp):
        local = layout.local(r)
        first, last = 0 in local, layout.n_stages - 1 in local
        keep = tuple(f"{plan.pp_blocks}.{i}" for s in local for i in range(*layout.ranges[s]))
        keep += (plan.pp_first if first else ()) + (plan.pp_last if last else ())
        c = count_params(model_cfg, plan, topo.encoder_tp, keep=keep)
        held = sum(tl.in_flight[s] * (layout.ranges[s][1] - layout.ranges[s][0]) for s in local)
        rank = _PPRank(first, last, held, tl.in_flight[0] if first else 0)
        for k, v in _phases(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, c, pp=rank, **kw).items():
            out[f"pp{r}:{k}"] = v
    return out


def _phases(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
            counts: ParamCounts | None = None, *, kernels: bool | None = None, compile: bool = True,
            float8: bool = False, vision_patches: int = 0, grad_accum: int = 1,
            pp: _PPRank | None = None) -> dict[str, dict[str, float]]:
    """:func:`estimate_phases` of one rank; ``pp``: a pipeline rank (``counts`` are its parameters)."""
    c = counts or count_params(model_cfg, plan, topo.encoder_tp)
    spec = spec_for_config(model_cfg)
    dims = spec.dims(model_cfg)
    kernels = _kernels(spec, model_cfg, kernels)
    f, t = topo.fsdp, topo.tp
    ep = max(topo.ep, 1)
    a = param_dtype_bytes
    sharded = c.tp_sharded / (t * f) + c.replicated / f + c.experts / f
    master, optim, grads_all = 4 * sharded, 8 * sharded, 4 * sharded
    fsdp_on = not (f == 1 and topo.dp_replicate == 1 and a == 4 and ep == 1)
    blk_un = c.block_dense / t + c.block_experts / ep  # one block's unsharded params
    blk_sh = c.block_dense / (t * f) + c.block_experts / f
    vis_un = c.vision_block / (t if topo.encoder_tp else 1)  # its linears (nearly all of it) are tp-sharded
    vis_sh = vis_un / f
    root_un = c.root / max(1, t)
    root_sh = root_un / f
    L = c.n_blocks if pp is not None else max(c.n_blocks, dims.num_layers)
    D, V = dims.hidden_size, dims.vocab_size
    st = t if topo.sp else 1
    tokens = micro_batch * seq_len / topo.cp
    terms = spec.memory_terms(model_cfg, topo, a, kernels=kernels, compile=compile, float8=float8)
    blk = terms.decoder
    vblk = terms.vision or BlockBytes(0.0, 0.0, 0.0)
    vis = dims.vision if pp is None or pp.first else None  # pipeline: the vision tower runs on stage 0
    # one [V, D] head-weight gradient in param dtype, held from the loss to the root's post-backward
    head_grad = a * V * D / (t if (t > 1 and plan is not None and plan.loss_parallel) else 1)
    loss_work, _ = loss_bytes(model_cfg, plan, topo, tokens, a, kernels=kernels, loss_chunk=terms.loss_chunk)
    if pp is not None and not pp.last:  # the head and the loss live on the last stage
        head_grad = loss_work = 0.0

    # forward-only activations outside the blocks (the family's: final norm, RoPE tables, ...)
    head_acts = tokens * terms.head
    # blocks under AC (activation_checkpoint.num_layers = N > 0: the first N AC units in module order, the
    # encoder blocks first, then the decoder blocks); the others keep everything
    n_vis = (c.vision_blocks or vis.depth) if vis is not None else 0
    n_ac_vis = 0 if topo.ac == "none" else (min(topo.ac_layers, n_vis) if topo.ac_layers > 0 else n_vis)
    n_ac = 0 if topo.ac == "none" else (min(max(0, topo.ac_layers - n_vis), L) if topo.ac_layers > 0 else L)
    vis_acts = 0.0
    if vis is not None and vision_patches:
        nv = vision_patches
        vis_acts = nv * (n_ac_vis * vblk.kept + (n_vis - n_ac_vis) * vblk.full) + nv * terms.vision_stem
        vis_acts *= pp.vision_in_flight if pp is not None else 1
        head_acts += tokens * terms.vision_head  # kept through the forward with vision input (DeepStack adds)

    def kept_upto(j: int) -> float:  # saved bytes per token of blocks 0..j
        return min(j + 1, n_ac) * blk.kept + max(0, j + 1 - n_ac) * blk.full

    recompute = (blk.full - blk.kept) * tokens if topo.ac != "none" else 0.0
    root_params = a * root_un if fsdp_on else 0.0
    # pipeline: the other micro-batches in flight hold their stages' blocks' activations; FSDP2 accumulates the
    # unsharded fp32 gradients of every local block and root module over the micro-batches (synced after the last)
    others = max(0.0, pp.blocks_in_flight - L) * tokens * kept_upto(L - 1) / max(L, 1) if pp is not None else 0.0
    pp_grads = (4 * (blk_un * L + vis_un * n_vis + root_un) if fsdp_on else grads_all) if pp is not None else None
    phases: dict[str, dict[str, float]] = {}

    def add(name, **kw):
        out = {"params": master, "grads": 0.0, "optimizer": optim, "fsdp_buffers": 0.0, "activations": 0.0,
               "loss": 0.0, "workspace": 0.0}
        out.update(kw)
        if grad_accum > 1:  # a later micro-batch: every gradient shard already holds the earlier ones' sum
            out["grads"] = grads_all
        if pp_grads is not None and name != "optimizer_step":
            out["grads"] = pp_grads
        out["total"] = sum(out.values())
        phases[name] = out

    # parallel.fsdp_reshard_after_forward = never: every block's (and encoder block's) gathered params outlive
    # its forward until its backward (float8: tensorwise, the default recipe, gathers the linears' weights as
    # float8, 1 byte each; the norms' few params are counted at that size too)
    never = fsdp_on and topo.reshard == "never"
    kept_b = 1 if float8 else a
    kept_fwd = kept_b * (blk_un * L + vis_un * n_vis) if never else 0.0
    add("forward_end", fsdp_buffers=root_params + kept_fwd,
        activations=kept_upto(L - 1) * tokens + others + head_acts + vis_acts, loss=loss_work)
    for j in range(L - 1, -1, -1):
        done = L - 1 - j
        buf = root_params
        if never:  # blocks 0..j still gathered (nothing to prefetch), the encoder blocks too, and j's grads
            buf += kept_b * (blk_un * (j + 1) + vis_un * n_vis) + a * blk_un
            buf += 4 * blk_un if done else 0.0
        elif fsdp_on:  # block j + the prefetched blocks below it (parallel.fsdp_prefetch; FSDP2's own: one), j's grads
            buf += a * blk_un * (1 + min(max(topo.prefetch, 1), j)) + a * blk_un
            buf += 4 * blk_un if done else 0.0  # previous block's fp32 reduce-scatter input (one in flight)
        add(f"backward_block_{j}", grads=4 * blk_sh * done, fsdp_buffers=buf,
            activations=kept_upto(j) * tokens + others + (recompute if j < n_ac else 0.0) + vis_acts, loss=head_grad,
            workspace=tokens * (a * D / st + blk.bwd_tmp))
    llm_grads = 4 * blk_sh * L
    if vis is not None and vision_patches:
        vbuf = root_params + (a * 3 * vis_un + 4 * blk_un if fsdp_on else 0.0)  # encoder block params x2 + grads
        if never:  # the other encoder blocks are still gathered
            vbuf += kept_b * vis_un * max(n_vis - 2, 0)
        add("backward_vision", grads=llm_grads, fsdp_buffers=vbuf,
            activations=vis_acts + (vblk.full - vblk.kept) * vision_patches * (n_ac_vis > 0),
            loss=head_grad, workspace=vision_patches * (a * vis.hidden_size + vblk.bwd_tmp))
    blocks_grads = llm_grads + 4 * vis_sh * c.vision_blocks
    if fsdp_on and (pp is None or pp.first):
        add("embedding_backward", grads=blocks_grads,
            fsdp_buffers=root_params + 4 * (vis_un if c.vision_blocks else blk_un), loss=2 * head_grad)
        rs = max(a * root_un + 4 * root_un, 4 * root_un + 4 * root_sh)  # bf16 grads -> fp32 in -> fp32 out
        add("root_reduce_scatter", grads=blocks_grads, fsdp_buffers=rs)
    add("optimizer_step", grads=grads_all)
    return phases


def estimate(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
             counts: ParamCounts | None = None, **kw) -> dict[str, float]:
    """Bytes per GPU by category at the peak moment of the step (see :func:`estimate_phases`) and their
    total (the estimated peak)."""
    phases = estimate_phases(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, counts, **kw)
    return dict(max(phases.values(), key=lambda p: p["total"]))


def peak_phase(phases: dict[str, dict[str, float]]) -> str:
    """The name of the phase with the largest total."""
    return max(phases, key=lambda k: phases[k]["total"])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(model_cfg, plan, n_gpus: int, gpu_mem_gb: float, seq_len: int, micro_batch: int,
            param_dtype_bytes: int = 2, headroom: float = 0.9, encoder_tp: bool = False,
            **kw) -> list[tuple[Topology, dict[str, float]]]:
    """Topologies that fit ``headroom * gpu_mem_gb``, best first (no AC before selective before full, then
    the smallest tp, then the smallest cp, then the largest ep). ``kw`` go to :func:`estimate`."""
    c = count_params(model_cfg, plan, encoder_tp)
    dims = spec_for_config(model_cfg).dims(model_cfg)
    H, G, E = dims.num_heads, dims.num_kv_heads, dims.num_experts
    fits = []
    for tp in _divisors(n_gpus):
        if tp > 8 or H % tp or G % tp:
            continue
        for cp in _divisors(n_gpus // tp):
            if seq_len % (2 * cp * tp) and cp > 1:
                continue
            ds = n_gpus // (tp * cp)
            for ep in (_divisors(ds * cp) if E else [1]):
                if E and E % ep:
                    continue
                for ac in ("none", "selective", "full"):
                    topo = Topology(1, ds, cp, tp, ep, ac, bool(plan.sequence_parallel), encoder_tp)
                    est = estimate(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, c, **kw)
                    if est["total"] <= headroom * gpu_mem_gb * GiB:
                        fits.append((topo, est))
    order = {"none": 0, "selective": 1, "full": 2}
    fits.sort(key=lambda x: (order[x[0].ac], x[0].tp, x[0].cp, -x[0].ep))
    return fits


def format_table(est: dict[str, float], title: str) -> str:
    lines = [title, f"{'category':<14}{'GiB':>10}", "-" * 24]
    for k, v in est.items():
        if k == "total":
            lines.append("-" * 24)
        lines.append(f"{k:<14}{v / GiB:>10.3f}")
    return "\n".join(lines)
