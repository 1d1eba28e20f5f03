"""Using the kernels on DTensor shards (tensor / sequence parallel): wrappers built on
torch.distributed.tensor.experimental.local_map.

The kernels work on plain local tensors. local_map unwraps DTensor arguments to their local shards, calls
the kernel, and wraps the outputs back with the declared placements; in_grad_placements says how the
gradients of the inputs are laid out (a weight replicated over a sequence-sharded activation receives a
*partial* gradient on each rank, so it is declared Partial and DTensor sums it when it is redistributed).
Every wrapper takes the 1-D mesh (the TP axis) its DTensors live on.

Supported layouts (the ones Qwen3 TP / SP plans produce):
- rms_norm / add_rms_norm: activations Shard(seq_dim) (sequence parallel), weight Replicate.
- swiglu: gate and up Shard(-1) (colwise-sharded w1 / w3 outputs); purely elementwise.
- apply_rope / apply_mrope: q, k Shard(2) (heads, [B, S, H, Dh]); cos / sin Replicate (grads Partial).
- bias_gelu: x Shard(-1), bias Shard(0) (colwise-sharded fc1 of the ViT MLP).
linear_cross_entropy with a vocabulary-sharded lm_head needs a cross-rank logsumexp: that is
titan_mm.kernels.vocab_parallel_linear_cross_entropy (on local shards and a process group, not local_map),
which loss parallel (titan_mm.parallel.tp) installs.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from . import add_rms_norm, apply_mrope, apply_rope, bias_gelu, rms_norm, swiglu


def sp_rms_norm(mesh, seq_dim: int = 1):
    """rms_norm(x, w, eps) on a sequence-sharded x (Shard(seq_dim)) with a replicated w."""
    return local_map(
        rms_norm,
        out_placements=[Shard(seq_dim)],
        in_placements=([Shard(seq_dim)], [Replicate()], None),
        in_grad_placements=([Shard(seq_dim)], [Partial()], None),
        device_mesh=mesh,
        redistribute_inputs=True,
    )


def sp_add_rms_norm(mesh, seq_dim: int = 1):
    """add_rms_norm(x, residual, w, eps) -> (normed, new_residual), all activations Shard(seq_dim)."""
    return local_map(
        add_rms_norm,
        out_placements=([Shard(seq_dim)], [Shard(seq_dim)]),
        in_placements=([Shard(seq_dim)], [Shard(seq_dim)], [Replicate()], None),
        in_grad_placements=([Shard(seq_dim)], [Shard(seq_dim)], [Partial()], None),
        device_mesh=mesh,
        redistribute_inputs=True,
    )


def tp_swiglu(mesh):
    """swiglu(gate, up) with gate / up sharded on the last (MLP width) dim."""
    return local_map(
        swiglu,
        out_placements=[Shard(-1)],
        in_placements=([Shard(-1)], [Shard(-1)]),
        device_mesh=mesh,
        redistribute_inputs=True,
    )


def tp_apply_rope(mesh, head_dim: int = 2):
    """apply_rope(q, k, cos, sin) with q / k sharded over heads and replicated cos / sin."""
    return local_map(
        apply_rope,
        out_placements=([Shard(head_dim)], [Shard(head_dim)]),
        in_placements=([Shard(head_dim)], [Shard(head_dim)], [Replicate()], [Replicate()]),
        in_grad_placements=([Shard(head_dim)], [Shard(head_dim)], [Partial()], [Partial()]),
        device_mesh=mesh,
        redistribute_inputs=True,
    )


def tp_apply_mrope(mesh, mrope_section, head_dim: int = 2):
    """apply_mrope(q, k, cos, sin) with q / k sharded over heads (mrope_section is bound here: local_map
    flattens list arguments into separate leaves)."""
    section = [int(s) for s in mrope_section]

    def _mrope(q, k, cos, sin):
        return apply_mrope(q, k, cos, sin, section)

    return local_map(
        _mrope,
        out_placements=([Shard(head_dim)], [Shard(head_dim)]),
        in_placements=([Shard(head_dim)], [Shard(head_dim)], [Replicate()], [Replicate()]),
        in_grad_placements=([Shard(head_dim)], [Shard(head_dim)], [Partial()], [Partial()]),
        device_mesh=mesh,
        redistribute_inputs=True,
    )


def tp_bias_gelu(mesh):
    """bias_gelu(x, b) with x sharded on its last dim and b on its only dim."""
    return local_map(
        bias_gelu,
        out_placements=[Shard(-1)],
        in_placements=([Shard(-1)], [Shard(0)]),
        device_mesh=mesh,
        redistribute_inputs=True,
    )
