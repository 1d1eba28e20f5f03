"""The train step: one optimizer update over the micro-batches of one global batch.

    result = train_step(state, micro_batches, ctx)

Loss. The step knows no loss: ``ctx.objective`` (titan_mm.objectives) prepares the micro-batches on the host
(noise, targets), counts each loss term's normalizer (label tokens, latent elements), and computes the named
loss-term sums inside the forward (``model(..., loss=objective.bind(batch))`` -> ``out.terms``). The step divides
each term by its count over the WHOLE global batch (every micro-batch on every data-parallel rank: one all-reduce
of the CPU-known counts per step, before any backward), so the update is the gradient of the true means, not a mean
of micro-batch means. titan_mm.parallel sums (not averages) data-parallel gradients, so no extra scaling is needed.
MoE aux losses are averaged over the micro-batches and the dp x cp ranks (gradients are summed; each rank adds
aux / (n_micro x dp x cp)).

Then: global grad-norm clip over every mesh axis (titan_mm.parallel.clip), a non-finite check (the same
decision on every rank: the loss and norm are global), optimizer step, scheduler step.

float16 (``TrainState.scaler``, a :class:`LossScaler`): each micro-batch's backward runs on loss x scale (the
normalized loss, scaled once); the gradients are unscaled before the clip; gradients that are not finite anywhere
(the global grad norm: every rank and mesh axis) with a finite loss are an overflow: the update is skipped, the
scale halves, and it is not a NaN-policy event. A non-finite loss still goes to the NaN guard.

Where the check is made. With torch's fused AdamW (CUDA; :func:`titan_mm.train.optim.supports_found_inf`)
and a NaN guard, the check is computed on the device and handed to the optimizer as ``found_inf`` (the
GradScaler mechanism: the fused kernel skips the update and restores ``state['step']``), so
``opt.step()`` is enqueued before the one host read of the step's statistics, and that read waits for the
statistics alone (an event, not a stream sync): the GPU runs the update while the host returns and prepares the
next step. The NaN guard then sees the same values and makes the same decision on the
host (count, log, or raise for policy "stop" / too many skips; the update is already skipped). Any other
optimizer, or ``StepContext.device_skip=False``, keeps the host-decided path: read, decide, then step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_mm.nn.attention import batch_rows, build_attn_meta
from titan_mm.objectives import CausalLM, Objective
from titan_mm.observe.health import NanGuard, NonFiniteError
from titan_mm.parallel.clip import clip_coef, clip_grad_norm_
from titan_mm.parallel.cp import prepare_cp_batch
from titan_mm.train.optim import supports_found_inf
from titan_mm.train.state import TrainState

STEP_KEYS = {"input_ids", "position_ids", "doc_ids", "cu_seqlens", "max_seqlen"}
"""Batch keys the step and the attention metadata consume; with the objective's ``loss_keys`` they are not model
keyword arguments."""
NOT_MODEL_KWARGS = STEP_KEYS | set(CausalLM.loss_keys)
"""Keys that are no family input of a causal-LM batch (for code that calls the forward itself: decoding, tests)."""
HOST_KEYS = ("cu_seqlens", "max_seqlen")
"""Keys that stay on the host (with the objective's ``host_keys``)."""


@dataclass
class StepContext:
    device: torch.device
    attn_backend: str = "sdpa"
    sliding_window: int | None = None
    max_norm: float = 1.0
    loss_group: Any = None
    """Process group whose ranks' loss sums add up to the global batch: dp x cp (None: one process)."""
    count_group: Any = None
    """Process group of the ranks that read different rows (dp); label counts are summed over it."""
    dp_world: int = 1
    """Data-parallel ranks that read different rows."""
    loss_world: int = 1
    """Ranks of loss_group (dp x cp): the MoE aux loss is averaged over them and over the micro-batches."""
    nan_guard: NanGuard | None = None
    clip_fn: Callable | None = None
    """titan_mm.parallel.clip.clip_grad_norm_'s signature (default: it): ``clip_fn(params, max_norm) -> norm``;
    with fused AdamW also ``scale=False`` (measure only: the factor goes into the optimizer's kernel)."""
    parallel_dims: Any = None
    """titan_mm.parallel.mesh.ParallelDims; with cp > 1 each micro-batch is split over the cp axis."""
    cp_mode: str = "ulysses"
    objective: Objective = field(default_factory=CausalLM)
    """titan_mm.objectives: prepares the micro-batches, counts each loss term's normalizer, returns the loss terms;
    its mask_kind (None: "causal") and block_size set the attention metadata."""
    dp_rank: int = 0
    """This rank's index among the dp ranks (the objective's noise is seeded by the global micro-batch slot)."""
    prepare_batch: Callable | None = None
    """prepare_batch(micro_batch, device) -> micro_batch: the family's host-side metadata (ModelSpec.prepare_batch
    bound to the model config), before the CP split."""
    seq_keys: tuple[str, ...] = ()
    """The family's sequence keys that the CP split cuts (ModelSpec.seq_keys)."""
    encoder_balance: Any = None
    """parallel.encoder_balance: the planner (titan_mm.parallel.encoder_balance.balance_planner, over the dp "batch"
    ranks) with which the family's prepare_batch plans the vision tower's all-to-all; None: off."""
    inject_nan: bool = False
    """Fault injection (tests): multiply this step's loss by NaN."""
    after_optimizer: Callable | None = None
    """Called after each applied optimizer step, e.g. float8 scale precompute. On the host-decided path not
    after a skipped one; on the device-skip path (``device_skip``) it runs after every ``opt.step()``, skipped
    or not, because the skip is only known on the device then (the weights are unchanged by a skipped step,
    so a hook that derives state from them, like the float8 scale precompute, computes the same values)."""
    pipeline: Any = None
    """titan_mm.parallel.pipeline.Pipeline when parallel.pp > 1: the micro-batches' forward and backward run through
    its schedule (:func:`_pp_forward_backward`); None: :func:`forward_backward`."""
    device_skip: bool = True
    """Decide the NaN skip on the device when the optimizer supports it (torch's fused AdamW, see
    titan_mm.train.optim.supports_found_inf) and a ``nan_guard`` is set: ``opt.step()`` is enqueued before
    the host reads the step's statistics. False forces the host-decided path (read, decide, then step)."""


@dataclass
class StepResult:
    loss: float
    """The objective's loss: the sum of its terms' global means (the MoE aux loss not included)."""
    aux_loss: float
    grad_norm: float
    lr: float
    terms: dict[str, float]
    """Each loss term's global mean ({"ce": token-mean cross-entropy}, {"mse": ...}), in the objective's order."""
    counts: dict[str, int]
    """Each loss term's normalizer over the global batch (label tokens, latent elements)."""
    tokens: int
    """Input positions in the global batch (rows x seq_len over all micro-batches and dp ranks)."""
    skipped: bool
    """The update was dropped: a NaN-policy skip, or a float16 overflow."""
    compute_s: float
    loss_scale: float | None = None
    """The loss scale this step's backward ran with (param_dtype float16), else None."""
    prepare_s: float = 0.0
    """Host seconds of the objective's preparation (noise, corrupted inputs, targets, counts) before the first
    launch: the GPU idles through it, as the step reads its loss on the host (metric ``host_prepare_s``)."""


class LossScaler:
    """Dynamic loss scaling for float16 compute: the scale and its growth tracker are device tensors, moved by
    torch's own GradScaler kernel (``torch._amp_update_scale_``: x0.5 and a skipped step on an overflow, x2 after
    ``growth_interval`` finite steps in a row), so they cost no host sync.

    Why not ``torch.amp.GradScaler`` / ``ShardedGradScaler`` whole (torch 2.13, gloo, tiny Qwen3): GradScaler's
    ``unscale_`` runs one foreach op over every gradient of a device, which raises for a mix of DTensor and plain
    gradients (tp without FSDP), and reduces found_inf only over the mesh of the first DTensor (ep experts sit on
    another mesh); ShardedGradScaler adds a SUM all-reduce on top of DTensor's MAX (found_inf == 2.0 on 2 ranks, a
    [1]-shaped flag that torch's fused AdamW rejects) and needs a process group. Here gradients are unscaled
    shard by shard, and the inf check is the global grad norm (titan_mm.parallel.clip), so an inf on one rank
    skips the step on every rank."""

    growth_factor = 2.0
    backoff_factor = 0.5

    def __init__(self, device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_interval = int(growth_interval)

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> None:
        """grad /= scale in place, on each gradient's local shard."""
        inv = self.scale.double().reciprocal().float()  # as GradScaler: exact for powers of two
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                by_device[g.device].append(g)
        for dev, gs in by_device.items():
            torch._foreach_mul_(gs, inv.to(dev))

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off (found_inf: 1-element tensor, nonzero = the gradients were not finite) or count a good step."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf.to(self.scale.device, torch.float32),
                                 self.growth_factor, self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale.fill_(sd["scale"])  # a float32 value held as a Python float: restored bitwise
        self.growth_tracker.fill_(sd["growth_tracker"])


def to_device(batch: dict[str, Any], device: torch.device, host_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The batch's tensors on ``device`` (non-blocking), but HOST_KEYS and ``host_keys``. Host tensors go to a
    GPU through pinned memory: a pageable copy (an objective's noisy inputs and targets, built in the step) blocks
    the host until the GPU stream reaches it, so the host could not prepare a step while the last one finishes."""
    keep = set(HOST_KEYS) | set(host_keys)
    pin = device.type == "cuda"
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and k not in keep:
            if pin and v.device.type == "cpu" and not v.is_pinned():
                v = v.contiguous().pin_memory()  # contiguous: an expanded view cannot be pinned
            v = v.to(device, non_blocking=True)
        out[k] = v
    return out


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def local_counts(micro_batches: list[dict], objective: Objective) -> dict[str, int]:
    """Each loss term's normalizer over ``micro_batches`` (prepared, full, not yet CP-split rows), on the host."""
    per_mb = [objective.counts(mb) for mb in micro_batches]
    return {t: sum(c[t] for c in per_mb) for t in objective.terms}


def global_counts(micro_batches: list[dict], ctx: StepContext) -> dict[str, int]:
    """Each loss term's normalizer over the whole global batch: one all-reduce of the host-known counts over the dp
    ranks (none for one rank)."""
    local = local_counts(micro_batches, ctx.objective)
    if ctx.count_group is None or dist.get_world_size(ctx.count_group) == 1:
        return local
    return dict(zip(local, reduce_counts(list(local.values()), ctx.count_group, ctx.device)))


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def reduce_counts(values: list[int], group, device: torch.device) -> list[int]:
    """The sums of the host's ``values`` over ``group``, read on the host. With NCCL the reduce and its read run on
    a side stream: the counts are the host's, so they need not queue behind the previous step's work still on the
    compute stream (its AdamW), which a read there would wait for, leaving the GPU idle while the host then builds
    this step's inputs."""
    if dist.get_backend(group) != "nccl":
        t = torch.tensor(values, dtype=torch.int64)
        _all_reduce_sum(t, group)
        return t.tolist()
    with torch.cuda.stream(_side_stream(device)):
        t = torch.tensor(values, dtype=torch.int64, device=device)
        _all_reduce_sum(t, group)
        return t.tolist()


def model_inputs(b: dict[str, Any], objective: Objective) -> dict[str, Any]:
    """The batch keys a family's forward takes as keywords: all but the step's and the objective's loss keys."""
    return {k: v for k, v in b.items() if k not in STEP_KEYS and k not in objective.loss_keys}


def _denoms(counts: dict[str, int], stats: tuple[str, ...] = ()) -> list[float]:
    # a logged-only term (Objective.stats, detached) divides by inf: it adds exactly 0 to the loss
    return [math.inf if t in stats else float(max(n, 1)) for t, n in counts.items()]


def _objective_loss(terms: torch.Tensor, denoms: list[float]) -> torch.Tensor:
    """sum_i terms[i] / denoms[i]: each term's share of its global mean."""
    loss = terms[0] / denoms[0]
    for i in range(1, len(denoms)):
        loss = loss + terms[i] / denoms[i]
    return loss


def host_prepare(mb: dict, ctx: StepContext):
    """(micro-batch for this rank, attention metadata), on the host: the family's metadata, then
    build_attn_meta, or the CP split of the sequence."""
    if ctx.prepare_batch is not None:
        eb = {} if ctx.encoder_balance is None else {"encoder_balance": ctx.encoder_balance}
        mb = ctx.prepare_batch(mb, ctx.device, **eb)
    pd = ctx.parallel_dims
    kind, block = ctx.objective.mask_kind or "causal", ctx.objective.block_size
    if pd is not None and pd.cp_enabled:
        return prepare_cp_batch(mb, pd, ctx.attn_backend, ctx.device, ctx.sliding_window, mode=ctx.cp_mode,
                                seq_keys=ctx.seq_keys + ctx.objective.seq_keys, kind=kind, block_size=block)
    return mb, build_attn_meta(mb, ctx.attn_backend, ctx.device, sliding_window=ctx.sliding_window, kind=kind,
                               block_size=block)


def sdpa_priority(device: torch.device):
    """SDPA backend order for the step. On CUDA cuDNN attention comes first: at Qwen3 shapes on the H200 its
    causal GQA forward+backward is 1.9x faster than flash (bench/attention.py, bench/results/attention.json);
    flash, memory-efficient and math stay as fallbacks for inputs cuDNN refuses. Inside compiled blocks the
    choice is made at trace time, which happens within this context."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _forward(model, mb: dict, ctx: StepContext):
    """The forward of one (prepared, not yet CP-split) micro-batch with the objective's loss: (ModelOutput, its
    loss terms stacked [T] in the objective's order)."""
    obj = ctx.objective
    mb, attn = host_prepare(mb, ctx)
    b = to_device(mb, ctx.device, obj.host_keys)
    out = model(b.get("input_ids"), position_ids=b.get("position_ids"), attn=attn, loss=obj.bind(b),
                **model_inputs(b, obj))
    if out.terms is None:
        raise RuntimeError("the model's forward ignored its loss argument (out.terms is None): a family's forward "
                           "calls the objective's loss on its output (docs/models.md, Objectives)")
    return out, torch.stack([out.terms[t].float() for t in obj.terms])


def forward_backward(model, micro_batches: list[dict], ctx: StepContext, counts: dict[str, int],
                     scaler: LossScaler | None = None):
    """Accumulate gradients of (sum_t term_t / counts[t] + mean aux) over the prepared micro-batches (times the
    loss scale when ``scaler`` is given); ``counts``: :func:`global_counts`.

    Returns (local term sums [T], local aux sum) as device tensors (detached, fp32)."""
    denoms = _denoms(counts, ctx.objective.stats)
    n_micro = len(micro_batches)
    aux_scale = 1.0 / (n_micro * ctx.loss_world)
    loss_acc = torch.zeros(len(denoms), dtype=torch.float32, device=ctx.device)
    aux_acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for mb in micro_batches:
        out, terms = _forward(model, mb, ctx)
        loss = _objective_loss(terms, denoms)
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.float() * aux_scale
            aux_acc += out.aux_loss.detach().float()
        if ctx.inject_nan:
            loss = loss * float("nan")
        (loss if scaler is None else loss * scaler.scale).backward()
        loss_acc += terms.detach() * (float("nan") if ctx.inject_nan else 1.0)
    return loss_acc, aux_acc


@torch.no_grad()
def eval_loss_sums(model, micro_batches: list[dict], ctx: StepContext) -> tuple[dict[str, float], dict[str, int]]:
    """({term: sum}, {term: count}) of ``micro_batches`` over the whole global batch: the train step's forward, host
    preparation and reductions without grads or the aux loss. The objective prepares them as at step 0 (a
    diffusion LM's or flow matching's noise)."""
    micro_batches = ctx.objective.prepare(micro_batches, 0, ctx.dp_rank)
    counts = global_counts(micro_batches, ctx)
    model.eval()
    loss_acc = torch.zeros(len(counts), dtype=torch.float32, device=ctx.device)
    with sdpa_priority(ctx.device):
        if ctx.pipeline is not None:  # the schedule's forward-only pass; every pp rank gets the sums
            loss_acc += ctx.pipeline.eval(_pp_micros(micro_batches, ctx))
        else:
            for mb in micro_batches:
                loss_acc += _forward(model, mb, ctx)[1]
    if ctx.loss_group is not None:
        comm_dev = ctx.device if dist.get_backend(ctx.loss_group) == "nccl" else torch.device("cpu")
        loss_acc = _all_reduce_sum(loss_acc.to(comm_dev), ctx.loss_group)
    return dict(zip(counts, loss_acc.tolist())), counts


def _pp_forward_backward(model, micro_batches: list[dict], ctx: StepContext, counts: dict[str, int],
                         scaler: LossScaler | None = None):
    """:func:`forward_backward` under pipeline parallelism: the same host preparation per micro-batch (family
    metadata, attention metadata or the CP split) and the same loss (sum_t term_t / counts[t] + aux / (n_micro x
    dp x cp), times the loss scale), run by ``ctx.pipeline``'s schedule; the last stage computes it. Returns
    (local term sums [T], local aux sum), the same on every pp rank."""
    return ctx.pipeline.run(_pp_micros(micro_batches, ctx), _denoms(counts, ctx.objective.stats),
                            1.0 / (len(micro_batches) * ctx.loss_world), None if scaler is None else scaler.scale,
                            ctx.inject_nan)


def _pp_micros(micro_batches: list[dict], ctx: StepContext) -> list:
    """The micro-batches as ``ctx.pipeline``'s stages read them, after the same host preparation as without it."""
    obj = ctx.objective
    micros = []
    for mb in micro_batches:
        mb, attn = host_prepare(mb, ctx)
        b = to_device(mb, ctx.device, obj.host_keys)
        micros.append(ctx.pipeline.micro(b, attn, model_inputs(b, obj), obj.bind(b), obj.terms))
    return micros


def _read_later(ts: list[torch.Tensor]) -> Callable[[], list[float]]:
    """Start copying the 1-element or flat tensors ``ts`` to the host; the returned call waits for that copy
    alone (a CUDA event), not for what is enqueued after it (a blocking ``.cpu()`` would wait for the optimizer
    step too)."""
    on_cuda = [t.device for t in ts if t.is_cuda]
    if not on_cuda:
        flat = torch.cat([t.reshape(-1) for t in ts])
        return flat.tolist
    flat = torch.cat([t.reshape(-1).to(on_cuda[0]) for t in ts])
    buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    buf.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def wait() -> list[float]:
        done.synchronize()
        return buf.tolist()

    return wait


def _param_device(opt) -> torch.device:
    for g in opt.param_groups:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


def _update(opt, ctx: StepContext, found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None):
    """``opt.step()`` with this step's device flags (GradScaler's attributes, read by the fused kernel; never left
    for a later step), then the after-optimizer hook."""
    flags = {k: v for k, v in (("found_inf", found_inf), ("grad_scale", grad_scale)) if v is not None}
    for k, v in flags.items():
        setattr(opt, k, v)
    try:
        opt.step()
    finally:
        for k in flags:
            delattr(opt, k)
    if ctx.after_optimizer is not None:
        ctx.after_optimizer()


def train_step(state: TrainState, micro_batches: list[dict], ctx: StepContext) -> StepResult:
    """Forward/backward over ``micro_batches``, clip, optimizer and scheduler step; advances ``state.step``."""
    t0 = time.perf_counter()
    model, opt, scaler = state.model, state.optimizer, state.scaler
    model.train()
    # host: noisy inputs, targets, weights, each term's normalizer (titan_mm.objectives)
    micro_batches = ctx.objective.prepare(micro_batches, state.step, ctx.dp_rank)
    counts = global_counts(micro_batches, ctx)
    prepare_s = time.perf_counter() - t0
    with sdpa_priority(ctx.device):
        term_sums, aux_sum = (forward_backward if ctx.pipeline is None else _pp_forward_backward)(
            model, micro_batches, ctx, counts, scaler)
    if scaler is not None:
        scaler.unscale_(model.parameters())  # the clip and the optimizer see true gradients

    clip = ctx.clip_fn or clip_grad_norm_
    # fused AdamW divides each gradient by opt.grad_scale in its own kernel (GradScaler's attribute): the clip
    # factor goes there instead of a pass over every gradient (8 ms of a Qwen3-8B 12-layer step on the H200)
    fold_clip = ctx.max_norm > 0 and supports_found_inf(opt)
    grad_norm = clip(model.parameters(), ctx.max_norm, scale=False) if fold_clip else clip(model.parameters(),
                                                                                         ctx.max_norm)
    grad_scale = (1.0 / clip_coef(grad_norm.float(), ctx.max_norm)).to(_param_device(opt)) if fold_clip else None

    # one reduction for what we log and decide on; global values, so every rank decides the same
    stats = torch.cat([term_sums, aux_sum.reshape(1)]).to(torch.float32)
    if ctx.loss_group is not None:
        comm_dev = ctx.device if dist.get_backend(ctx.loss_group) == "nccl" else torch.device("cpu")
        stats = _all_reduce_sum(stats.to(comm_dev), ctx.loss_group)
    gnorm_t = grad_norm.detach().float().reshape(1)
    lr = opt.param_groups[0]["lr"]
    host_reads = [stats, gnorm_t]
    if scaler is not None:
        host_reads.append(scaler.scale.reshape(1).clone())  # the scale this step ran with
        scaler.update(~torch.isfinite(gnorm_t))  # the grad norm is global: the same decision on every rank

    # the statistics start for the host now: the read below waits for them alone, so on the device-skip path the
    # optimizer runs on the GPU while the host returns and prepares the next step
    read_host = _read_later(host_reads)
    # Device-decided skip: enqueue opt.step() before the host read below.
    device_skip = ctx.device_skip and supports_found_inf(opt)
    if device_skip:
        if ctx.nan_guard is not None or scaler is not None:
            # the guard's / the scaler's test (loss and grad norm finite; an overflow makes the norm inf) as a
            # 0-dim float32 flag on the params' device (a plain tensor also for DTensor params: DTensor treats a
            # 0-dim plain tensor as replicated; it must be 0-dim, as GradScaler's, since the optimizer subtracts
            # it in place from the 0-dim step counts)
            dev = _param_device(opt)
            finite = torch.isfinite(stats[:-1].sum().to(dev)) & torch.isfinite(gnorm_t[0].to(dev))
            found_inf = (~finite).to(torch.float32)
        else:
            found_inf = None
        _update(opt, ctx, found_inf=found_inf, grad_scale=grad_scale)

    host = read_host()
    n_terms = len(counts)
    terms = {t: host[i] / max(n, 1) for i, (t, n) in enumerate(counts.items())}
    loss = sum(v for t, v in terms.items() if t not in ctx.objective.stats)
    aux = host[n_terms] / (len(micro_batches) * ctx.loss_world)
    gnorm = host[n_terms + 1]
    loss_scale = host[n_terms + 2] if scaler is not None else None

    # the same tests as found_inf above, on the same values: on the device-skip path the update was already
    # skipped exactly when ok is False (or the guard raises: policy "stop" / too many skips in a row)
    overflow = scaler is not None and math.isfinite(loss) and not math.isfinite(gnorm)
    if overflow:
        ok = False
        if loss_scale <= 1.0:
            raise NonFiniteError(
                f"step {state.step + 1}: float16 gradients overflow even at loss scale {loss_scale:g}: the model "
                "leaves float16's range; use --training.param_dtype float32 (or bfloat16 where the GPU has it), "
                "or lower optimizer.lr; the last checkpoint is intact.")
    elif ctx.nan_guard is not None:
        ok = ctx.nan_guard.check(state.step + 1, loss, gnorm)
    else:  # no guard: only the loss scaler drops non-finite updates
        ok = scaler is None or (math.isfinite(loss) and math.isfinite(gnorm))
    if ok and not device_skip:
        _update(opt, ctx, grad_scale=grad_scale)
    elif not ok and not overflow:
        state.nan_count += 1
    opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update makes LambdaLR warn about the call order
        warnings.simplefilter("ignore", UserWarning)
        state.scheduler.step()
    state.step += 1
    tokens = sum(math.prod(batch_rows(mb)) for mb in micro_batches) * ctx.dp_world  # a batch may hold no tokens
    return StepResult(
        loss=loss, aux_loss=aux, grad_norm=gnorm, lr=lr, terms=terms, counts=counts, tokens=tokens,
        skipped=not ok, compute_s=time.perf_counter() - t0, loss_scale=loss_scale, prepare_s=prepare_s,
    )
