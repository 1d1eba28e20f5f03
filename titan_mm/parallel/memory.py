"""Per-GPU memory estimate for a model config + topology (+ AC), and a topology suggestion.

    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml                      # the config's topology
    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml --tp 2 --ac selective
    python -m titan_mm.parallel.memory --config qwen3_1.7b.toml --gpus 8 --gpu-mem-gb 141   # + suggestion

What is counted (bytes per GPU; fp32 master weights, AdamW, FSDP2 as titan_mm.parallel.apply sets it up):

  params      fp32 shards: TP-sharded matrices / (tp * fsdp), other dense params / fsdp, experts / fsdp
              (experts live on [ep_fsdp, ep] = dp_shard x cp ranks); fsdp = dp_shard * cp (HSDP's
              dp_replicate does not shard).
  grads       same shards as params, fp32 (reduce dtype).
  optimizer   AdamW: two fp32 states per sharded param.
  fsdp buffers unsharded params of two blocks (the current one and the prefetched one) in param dtype,
              plus one block's unsharded gradients in fp32; the root (embedding / head / final norm) too.
  activations per token per block, counted from the saved tensors of this repo's Qwen3 block (norms keep
              fp32 copies; attention stores q, k, v, out, not S x S: flash / efficient / flex kernels),
              tokens per GPU = micro_batch * seq_len / cp; TP divides the head and FFN terms (the residual
              stream is divided too with sequence parallel). AC: none / selective ("op": matmul and
              attention outputs kept) / full (block inputs kept + one block recomputed at a time).
  loss        the chunked cross-entropy: its fp32 [V, D] weight-gradient buffer and a few [chunk, V] fp32
              buffers (divided by tp with loss parallel).

Not modelled: the CUDA context and NCCL buffers (outside torch.cuda.max_memory_allocated), allocator
fragmentation (typically 5-10%), float8 scales, torch.compile's different saved-tensor choices.
"""

from __future__ import annotations

import argparse
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

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} ep={self.ep} "
                f"ac={self.ac}")


@dataclass(frozen=True)
class ParamCounts:
    tp_sharded: int  # dense params split over tp (colwise / rowwise / embedding_rowwise)
    replicated: int  # dense params replicated over tp
    experts: int
    block_dense: int  # dense params of the largest block (for the FSDP working set)
    block_experts: int
    root: int  # params outside the blocks (embedding, head, final norm)

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.experts


def count_params(model_cfg, plan) -> ParamCounts:
    """Count by building the model on the meta device and classifying each parameter by the plan."""
    import fnmatch

    import torch

    build = _build_fn(model_cfg)
    with torch.device("meta"):
        model = build(model_cfg)
    tp_pat = [p for p, s in plan.tp.items() if s in ("colwise", "rowwise", "embedding_rowwise")]
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
    bd = max((v[0] for v in per_block.values()), default=0)
    be = max((v[1] for v in per_block.values()), default=0)
    return ParamCounts(tp, rep, ex, bd, be, root)


def _build_fn(model_cfg):
    from titan_mm.registry import get_model_spec

    mt = getattr(model_cfg, "model_type", None)
    for name in ([mt] if isinstance(mt, str) else []) + ["qwen3", "qwen3_moe"]:
        try:
            spec = get_model_spec(name)
        except Exception:  # noqa: BLE001 - try the next family name
            continue
        if isinstance(model_cfg, spec.config_cls):
            return spec.build
    raise ValueError(f"no registered model family builds a {type(model_cfg).__name__}.")


def _g(cfg, name, default=0):
    return getattr(cfg, name, default) or default


