"""Per-GPU peak memory estimate for a model config + topology (+ AC), and a topology suggestion.

    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml                      # the config's topology
    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml --tp 2 --ac selective
    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml --gpus 8 --gpu-mem-gb 141   # + suggestion

The estimate follows one training step of titan_mm (FSDP2 with bf16 params / fp32 reduce, fp32 master
weights, AdamW, the train step's ``zero_grad(set_to_none=True)``) through the moments where memory can
peak and returns the largest (``estimate``; every moment: ``estimate_phases``). Bytes per GPU, in the
steady state (step >= 2: the AdamW state exists). Shards: fp32 master params, fp32 grads and the two
AdamW states hold TP-sharded matrices / (tp * fsdp), other dense params / fsdp, experts / fsdp (experts
live on [ep_fsdp, ep] = dp_shard x cp ranks); fsdp = dp_shard * cp (HSDP's dp_replicate does not shard).

  forward_end          params + optimizer (no gradients: the previous step freed them)
                       + the root's unsharded params (embedding / head / final norm / vision stem: FSDP2
                         keeps them from the forward through the backward)
                       + the saved activations of every block (+ the vision tower) at the loss
                       + the loss's working set: fused Triton CE (kernels on) = a [C, V]
                         logits chunk, grad_h [N, D] and grad_W [V, D] in the weight dtype (V/tp under
                         loss parallel); the PyTorch chunked CE (kernels off) = fp32 grad_W plus up to
                         (16 + a) * C * V bytes of chunk buffers (fp32 logits, exp temp, softmax, grad;
                         the previous chunk's softmax and bf16 grad are still bound when the next
                         chunk's are made).
  backward_block_{j}   the backward of block j (every j is checked): saved activations of blocks <= j
                       (+ one block's recompute under AC), fp32 gradient shards of the blocks already
                       done, the previous block's fp32 reduce-scatter input (FSDP2 keeps one in flight),
                       block j's unsharded bf16 params, the prefetched next block's, block j's bf16
                       gradients, the held head-weight gradient (the CE computes it in the forward), the
                       incoming gradient [N, D] and the block's largest gradient temporaries (SwiGLU:
                       2 [N, F]; MoE: 2 [N*k, D]).
  backward_vision      (Qwen3-VL) all decoder gradients + the ViT's saved activations.
  embedding_backward   all block gradients + two [V, D] bf16 gradients (head + embedding) + the root params.
  root_reduce_scatter  all block gradients + the root's bf16 grads -> fp32 input -> fp32 output.
  optimizer_step       params + grads + optimizer.

With ``parallel.fsdp_reshard_after_forward = never`` (``Topology.reshard``) no block frees its gathered params
after its forward: forward_end holds all of them (and the ViT blocks'), backward_block_{j} those of blocks
0..j (nothing is prefetched), in bf16, or 1 byte per param with float8 (tensorwise gathers float8 weights).

Gradient accumulation (``grad_accum`` > 1 micro-batches per step): from the second micro-batch on, the fp32
gradient shards of the whole model exist through its forward and backward, so every phase carries them.

Saved activations per token and block are counted from this repo's code paths: Triton RMSNorm / RoPE /
SwiGLU custom ops (inputs + fp32 rstd saved), fused causal SDPA (q, k, v, out, fp32 lse; never S x S),
qk-norm inputs, linear inputs; MoE: router probs (fp32), routed copies [N*k, D] of the inputs and outputs,
gate/up [N*k, F]; compile recomputes pointwise ops (silu, gelu), eager keeps them. float8 linears (under
compile) keep their inputs as float8 when nothing else keeps the bf16 tensor (and add a float8 copy when
something does: the attention output). Selective AC ("op"): matmul / attention outputs kept; full AC:
block inputs kept + one block recomputed at a time. With TP the head / FFN terms are divided by tp (the
residual stream too with sequence parallel; Qwen3-VL: also the DeepStack additions, which sequence parallel
cuts to the local shard with the embeddings); with CP the tokens are divided by cp. The ViT and the mergers are
divided by tp only with ``encoder_tp`` (``parallel.encoder_tp``; their token stream is never sequence-split).
Loss parallel (the plan names a head, tied or not): the head weight, its gradient and the loss's [C, V] chunks
are divided by tp (kernels on: the fused CE's vocab-parallel form; off: the PyTorch vocab-parallel chunked CE).

Not modelled: the CUDA context, cuBLAS / cuDNN workspaces and NCCL buffers (outside
torch.cuda.max_memory_allocated), allocator fragmentation (reserved vs allocated), float8 scales, HSDP's
all-reduce buffers, expert-parallel all-to-all buffers. Checked against measured H200 peaks by
bench/memory_check.py (docs/parallel.md, "Checked against the H200").
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Topology:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    ac: str = "none"  # none | selective | full
    sp: bool = True  # sequence parallel (with tp > 1, when the plan has sequence_parallel entries)
    encoder_tp: bool = False  # Qwen3-VL: ViT and mergers sharded over tp (parallel.encoder_tp), else replicated
    ac_layers: int = 0  # activation_checkpoint.num_layers: the AC mode on the first N AC units only (0 = all)
    reshard: str = "always"  # parallel.fsdp_reshard_after_forward: always | never

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} ep={self.ep} "
                f"ac={self.ac}" + (f" ac_layers={self.ac_layers}" if self.ac_layers and self.ac != "none" else "")
                + (f" reshard={self.reshard}" if self.reshard != "always" else ""))


@dataclass(frozen=True)
class ParamCounts:
    tp_sharded: int  # dense params split over tp (colwise / rowwise / embedding_rowwise)
    replicated: int  # dense params replicated over tp
    experts: int
    block_dense: int  # dense params of the largest decoder block (for the FSDP working set)
    block_experts: int
    root: int  # params outside the blocks (embedding, head, final norm; VL: patch / position embeddings, mergers)
    n_blocks: int = 0  # decoder (LLM) blocks
    vision_blocks: int = 0  # ViT blocks (Qwen3-VL)
    vision_block: int = 0  # params of one ViT block

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.experts


def count_params(model_cfg, plan, encoder_tp: bool = False) -> ParamCounts:
    """Count by building the model on the meta device and classifying each parameter by the plan: tp-sharded
    are the plan's colwise / rowwise / embedding entries, the loss-parallel head (tied: the embedding) and,
    with ``encoder_tp``, the encoder entries."""
    import fnmatch

    import torch

    build = _build_fn(model_cfg)
    with torch.device("meta"):
        model = build(model_cfg)
    styles = {**plan.tp, **(plan.encoder_tp if encoder_tp else {})}
    tp_pat = [p for p, s in styles.items() if s in ("colwise", "rowwise", "embedding_rowwise")]
    if plan.loss_parallel:
        tp_pat.append(plan.loss_parallel)
    ep_pat = [p for p, s in plan.ep.items() if s == "experts"]
    blocks = [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in plan.fsdp_units)]
    blocks = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks)]
    tp = rep = ex = 0
    per_block: dict[str, list[int]] = {b: [0, 0] for b in blocks}
    root = 0
    for name, p in model.named_parameters():
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
    vis = {b: v for b, v in per_block.items() if b.startswith("visual")}
    dec = {b: v for b, v in per_block.items() if b not in vis}
    bd = max((v[0] for v in dec.values()), default=0)
    be = max((v[1] for v in dec.values()), default=0)
    vb = max((v[0] + v[1] for v in vis.values()), default=0)
    return ParamCounts(tp, rep, ex, bd, be, root, len(dec), len(vis), vb)


def _build_fn(model_cfg):
    from titan_mm.registry import get_model_spec

    mt = getattr(model_cfg, "model_type", None)
    names = ([mt] if isinstance(mt, str) else []) + ["qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"]
    for name in names:
        try:
            spec = get_model_spec(name)
        except Exception:  # noqa: BLE001 - try the next family name
            continue
        if isinstance(model_cfg, spec.config_cls):
            return spec.build
    raise ValueError(f"no registered model family builds a {type(model_cfg).__name__}.")


def _g(cfg, name, default=0):
    return getattr(cfg, name, default) or default


def _text(model_cfg):
    """The decoder part of a config (Qwen3-VL keeps it in ``.text``)."""
    return getattr(model_cfg, "text", None) or model_cfg


def _vision(model_cfg):
    return getattr(model_cfg, "vision", None)


# ------------------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class BlockBytes:
    """Bytes per token of one block."""

    kept: float  # saved for the backward under the AC mode (what every block holds at the loss)
    full: float  # saved without AC (what one block holds while it is recomputed under AC)
    bwd_tmp: float  # largest gradient temporaries of its backward, on top of what it saved


def decoder_block_bytes(model_cfg, topo: Topology, act_bytes: int = 2, *, kernels: bool | None = None,
                        compile: bool = True, float8: bool = False) -> BlockBytes:
    """Saved bytes per token of one Qwen3 / Qwen3-MoE decoder block (see the module docstring).

    Dense block with the Triton ops (or any ops under compile, which keeps bf16 inputs and recomputes
    pointwise math): attn_norm / ffn_norm inputs (2 D) + fp32 rstd, q/k/v linear input (D), qk-norm inputs
    (H K + G K) + fp32 rstd per head, attention q, k, v, out (H K + 2 G K + H K) + fp32 lse per head, FFN
    input (D), gate and up (2 F), SwiGLU output (F): 4 D + 3 H K + 3 G K + 3 F elements of ``act_bytes``.
    Eager PyTorch reference ops also keep the fp32 upcast of each RMSNorm input and silu(gate)."""
    c = _text(model_cfg)
    a = act_bytes
    if kernels is None:
        kernels = bool(getattr(c, "kernels", False))
    D = _g(c, "hidden_size")
    H = _g(c, "num_attention_heads")
    G = _g(c, "num_key_value_heads", H)
    K = _g(c, "head_dim", D // max(H, 1))
    F = _g(c, "intermediate_size")
    E = _g(c, "num_experts")
    k = _g(c, "num_experts_per_tok", 1)
    Fm = _g(c, "moe_intermediate_size")
    t = topo.tp
    st = t if topo.sp else 1  # sequence parallel divides the residual-stream (D) terms
    fused = kernels or compile  # no fp32 upcasts / pointwise outputs kept
    norm_in = a * D / st + 4 / st  # one block RMSNorm: its input + fp32 rstd
    if not fused:
        norm_in += 4 * D / st  # eager reference RMSNorm keeps the fp32 upcast too
    attn = (a * (H + G) * K + 4 * (H + G)) / t  # qk-norm inputs + rstd
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


def vision_block_bytes(model_cfg, topo: Topology, act_bytes: int = 2, *, compile: bool = True) -> BlockBytes:
    """Saved bytes per patch of one Qwen3-VL ViT block: LayerNorm inputs (2 Dv) + fp32 mean / rstd, their
    outputs as linear inputs (2 Dv), the qkv projection output (3 Dv: v is a view of it and keeps it
    alive), rotated q and k (2 Dv), attention output (Dv) + fp32 lse, fc1 output (Iv; eager also keeps
    gelu's output). Replicated over tp unless ``topo.encoder_tp``: then the per-head and MLP-channel terms
    (everything but the LayerNorms and the linear inputs) are divided by tp."""
    v = _vision(model_cfg)
    if v is None:
        return BlockBytes(0.0, 0.0, 0.0)
    a = act_bytes
    Dv, Iv, Hv = v.hidden_size, v.intermediate_size, v.num_heads
    t = topo.tp if topo.encoder_tp else 1
    full = a * (4 * Dv + (6 * Dv + Iv * (1 if compile else 2)) / t) + 16 + 4 * Hv / t
    # block input, qkv output, attention output, proj output, fc1 output, fc2 output + lse
    selective = a * (Dv + (3 * Dv + Dv) / t + Dv + Iv / t + Dv) + 4 * Hv / t
    kept = {"none": full, "selective": selective, "full": a * Dv}[topo.ac]
    return BlockBytes(kept, full, 2 * a * Iv / t)


def vision_stem_bytes(model_cfg, act_bytes: int = 2, topo: Topology | None = None) -> float:
    """Saved bytes per patch outside the ViT blocks: patch-embedding input, the main merger (LayerNorm
    input, fc1 input, fc1 / gelu outputs: 4 Dv per patch) and each DeepStack merger (3 Dv per patch; its
    LayerNorm input is the block output, kept by the next block). With ``topo.encoder_tp`` the fc1 / gelu
    outputs are divided by tp."""
    v = _vision(model_cfg)
    if v is None:
        return 0.0
    a = act_bytes
    t = topo.tp if topo is not None and topo.encoder_tp else 1
    return a * v.patch_dim + a * v.hidden_size * ((2 + 2 / t) + (1 + 2 / t) * len(v.deepstack_visual_indexes))


def activation_bytes_per_token(model_cfg, topo: Topology, act_bytes: int) -> tuple[float, float, float]:
    """(bytes per token kept per decoder block, one block's full activations, final norm + loss input)."""
    b = decoder_block_bytes(model_cfg, topo, act_bytes)
    D = _g(_text(model_cfg), "hidden_size")
    st = topo.tp if topo.sp else 1
    head = (act_bytes * D + 4) / st + act_bytes * D  # final norm: its input + rstd; its (gathered) output
    return b.kept, b.full, head


def loss_bytes(model_cfg, plan, topo: Topology, tokens: float, act_bytes: int = 2, *,
               kernels: bool | None = None) -> tuple[float, float]:
    """(working set of the loss in the forward, what it keeps for the backward: grad_h and grad_W)."""
    c = _text(model_cfg)
    a = act_bytes
    V, D = _g(c, "vocab_size"), _g(c, "hidden_size")
    N = int(tokens)
    if kernels is None:
        kernels = bool(getattr(c, "kernels", False))
    vt = topo.tp if (topo.tp > 1 and plan is not None and plan.loss_parallel) else 1
    keep = (a * V * D) / vt + a * N * D  # grad_W (weight dtype) and grad_h (kept until the backward)
    if kernels and N > 0:
        # titan_mm.kernels.linear_cross_entropy (loss parallel: its vocab-parallel form on the V/tp shard): one
        # [C, V/vt] logits buffer in h.dtype, C from default_chunk_size over the shard
        Vl = math.ceil(V / vt)
        chunk = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(N / math.ceil(Vl / D))))))
        work = keep + a * min(chunk, N) * Vl + 4 * N
        return work, keep
    # titan_mm.models.common.loss.chunked_cross_entropy (fp32 grad_W accumulator, fp32 chunk buffers)
    C = min(int(_g(c, "loss_chunk_size", 4096)), max(N, 1))
    sizes = [min(C, N - s) for s in range(0, N, C)] or [0]
    chunk_peak = (12 + a) * sizes[0]
    for prev, cur in zip(sizes, sizes[1:]):
        chunk_peak = max(chunk_peak, (4 + a) * prev + 12 * cur)  # previous softmax + bf16 grad still bound
    work = 4 * V * D / vt + a * N * D + chunk_peak * V / vt
    return work, keep


