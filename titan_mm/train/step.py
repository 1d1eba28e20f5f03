"""The train step: one optimizer update over the micro-batches of one global batch.

    result = train_step(state, micro_batches, ctx)

Loss. Each micro-batch's forward returns ``loss_sum`` (sum of token cross-entropy over labels != -100).
The step divides it by the number of label tokens of the WHOLE global batch (every micro-batch on every
data-parallel rank: one all-reduce of a CPU-known count per step, before any backward), so the update
is the gradient of the true token mean, not a mean of micro-batch means. titan_mm.parallel sums (not
averages) data-parallel gradients, so no extra scaling is needed. MoE aux losses are averaged over the
micro-batches and the dp x cp ranks (gradients are summed; each rank adds aux / (n_micro x dp x cp)).

Then: global grad-norm clip over every mesh axis (titan_mm.parallel.clip), a non-finite check (the same
decision on every rank: the loss and norm are global), optimizer step, scheduler step.

Where the check is made. With torch's fused AdamW (CUDA; :func:`titan_mm.train.optim.supports_found_inf`)
and a NaN guard, the check is computed on the device and handed to the optimizer as ``found_inf`` (the
GradScaler mechanism: the fused kernel skips the update and restores ``state['step']``), so
``opt.step()`` is enqueued before the one host read of the step's statistics and the GPU does not idle
while the host launches it. The NaN guard then sees the same values and makes the same decision on the
host (count, log, or raise for policy "stop" / too many skips; the update is already skipped). Any other
optimizer, or ``StepContext.device_skip=False``, keeps the host-decided path: read, decide, then step.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from titan_mm.models.common.attention import build_attn_meta
from titan_mm.observe.health import NanGuard
from titan_mm.parallel.clip import clip_grad_norm_
from titan_mm.train.optim import supports_found_inf
from titan_mm.train.state import TrainState

# Batch keys consumed by the step / attention metadata, not passed to the model as keyword arguments.
_NOT_MODEL_KWARGS = {"input_ids", "labels", "position_ids", "doc_ids", "cu_seqlens", "max_seqlen", "num_label_tokens"}


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
    parallel_dims: Any = None
    """titan_mm.parallel.mesh.ParallelDims; with cp > 1 each micro-batch is split over the cp axis."""
    cp_mode: str = "ulysses"
    mask_kind: str = "causal"
    """Attention mask kind the objective trains with (titan_mm/models/common/attention.py KINDS)."""
    block_size: int | None = None
    """Block size of the "block_causal" kind."""
    prepare_batch: Callable | None = None
    """prepare_batch(micro_batch, device) -> micro_batch: the family's host-side metadata (ModelSpec.prepare_batch
    bound to the model config), before the CP split."""
    seq_keys: tuple[str, ...] = ()
    """The family's sequence keys that the CP split cuts (ModelSpec.seq_keys)."""
    inject_nan: bool = False
    """Fault injection (tests): multiply this step's loss by NaN."""
    after_optimizer: Callable | None = None
    """Called after each applied optimizer step, e.g. float8 scale precompute. On the host-decided path not
    after a skipped one; on the device-skip path (``device_skip``) it runs after every ``opt.step()``, skipped
    or not, because the skip is only known on the device then (the weights are unchanged by a skipped step,
    so a hook that derives state from them, like the float8 scale precompute, computes the same values)."""
    device_skip: bool = True
    """Decide the NaN skip on the device when the optimizer supports it (torch's fused AdamW, see
    titan_mm.train.optim.supports_found_inf) and a ``nan_guard`` is set: ``opt.step()`` is enqueued before
    the host reads the step's statistics. False forces the host-decided path (read, decide, then step)."""


@dataclass
class StepResult:
    loss: float
    """Global token-mean cross-entropy (plus nothing else)."""
    aux_loss: float
    grad_norm: float
    lr: float
    label_tokens: int
    """Label tokens in the global batch."""
    tokens: int
    """Input positions in the global batch (rows x seq_len over all micro-batches and dp ranks)."""
    skipped: bool
    compute_s: float


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "max_seqlen", "num_label_tokens"):
            v = v.to(device, non_blocking=True)
        out[k] = v
    return out


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def global_label_count(micro_batches: list[dict], ctx: StepContext) -> int:
    """Label tokens of the whole global batch (one all-reduce of a host-known count over the dp ranks;
    the micro-batches are the full, not yet CP-split rows)."""
    local = sum(int(mb["num_label_tokens"]) for mb in micro_batches)
    if ctx.count_group is None:
        return local
    comm_dev = ctx.device if dist.get_backend(ctx.count_group) == "nccl" else torch.device("cpu")
    t = torch.tensor([local], dtype=torch.int64, device=comm_dev)
    _all_reduce_sum(t, ctx.count_group)
    return int(t.item())


def _prepare(mb: dict, ctx: StepContext):
    """(micro-batch for this rank, attention metadata), on the host: the family's metadata, then
    build_attn_meta, or the CP split of the sequence."""
    if ctx.prepare_batch is not None:
        mb = ctx.prepare_batch(mb, ctx.device)
    pd = ctx.parallel_dims
    if pd is not None and pd.cp_enabled:
        from titan_mm.parallel.cp import prepare_cp_batch

        return prepare_cp_batch(mb, pd, ctx.attn_backend, ctx.device, ctx.sliding_window, mode=ctx.cp_mode,
                                seq_keys=ctx.seq_keys, kind=ctx.mask_kind, block_size=ctx.block_size)
    return mb, build_attn_meta(mb, ctx.attn_backend, ctx.device, sliding_window=ctx.sliding_window,
                               kind=ctx.mask_kind, block_size=ctx.block_size)


