"""Qwen3 / Qwen3-MoE activation terms for the memory estimator (titan_mm/parallel/memory.py, which counts
the parameters, FSDP2 buffers, gradients, optimizer state and the loss for any family).

Saved activations per token and block are counted from this repo's code paths: Triton RMSNorm / RoPE /
SwiGLU custom ops (inputs + fp32 rstd saved), fused causal SDPA (q, k, v, out, fp32 lse; never S x S),
qk-norm inputs, linear inputs; MoE: router probs (fp32), routed copies [N*k, D] of the inputs and outputs,
gate/up [N*k, F]; compile recomputes pointwise ops (silu), eager keeps them. float8 linears (under compile)
keep their inputs as float8 when nothing else keeps the bf16 tensor (and add a float8 copy when something
does: the attention output). Selective AC ("op"): matmul / attention outputs kept; full AC: block inputs
kept. With TP the head / FFN terms are divided by tp, the residual stream (D) terms too with sequence
parallel. Every MoE config's block is counted as an MoE block (the largest block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def decoder_block_bytes(cfg: Qwen3Config, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                        compile: bool = True, float8: bool = False) -> BlockBytes:
    """Saved bytes per token of one Qwen3 / Qwen3-MoE decoder block.

    Dense block with the Triton ops (or any ops under compile, which keeps bf16 inputs and recomputes
    pointwise math): attn_norm / ffn_norm inputs (2 D) + fp32 rstd, q/k/v linear input (D), qk-norm inputs
    (H K + G K) + fp32 rstd per head, attention q, k, v, out (H K + 2 G K + H K) + fp32 lse per head, FFN
    input (D), gate and up (2 F), SwiGLU output (F): 4 D + 3 H K + 3 G K + 3 F elements of ``act_bytes``.
    Eager PyTorch reference ops also keep the fp32 upcast of each RMSNorm input and silu(gate). Without
    ``qk_norm`` (Qwen2 decoders) the qk-norm terms are dropped; q/k/v biases save nothing.
    ``kernels``: None = the config's ``kernels``."""
    a = act_bytes
    if kernels is None:
        kernels = bool(cfg.kernels)
    D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    F, E, k, Fm = cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    t = topo.tp
    st = t if topo.sp else 1  # sequence parallel divides the residual-stream (D) terms
    fused = kernels or compile  # no fp32 upcasts / pointwise outputs kept
    norm_in = a * D / st + 4 / st  # one block RMSNorm: its input + fp32 rstd
    if not fused:
        norm_in += 4 * D / st  # eager reference RMSNorm keeps the fp32 upcast too
    attn = 0.0
    if cfg.qk_norm:  # qk-norm inputs + rstd (without it the q / k projection outputs go straight to RoPE)
        attn += (a * (H + G) * K + 4 * (H + G)) / t
        if not fused:
            attn += 4 * (H + G) * K / t
    attn += (a * (2 * H + 2 * G) * K + 4 * H) / t  # attention q, k, v, out + lse
    lin_in = 2 * a * D / st  # q/k/v projection input, FFN input (the wo input is the attention output)
    if E:  # MoE: router probs fp32, int64 routing indices, routed inputs / outputs [N*k, D], gate / up
        ffn = 4 * E + 8 * 3 * k + 4 * 2 * k + 2 * a * k * D + 2 * a * k * Fm * (1 if compile else 2)
        ffn_sel = 4 * E + 8 * 3 * k + a * E + 2 * a * k * D + 2 * a * k * Fm  # mm / grouped_mm outputs
        ffn_tmp = 2 * a * k * D  # d(routed output) and the gathered incoming gradient [N*k, D]
    else:
        ffn = 3 * a * F / t if fused else 4 * a * F / t  # gate, up, SwiGLU output (+ silu(gate) eager)
        ffn_sel = 2 * a * F / t + a * D / st  # gate, up, down-projection output
        ffn_tmp = 2 * a * F / t  # d(gate), d(up) while gate, up and d(SwiGLU out) are alive
    if float8:  # float8 linear inputs (1 byte) where only a linear reads them; a float8 copy of the attn output
        lin_in -= 2 * D / st
        attn += H * K / t
        if not E:
            ffn -= F / t
    block_in = a * D / st
    full = 2 * norm_in + attn + lin_in + ffn
    selective = (block_in + a * (H + 2 * G) * K / t + a * H * K / t + 4 * H / t + a * D / st + ffn_sel)
    kept = {"none": full, "selective": selective, "full": block_in}[topo.ac]
    bwd_tmp = max(ffn_tmp, a * (H + 2 * G) * K / t)
    return BlockBytes(kept, full, bwd_tmp)


def head_bytes(cfg: Qwen3Config, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None) -> float:
    """Bytes per token saved outside the blocks through the forward: the final norm's input + fp32 rstd
    (sequence-split under sequence parallel) and its gathered output, the RoPE cos / sin tables; the eager
    reference final norm (kernels off) also keeps its fp32 upcast."""
    a, D = act_bytes, cfg.hidden_size
    st = topo.tp if topo.sp else 1
    out = (a * D + 4) / st + a * D + 2 * a * cfg.head_dim
    if not (bool(cfg.kernels) if kernels is None else kernels):
        out += 4 * D / st
    return out


def memory_terms(cfg: Qwen3Config, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The estimator's per-token terms of a Qwen3 / Qwen3-MoE model (``kernels``: None = the config's)."""
    return MemoryTerms(
        decoder=decoder_block_bytes(cfg, topo, act_bytes, kernels=kernels, compile=compile, float8=float8),
        head=head_bytes(cfg, topo, act_bytes, kernels=kernels),
        loss_chunk=cfg.loss_chunk_size,
    )
