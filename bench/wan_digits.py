"""Wan's moving-digits debug task end to end (docs/wan.md "Digits debug task"): train debug_wan_digits.toml through
the launcher, then the held-out check of python -m titan_mm.tools.wan_digits.

    OMP_NUM_THREADS=1 python bench/wan_digits.py [--steps 1500] [--prompts 400] [--gif docs/images/wan_digits.gif] \\
        [--out bench/results/wan_digits_cpu.json]

Records the training wall time and the loss at every logged step, the share of held-out prompts' clips right
(digit and direction both), of right digits and of right directions, and the scorer's own share on real held-out
clips (its ceiling), with the sampling settings. Wall times are of the shared CPU named in the row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.debug_task import cpu_device, train_run  # noqa: E402
from titan_mm.tools.wan_digits import main as check  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the config's)")
    ap.add_argument("--prompts", type=int, default=400, help="held-out prompts scored")
    ap.add_argument("--sampling", nargs="*", default=[], help="extra flags of titan_mm.tools.wan_digits")
    ap.add_argument("--gif", default=None, help="also write 8 clips (tools.wan_digits --gif) to this GIF")
    ap.add_argument("--run", default=None, help="a folder for the run (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/wan_digits_cpu.json"))
    a = ap.parse_args()
    folder = a.run or tempfile.mkdtemp(prefix="wan_digits_")
    train_s, metrics = train_run("debug_wan_digits", Path(folder), a.steps)
    losses = {s: round(r["loss"], 4) for s, r in metrics.items()}
    scores = os.path.join(folder, "scores.json")
    t0 = time.perf_counter()
    if check(["--model", os.path.join(folder, "run"), "--prompts", str(a.prompts), "--out", scores, *a.sampling,
              *(["--gif", a.gif] if a.gif else [])]) != 0:
        sys.exit("the held-out check failed")
    with open(scores) as fh:
        res = json.load(fh)
    out = {"question": "does the tiny Wan transformer learn the moving-digits task on a CPU: the share of held-out "
                       "prompts' sampled clips with the asked digit and direction (target >= 0.70)",
           "device": cpu_device(),
           "command": "OMP_NUM_THREADS=1 python bench/wan_digits.py " + " ".join(sys.argv[1:]),
           "train_steps": max(losses), "train_s": round(train_s, 1), "check_s": round(time.perf_counter() - t0, 1),
           "loss": losses, **res}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(json.dumps({k: v for k, v in out.items() if k != "loss"}, indent=1))


if __name__ == "__main__":
    main()