def sdpa_priority(device: torch.device):
    """SDPA backend order for the step. On CUDA cuDNN attention comes first: at Qwen3 shapes on the H200 its
    causal GQA forward+backward is 1.9x faster than flash (bench/attention.py, bench/results/attention.json);
    flash, memory-efficient and math stay as fallbacks for inputs cuDNN refuses. Inside compiled blocks the
    choice is made at trace time, which happens within this context."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def forward_backward(model, micro_batches: list[dict], ctx: StepContext, n_global_labels: int):
    """Accumulate gradients of (sum CE / n_global_labels + mean aux) over the micro-batches.

    Returns (local loss_sum, local aux sum) as device tensors (detached, fp32)."""
    denom = float(max(n_global_labels, 1))
    n_micro = len(micro_batches)
    aux_scale = 1.0 / (n_micro * ctx.loss_world)
    loss_acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    aux_acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for mb in micro_batches:
        mb, attn = _prepare(mb, ctx)
        b = _to_device(mb, ctx.device)
        extra = {k: v for k, v in b.items() if k not in _NOT_MODEL_KWARGS}
        out = model(b["input_ids"], position_ids=b.get("position_ids"), attn=attn, labels=b["labels"], **extra)
        if out.loss_sum is None:
            raise RuntimeError("the model returned loss_sum=None although labels were given (see ModelOutput contract)")
        loss = out.loss_sum.float() / denom
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.float() * aux_scale
            aux_acc += out.aux_loss.detach().float()
        if ctx.inject_nan:
            loss = loss * float("nan")
        loss.backward()
        loss_acc += out.loss_sum.detach().float() * (float("nan") if ctx.inject_nan else 1.0)
    return loss_acc, aux_acc


def _param_device(opt) -> torch.device:
    for g in opt.param_groups:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


def train_step(state: TrainState, micro_batches: list[dict], ctx: StepContext) -> StepResult:
    """Forward/backward over ``micro_batches``, clip, optimizer and scheduler step; advances ``state.step``."""
    t0 = time.perf_counter()
    model, opt = state.model, state.optimizer
    model.train()
    n_labels = global_label_count(micro_batches, ctx)
    with sdpa_priority(ctx.device):
        loss_sum, aux_sum = forward_backward(model, micro_batches, ctx, n_labels)

    clip = ctx.clip_fn or clip_grad_norm_
    grad_norm = clip(model.parameters(), ctx.max_norm)

    # one reduction for what we log and decide on; global values, so every rank decides the same
    stats = torch.stack([loss_sum, aux_sum]).to(torch.float32)
    if ctx.loss_group is not None:
        comm_dev = ctx.device if dist.get_backend(ctx.loss_group) == "nccl" else torch.device("cpu")
        stats = _all_reduce_sum(stats.to(comm_dev), ctx.loss_group)
    gnorm_t = grad_norm.detach().float().reshape(1)
    lr = opt.param_groups[0]["lr"]

    # Device-decided skip: enqueue opt.step() before the host read below (the read waits for the GPU).
    device_skip = ctx.device_skip and supports_found_inf(opt)
    if device_skip:
        if ctx.nan_guard is not None:
            # the guard's test (loss and grad norm finite) as a 0-dim float32 flag on the params' device (a
            # plain tensor also for DTensor params: DTensor treats a 0-dim plain tensor as replicated; it must
            # be 0-dim, as GradScaler's, since the optimizer subtracts it in place from the 0-dim step counts)
            dev = _param_device(opt)
            finite = torch.isfinite(stats[0].to(dev)) & torch.isfinite(gnorm_t[0].to(dev))
            opt.found_inf = (~finite).to(torch.float32)
        try:
            opt.step()
        finally:
            if hasattr(opt, "found_inf"):  # this step's flag only: never reused by a later step
                del opt.found_inf
        if ctx.after_optimizer is not None:
            ctx.after_optimizer()

    host = torch.cat([stats.cpu(), gnorm_t.cpu()]).tolist()
    loss = host[0] / max(n_labels, 1)
    aux = host[1] / (len(micro_batches) * ctx.loss_world)
    gnorm = host[2]

    ok = True
    if ctx.nan_guard is not None:
        # same test as found_inf above, on the same values: on the device-skip path the update was already
        # skipped exactly when this returns False (or raises: policy "stop" / too many skips in a row)
        ok = ctx.nan_guard.check(state.step + 1, loss, gnorm)
    if ok and not device_skip:
        opt.step()
        if ctx.after_optimizer is not None:
            ctx.after_optimizer()
    elif not ok:
        state.nan_count += 1
    opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update makes LambdaLR warn about the call order
        warnings.simplefilter("ignore", UserWarning)
        state.scheduler.step()
    state.step += 1
    tokens = sum(int(mb["input_ids"].numel()) for mb in micro_batches) * ctx.dp_world
    return StepResult(
        loss=loss, aux_loss=aux, grad_norm=gnorm, lr=lr, label_tokens=n_labels, tokens=tokens,
        skipped=not ok, compute_s=time.perf_counter() - t0,
    )
