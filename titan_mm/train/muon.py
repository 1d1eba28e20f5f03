"""Muon for the trunk's matrices and AdamW for everything else, as ONE torch.optim.Optimizer.

    opt = MuonAdamW(groups, lr=..., betas=..., eps=..., weight_decay=...)   # built by titan_mm.train.optim

Every parameter group carries ``algo``: ``"muon"`` or ``"adamw"``. One optimizer means one LambdaLR over
both kinds of groups, one grad-norm clip, one ``opt.step()`` in the train step and one ``optimizer`` item in
the DCP checkpoint (get/set_optimizer_state_dict see the Muon momentum buffers next to AdamW's moments).

Muon update of a matrix W with gradient G (Moonlight's formulation, "Muon is Scalable for LLM Training"):

    B <- mu * B + G                              momentum buffer (state "momentum_buffer", sharded like W)
    U <- G + mu * B   (nesterov)  or  B          the direction
    O <- NS5(U)                                  Newton-Schulz: ~ the nearest semi-orthogonal matrix
    W <- W * (1 - lr * wd) - lr * s(A, B) * O    decoupled weight decay, then the update

with ``s = 0.2 * sqrt(max(A, B))`` ("moonlight": the update's RMS matches AdamW's, so AdamW learning rates and
weight decay carry over), ``sqrt(max(1, A / B))`` ("original", Keller Jordan's) or 1 ("none"); A x B is the
matrix (rows = output features). NS5 is Keller Jordan's quintic iteration (coefficients 3.4445, -4.7750,
2.0315; 5 steps): bf16 on CUDA, compiled; fp32 on the CPU. A 3-D weight [E, A, B] (MoE experts) is E matrices
orthogonalized as one batch; a fused projection (ModelSpec.fused_params: q/k/v in one weight) is orthogonalized
part by part when ``layouts`` names it (optimizer.muon_split_fused), else whole.

Why not torch.optim.Muon (torch >= 2.9): it takes 2-D parameters only (no expert batches), runs NS in bf16
always (the fp32 equality tests could not hold), orthogonalizes whatever tensor it holds (a DTensor shard
under FSDP / TP, which is not the matrix's orthogonalization), and is a second optimizer beside AdamW.

Distributed (DTensor parameters, FSDP2 Shard(0) and / or TP): each matrix is orthogonalized whole on one
owner rank. Matrices are assigned to the ranks of their mesh greedily by NS cost (largest first, to the least
loaded rank), then every rank (1) all-gathers the direction of every matrix (``full_tensor``, in the NS dtype)
and keeps those it owns, (2) runs NS on its own matrices (batched by shape), (3) scatters the results back:
the owner holds O, the others zeros, as a Partial(sum) DTensor redistributed to the parameter's placements (a
reduce-scatter, exact: one term is non-zero). All gathers are issued before any NS, so the ranks compute at
the same time. Expert weights sharded on the expert dim only (FSDP / EP over dim 0) hold whole matrices and
are orthogonalized in place, without communication. Communication per step: one all-gather and one
reduce-scatter of the Muon matrices (in bf16 on CUDA), like one FSDP pass over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
ADJUST_LR = ("moonlight", "original", "none")
_BATCH_ELEMENTS = 1 << 27  # largest NS batch (elements of the stacked input): bounds the working memory


def newton_schulz(g: Tensor, steps: int) -> Tensor:
    """Orthogonalize the matrices of ``g`` [..., A, B] (batched over the leading dims) in g's dtype: X / ||X||_F,
    then ``steps`` quintic iterations X <- a X + (b XX^T + c (XX^T)^2) X on the wide orientation."""
    a, b, c = NS_COEFFICIENTS
    x = g if g.ndim == 3 else g.reshape(-1, *g.shape[-2:])
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        s = x @ x.mT
        s = torch.baddbmm(s, s, s, beta=b, alpha=c)
        x = torch.baddbmm(x, s, x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(g.shape)


_compiled: dict[str, Any] = {}


def _ns(x: Tensor, steps: int, compile_ns: bool) -> Tensor:
    if not compile_ns:
        return newton_schulz(x, steps)
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(newton_schulz, dynamic=None)
    return _compiled["fn"](x, steps)


def lr_ratio(rows: int, cols: int, adjust: str) -> float:
    """Multiplier on the learning rate for the orthogonalized update of a rows x cols matrix."""
    if adjust == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust == "none":
        return 1.0
    raise ValueError(f"unknown muon adjust_lr {adjust!r}; available: {', '.join(ADJUST_LR)}")


def ns_cost(shape: torch.Size | tuple[int, ...]) -> float:
    """Multiply-adds of one NS iteration over a weight of this shape (m <= n the matrix sides)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * m * m * n + m ** 3)


