"""The BAGEL digits debug task's held-out scores (titan_mm.models.bagel.digits; docs/bagel.md "Digits debug task"):
understanding by exact match of the greedy answer on the 360 held-out images, generation read as asked by a
classifier trained on the digits' training split.

    python -m titan_mm.tools.bagel_digits --model outputs/debug_bagel_digits [--per-digit 10] [--limit N] \\
        [--png grid.png] [--out scores.json]

``--model``: a BAGEL run (or checkpoint) trained on builtin:digits (train_configs/debug_bagel_digits.toml). Every
mistake is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError
from titan_mm.data.builtin.images import digits_records
from titan_mm.loader import load_model
from titan_mm.models.bagel import BagelModel
from titan_mm.models.bagel.data import BagelDocs
from titan_mm.models.bagel.digits import SAMPLER, evaluate, grid
from titan_mm.models.bagel.sample import write_png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.bagel_digits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a BAGEL run (or checkpoint) trained on builtin:digits")
    ap.add_argument("--per-digit", type=int, default=10, help="images generated per digit")
    ap.add_argument("--limit", type=int, default=None, help="held-out images asked (default: all 360)")
    ap.add_argument("--seed", type=int, default=0, help="the generation noise's seed")
    ap.add_argument("--png", default=None, help="write the generated images here, a row per digit")
    ap.add_argument("--out", default=None, help="write the scores here (JSON)")
    a = ap.parse_args(argv)
    try:
        if a.per_digit < 1 or (a.limit is not None and a.limit < 1):
            raise ValueError(f"--per-digit {a.per_digit} / --limit {a.limit}: give counts >= 1")
        got = load_model(a.model)
        if not isinstance(got.model, BagelModel):
            raise ValueError(f"--model {a.model} holds a {got.spec.name} model; give a BAGEL run trained on "
                             "builtin:digits (train_configs/debug_bagel_digits.toml)")
        docs = BagelDocs(got.model_cfg, got.data, got.tokenizer, got.job.training.seed if got.job else 0)
        s = evaluate(got.model, docs, limit=a.limit, per_digit=a.per_digit, seed=a.seed, **SAMPLER)
    except (ValueError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.png:
        write_png(grid(s.images), a.png)
    res = {"understanding": s.understanding, "generation": s.generation, "read": s.read,
           "held_out_images": a.limit or len(digits_records(test=True)), "per_digit": a.per_digit, "seed": a.seed,
           "sampler": SAMPLER}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    print(json.dumps({k: res[k] for k in ("understanding", "generation")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
