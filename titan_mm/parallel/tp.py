"""Tensor parallelism from the plan's ``tp`` entries (module pattern -> style), over the ``tp`` mesh axis.

Styles (values of ``ParallelizePlan.tp``):

    "colwise"            nn.Linear: weight (and bias) Shard(0); input Replicate, output = local shard of the
                         features (q/k/v, gate/up). Heads are split, so attention runs on H/tp local heads.
    "rowwise"            nn.Linear: weight Shard(1); input = local features, output all-reduced to
                         Replicate (o, down).
    "embedding_rowwise"  nn.Embedding: weight Shard(0) over the vocabulary; output all-reduced (Replicate).
                         Not for tied embeddings: the output head would then need loss parallel.
    "grad_sum"           a replicated parameter that is *used on local shards* (qk-norm weights applied
                         to the local heads): its forward value is the same on every tp rank but each rank's
                         gradient is partial, so it is summed over tp in backward. The module holding the
                         parameter must be read by its parent's forward (``rms_norm(q, self.q_norm.weight)``):
                         the parent gets a pre-forward hook that swaps in a view whose backward all-reduces,
                         and a post-forward hook that puts the parameter back (FQNs and state dicts unchanged).
    "replicate"          documentation only: the module stays replicated and computes identical values and
                         gradients on every tp rank (norms, router, output head in this mode).
    "colwise_norm"       nn.RMSNorm over the features a colwise linear splits (a q / k norm across all heads):
                         swapped for a :class:`ShardedRMSNorm` (same FQN and state-dict key) whose weight is
                         Shard(0) and whose sum of squares is all-reduced over tp (a [*, 1] tensor per call).

Sequence parallel (``parallel.sequence_parallel``; the plan's ``sequence_parallel`` entries replace / extend
``tp``): the residual stream between blocks is a local ``[B, S/tp, D]`` shard (sequence dim 1).

    "embedding_rowwise_seq"  embedding_rowwise whose output is reduce-scattered to the local sequence shard.
    "rowwise_seq"            rowwise whose output is reduce-scattered to the local sequence shard (o, down).
    "seq_gather"             module whose first input is the local shard and whose linears are colwise
                             (attention, dense MLP): the input becomes a Replicate DTensor (all-gather; its
                             backward reduce-scatters the partial input gradients).
    "seq_gather_local"       module computed redundantly on every tp rank (MoE): the first input is
                             all-gathered to a plain full tensor; the first output is cut back to the local
                             shard (backward: all-gather of the identical gradients, no sum).
    "seq_gather_output"      the final norm: grad_sum on its own weight, and its output is all-gathered to
                             the full sequence for the replicated loss (backward: the local slice).
    "seq_scatter_output"     a replicated module whose full output is cut to the local sequence shard (the
                             tied embedding; Qwen3-VL's ``embed_out``, whose output is a tuple: every tensor
                             in it is cut; backward: all-gather of the identical gradients).
    "grad_sum"               (as above) for the block norms, which now see only the local tokens.

Encoder TP (``parallel.encoder_tp``): the plan's ``encoder_tp`` entries (Qwen3-VL: ViT attention / MLP and the
patch / DeepStack mergers, colwise + rowwise) are added to ``tp``; off, the encoders stay replicated. The
encoders' activations are never sequence-split (each image is one bidirectional attention document).

Loss parallel (``plan.loss_parallel`` = the FQN of the module holding the output-head weight,
``parallel.loss_parallel``): the head's weight is ``Shard(0)`` over the vocabulary. An untied head is an
nn.Linear (ColwiseParallel). A tied head is the token embedding (nn.Embedding): it becomes vocab-sharded too,
as style "embedding_rowwise" (output all-reduced), or "embedding_rowwise_seq" where the styles had
"seq_scatter_output" (output reduce-scattered to the sequence shard); the embedding and the loss then add their
gradients into the same shard. The ``ops`` of the nearest module above the head (the text model; a dataclass
with ``cross_entropy`` and ``logits`` fields) are swapped: ``cross_entropy`` becomes
:func:`vocab_parallel_cross_entropy` (titan_mm.nn.loss.chunked_cross_entropy with ``group=``: per
chunk a local [chunk, V/tp] fp32 logits block, the max / sum-exp / target logit all-reduced over tp, the input
gradient all-reduced once at the end) and ``logits`` becomes :func:`vocab_parallel_logits`
(local vocabulary slice, all-gathered). A model that used the fused Triton linear-CE of titan_mm.kernels gets
its vocab-parallel form instead (:func:`vocab_parallel_fused_cross_entropy`: per chunk a Triton pass for the
shard's log-sum-exp and target logit, one all-gather of those per-row pieces, a Triton pass writing the
shard's logit gradients in place; no fp32 [chunk, V/tp] blocks), where the Triton path can run (CUDA).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_mm import kernels as K
from titan_mm.config import Parallel
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.parallel.plan import ParallelizePlan, match_modules

STYLES = ("colwise", "rowwise", "embedding_rowwise", "grad_sum", "replicate", "colwise_norm", "embedding_rowwise_seq",
          "rowwise_seq", "seq_gather", "seq_gather_local", "seq_gather_output", "seq_scatter_output")
SEQ_DIM = 1


def _gather_replicate_dtensor(x, mesh):
    """Local sequence shard -> Replicate DTensor (all-gather; backward: reduce-scatter of partial grads)."""
    return DTensor.from_local(x, mesh, (Shard(SEQ_DIM),), run_check=False).redistribute(mesh, (Replicate(),))


class _WaitCollective(torch.autograd.Function):
    """AsyncCollectiveTensor -> the plain tensor it wraps (waits for the collective); gradient unchanged."""

    @staticmethod
    def forward(ctx, x):
        return x.trigger_wait()

    @staticmethod
    def backward(ctx, g):
        return g


def _plain(x):
    """In eager mode a functional collective's output (what ``to_local()`` of a redistributed DTensor returns) is
    an ``AsyncCollectiveTensor``: a wrapper without storage that waits on its first non-view use. Torch ops
    unwrap it themselves, but the Triton kernels' eager path (titan_mm.kernels: autograd.Functions that launch
    on data pointers) would read the wrapper's pointer. The residual stream and the tensors the norms / the CE
    get are therefore handed on as plain tensors (a no-op under torch.compile, which has no such wrappers)."""
    return _WaitCollective.apply(x) if isinstance(x, AsyncCollectiveTensor) else x


def _plain_output(mod, args, out):
    return _plain(out)


def _gather_local(x, mesh):
    """Local sequence shard -> full plain tensor; the backward expects identical grads on every rank."""
    return _plain(_gather_replicate_dtensor(x, mesh).to_local())


def _scatter_local(y, mesh):
    """Full plain tensor, identical on every rank -> this rank's sequence shard (backward: all-gather)."""
    return DTensor.from_local(y, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(SEQ_DIM),)).to_local()


