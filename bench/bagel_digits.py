"""BAGEL's digits debug task end to end (docs/bagel.md "Digits debug task"): train debug_bagel_digits.toml through
the launcher, then the held-out scores of python -m titan_mm.tools.bagel_digits at every checkpoint.

    OMP_NUM_THREADS=1 python bench/bagel_digits.py [--steps N] [--per-digit 10] [--png docs/images/bagel_digits.png] \\
        [--out bench/results/bagel_digits_cpu.json]

Records the training wall time, the CE and MSE at every logged step, and per checkpoint the held-out understanding
(exact match over the 360 held-out images) and generation (the share of --per-digit images per digit that the
classifier reads as asked), with the sampler's settings and the classifier's own score on the held-out originals
(its ceiling). Wall times are of the shared CPU named in the row.
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

import numpy as np  # noqa: E402

from bench.debug_task import cpu_device, train_run  # noqa: E402
from titan_mm.data.builtin.images import digits_data  # noqa: E402
from titan_mm.models.bagel.digits import classifier, held_out  # noqa: E402
from titan_mm.tools.bagel_digits import main as score  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the config's)")
    ap.add_argument("--per-digit", type=int, default=10, help="images generated per digit")
    ap.add_argument("--png", default=None, help="also write the last checkpoint's images here, a row per digit")
    ap.add_argument("--run", default=None, help="a folder for the run (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/bagel_digits_cpu.json"))
    a = ap.parse_args()
    folder = Path(a.run or tempfile.mkdtemp(prefix="bagel_digits_"))
    train_s, metrics = train_run("debug_bagel_digits", folder, a.steps, "--checkpoint.keep_last", "10")
    curve = {s: {"ce": round(r["loss/ce"], 4), "mse": round(r["loss/mse"], 4)} for s, r in metrics.items()}
    scores, t0 = {}, time.perf_counter()
    steps = sorted(folder.glob("run/checkpoints/step-*"))
    for ck in steps:
        out = folder / f"{ck.name}.json"
        png = a.png if ck == steps[-1] else None
        if score(["--model", str(ck), "--per-digit", str(a.per_digit), "--out", str(out),
                  *(["--png", png] if png else [])]) != 0:
            sys.exit(f"scoring {ck} failed")
        scores[int(ck.name.split("-")[1])] = json.loads(out.read_text())
    images, target = digits_data()
    test = np.array([held_out(i) for i in range(len(target))])
    last = scores[max(scores)]
    res = {"question": "does the tiny BAGEL learn the digits asked both ways on a CPU: held-out understanding by "
                       "exact match (target >= 0.90), generated digits read as asked (target >= 0.80)",
           "device": cpu_device(),
           "command": "OMP_NUM_THREADS=1 python bench/bagel_digits.py " + " ".join(sys.argv[1:]),
           "steps": max(metrics), "train_s": round(train_s, 1), "score_s": round(time.perf_counter() - t0, 1),
           "understanding": last["understanding"], "generation": last["generation"],
           "classifier_on_held_out_originals": float(np.mean(classifier().predict(images[test].reshape(-1, 64))
                                                             == target[test])),
           "sampler": last["sampler"], "per_digit": a.per_digit,
           "per_checkpoint": {s: {"understanding": v["understanding"], "generation": v["generation"],
                                  "read": v["read"]} for s, v in scores.items()},
           "loss": curve}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
        fh.write("\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("loss", "per_checkpoint")}, indent=1))


if __name__ == "__main__":
    main()
