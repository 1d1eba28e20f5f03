"""Wan activation terms for the memory estimator (titan_mm/parallel/memory.py, which counts the parameters, FSDP2
buffers, gradients, optimizer state and the loss for any family).

Saved bytes per video token of one WanBlock, counted from model.py's eager code path
(tests/unit/test_memory_wan_bagel.py walks the autograd graph of a block on CPU in fp32 and in bf16 and finds exactly
these bytes):

- each modulated FP32LayerNorm (before attn1 and before the FFN): its fp32 input copy, fp32 mean and rstd, its fp32
  output (the ``1 + scale`` multiplicand) and the modulated input of the next linear in the activation dtype;
- attn1: the q / k RMSNorms over all heads (eager: torch's composite keeps its input upcast to fp32, the fp32 rstd
  and the fp32 normalized values), the rotated q and k and v, the attention output and fp32 log-sum-exp per head,
  and the block's ``attn1 * gate`` multiplicand (D);
- the cross-attention norm (``cross_attn_norm``: fp32 input, mean, rstd, output cast for ``to_q``), attn2's q path
  (projection, RMSNorm, SDPA's q), its output and log-sum-exp;
- the FFN: the GELU input and output (F) and the ``ffn * c_gate`` multiplicand (D, upcast to fp32);
- with ``first_frame_clean`` (a t per patch) each block's fp32 ``scale_shift_table + mod`` [6 D] and the ``1 + scale``
  / ``1 + c_scale`` multiplicands [2 D] are per token too (per clip otherwise: not counted).

With tp the head-sized (q / k / v / attention output, D/tp local features) and FFN terms are divided by tp; the
residual stream is replicated over tp (the plan has no sequence parallel), so its terms are not. Under compile the
RMSNorms keep their input and rstd only and the GELU output is recomputed. Selective AC keeps the linears' and the
attention's outputs (titan_mm.parallel.apply); full AC the block input. Not counted (per clip, not per token): the
cross-attention's keys and values over the L text tokens (about 4 L D activation bytes per block and clip), the
text embedder, and the dense [S, S] mask the CPU SDPA path builds (the GPU backends never hold one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_mm.models.wan.config import WanConfig
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def block_bytes(cfg: WanConfig, topo: Topology, act_bytes: int = 2, *, compile: bool = True) -> BlockBytes:
    """Saved bytes per video token of one Wan block under ``topo``'s AC mode and tp (module docstring)."""
    a, t = act_bytes, topo.tp
    D, H, F = cfg.dim, cfg.num_attention_heads, cfg.ffn_dim
    mod_norm = 8 * D + 8 + a * D  # fp32 input copy + output, mean / rstd, the modulated linear input
    # one RMSNorm over all heads: eager, torch's composite keeps the fp32 upcast of its input, rstd and the fp32
    # normalized values; compiled, the input and rstd
    rms = 4 + (a * D / t if compile else 8 * D / t)
    attn1 = 4 * a * D / t + 4 * H / t + a * D  # rotated q, k, v, output + lse; the gated output
    attn2 = 2 * a * D / t + 4 * H / t  # SDPA's q and the output + lse
    if cfg.qk_norm:
        attn1 += 2 * rms
        attn2 += rms
    cross_norm = 4 * D + 8 + a * D if cfg.cross_attn_norm else a * D  # the to_q input (the stream when no norm)
    ffn = (1 if compile else 2) * a * F / t + 4 * D  # GELU input (and output), the gated output (upcast to fp32)
    per_patch = 32 * D if cfg.first_frame_clean else 0.0  # fp32 modulation table + the two 1 + scale
    full = 2 * mod_norm + attn1 + cross_norm + attn2 + ffn + per_patch
    selective = (a * D + 4 * a * D / t + 2 * a * D / t  # block input, attn1's q / k / v and attn2's q and outputs
                 + 8 * H / t + 3 * a * D + a * F / t)  # lse x 2, the three rowwise outputs, the FFN projection
    kept = {"none": full, "selective": selective, "full": a * D}[topo.ac]
    return BlockBytes(kept, full, max(2 * a * F / t, 3 * a * D / t))


def head_bytes(cfg: WanConfig, act_bytes: int = 2) -> float:
    """Bytes per video token saved outside the blocks: the 3-D RoPE's fp32 cos / sin (K/2 each), the modulated final
    norm (fp32 input, mean / rstd, output) and ``proj_out``'s input; with a t per patch the [6 D] modulation and the
    time embedding as well."""
    a, D = act_bytes, cfg.dim
    out = 4 * cfg.attention_head_dim + 8 * D + 8 + a * D
    return out + (7 * a * D if cfg.first_frame_clean else 0.0)


def memory_terms(cfg: WanConfig, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The estimator's per-token terms of a Wan transformer. ``kernels`` and ``float8`` change nothing here: the fused
    q / k norms and bias + GELU save what the compiled references save (the input and its statistics, the GELU's
    input), and float8's own copies are not modelled."""
    return MemoryTerms(decoder=block_bytes(cfg, topo, act_bytes, compile=compile), head=head_bytes(cfg, act_bytes))
