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

from titan_mm.checkpoint_io import CheckpointError, resolve_checkpoint, step_dir_name
from titan_mm.config import ConfigError, JobConfig, check_mixture, load_config
from titan_mm.eval.evaluator import Evaluator, read_tasks
from titan_mm.loader import Source, load_weights, resolve_source
from titan_mm.train.setup import setup


def main(argv: list[str] | None = None) -> int:
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
        cfg, src = _config(a)
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
        out = evaluate(cfg, src)
    except (ConfigError, CheckpointError, json.JSONDecodeError) as err:
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(out, sort_keys=True)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


def _config(a) -> tuple[JobConfig, Source | None]:
    """(JobConfig, the checkpoint; None for an HF folder, whose weights setup loads as model.hf_path)."""
    p = Path(a.checkpoint)
    if a.step is not None:
        if (p / "config.json").is_file():
            raise ConfigError("--step picks a titan_mm checkpoint; an HF folder holds one set of weights")
        ck = resolve_checkpoint(p).parent / step_dir_name(a.step)
        if not ck.is_dir():
            raise ConfigError(f"{ck} does not exist; pick a step that was saved (ls {ck.parent})")
        p = ck
    src = resolve_source(p)
    if src.is_hf:
        cfg = load_config(["--config", a.config]) if a.config else JobConfig()
        cfg.model.hf_path, cfg.model.init_from_hf = str(src.path), True
        return cfg, None
    if a.config:
        raise ConfigError("--config is for HF folders; a titan_mm checkpoint carries its own config.toml")
    return src.job, src


def evaluate(cfg: JobConfig, src: Source | None) -> dict:
    """Build the run's model in this process (world 1), load the checkpoint, and score every task and source."""
    tasks = read_tasks(cfg)  # a bad task fails before the build
    run = setup(cfg)
    step = load_weights(run.model, run.spec, src) if src is not None else 0
    metrics = Evaluator(cfg, run, tasks)(step, tasks=True)
    return {"step": step, "checkpoint": str(src.path if src is not None else cfg.model.hf_path), **metrics}


if __name__ == "__main__":
    sys.exit(main())
