"""Muon against AdamW at equal tokens: the trainer twice on one recipe, the same seed and batches, only
optimizer.name differs (Muon's matrices take the AdamW lr through Moonlight's 0.2 * sqrt(max(A, B)) scale, so one
lr serves both); the loss of every step from each run's metrics.jsonl.

    PYTHONPATH=$PWD python3 bench/optim_curve.py --out $OUT/optim_curve.json      # H200: Qwen3-1.7B shape, 4 layers (~3 min)
    PYTHONPATH=$PWD python3 bench/optim_curve.py --cpu                            # debug_qwen3 on the CPU, 200 steps
    PYTHONPATH=$PWD python3 bench/optim_curve.py --cpu --steps 6 --out /tmp/c.json  # smoke test
    python3 bench/optim_curve.py --plot bench/results/optim_curve.json            # docs/optim_curve.png + table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.eval_overhead import trainer_metrics  # noqa: E402  (one trainer run -> its metrics rows)
OPTIMIZERS = ("adamw", "muon")
TABLE_STEPS = (1, 10, 25, 50, 100, 150, 200)


def losses(config: str, optimizer: str, steps: int, extra: list[str]) -> dict[int, float]:
    rows = trainer_metrics(["--config", config, "--job.name", optimizer, "--optimizer.name", optimizer,
                            "--training.steps", str(steps), "--metrics.log_freq", "1",
                            "--lr_scheduler.warmup_steps", str(max(1, steps // 10)), *extra], f"the {optimizer} run")
    return {s: m["loss"] for s, m in rows.items()}


def table(res: dict) -> str:
    curves = {o: {int(s): v for s, v in res["loss"][o].items()} for o in OPTIMIZERS}
    out = ["| step | " + " | ".join(OPTIMIZERS) + " | muon - adamw |", "|---" * (len(OPTIMIZERS) + 2) + "|"]
    for s in TABLE_STEPS:
        if all(s in c for c in curves.values()):
            a, m = curves["adamw"][s], curves["muon"][s]
            out.append(f"| {s} | {a:.3f} | {m:.3f} | {m - a:+.3f} |")
    return "\n".join(out)


def plot(path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for o in OPTIMIZERS:
        pts = sorted((int(s), v) for s, v in res["loss"][o].items())
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=o)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(res["title"])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(table(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3_1.7b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers kept (the recipe's widths)")
    ap.add_argument("--rows", type=int, default=4, help="global batch rows (of data.seq_len tokens)")
    ap.add_argument("--cpu", action="store_true", help="debug_qwen3 (its own batch) on the CPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "optim_curve.json"))
    ap.add_argument("--plot", help="results JSON to draw into --png (no runs)")
    ap.add_argument("--png", default=str(ROOT / "docs" / "optim_curve.png"))
    a = ap.parse_args(argv)
    if a.plot:
        plot(Path(a.plot), Path(a.png))
        return 0
    config, steps = ("debug_qwen3" if a.cpu else a.config), a.steps
    if a.cpu:
        extra = ["--job.device", "cpu"]
    else:
        extra = ["--model.overrides", json.dumps({"num_hidden_layers": a.layers}), "--training.global_batch_size",
                 str(a.rows), "--data.micro_batch_size", str(a.rows)]
    res = {"config": config, "steps": steps, "extra": extra,
           "title": f"{config}{'' if a.cpu else f', {a.layers} layers'}: Muon vs AdamW, same batches",
           "loss": {o: losses(config, o, steps, extra) for o in OPTIMIZERS}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
