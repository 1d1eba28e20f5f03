"""The held-out check of Wan's moving-digits debug task (titan_mm.models.wan.digits, docs/wan.md "Digits debug
task"): clips sampled through the training forward for held-out (digit, direction) prompts, each right when a
digit classifier reads the prompt's digit in its frames and the intensity centroids move in the prompt's direction.

    OMP_NUM_THREADS=1 python -m titan_mm.launch.train --config debug_wan_digits.toml
    python -m titan_mm.tools.wan_digits --model outputs/debug_wan_digits [--prompts 40] [--steps 20] [--shift 3] \\
        [--guidance-scale 6] [--gif clips.gif] [--out scores.json]

``--model``: the run (its newest checkpoint), a checkpoint or step folder, or an exported folder of the digits
flavor. Prints the share of right clips (the task's bar: 0.70), of right digits and of right directions, and the
scorer's own share on the held-out digits' real clips (its ceiling). ``--gif``: 8 clips side by side (digits 0-7, the
directions in turn: digits.showcase).
Every mistake is one line and exit status 2, before the model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError
from titan_mm.loader import load_model
from titan_mm.models.wan import WanModel
from titan_mm.models.wan import digits
from titan_mm.models.wan.sample import check_sampling, write_gif

TARGET = 0.70
"""Issue 48's bar: the share of held-out clips whose digit and direction are both right."""


def check_args(a: argparse.Namespace) -> None:
    check_sampling(a.steps, a.shift, a.guidance_scale)
    digits.prompts(a.prompts)
    if a.gif and Path(a.gif).suffix.lower() != ".gif":
        raise ValueError(f"--gif {a.gif}: name a *.gif file")
    if a.out and Path(a.out).suffix.lower() != ".json":
        raise ValueError(f"--out {a.out}: name a *.json file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.wan_digits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="run / checkpoint folder of the digits flavor")
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts (1 to 360)")
    ap.add_argument("--steps", type=int, default=20, help="Euler steps")
    ap.add_argument("--shift", type=float, default=3.0,
                    help="timestep shift of the sigmas (3: debug_wan_digits.toml's objective.flow_shift)")
    ap.add_argument("--guidance-scale", type=float, default=6.0, help="classifier-free guidance; <= 1: off")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    ap.add_argument("--gif", default=None, help="write 8 clips (digits 0-7, the directions in turn) side by side to this GIF")
    ap.add_argument("--out", default=None, help="write the scores to this JSON file")
    a = ap.parse_args(argv)
    try:
        check_args(a)
        got = load_model(a.model)
        if not isinstance(got.model, WanModel) or got.model_cfg.synthetic != "digits":
            raise ValueError(f"--model {a.model} is not a Wan model of the digits task (model.flavor = \"digits\")")
    except (ValueError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res, frames = digits.evaluate(got.model, a.prompts, steps=a.steps, shift=a.shift,
                                  guidance_scale=a.guidance_scale, seed=a.seed)
    res |= {"reference": digits.reference_score(a.prompts), "target": TARGET, "sampling_steps": a.steps, "shift": a.shift,
            "guidance_scale": a.guidance_scale, "seed": a.seed}
    print(f"[titan_mm] digits held-out: {res['accuracy']:.3f} of {res['clips']} clips right (digit "
          f"{res['digit_accuracy']:.3f}, direction {res['direction_accuracy']:.3f}; target {TARGET}); the scorer on "
          f"real clips: {res['reference']['accuracy']:.3f}")
    if a.gif:
        write_gif(digits.strip(frames[digits.showcase(a.prompts)]), a.gif, fps=2)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