def _map_tensors(out, fn):
    """``fn`` on every tensor of a (nested) tuple / list output; other values as they are."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(x, fn) for x in out)
    return out


def _install_seq_hooks(mod: nn.Module, style: str, mesh) -> None:
    if style == "seq_gather":
        def pre(m, args, kwargs):
            return (_gather_replicate_dtensor(args[0], mesh), *args[1:]), kwargs

        mod.register_forward_pre_hook(pre, with_kwargs=True)
    elif style == "seq_gather_local":
        def pre(m, args, kwargs):
            return (_gather_local(args[0], mesh), *args[1:]), kwargs

        def post(m, args, out):
            if isinstance(out, tuple):
                return (_scatter_local(out[0], mesh), *out[1:])
            return _scatter_local(out, mesh)

        mod.register_forward_pre_hook(pre, with_kwargs=True)
        mod.register_forward_hook(post)
    elif style == "seq_gather_output":
        _install_grad_sum(mod, mesh.get_group())

        def post(m, args, out):
            return _gather_local(out, mesh)

        mod.register_forward_hook(post)
    elif style == "seq_scatter_output":
        def post(m, args, out):
            return _map_tensors(out, lambda t: _scatter_local(t, mesh))

        mod.register_forward_hook(post)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the gradient over ``group`` in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _install_grad_sum(mod: nn.Module, group, child_name: str | None = None) -> None:
    """grad_sum: for the length of ``mod``'s forward its own parameters (``child_name``: those of that child, which
    its parent's forward uses without calling it as a module; looked up at each call) pass through
    _SumGradOverGroup."""
    stash: dict[str, Any] = {}

    def holder(m: nn.Module) -> nn.Module:
        return m if child_name is None else getattr(m, child_name)

    def pre(m, args):
        h = holder(m)
        for pname, p in list(h._parameters.items()):
            if p is not None:
                stash[pname] = p
                h._parameters[pname] = _SumGradOverGroup.apply(p, group)

    def post(m, args, out):
        h = holder(m)
        for pname, p in stash.items():
            h._parameters[pname] = p
        stash.clear()
        return out

    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; backward: the gradients summed the same way (every rank's copy of the sum feeds its own
    part of the loss). Functional collectives, so compiled blocks trace it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class ShardedRMSNorm(nn.Module):
    """Style "colwise_norm": an RMSNorm whose input is this rank's slice of the normalized features. The sum of
    squares is all-reduced over tp (backward: the gradients summed the same way); each rank scales its own
    features by its weight shard. Arithmetic as torch's rms_norm: x * rsqrt(mean(x^2) + eps) * w in fp32."""

    def __init__(self, norm: nn.RMSNorm, tp_mesh):
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(norm.weight, tp_mesh, (Shard(0),)))
        self.eps, self.group = norm.eps, tp_mesh.get_group()

    def forward(self, x):
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        xf = x.float()
        ss = _AllReduceSum.apply(xf.pow(2).sum(-1, keepdim=True), self.group)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return (xf * torch.rsqrt(ss / self.weight.shape[0] + eps) * w).type_as(x)


