"""What online eval costs a training run: the trainer on a recipe with [eval] on, timed from its own metrics.jsonl.

One run of --steps steps evaluates every --every steps (held-out loss of --max-batches global batches of
builtin:qa_test, and --task-limit greedy generations of the built-in QA through the serving engine on the live
weights). Reported: the step time (p50 of the steps without eval), each eval's time, held-out part, weight
hand-off to the engine and generation; the overhead of an eval every --interval steps as a percentage of the
training time (eval time / (interval x step time)); the training step's peak memory on the steps after an eval
against those before the first (an eval frees what it took).

    PYTHONPATH=$PWD python3 bench/eval_overhead.py [--config qwen3_1.7b --steps 30 --every 10 --interval 500]
    PYTHONPATH=$PWD python3 bench/eval_overhead.py --cpu [--out x.json]   # smoke test: debug_qwen3 on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def trainer_metrics(args: list[str], what: str = "the run") -> dict[int, dict]:
    """The metrics.jsonl rows, by step, of one ``titan_mm.launch.train`` run with ``args`` (a temporary run
    folder; no checkpoints, no TensorBoard). A failed run stops the bench with its stderr."""
    from titan_mm.observe.metrics import read_metrics

    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "titan_mm.launch.train", *args, "--job.dump_folder", d,
               "--checkpoint.enable", "False", "--metrics.enable_tensorboard", "False"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise SystemExit(f"{what} failed:\n{r.stderr[-3000:]}")
        return read_metrics(next(Path(d).iterdir()) / "metrics.jsonl")


def measure(config: str, steps: int, every: int, interval: int, max_batches: int, task_limit: int,
            extra: list[str]) -> dict:
    rows = trainer_metrics(["--config", config, "--training.steps", str(steps), "--eval.interval", str(every),
                            "--eval.dataset", "builtin:qa_test", "--eval.max_batches", str(max_batches),
                            "--eval.tasks", "qa", "--eval.task_limit", str(task_limit), "--eval.max_new_tokens",
                            "4", *extra])
    evals = {s: m for s, m in rows.items() if "eval/time_s" in m}
    first = min(evals)
    plain = [m["step_time_s"] for s, m in rows.items() if s not in evals and s > 2]  # past compile / warm-up
    step = statistics.median(plain)
    ev = [evals[s]["eval/time_s"] for s in sorted(evals)[1:] or sorted(evals)]  # the first eval reads its batches
    eval_s = statistics.median(ev)
    before = max(m["mem_peak_gb"] for s, m in rows.items() if 2 < s <= first)
    after = max(m["mem_peak_gb"] for s, m in rows.items() if s > first)
    last = evals[max(evals)]
    return {
        "config": config, "steps": steps, "eval_every": every, "step_time_s": step, "eval_time_s": eval_s,
        "eval_times_s": [evals[s]["eval/time_s"] for s in sorted(evals)],
        "handoff_s": last["eval/handoff_s"], "generate_s": last["eval/generate_s"],
        "heldout_s": last["eval/time_s"] - last["eval/generate_s"], "heldout_tokens": last["eval/qa_test/tokens"],
        "prompts": last["eval/qa/n"], "eval_peak_mem_gb": last["eval/peak_mem_gb"],
        "step_peak_mem_gb_before_eval": before, "step_peak_mem_gb_after_eval": after,
        "max_batches": max_batches, "interval": interval, "overhead_pct": 100.0 * eval_s / (interval * step),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3_1.7b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10, help="eval.interval of the measured run")
    ap.add_argument("--interval", type=int, default=500, help="the eval interval the overhead is reported for")
    ap.add_argument("--max-batches", type=int, default=8)
    ap.add_argument("--task-limit", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="smoke test: debug_qwen3 on the CPU, 8 steps")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_overhead.json"))
    a = ap.parse_args(argv)
    if a.cpu:
        res = measure("debug_qwen3", 8, 4, a.interval, 1, 4, ["--job.device", "cpu"])
    else:
        res = measure(a.config, a.steps, a.every, a.interval, a.max_batches, a.task_limit, [])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