def activation_bytes_per_token(model_cfg, topo: Topology, act_bytes: int) -> tuple[float, float, float]:
    """(bytes per token kept per block, bytes per token of one block's full activations, head/loss per token)."""
    a = act_bytes
    D = _g(model_cfg, "hidden_size")
    H = _g(model_cfg, "num_attention_heads")
    G = _g(model_cfg, "num_key_value_heads", H)
    K = _g(model_cfg, "head_dim", D // max(H, 1))
    F = _g(model_cfg, "intermediate_size")
    E = _g(model_cfg, "num_experts")
    k = _g(model_cfg, "num_experts_per_tok", 1)
    Fm = _g(model_cfg, "moe_intermediate_size")
    t = topo.tp
    st = t if topo.sp else 1  # sequence parallel divides the residual-stream (D) terms
    norm = (4 * D + 2 * a * D) / st  # fp32 upcast + input + output
    attn = a * (H + 2 * G) * K / t + (4 + a) * (H + G) * K / t + a * (H + G) * K / t + a * H * K / t
    if E:
        ffn = 8 * E + k * a * (4 * D + 4 * Fm)
        ffn_sel = 4 * E + k * a * (2 * Fm + D) + a * D
    else:
        ffn = 4 * a * F / t
        ffn_sel = 2 * a * F / t + a * D
    full = 2 * norm + attn + ffn
    selective = a * D / st + a * (H + 2 * G) * K / t + a * H * K / t + a * D / st + ffn_sel
    kept = {"none": full, "selective": selective, "full": a * D / st}[topo.ac]
    head = norm + a * D  # final norm + its (gathered) output / grad
    return kept, full, head


def estimate(model_cfg, plan, topo: Topology, seq_len: int, micro_batch: int, param_dtype_bytes: int = 2,
             counts: ParamCounts | None = None) -> dict[str, float]:
    """Bytes per GPU by category (see the module docstring) and their total."""
    c = counts or count_params(model_cfg, plan)
    f, t = topo.fsdp, topo.tp
    sharded = c.tp_sharded / (t * f) + c.replicated / f + c.experts / f
    params = 4 * sharded
    grads = 4 * sharded
    optim = 8 * sharded
    unsharded_block = c.block_dense / t + c.block_experts / max(topo.ep, 1)
    fsdp_buf = unsharded_block * (2 * param_dtype_bytes + 4) + c.root * param_dtype_bytes / max(1, t)
    if f == 1 and topo.dp_replicate == 1 and param_dtype_bytes == 4:
        fsdp_buf = 0.0  # no FSDP: params are used in place
    tokens = micro_batch * seq_len / topo.cp
    L = _g(model_cfg, "num_hidden_layers")
    kept, full, head = activation_bytes_per_token(model_cfg, topo, param_dtype_bytes)
    acts = tokens * (L * kept + (full if topo.ac != "none" else 0) + head)
    V = _g(model_cfg, "vocab_size")
    D = _g(model_cfg, "hidden_size")
    chunk = min(int(_g(model_cfg, "loss_chunk_size", 4096)), int(tokens))
    vt = t if (t > 1 and plan.loss_parallel) else 1  # loss parallel splits the vocabulary
    loss = (4 * V * D + 3 * 4 * chunk * V) / vt
    out = {"params": params, "grads": grads, "optimizer": optim, "fsdp_buffers": fsdp_buf, "activations": acts,
           "loss": loss}
    out["total"] = sum(out.values())
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(model_cfg, plan, n_gpus: int, gpu_mem_gb: float, seq_len: int, micro_batch: int,
            param_dtype_bytes: int = 2, headroom: float = 0.9) -> list[tuple[Topology, dict[str, float]]]:
    """Topologies that fit ``headroom * gpu_mem_gb``, best first (no AC before selective before full, then
    the smallest tp, then the smallest cp, then the largest ep)."""
    c = count_params(model_cfg, plan)
    H = _g(model_cfg, "num_attention_heads")
    G = _g(model_cfg, "num_key_value_heads", H)
    E = _g(model_cfg, "num_experts")
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
                    topo = Topology(1, ds, cp, tp, ep, ac, bool(plan.sequence_parallel))
                    est = estimate(model_cfg, plan, topo, seq_len, micro_batch, param_dtype_bytes, c)
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
    ap.add_argument("--no-sp", action="store_true", help="estimate without sequence parallel")
    ap.add_argument("--seq-len", type=int, default=None, help="override data.seq_len")
    ap.add_argument("--micro-batch", type=int, default=None, help="override data.micro_batch_size")
    ap.add_argument("--gpus", type=int, default=None, help="GPU count (default: the topology's world size)")
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory in GiB: also suggest topologies")
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
    topo = Topology(dp_r, ds, cp, tp, ep, pick(args.ac, cfg.activation_checkpoint.mode), sp)
    seq = pick(args.seq_len, cfg.data.seq_len)
    mb = pick(args.micro_batch, cfg.data.micro_batch_size)
    pbytes = 2 if cfg.training.param_dtype == "bfloat16" else 4
    counts = count_params(model_cfg, plan)
    est = estimate(model_cfg, plan, topo, seq, mb, pbytes, counts)
    name = cfg.model.hf_path or f"{cfg.model.name}/{cfg.model.flavor}"
    print(f"model {name}: {counts.total / 1e9:.3f} B params ({counts.experts / 1e9:.3f} B in experts); "
          f"seq_len={seq} micro_batch={mb} param_dtype={cfg.training.param_dtype}")
    print(format_table(est, f"per-GPU memory, {topo.describe()} (world {topo.world})"))
    if args.gpu_mem_gb:
        n = gpus or topo.world
        fits = suggest(model_cfg, plan, n, args.gpu_mem_gb, seq, mb, pbytes)
        if not fits:
            print(f"\nno topology of {n} GPUs fits {args.gpu_mem_gb} GiB at micro_batch={mb}, seq_len={seq}; "
                  "lower the micro batch or the sequence length, or add GPUs.")
        else:
            print(f"\nsuggested for {n} GPUs x {args.gpu_mem_gb} GiB (best first; 90% headroom):")
            for t, e in fits[:5]:
                print(f"  {t.describe():<60} {e['total'] / GiB:8.2f} GiB")


if __name__ == "__main__":
    main()
