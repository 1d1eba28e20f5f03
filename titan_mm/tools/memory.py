"""Per-GPU peak memory of a training config, and the topologies that fit (the estimator:
titan_mm/parallel/memory.py; docs/parallel.md, "Memory estimator").

    python -m titan_mm.tools.memory --config qwen3_1.7b.toml                      # the config's topology
    python -m titan_mm.tools.memory --config qwen3_1.7b.toml --tp 2 --ac selective
    python -m titan_mm.tools.memory --config qwen3_1.7b.toml --gpus 8 --gpu-mem-gb 141   # + suggestion
    python -m titan_mm.tools.memory --config qwen3_1.7b.toml --data.seq_len 8192  # any job-config key

The model is resolved as the trainer resolves it on a GPU (model.attn_backend auto = flex; kernels on
unless kernels.mode = reference). Flags this tool does not know go to the job config (titan_mm.config), as
they do for the trainer. Only config.json of model.hf_path is read (a local folder or a Hub id); when the
folder does not exist yet, the estimate uses model.name / model.flavor and says so.
"""

from __future__ import annotations

import argparse

from titan_mm.config import ConfigError, load_config
from titan_mm.dtypes import torch_dtype
from titan_mm.models.hf_io import HFPathNotFound, local_hf_dir
from titan_mm.parallel.apply import one_rank_cast
from titan_mm.parallel.memory import GiB, Topology, count_params, estimate_phases, format_table, peak_phase, suggest
from titan_mm.registry import SpecError, resolve_model


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.memory", description=__doc__.split("\n\n")[0],
                                 epilog="Other --section.key flags override the job config (run_train.sh --help).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--config", required=True, help="a TOML in train_configs/ or a path")
    for name in ("dp-replicate", "dp-shard", "cp", "tp", "ep", "pp"):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"override parallel.{name.replace('-', '_')}")
    ap.add_argument("--ac", choices=("none", "selective", "full"), default=None, help="override activation_checkpoint.mode")
    ap.add_argument("--reshard", choices=("always", "never"), default=None,
                    help="override parallel.fsdp_reshard_after_forward")
    ap.add_argument("--no-sp", action="store_true", help="estimate without sequence parallel")
    ap.add_argument("--encoder-tp", action="store_true", help="modality encoders sharded over tp "
                    "(default: parallel.encoder_tp of the config)")
    ap.add_argument("--seq-len", type=int, default=None, help="override data.seq_len")
    ap.add_argument("--micro-batch", type=int, default=None, help="override data.micro_batch_size")
    ap.add_argument("--gpus", type=int, default=None, help="GPU count (default: the topology's world size)")
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory in GiB: also suggest topologies")
    ap.add_argument("--vision-patches", type=int, default=0,
                    help="vision-encoder patches per micro-batch (0: encoder activations not counted)")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args, rest = ap.parse_known_args(argv)

    try:
        cfg = load_config(["--config", args.config, *rest])
        m = cfg.model
        hf_path = m.hf_path
        if hf_path:
            try:
                local_hf_dir(hf_path)
            except HFPathNotFound as e:  # a recipe for a model not fetched yet: its flavor has the shapes
                print(f"{e}; estimating {m.name}/{m.flavor} (model.name / model.flavor) instead")
                hf_path = None
        spec, model_cfg = resolve_model(
            m.name, m.flavor, hf_path, m.overrides,
            attn_backend="flex" if m.attn_backend == "auto" else m.attn_backend,
            kernels=False if cfg.kernels.mode == "reference" else cfg.kernels.ops)
    except (ConfigError, SpecError) as e:
        ap.error(str(e))
    if spec.memory_terms is None:
        ap.error(f"the {spec.name} family declares no activation terms (ModelSpec.memory_terms), so its memory "
                 "cannot be estimated yet; measure a short run's peak instead (metrics.jsonl: mem_peak_gb)")
    plan = spec.plan(model_cfg)
    p = cfg.parallel
    pick = lambda a, d: d if a is None else a  # noqa: E731
    dp_r, cp, tp, ep = pick(args.dp_replicate, p.dp_replicate), pick(args.cp, p.cp), pick(args.tp, p.tp), pick(args.ep, p.ep)
    ds = pick(args.dp_shard, p.dp_shard)
    pp = pick(args.pp, p.pp)
    gpus = args.gpus
    if ds == -1:
        ds = max(1, (gpus or dp_r * cp * tp * pp) // (dp_r * cp * tp * pp))
    sp = p.sequence_parallel and not args.no_sp and bool(plan.sequence_parallel)
    enc = bool(args.encoder_tp or p.encoder_tp) and bool(plan.encoder_tp)
    reshard = pick(args.reshard, str(p.fsdp_reshard_after_forward))
    if one_rank_cast(dp_r * ds * cp * tp * pp, cfg, torch_dtype(cfg.training.param_dtype), pipelined=pp > 1):
        reshard = "never"  # the one-rank cast path (titan_mm.parallel.apply) holds every copy as never does
    topo = Topology(dp_r, ds, cp, tp, ep, pick(args.ac, cfg.activation_checkpoint.mode), sp, enc,
                    int(cfg.activation_checkpoint.num_layers), reshard,
                    pp, p.pp_schedule, p.pp_virtual_stages, 0, tuple(p.pp_layers_per_stage), tuple(p.pp_split_points),
                    p.fsdp_prefetch)
    seq = pick(args.seq_len, cfg.data.seq_len)
    mb = pick(args.micro_batch, cfg.data.micro_batch_size)
    pbytes = 4 if cfg.training.param_dtype == "float32" else 2  # bfloat16 / float16
    counts = count_params(model_cfg, plan, enc)
    kw = dict(compile=bool(cfg.compile.enable), float8=bool(cfg.float8.enable), vision_patches=args.vision_patches)
    per_pass = mb * dp_r * ds  # rows per micro-batch over the data-parallel ranks
    accum = max(1, (cfg.training.global_batch_size or per_pass * max(1, p.pp_microbatches)) // per_pass)
    phases = estimate_phases(model_cfg, plan, topo, seq, mb, pbytes, counts, grad_accum=accum, **kw)
    peak = peak_phase(phases)
    est = phases[peak]
    name = hf_path or f"{m.name}/{m.flavor}"
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
