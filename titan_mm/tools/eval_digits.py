"""Held-out accuracy of a Qwen3-VL model on the built-in digits captioning data (greedy decoding through
titan_mm's own forward).

    python -m titan_mm.tools.eval_digits --checkpoint outputs/debug_qwen3_vl_moe [--limit 360]
    python -m titan_mm.tools.eval_digits --hf /path/to/exported_hf_dir --config debug_qwen3_vl_moe.toml

Each held-out record (load_digits index % 5 == 0, 360 images) is tokenized exactly as in training (the
data pipeline's processor and chat template, the run's image resize settings); the prompt is everything
up to the assistant's first answer token, and the model generates greedily (no KV cache: the whole
sequence is re-run per new token, prompts are ~20 tokens) until <|im_end|> or ``max_new_tokens``.
An answer is correct when the generated text, stripped, equals the digit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from titan_mm.data.builtin.images import digits_records
from titan_mm.data.packing import IGNORE_INDEX
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.models.qwen3_vl.model import vision_inputs
from titan_mm.registry import spec_for_config


def _prompts(job_cfg, model_cfg, limit: int | None):
    d = job_cfg.data
    tok = load_tokenizer(d.tokenizer_path)
    proc = Processor(tok, ProcessorConfig(d, spec_for_config(model_cfg).data_needs(model_cfg)))
    out = []
    for rec in digits_records(test=True)[:limit]:
        doc = proc(parse_record(rec))
        first = int(np.nonzero(doc.labels != IGNORE_INDEX)[0][0])  # position that predicts the first answer token
        out.append((doc.input_ids[: first + 1], doc.positions[:, : first + 1], doc.media, rec["answer"]))
    return tok, out


@torch.no_grad()
def generate(model, prompts, eos_id: int, max_new_tokens: int = 3, device="cpu") -> list[list[int]]:
    """Greedy continuation of each (ids [L], positions [3, L], media) prompt; right-padded batch."""
    B = len(prompts)
    L = max(len(p[0]) for p in prompts) + max_new_tokens
    ids = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(3, B, L, dtype=torch.long)
    lens = []
    for i, (pi, pp, _, *_) in enumerate(prompts):
        ids[i, : len(pi)] = torch.as_tensor(pi)
        pos[:, i, : len(pi)] = torch.as_tensor(pp)
        lens.append(len(pi))
    batch = {"input_ids": ids}
    pv = [torch.as_tensor(x) for p in prompts for x in p[2].get("pixel_values", [])]
    gr = [torch.as_tensor(x).view(-1, 3) for p in prompts for x in p[2].get("image_grid_thw", [])]
    if pv:
        batch["pixel_values"] = torch.cat(pv).float()
        batch["image_grid_thw"] = torch.cat(gr).long()
    extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in vision_inputs(model.cfg, batch, device).items()}  # host-built, as the train step does
    vis = {k: batch[k].to(device) for k in ("pixel_values",) if k in batch}
    out_tokens: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for _ in range(max_new_tokens):
        at = torch.tensor(lens, device=device) - 1
        logits = model(ids.to(device), position_ids=pos.to(device), attn=None, logits_at=at, **vis, **extra).logits
        for i in range(B):
            if done[i]:
                continue
            t = lens[i] - 1
            nxt = int(logits[i].argmax())
            out_tokens[i].append(nxt)
            ids[i, t + 1] = nxt
            pos[:, i, t + 1] = pos[:, i, t].max() + 1
            lens[i] += 1
            done[i] = nxt == eos_id
        if all(done):
            break
    return out_tokens


def evaluate(model, job_cfg, limit: int | None = None, batch_size: int = 64, device="cpu", verbose=False) -> dict:
    tok, prompts = _prompts(job_cfg, model.cfg, limit)
    eos = tok._tok.token_to_id("<|im_end|>")
    model.eval()
    correct, t0, examples = 0, time.perf_counter(), []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s : s + batch_size]
        gens = generate(model, chunk, eos, device=device)
        for (_, _, _, ans), g in zip(chunk, gens):
            text = tok._tok.decode([t for t in g if t != eos]).strip()
            correct += text == ans
            if len(examples) < 8:
                examples.append((ans, text))
    n = len(prompts)
    res = {"accuracy": correct / max(n, 1), "correct": correct, "n": n, "eval_s": time.perf_counter() - t0,
           "examples": examples}
    if verbose:
        print(json.dumps(res))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="run folder, checkpoints folder or step folder of a titan_mm run")
    ap.add_argument("--hf", help="an HF model folder (exported) instead of a checkpoint; needs --config")
    ap.add_argument("--config", help="the training TOML (for the data settings) with --hf")
    ap.add_argument("--limit", type=int, default=None, help="evaluate the first N held-out images (default all 360)")
    ap.add_argument("--batch-size", type=int, default=64)
    a = ap.parse_args(argv)
    if bool(a.checkpoint) == bool(a.hf):
        ap.error("give exactly one of --checkpoint or --hf")
    if a.checkpoint:
        from titan_mm.config import load_toml
        from titan_mm.export import load_model_from_checkpoint
        from titan_mm.train.checkpoint import CONFIG_FILE

        model, _, _, ck = load_model_from_checkpoint(a.checkpoint)
        job = load_toml(Path(ck) / CONFIG_FILE)
    else:
        if not a.config:
            ap.error("--hf needs --config (the training TOML, for the image resize settings)")
        from titan_mm.config import load_config
        from titan_mm.export import load_model_from_hf

        job = load_config(["--config", a.config])
        model, _, _ = load_model_from_hf(a.hf)
    res = evaluate(model.float(), job, a.limit, a.batch_size)
    print(f"digits held-out accuracy: {res['accuracy']:.3f} ({res['correct']}/{res['n']}) in {res['eval_s']:.1f}s; "
          f"examples (answer, generated): {res['examples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
