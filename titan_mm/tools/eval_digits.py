"""Held-out accuracy of a vision-language model on the built-in digits captioning data: the eval task ``digits``
(titan_mm.eval.tasks), decoded greedily by the serving engine on the loaded weights.

    python -m titan_mm.tools.eval_digits --checkpoint outputs/debug_qwen3_vl_moe [--limit 360]
    python -m titan_mm.tools.eval_digits --hf /path/to/exported_hf_dir --config debug_qwen3_vl_moe.toml

Each held-out record (360 images) is rendered as in training (the run's chat template and image resize settings)
and ends with the assistant's turn opened; the engine generates up to 3 tokens, stopping at <|im_end|> /
<|endoftext|>. An answer is correct when the generated text, stripped, equals the digit.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError, JobConfig, load_config
from titan_mm.eval.evaluator import engine_texts, eval_engine
from titan_mm.eval.tasks import load_task
from titan_mm.loader import Loaded, load_model

MAX_NEW_TOKENS = 3  # a digit, <|im_end|>, and one more to see a model that does not stop


def evaluate(got: Loaded, job: JobConfig, limit: int | None = None, device: torch.device | str = "cpu") -> dict:
    """{"accuracy", "correct", "n", "eval_s", "examples": [(answer, generated)] of the first 8}."""
    task = load_task("digits", limit or 0)
    t0 = time.perf_counter()
    engine = eval_engine(got.model, got.spec, got.model_cfg, got.tokenizer, torch.device(device), job.data)
    texts = engine_texts(engine, task.items, MAX_NEW_TOKENS)
    answers = [it["reference"] for it in task.items]
    correct = sum(t is not None and t.strip() == a for t, a in zip(texts, answers))
    n = len(answers)
    return {"accuracy": correct / max(n, 1), "correct": correct, "n": n, "eval_s": time.perf_counter() - t0,
            "examples": [(a, (t or "").strip()) for a, t in zip(answers[:8], texts)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="run folder, checkpoints folder or step folder of a titan_mm run")
    ap.add_argument("--hf", help="an HF model folder (exported) instead of a checkpoint; needs --config")
    ap.add_argument("--config", help="the training TOML (for the data settings) with --hf")
    ap.add_argument("--limit", type=int, default=None, help="evaluate the first N held-out images (default all 360)")
    a = ap.parse_args(argv)
    if bool(a.checkpoint) == bool(a.hf):
        ap.error("give exactly one of --checkpoint or --hf")
    if a.hf and not a.config:
        ap.error("--hf needs --config (the training TOML, for the image resize settings)")
    try:
        got = load_model(a.checkpoint or a.hf)
        res = evaluate(got, got.job or load_config(["--config", a.config]), a.limit)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"digits held-out accuracy: {res['accuracy']:.3f} ({res['correct']}/{res['n']}) in {res['eval_s']:.1f}s; "
          f"examples (answer, generated): {res['examples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