# ------------------------------------------------------------------------------------------ fused rows
def split_parts(t: Tensor, layout) -> list[Tensor]:
    """The part matrices of a fused weight ``t`` [..., R, C] as [batch, rows_j, C] tensors (copies if strided).
    ``layout``: titan_mm.registry.FusedRows (rows = [groups, sum(sizes)]), or None for the whole matrix."""
    r, c = t.shape[-2:]
    x = t.reshape(-1, r, c)
    if layout is None:
        return [x]
    g, sizes = layout.groups, tuple(layout.sizes)
    if g * sum(sizes) != r:
        raise ValueError(f"fused layout {layout} does not cover {r} rows ({g} x {sum(sizes)})")
    x = x.reshape(x.shape[0], g, sum(sizes), c)
    return [p.reshape(x.shape[0], g * s, c) for p, s in zip(torch.split(x, sizes, dim=2), sizes)]


def join_parts(parts: list[Tensor], shape: torch.Size, layout) -> Tensor:
    """Inverse of :func:`split_parts`."""
    if layout is None:
        return parts[0].reshape(shape)
    b, c = parts[0].shape[0], shape[-1]
    g = layout.groups
    return torch.cat([p.reshape(b, g, -1, c) for p in parts], dim=2).reshape(shape)


@dataclass
class _Job:
    """One weight to orthogonalize here: its full (or expert-local) direction, its parts, the result."""

    u: Tensor
    steps: int
    layout: Any
    adjust: str
    parts: list[Tensor] | None = None
    out: Tensor | None = None


def orthogonalize(jobs: list[_Job], compile_ns: bool) -> None:
    """Set ``job.out`` = the scaled NS result of every job, running the parts of equal shape as batches."""
    by_key: dict[tuple, list[tuple[int, int]]] = {}
    for i, j in enumerate(jobs):
        j.parts = split_parts(j.u, j.layout)
        if j.u.numel() == 0:  # no experts on this rank (uneven expert sharding)
            continue
        for k, p in enumerate(j.parts):
            by_key.setdefault((tuple(p.shape[1:]), p.dtype, p.device, j.steps, j.adjust), []).append((i, k))
    for (shape, _, _, steps, adjust), members in by_key.items():
        scale = lr_ratio(shape[0], shape[1], adjust)
        chunks, cur, n = [], [], 0  # batches of at most _BATCH_ELEMENTS input elements (or one part)
        for i, k in members:
            size = jobs[i].parts[k].numel()
            if cur and n + size > _BATCH_ELEMENTS:
                chunks.append(cur)
                cur, n = [], 0
            cur.append((i, k))
            n += size
        chunks.append(cur)
        for chunk in chunks:
            xs = [jobs[i].parts[k] for i, k in chunk]
            y = _ns(torch.cat(xs) if len(xs) > 1 else xs[0], steps, compile_ns) * scale
            for (i, k), piece in zip(chunk, torch.split(y, [x.shape[0] for x in xs])):
                jobs[i].parts[k] = piece
    for j in jobs:
        j.out = join_parts(j.parts, j.u.shape, j.layout)
        j.parts = None


# ------------------------------------------------------------------------------------------ DTensor side
def _is_dtensor(t: Tensor) -> bool:
    return isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _holds_whole_matrices(t) -> bool:
    """A DTensor whose every shard cuts only batch dims (experts over dim 0) or lies on a mesh dim of size 1
    (FSDP2 on one GPU), and is otherwise replicated: its local tensor holds whole matrices."""
    for pl, size in zip(t.placements, t.device_mesh.shape):
        if size == 1 or pl.is_replicate():
            continue
        dim = getattr(pl, "dim", None)
        if dim is None or pl.is_partial() or (dim % t.ndim) >= t.ndim - 2:
            return False
    return True


def _flat_rank(mesh) -> int:
    idx = 0
    for c, s in zip(mesh.get_coordinate(), mesh.shape):
        idx = idx * s + c
    return idx