# ------------------------------------------------------------------------------------------- the step
def estimate_phases(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
                    counts: ParamCounts | None = None, *, kernels: bool | None = None, compile: bool = True,
                    float8: bool = False, vision_patches: int = 0, grad_accum: int = 1) -> dict[str, dict[str, float]]:
    """Bytes per GPU by category at each moment of the step where memory can peak (module docstring).

    ``vision_patches``: ViT patches per micro-batch (Qwen3-VL; 0 = the vision tower's activations are not
    counted). ``kernels``: the model uses titan_mm.kernels (default: the config's ``kernels``)."""
    c = counts or count_params(model_cfg, plan, topo.encoder_tp)
    tc = _text(model_cfg)
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
    L = max(c.n_blocks, _g(tc, "num_hidden_layers"))
    D, V = _g(tc, "hidden_size"), _g(tc, "vocab_size")
    st = t if topo.sp else 1
    tokens = micro_batch * seq_len / topo.cp
    blk = decoder_block_bytes(model_cfg, topo, a, kernels=kernels, compile=compile, float8=float8)
    vblk = vision_block_bytes(model_cfg, topo, a, compile=compile)
    vis = _vision(model_cfg)
    # one [V, D] head-weight gradient in param dtype, held from the loss to the root's post-backward
    head_grad = a * V * D / (t if (t > 1 and plan is not None and plan.loss_parallel) else 1)
    loss_work, _ = loss_bytes(model_cfg, plan, topo, tokens, a, kernels=kernels)

    # forward-only activations outside the blocks: final norm (+ its output), RoPE tables, VL extras
    head_acts = tokens * ((a * D + 4) / st + a * D + 2 * a * _g(tc, "head_dim", 128))
    # blocks under AC (activation_checkpoint.num_layers = N > 0: the first N AC units in module order, which
    # for Qwen3-VL are the vision blocks first, then the decoder blocks); the others keep everything
    n_vis = (c.vision_blocks or vis.depth) if vis is not None else 0
    n_ac_vis = 0 if topo.ac == "none" else (min(topo.ac_layers, n_vis) if topo.ac_layers > 0 else n_vis)
    n_ac = 0 if topo.ac == "none" else (min(max(0, topo.ac_layers - n_vis), L) if topo.ac_layers > 0 else L)
    vis_acts = 0.0
    if vis is not None and vision_patches:
        nv = vision_patches
        vis_acts = nv * (n_ac_vis * vblk.kept + (n_vis - n_ac_vis) * vblk.full) + nv * vision_stem_bytes(model_cfg, a, topo)
        # DeepStack adds, alive all forward (sequence parallel: cut to the local shard with the embeddings)
        head_acts += tokens * a * D * len(vis.deepstack_visual_indexes) / st
    if not (kernels if kernels is not None else bool(getattr(tc, "kernels", False))):
        head_acts += tokens * 4 * D / st  # the final norm is the reference RMSNorm (eager): fp32 upcast kept
    def kept_upto(j: int) -> float:  # saved bytes per token of blocks 0..j
        return min(j + 1, n_ac) * blk.kept + max(0, j + 1 - n_ac) * blk.full

    recompute = (blk.full - blk.kept) * tokens if topo.ac != "none" else 0.0
    root_params = a * root_un if fsdp_on else 0.0
    phases: dict[str, dict[str, float]] = {}

    def add(name, **kw):
        out = {"params": master, "grads": 0.0, "optimizer": optim, "fsdp_buffers": 0.0, "activations": 0.0,
               "loss": 0.0, "workspace": 0.0}
        out.update(kw)
        if grad_accum > 1:  # a later micro-batch: every gradient shard already holds the earlier ones' sum
            out["grads"] = grads_all
        out["total"] = sum(out.values())
        phases[name] = out

    # parallel.fsdp_reshard_after_forward = never: every block's (and ViT block's) gathered params outlive
    # its forward until its backward (float8: tensorwise, the default recipe, gathers the linears' weights as
    # float8, 1 byte each; the norms' few params are counted at that size too)
    never = fsdp_on and topo.reshard == "never"
    kept_b = 1 if float8 else a
    kept_fwd = kept_b * (blk_un * L + vis_un * n_vis) if never else 0.0
    add("forward_end", fsdp_buffers=root_params + kept_fwd,
        activations=kept_upto(L - 1) * tokens + head_acts + vis_acts, loss=loss_work)
    for j in range(L - 1, -1, -1):
        done = L - 1 - j
        buf = root_params
        if never:  # blocks 0..j still gathered (nothing to prefetch), the ViT blocks too, and j's grads
            buf += kept_b * (blk_un * (j + 1) + vis_un * n_vis) + a * blk_un
            buf += 4 * blk_un if done else 0.0
        elif fsdp_on:
            buf += a * blk_un * (2 if j > 0 else 1) + a * blk_un  # block j + prefetched j-1 params, j's grads
            buf += 4 * blk_un if done else 0.0  # previous block's fp32 reduce-scatter input (one in flight)
        add(f"backward_block_{j}", grads=4 * blk_sh * done, fsdp_buffers=buf,
            activations=kept_upto(j) * tokens + (recompute if j < n_ac else 0.0) + vis_acts, loss=head_grad,
            workspace=tokens * (a * D / st + blk.bwd_tmp))
    llm_grads = 4 * blk_sh * L
    if vis is not None and vision_patches:
        vbuf = root_params + (a * 3 * vis_un + 4 * blk_un if fsdp_on else 0.0)  # ViT block params x2 + grads
        if never:  # the other ViT blocks are still gathered
            vbuf += kept_b * vis_un * max(n_vis - 2, 0)
        add("backward_vision", grads=llm_grads, fsdp_buffers=vbuf,
            activations=vis_acts + (vblk.full - vblk.kept) * vision_patches * (n_ac_vis > 0),
            loss=head_grad, workspace=vision_patches * (a * vis.hidden_size + vblk.bwd_tmp))
    blocks_grads = llm_grads + 4 * vis_sh * c.vision_blocks
    if fsdp_on:
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
    tc = _text(model_cfg)
    H = _g(tc, "num_attention_heads")
    G = _g(tc, "num_key_value_heads", H)
    E = _g(tc, "num_experts")
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.parallel.memory", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a TOML in train_configs/ or a path")
    for name in ("dp-replicate", "dp-shard", "cp", "tp", "ep"):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"override parallel.{name.replace('-', '_')}")
    ap.add_argument("--ac", choices=("none", "selective", "full"), default=None, help="override activation_checkpoint.mode")
    ap.add_argument("--reshard", choices=("always", "never"), default=None,
                    help="override parallel.fsdp_reshard_after_forward")
    ap.add_argument("--no-sp", action="store_true", help="estimate without sequence parallel")
    ap.add_argument("--encoder-tp", action="store_true", help="Qwen3-VL: ViT and mergers sharded over tp "
                    "(default: parallel.encoder_tp of the config)")
    ap.add_argument("--seq-len", type=int, default=None, help="override data.seq_len")
    ap.add_argument("--micro-batch", type=int, default=None, help="override data.micro_batch_size")
    ap.add_argument("--gpus", type=int, default=None, help="GPU count (default: the topology's world size)")
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory in GiB: also suggest topologies")
    ap.add_argument("--vision-patches", type=int, default=0,
                    help="Qwen3-VL: ViT patches per micro-batch (0: vision activations not counted)")
    args = ap.parse_args(argv)

    import torch

    from titan_mm.config import load_toml, resolve_config_path
    from titan_mm.train.trainer import resolve_model

    cfg = load_toml(resolve_config_path(args.config))
    spec, model_cfg = resolve_model(cfg, torch.device("cuda"))
    plan = spec.plan(model_cfg)
    p = cfg.parallel
    pick = lambda a, d: d if a is None else a  # noqa: E731
    dp_r, cp, tp, ep = pick(args.dp_replicate, p.dp_replicate), pick(args.cp, p.cp), pick(args.tp, p.tp), pick(args.ep, p.ep)
    ds = pick(args.dp_shard, p.dp_shard)
    gpus = args.gpus
    if ds == -1:
        ds = max(1, (gpus or dp_r * cp * tp) // (dp_r * cp * tp))
    sp = cfg.parallel.sequence_parallel and not args.no_sp and bool(plan.sequence_parallel)
    enc = bool(args.encoder_tp or getattr(p, "encoder_tp", False)) and bool(plan.encoder_tp)
    topo = Topology(dp_r, ds, cp, tp, ep, pick(args.ac, cfg.activation_checkpoint.mode), sp, enc,
                    int(cfg.activation_checkpoint.num_layers),
                    pick(args.reshard, str(cfg.parallel.fsdp_reshard_after_forward)))
    seq = pick(args.seq_len, cfg.data.seq_len)
    mb = pick(args.micro_batch, cfg.data.micro_batch_size)
    pbytes = 2 if cfg.training.param_dtype == "bfloat16" else 4
    counts = count_params(model_cfg, plan, enc)
    kw = dict(compile=bool(cfg.compile.enable), float8=bool(cfg.float8.enable), vision_patches=args.vision_patches)
    per_pass = mb * dp_r * ds  # rows per micro-batch over the data-parallel ranks
    accum = max(1, (cfg.training.global_batch_size or per_pass) // per_pass)
    phases = estimate_phases(model_cfg, plan, topo, seq, mb, pbytes, counts, grad_accum=accum, **kw)
    peak = peak_phase(phases)
    est = phases[peak]
    name = cfg.model.hf_path or f"{cfg.model.name}/{cfg.model.flavor}"
    print(f"model {name}: {counts.total / 1e9:.3f} B params ({counts.experts / 1e9:.3f} B in experts); "
          f"seq_len={seq} micro_batch={mb} grad_accum={accum} param_dtype={cfg.training.param_dtype}")
    print(format_table(est, f"per-GPU peak memory ({peak}), {topo.describe()} (world {topo.world})"))
    if args.gpu_mem_gb:
        n = gpus or topo.world
        fits = suggest(model_cfg, plan, n, args.gpu_mem_gb, seq, mb, pbytes, encoder_tp=enc, **kw)
        if not fits:
            print(f"\nno topology of {n} GPUs fits {args.gpu_mem_gb} GiB at micro_batch={mb}, seq_len={seq}; "
                  "lower the micro batch or the sequence length, or add GPUs.")
        else:
            print(f"\nsuggested for {n} GPUs x {args.gpu_mem_gb} GiB (best first; 90% headroom):")
            for t, e in fits[:5]:
                print(f"  {t.describe():<60} {e['total'] / GiB:8.2f} GiB")


if __name__ == "__main__":
    main()
