"""Evaluate a saved checkpoint with the tasks and held-out sources of online eval (docs/eval.md).

    python -m titan_mm.eval --checkpoint outputs/debug_qwen3_vl                  # newest checkpoint, the run's [eval]
    python -m titan_mm.eval --checkpoint outputs/debug_qwen3_vl --step 8 --tasks digits
    python -m titan_mm.eval --checkpoint /tmp/hf_export --config debug_qwen3_vl.toml --tasks digits qa

A titan_mm checkpoint is built as its run built it (its saved config.toml, one process) and loaded from DCP; an
HF folder (config.json + safetensors) takes the data and eval settings of --config. The metrics are those the
trainer logs at an eval step (eval/<name>/<metric>), printed as one JSON object (and written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from titan_mm.config import ConfigError, check_mixture
    from titan_mm.train.checkpoint import CheckpointError

    ap = argparse.ArgumentParser(prog="python -m titan_mm.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a run folder, its checkpoints folder, a step folder, or an "
                    "HF model folder")
    ap.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest that verifies)")
    ap.add_argument("--config", help="HF folders: the training TOML whose [data] and [eval] apply")
    ap.add_argument("--tasks", nargs="*", help="replaces eval.tasks (digits, qa, FILE.jsonl[|pkg.mod:fn])")
    ap.add_argument("--dataset", help="replaces the held-out sources (eval.dataset)")
    ap.add_argument("--mixture", help="replaces the held-out sources: a JSON object {source: weight}")
    ap.add_argument("--max-batches", type=int, help="eval.max_batches")
    ap.add_argument("--task-limit", type=int, help="eval.task_limit")
    ap.add_argument("--device", help="job.device (default: the run's)")
    ap.add_argument("--out", help="also write the metrics JSON here")
    a = ap.parse_args(argv)
    try:
        cfg, ck = _config(a)
        e = cfg.eval
        if a.tasks is not None:
            e.tasks = a.tasks
        if a.dataset is not None or a.mixture is not None:
            e.dataset, e.mixture = a.dataset or "", json.loads(a.mixture) if a.mixture else {}
            check_mixture(e.mixture, "--mixture")
        e.max_batches = e.max_batches if a.max_batches is None else a.max_batches
        e.task_limit = e.task_limit if a.task_limit is None else a.task_limit
        if a.device:
            cfg.job.device = a.device
        if not (e.tasks or e.dataset or e.mixture):
            raise ConfigError("nothing to evaluate: the run has no [eval] tasks or sources; pass --tasks and/or "
                              "--dataset")
        out = evaluate(cfg, ck)
    except (ConfigError, CheckpointError, json.JSONDecodeError) as err:
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(out, sort_keys=True)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


def _config(a):
    """(JobConfig, checkpoint step folder or None for an HF folder) of the command line."""
    from titan_mm.config import ConfigError, JobConfig, load_config
    from titan_mm.export import checkpoint_config
    from titan_mm.train.checkpoint import resolve_checkpoint, resolve_verified, step_dir_name

    p = Path(a.checkpoint)
    if (p / "config.json").is_file():
        if a.step is not None:
            raise ConfigError("--step picks a titan_mm checkpoint; an HF folder holds one set of weights")
        cfg = load_config(["--config", a.config]) if a.config else JobConfig()
        cfg.model.hf_path, cfg.model.init_from_hf = str(p), True
        return cfg, None
    if a.config:
        raise ConfigError("--config is for HF folders; a titan_mm checkpoint carries its own config.toml")
    if a.step is not None:
        ck = resolve_checkpoint(p).parent / step_dir_name(a.step)
        if not ck.is_dir():
            raise ConfigError(f"{ck} does not exist; pick a step that was saved (ls {ck.parent})")
        ck = resolve_verified(ck)
    else:
        ck = resolve_verified(p)
    return checkpoint_config(ck), ck


def evaluate(cfg, ck: Path | None) -> dict:
    """Build the run's model in this process (world 1), load the checkpoint, and score every task and source."""
    from titan_mm.eval.evaluator import Evaluator
    from titan_mm.train.checkpoint import load_model_weights
    from titan_mm.train.setup import setup

    run = setup(cfg)
    step = load_model_weights(run.model, ck) if ck is not None else 0
    metrics = Evaluator(cfg, run)(step, tasks=True)
    return {"step": step, "checkpoint": str(ck or cfg.model.hf_path), **metrics}


if __name__ == "__main__":
    sys.exit(main())