def _parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """(the module holding ``fqn``, its attribute name there)."""
    parent_name, _, child = fqn.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def vocab_parallel_logits(h, w_VD):
    """``h @ w_VD.T`` for ``w_VD`` a DTensor ``Shard(0)`` over the tp mesh and ``h`` [*, D] replicated over tp:
    each rank computes its vocabulary slice, all-gathered to the full [*, V] (backward: the input gradient is
    all-reduced). A plain ``w_VD`` gives ``F.linear``."""
    if not isinstance(w_VD, DTensor):
        return torch.nn.functional.linear(h, w_VD)
    mesh = w_VD.device_mesh
    hd = DTensor.from_local(h, mesh, (Replicate(),), run_check=False)
    return torch.nn.functional.linear(hd, w_VD).redistribute(mesh, (Replicate(),)).to_local()


def vocab_parallel_cross_entropy(h_ND, w_VD, labels_N, chunk_size: int = 4096, z_loss_weight: float = 0.0,
                                 weights_N=None, fused: bool = False):
    """Sum of token CE (times ``weights_N`` when given) over labels != -100 with ``w_VD`` a DTensor ``Shard(0)`` over the tp mesh; ``h_ND`` the
    full (replicated over tp) hidden states. Same value on every tp rank; fp32 scalar. ``fused``: the Triton
    kernels of titan_mm.kernels.vocab_parallel_linear_cross_entropy where they can run (CUDA), else (and by
    default) the chunked PyTorch version above."""
    if not isinstance(w_VD, DTensor):
        raise TypeError("vocab_parallel_cross_entropy needs the head weight as a DTensor sharded over the vocabulary.")
    mesh = w_VD.device_mesh
    V = w_VD.shape[0]
    v0 = mesh.get_local_rank() * math.ceil(V / mesh.size())  # torch.chunk layout of Shard(0)
    w_local = w_VD.to_local()
    if fused:
        if K.use_triton(h_ND, w_local) and h_ND.dtype == w_local.dtype:
            return K.vocab_parallel_linear_cross_entropy(h_ND, w_local, labels_N, v0, mesh.get_group(),
                                                         z_loss=float(z_loss_weight), chunk_size=chunk_size,
                                                         weights=weights_N)
    return chunked_cross_entropy(h_ND, w_local, labels_N, chunk_size, z_loss_weight, group=mesh.get_group(),
                                 vocab_start=v0, weights_N=weights_N)


