"""Exact-match accuracy of a diffusion LM on the built-in text QA (``builtin:qa_test``, 360 held-out questions),
sampled with titan_mm's own forward (titan_mm.serve.dllm_sample).

    python -m titan_mm.tools.eval_dllm --checkpoint outputs/debug_dllm_qwen3              # newest checkpoint
    python -m titan_mm.tools.eval_dllm --checkpoint outputs/debug_dllm_qwen3 --all        # every kept checkpoint
    python -m titan_mm.tools.eval_dllm --hf /tmp/dllm_hf --config debug_dllm_qwen3.toml   # an exported folder

Each question is rendered exactly as in training (the run's processor and chat template); the prompt is every token
before the first answer token. The canvas is ``--gen-length`` masks (default 4: the QA's three digits and
<|im_end|>), denoised in ``--steps`` steps per block. An answer is correct when the text before the first stop token
(<|im_end|> / <|endoftext|>), stripped, equals the record's answer. The objective (kind, mask token, block size)
comes from the run's config, or from ``titan_mm_objective`` in an exported config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from titan_mm.checkpoint_io import CheckpointError, list_checkpoints
from titan_mm.config import ConfigError, load_config
from titan_mm.data.builtin import builtin_records
from titan_mm.data.packing import IGNORE_INDEX
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.loader import load_model
from titan_mm.objectives.diffusion import build_diffusion, objective_from_hf, run_tokenizer
from titan_mm.serve.dllm_sample import sample


def qa_prompts(job_cfg, spec, model_cfg, limit: int | None = None):
    """(tokenizer, [(prompt ids, answer)]) of the held-out QA, tokenized as the run's data pipeline does."""
    tok = run_tokenizer(job_cfg)
    proc = Processor(tok, ProcessorConfig(job_cfg.data, spec.data_needs(model_cfg)))
    out = []
    for rec in builtin_records("qa_test")[:limit]:
        doc = proc(parse_record(rec))
        first = int(np.nonzero(doc.labels != IGNORE_INDEX)[0][0])  # the position that predicts the answer's first token
        out.append((doc.input_ids[: first + 1].tolist(), rec["answer"]))
    return tok, out


def evaluate(model, objective, job_cfg, spec, model_cfg, limit: int | None = None, gen_length: int = 4,
             steps: int = 4, block_length: int | None = None, batch_size: int = 64) -> dict:
    tok, prompts = qa_prompts(job_cfg, spec, model_cfg, limit)
    stop = tuple(i for i in (tok.im_end_id, tok.endoftext_id) if i is not None)
    model.eval()
    t0, correct, examples = time.perf_counter(), 0, []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s: s + batch_size]
        gens = sample(model, [p for p, _ in chunk], objective, gen_length, steps, block_length, stop_ids=stop)
        for (_, ans), g in zip(chunk, gens):
            text = tok.decode([t for t in g if t != objective.mask_id]).strip()
            correct += text == ans
            if len(examples) < 6:
                examples.append((ans, text))
    n = len(prompts)
    return {"accuracy": correct / max(n, 1), "correct": correct, "n": n, "eval_s": time.perf_counter() - t0,
            "examples": examples}


def _checkpoint_runs(path: str, every: bool):
    p = Path(path)
    for sub in (p / "checkpoints", p):
        cks = list_checkpoints(sub) if sub.is_dir() else []
        if cks:
            return cks if every else cks[-1:]
    return [p]  # a step folder itself


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="run folder, checkpoints folder or step folder of a titan_mm run")
    ap.add_argument("--all", action="store_true", help="with --checkpoint: evaluate every kept checkpoint")
    ap.add_argument("--hf", help="an exported HF folder (config.json with titan_mm_objective); needs --config")
    ap.add_argument("--config", help="the training TOML (data settings: chat template) with --hf")
    ap.add_argument("--limit", type=int, default=None, help="the first N held-out questions (default all 360)")
    ap.add_argument("--gen-length", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    ap.add_argument("--block-length", type=int, default=None, help="semi-autoregressive blocks (masked / shifted)")
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args(argv)
    if bool(a.checkpoint) == bool(a.hf):
        ap.error("give exactly one of --checkpoint or --hf")
    runs = []
    try:
        if a.checkpoint:
            for ck in _checkpoint_runs(a.checkpoint, a.all):
                got = load_model(ck)
                runs.append((got.path.name, got.model, build_diffusion(got.job, got.spec, got.model_cfg), got.job,
                             got.spec, got.model_cfg))
        else:
            if not a.config:
                ap.error("--hf needs --config (the training TOML, for the chat template)")
            job = load_config(["--config", a.config])
            got = load_model(a.hf)
            runs.append((a.hf, got.model, objective_from_hf(got.path), job, got.spec, got.model_cfg))
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, model, obj, job, spec, model_cfg in runs:
        if obj is None:
            print(f"error: {name} was trained with the causal objective; eval_dllm samples diffusion LMs",
                  file=sys.stderr)
            return 2
        res = evaluate(model.float(), obj, job, spec, model_cfg, a.limit, a.gen_length, a.steps, a.block_length,
                       a.batch_size)
        print(json.dumps({"checkpoint": str(name), "objective": obj.kind, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
