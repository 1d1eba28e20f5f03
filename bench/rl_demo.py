"""SFT, then GRPO, on a CPU (issue 51's demo; docs/rl.md "SFT, then GRPO, on a CPU"): held-out exact match before
and after GRPO, on the built-in QA (tiny Qwen3) or the built-in digits (tiny Qwen3-VL, the digit image in the prompt).

Each task runs, through the ordinary commands:
1. SFT (``python -m titan_mm.launch.train``, the task's debug config) for ``sft_steps`` with its schedule, saving a
   checkpoint every ``every`` steps; the one of step ``start`` is the starting point. The SFT stops early on
   purpose, so the held-out score leaves room (the rest of the SFT run is the comparison: more SFT instead of GRPO).
2. ``python -m titan_mm.export`` of that checkpoint, and ``python -m titan_mm.eval`` on it: step 0 of the curve.
3. GRPO (the task's train_configs/debug_rl_*.toml from that folder) with online eval of every held-out prompt
   (greedy, ``eval.task_limit 0``) every ``eval_every`` steps.

The held-out prompts (``qa_test`` / ``digits_test``, every 5th record) are never trained on: SFT reads ``qa`` /
``digits``, GRPO's prompts are ``builtin:qa`` / ``builtin:digits``. The curve (held-out score per GRPO step, training
reward, entropy) goes to ``--out``; ``--table`` prints the markdown of docs/rl.md from it.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/rl_demo.py --task qa          # minutes on a free CPU core
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/rl_demo.py --task digits
    python bench/rl_demo.py --table bench/results/rl_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_mm.observe.metrics import read_metrics  # noqa: E402

TASKS = {
    "qa": dict(
        metric="eval/qa/exact_match", eval_task="qa", new_tokens=6, sft_steps=100, start=80, every=10,
        sft=["--config", "train_configs/debug_qwen3.toml", "--data.dataset", "builtin:qa", "--data.chat_template",
             "chatml", "--data.seq_len", "256", "--data.micro_batch_size", "8", "--training.global_batch_size", "8",
             "--lr_scheduler.warmup_steps", "10"],
        grpo_steps=40, eval_every=10,
        grpo=["--config", "train_configs/debug_rl_qwen3.toml", "--training.global_batch_size", "256",
              "--data.micro_batch_size", "16", "--rl.prompts_per_step", "16", "--rl.group_size", "16",
              "--optimizer.lr", "4e-4", "--lr_scheduler.warmup_steps", "3", "--rl.negative_scale", "0"]),
    "digits": dict(
        metric="eval/digits/accuracy", eval_task="digits", new_tokens=3, sft_steps=60, start=40, every=10,
        sft=["--config", "train_configs/debug_qwen3_vl.toml", "--eval.interval", "0"],
        grpo_steps=40, eval_every=10,
        grpo=["--config", "train_configs/debug_rl_qwen3_vl.toml"]),
}
"""The settings of the runs "gM" (QA) and "vgP" (digits) of bench/results/rl_cpu.json; the gain is at the last step."""


def sh(args: list[str], log: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "a") as f:
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise SystemExit(f"rl_demo: {' '.join(args[:3])} failed ({p.returncode}); see {log}")


def run(task: str, work: Path, **shorter) -> dict:
    t = {**TASKS[task], **{k: v for k, v in shorter.items() if v is not None}}
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{task}.log"
    common = ["--job.dump_folder", str(work), "--metrics.enable_tensorboard", "False"]
    t0 = time.perf_counter()
    sh(["-m", "titan_mm.launch.train", *t["sft"], *common, "--job.name", f"{task}_sft", "--training.steps",
        str(t["sft_steps"]), "--checkpoint.interval", str(t["every"]), "--checkpoint.keep_last", "0",
        "--checkpoint.async_mode", "disabled"], log)
    sft_s = time.perf_counter() - t0
    ck = work / f"{task}_sft" / "checkpoints" / f"step-{t['start']:08d}"
    hf = work / f"{task}_sft{t['start']}_hf"
    sh(["-m", "titan_mm.export", "--checkpoint", str(ck), "--out", str(hf)], log)
    scores = {}
    for step in sorted({t["start"], t["sft_steps"]}):  # the start, and the end of the SFT run (the comparison)
        out = work / f"{task}_sft_eval_{step}.json"
        sh(["-m", "titan_mm.eval", "--checkpoint", str(work / f"{task}_sft"), "--step", str(step), "--tasks",
            t["eval_task"], "--task-limit", "0", "--out", str(out)], log)
        scores[step] = json.loads(out.read_text())[t["metric"]]
    t1 = time.perf_counter()
    sh(["-m", "titan_mm.launch.train", *t["grpo"], *common, "--job.name", f"{task}_grpo", "--model.hf_path", str(hf),
        "--training.steps", str(t["grpo_steps"]), "--eval.interval", str(t["eval_every"]), "--eval.tasks",
        t["eval_task"], "--eval.task_limit", "0", "--eval.max_new_tokens", str(t["new_tokens"]),
        "--checkpoint.enable", "False"], log)
    grpo_s = time.perf_counter() - t1
    rows = read_metrics(work / f"{task}_grpo" / "metrics.jsonl")
    curve = {0: scores[t["start"]], **{s: r[t["metric"]] for s, r in sorted(rows.items()) if t["metric"] in r}}
    return {"task": task, "metric": t["metric"], "sft": t["sft"], "sft_steps": t["sft_steps"], "start": t["start"],
            "grpo": t["grpo"], "grpo_steps": t["grpo_steps"], "heldout": curve,
            "sft_end": {"step": t["sft_steps"], "score": scores[t["sft_steps"]]},
            "gain_points": 100 * (curve[max(curve)] - curve[0]),
            "reward": {s: r["data/rl/reward_mean"] for s, r in sorted(rows.items())},
            "entropy": {s: r["loss/entropy"] for s, r in sorted(rows.items())},
            "wall_s": {"sft": sft_s, "grpo": grpo_s}}


def table(res: dict) -> str:
    lines = []
    for task, r in res.get("tasks", {}).items():
        steps = sorted(r["heldout"], key=int)
        lines += [f"**{task}** (SFT stopped at step {r['start']} of {r['sft_steps']}; {r['metric']}, every held-out "
                  "prompt, greedy)", "",
                  "| GRPO step | " + " | ".join(str(s) for s in steps) + " |",
                  "|---|" + "---|" * len(steps),
                  "| held-out | " + " | ".join(f"{r['heldout'][s]:.3f}" for s in steps) + " |", "",
                  f"{r['gain_points']:+.1f} points; the SFT run's own step {r['sft_end']['step']}: "
                  f"{r['sft_end']['score']:.3f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", action="append", help=f"one of {', '.join(TASKS)} (repeatable; default: all)")
    ap.add_argument("--dir", default="/tmp/rl_demo", help="the runs' folder")
    ap.add_argument("--out", default=str(ROOT / "bench/results/rl_cpu.json"))
    ap.add_argument("--table", help="print the markdown tables of this JSON and exit")
    for k in ("sft_steps", "start", "every", "grpo_steps", "eval_every"):  # a shorter run (smoke) than the task's
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, dest=k)
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    tasks = a.task or list(TASKS)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        print(f"rl_demo: unknown --task {bad[0]!r}; choose from {', '.join(TASKS)}", file=sys.stderr)
        return 2
    if a.start is not None and a.every and a.start % a.every:
        print(f"rl_demo: --start {a.start} must be a multiple of --every {a.every} (a saved checkpoint)", file=sys.stderr)
        return 2
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {"device": "cpu"}
    res.setdefault("tasks", {})  # bench/results/rl_cpu.json also holds the measured runs ("runs")
    for task in tasks:
        res["tasks"][task] = run(task, Path(a.dir), sft_steps=a.sft_steps, start=a.start, every=a.every,
                                 grpo_steps=a.grpo_steps, eval_every=a.eval_every)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(table({"tasks": {task: res["tasks"][task]}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