def vocab_parallel_fused_cross_entropy(h_ND, w_VD, labels_N, chunk_size: int = 4096, z_loss_weight: float = 0.0,
                                       weights_N=None):
    """:func:`vocab_parallel_cross_entropy` with the fused Triton kernels (installed by loss parallel when the
    model used the fused linear-CE of titan_mm.kernels)."""
    return vocab_parallel_cross_entropy(h_ND, w_VD, labels_N, chunk_size, z_loss_weight, weights_N, fused=True)


def _ops_owner(model: nn.Module, fqn: str) -> nn.Module:
    """The nearest module above ``fqn`` (its parent, ..., the root) with a dataclass ``ops`` that has
    ``cross_entropy`` and ``logits`` fields (the text model: Qwen3Model, also inside Qwen3-VL)."""
    parts = fqn.split(".")[:-1]
    for i in range(len(parts), -1, -1):
        mod = model.get_submodule(".".join(parts[:i])) if i else model
        ops = getattr(mod, "ops", None)
        if ops is not None and dataclasses.is_dataclass(ops) and all(hasattr(ops, f) for f in ("cross_entropy", "logits")):
            return mod
    raise TypeError(
        f"loss parallel needs a module above {fqn!r} with a dataclass ``ops`` that has ``cross_entropy`` and "
        f"``logits`` fields ({type(model).__name__} has none); drop loss_parallel from its plan or set "
        "parallel.loss_parallel=false."
    )


def _apply_loss_parallel(model: nn.Module, fqn: str, tp_mesh, styles: dict[str, str]) -> None:
    """Shard the head over the vocabulary (an untied nn.Linear here; a tied nn.Embedding through ``styles``,
    which this updates) and swap the text model's loss / logits ops for the vocab-parallel ones."""
    head = model.get_submodule(fqn)
    owner = _ops_owner(model, fqn)
    if isinstance(head, nn.Embedding):  # tied: the embedding's own style shards it; see the module docstring
        vocab_style = "embedding_rowwise_seq" if styles.get(fqn) == "seq_scatter_output" else "embedding_rowwise"
        for pattern in [p for p in styles if fnmatch.fnmatchcase(fqn, p)]:
            del styles[pattern]
        styles[fqn] = vocab_style
    else:
        _check(head, nn.Linear, fqn, "loss_parallel")
        _check_divisible(head.weight.shape[0], tp_mesh.size(), fqn, "loss_parallel (vocabulary)")
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    fused = bool(getattr(owner.ops.cross_entropy, "fused_linear_ce", False))  # the model used the Triton CE
    ce = vocab_parallel_fused_cross_entropy if fused else vocab_parallel_cross_entropy
    owner.ops = dataclasses.replace(owner.ops, cross_entropy=ce, logits=vocab_parallel_logits)


