"""BAGEL activation terms for the memory estimator (titan_mm/parallel/memory.py, which counts the parameters, FSDP2
buffers, gradients, optimizer state and the loss for any family).

Saved bytes per token of one decoder layer (MoTLayer, or the MLP-only split's MoELayer), counted from model.py's
eager code path (tests/unit/test_memory_wan_bagel.py walks the autograd graph of a layer on CPU in fp32 and in bf16
and finds exactly these bytes). Every token runs one expert, so a token saves one expert's worth whatever the split;
routing saves only index tensors (the host-built indices and the permutation built from them, int64, shared by
every layer: counted nowhere, 24 bytes a token):

- each RMSNorm (titan_mm.nn.norm.rms_norm: the attention and FFN norms, D; the per-head q and k norms, H K and G K):
  its fp32 upcast, fp32 rstd and the normalized values cast back; then the q / k / v and w1 / w3 inputs (D);
- attention under the batch's segment mask (the sdpa backend; fused SDPA kernels that take a mask lack GQA, so k and
  v are repeated to H heads): q, k, v, the output (H K each) and the fp32 log-sum-exp per head; ``wo``'s input (H K:
  the output's rows routed to each expert; the MLP-only split's one ``wo`` reads the output itself).
  Without GQA (G = H) v stays a view of the merged [(H + 2 G) K] q / k / v, which it keeps alive;
- the SwiGLU: gate, silu(gate), up and w2's input (F each); compile recomputes silu(gate).

With tp the head and FFN terms are divided by tp (the plan has no sequence parallel: the D terms stay). Under compile
the norms keep their input and rstd only. Selective AC keeps the linears' and the attention's outputs; full AC the
layer input. Not counted: the ViT tower's activations (per image patch; BAGEL's dims have no VisionDims), the [S, S]
mask of the sdpa backend (flex holds a block mask instead)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_mm.models.bagel.config import BagelConfig
from titan_mm.registry import BlockBytes, MemoryTerms

if TYPE_CHECKING:
    from titan_mm.parallel.memory import Topology


def _norm(width: float, rows: float, a: int, compile: bool) -> float:
    """Saved bytes of one rms_norm over ``rows`` vectors of ``width``: input (fp32 upcast eager), fp32 rstd, the
    normalized values (eager)."""
    return (a * width + 4 * rows) if compile else (4 * width + 4 * rows + a * width)


def block_bytes(cfg: BagelConfig, topo: Topology, act_bytes: int = 2, *, compile: bool = True) -> BlockBytes:
    """Saved bytes per token of one BAGEL decoder layer under ``topo``'s AC mode and tp (module docstring)."""
    c, a, t = cfg.llm_config, act_bytes, topo.tp
    D, H, G, K, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    norms = 2 * _norm(D, 1, a, compile) + _norm(H * K / t, H / t, a, compile) + _norm(G * K / t, G / t, a, compile)
    # q, the output, wo's input, lse; k and v repeated to H heads, or (no GQA) the rotated k and the merged q / k / v
    # that v is a view of
    kv = 2 * H * K if G < H else (H + 3 * G) * K
    attn = a * (2 * H * K + kv) / t + 4 * H / t
    if c.layer_module != "Qwen2MoEDecoderLayer":  # MoT: wo's input is a copy, the output's rows routed per expert
        attn += a * H * K / t
    ffn = (3 if compile else 4) * a * F / t
    full = norms + 2 * a * D + attn + ffn
    selective = (3 * a * D + a * (H + 2 * G) * K / t  # layer input, wo / w2 outputs; q / k / v projections
                 + a * H * K / t + 4 * H / t + 2 * a * F / t)  # attention output + lse, w1 / w3 outputs
    kept = {"none": full, "selective": selective, "full": a * D}[topo.ac]
    return BlockBytes(kept, full, max(2 * a * F / t, a * (H + 2 * G) * K / t))


def head_bytes(cfg: BagelConfig, act_bytes: int = 2, *, compile: bool = True) -> float:
    """Bytes per token saved outside the layers: the RoPE cos / sin tables (K each), each token's expert final norm
    and its output (the LM head's and llm2vae's input)."""
    c, a = cfg.llm_config, act_bytes
    return 2 * a * c.head_dim + _norm(c.hidden_size, 1, a, compile) + a * c.hidden_size


def memory_terms(cfg: BagelConfig, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                 compile: bool = True, float8: bool = False) -> MemoryTerms:
    """The estimator's per-token terms of BAGEL's decoder and the LM loss's chunk (the estimator's loss_bytes takes
    the fused or the chunked cross-entropy by ``kernels``, as lm_loss does). ``kernels`` and ``float8`` change
    nothing in the layers: the experts run titan_mm.nn's reference ops."""
    return MemoryTerms(decoder=block_bytes(cfg, topo, act_bytes, compile=compile),
                       head=head_bytes(cfg, act_bytes, compile=compile), loss_chunk=cfg.loss_chunk_size)