def assign_owners(shapes: list[torch.Size], n: int) -> list[int]:
    """Owner rank (0..n-1) of each matrix: largest NS cost first, each to the least loaded rank (ties: lowest
    rank, then list order), the same on every rank."""
    load = [0.0] * n
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        r = min(range(n), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += ns_cost(shapes[i])
    return owners


def orthogonalized_updates(directions: list[tuple[Tensor, Tensor, int, Any, str]], ns_dtype: torch.dtype | None,
                           compile_ns: bool | None) -> list[Tensor]:
    """The scaled orthogonalized update of every (direction, param, ns_steps, fused layout, adjust_lr), as this
    rank's local tensor: ``direction`` is the local tensor of the parameter's direction (placed like ``param``,
    a plain tensor or a DTensor). Collective when some parameter is a DTensor that splits its matrices: every
    rank of its mesh must call this with the same list."""
    def dtype_for(t):
        return ns_dtype or (torch.bfloat16 if t.is_cuda else torch.float32)

    out: list[Tensor | None] = [None] * len(directions)
    local: list[tuple[int, _Job]] = []
    remote: dict[Any, list[int]] = {}  # mesh -> indices of the matrices it splits
    for i, (u, p, steps, layout, adjust) in enumerate(directions):
        if not _is_dtensor(p) or _holds_whole_matrices(p):
            local.append((i, _Job(u.to(dtype_for(u)), steps, layout, adjust)))
        else:
            remote.setdefault(p.device_mesh, []).append(i)

    # (1) gather: every rank takes part in every all-gather and keeps the matrices it owns
    owned: list[tuple[int, _Job]] = []
    scatter: list[tuple[int, int, int]] = []  # (index, owner, my flat rank in the mesh)
    for mesh, idx in remote.items():
        me = _flat_rank(mesh)
        for i, owner in zip(idx, assign_owners([directions[i][1].shape for i in idx], mesh.size())):
            u, p, steps, layout, adjust = directions[i]
            full = DTensor.from_local(u.to(dtype_for(u)), mesh, p.placements, shape=p.shape,
                                      stride=p.stride()).full_tensor()
            if owner == me:
                owned.append((i, _Job(full, steps, layout, adjust)))
            scatter.append((i, owner, me))

    # (2) compute: this rank's matrices, batched by shape
    by_compile: dict[bool, list[_Job]] = {}
    for _, j in local + owned:
        by_compile.setdefault(j.u.is_cuda if compile_ns is None else compile_ns, []).append(j)
    for flag, js in by_compile.items():
        orthogonalize(js, flag)
    for i, j in local:
        out[i] = j.out
    mine = {i: j.out for i, j in owned}

    # (3) scatter: the owner's O (zeros elsewhere) as a Partial sum, redistributed to the parameter's placements
    for i, owner, me in scatter:
        u, p = directions[i][:2]
        o = mine.pop(i) if owner == me else torch.zeros(p.shape, dtype=dtype_for(u), device=u.device)
        part = DTensor.from_local(o, p.device_mesh, [Partial()] * p.device_mesh.ndim, shape=p.shape,
                                  stride=o.stride())
        out[i] = part.redistribute(p.device_mesh, p.placements).to_local()
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ the optimizer
class MuonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW for the groups with ``algo="adamw"`` and Muon (this module's docstring) for the groups
    with ``algo="muon"``, whose keys are ``momentum``, ``nesterov``, ``ns_steps`` and ``adjust_lr`` (their
    ``lr`` and ``weight_decay`` as in AdamW). ``layouts``: {id(param): FusedRows} for the Muon weights to
    orthogonalize part by part. ``ns_dtype``: None = bf16 on CUDA, fp32 elsewhere; ``compile_ns``: None =
    torch.compile the NS on CUDA.

    Muon state per weight: ``momentum_buffer`` (like the parameter: a DTensor with its placements under
    FSDP / TP) and ``step`` (updates made; torch's Adam.__setstate__ reads a ``step`` in every state)."""

    def __init__(self, params, *, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr: str = "moonlight", layouts: dict[int, Any] | None = None,
                 ns_dtype: torch.dtype | None = None, compile_ns: bool | None = None, **adamw_kwargs):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"muon ns_steps must be >= 1, got {ns_steps}")
        lr_ratio(1, 1, adjust_lr)  # rejects an unknown name
        super().__init__(params, **adamw_kwargs)
        for g in self.param_groups:
            g.setdefault("algo", "adamw")
            if g["algo"] == "muon":
                for k, v in (("momentum", momentum), ("nesterov", nesterov), ("ns_steps", ns_steps),
                             ("adjust_lr", adjust_lr)):
                    g.setdefault(k, v)
                for p in g["params"]:
                    if p.ndim < 2:
                        raise ValueError(f"Muon group {g.get('name', '')!r} holds a {p.ndim}-D parameter; Muon "
                                         "takes matrices (2-D) and batches of matrices (3-D and up)")
            elif g["algo"] != "adamw":
                raise ValueError(f"parameter group algo {g['algo']!r}: use 'muon' or 'adamw'")
        self.layouts = dict(layouts or {})
        self.ns_dtype, self.compile_ns = ns_dtype, compile_ns

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        # AdamW's own step (foreach / fused kernels, state init) over the AdamW groups only: the same group
        # dicts and self.state, so the schedule, state_dict and DCP see one optimizer
        self.param_groups = [g for g in groups if g["algo"] == "adamw"]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = groups
        self._muon_step([g for g in groups if g["algo"] == "muon"])
        return loss

    def _muon_step(self, groups: list[dict]) -> None:
        # the elementwise math on local tensors (DTensor dispatch per op would cost more than the op)
        work: list[tuple[Tensor, dict]] = []
        directions = []
        for g in groups:
            mu = g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["step"] = torch.tensor(0.0)
                grad = p.grad
                if _is_dtensor(grad) and grad.placements != p.placements:  # the local math needs p's layout
                    grad = grad.redistribute(p.device_mesh, p.placements)
                buf, grad = _local(st["momentum_buffer"]), _local(grad)
                buf.mul_(mu).add_(grad)
                st["step"] += 1
                u = grad.add(buf, alpha=mu) if g["nesterov"] else buf
                work.append((p, g))
                directions.append((u, p, g["ns_steps"], self.layouts.get(id(p)), g["adjust_lr"]))
        if not work:
            return
        updates = orthogonalized_updates(directions, self.ns_dtype, self.compile_ns)
        for (p, g), o in zip(work, updates):
            lr, w = g["lr"], _local(p)
            w.mul_(1.0 - lr * g["weight_decay"])
            w.add_(o, alpha=-lr)