def apply_tp(model: nn.Module, plan: ParallelizePlan, pd: ParallelDims, par: Parallel) -> None:
    """The plan's TP styles over the ``tp`` mesh, with the ``[parallel]`` switches (sequence_parallel, loss_parallel,
    encoder_tp) deciding which of its entries apply."""
    tp_mesh = pd.mesh("tp")
    if tp_mesh is None:
        raise RuntimeError("parallel.tp > 1 needs torch.distributed; call titan_mm.parallel.mesh.init_distributed().")
    if not plan.tp:
        raise ValueError(
            f"parallel.tp={pd.tp} but this model's plan has no tp entries; add them to the family's plan.py "
            "(see docs/parallel.md) or set parallel.tp = 1."
        )
    styles = dict(plan.tp)
    if par.encoder_tp:
        if not plan.encoder_tp:
            raise ValueError(f"parallel.encoder_tp is on but the plan of {type(model).__name__} has no encoder_tp "
                             "entries (no modality encoder to shard); set parallel.encoder_tp = false.")
        styles.update(plan.encoder_tp)
    if par.sequence_parallel:
        styles.update(plan.sequence_parallel)
    bad = {k: v for k, v in styles.items() if v not in STYLES}
    if bad:
        raise ValueError(f"unknown TP styles {bad}; known styles: {STYLES}.")
    if plan.loss_parallel and par.loss_parallel:
        _apply_loss_parallel(model, plan.loss_parallel, tp_mesh, styles)
    tp = tp_mesh.size()
    for pattern, style in styles.items():
        matched = match_modules(model, (pattern,))
        if not matched:
            raise ValueError(f"TP plan entry {pattern!r} ({style}) matches no module of {type(model).__name__}.")
        for fqn, mod in matched:
            if style == "colwise":
                _check(mod, nn.Linear, fqn, style)
                _check_divisible(mod.out_features, tp, fqn, style)
                parallelize_module(mod, tp_mesh, ColwiseParallel())
            elif style == "rowwise":
                _check(mod, nn.Linear, fqn, style)
                _check_divisible(mod.in_features, tp, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel())
                mod.register_forward_hook(_plain_output)  # all-reduced output: the residual stream
            elif style == "embedding_rowwise":
                _check(mod, nn.Embedding, fqn, style)
                _check_divisible(mod.num_embeddings, tp, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
                mod.register_forward_hook(_plain_output)
            elif style == "rowwise_seq":
                _check(mod, nn.Linear, fqn, style)
                _check_divisible(mod.in_features, tp, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel(output_layouts=Shard(SEQ_DIM)))
                mod.register_forward_hook(_plain_output)  # reduce-scattered output: the local residual shard
            elif style == "embedding_rowwise_seq":
                _check(mod, nn.Embedding, fqn, style)
                _check_divisible(mod.num_embeddings, tp, fqn, style)
                parallelize_module(mod, tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                 output_layouts=Shard(SEQ_DIM)))
                mod.register_forward_hook(_plain_output)
            elif style in ("seq_gather", "seq_gather_local", "seq_gather_output", "seq_scatter_output"):
                _install_seq_hooks(mod, style, tp_mesh)
            elif style == "grad_sum":
                parent, child = _parent(model, fqn)
                _install_grad_sum(parent, tp_mesh.get_group(), child)
            elif style == "colwise_norm":
                _check(mod, nn.RMSNorm, fqn, style)
                _check_divisible(mod.weight.shape[0], tp, fqn, style)
                parent, child = _parent(model, fqn)
                setattr(parent, child, ShardedRMSNorm(mod, tp_mesh))


def _check_divisible(n: int, tp: int, fqn: str, style: str) -> None:
    """Sharded dimensions must split evenly: head / channel reshapes take the local size as n / tp."""
    if n % tp:
        raise ValueError(f"TP style {style!r} on {fqn}: its sharded dimension ({n}) is not divisible by tp({tp}).")


def _check(mod, cls, fqn, style):
    if not isinstance(mod, cls):
        raise TypeError(f"TP style {style!r} applies to {cls.__name__}, but {fqn} is a {type(mod).__name__}.")
