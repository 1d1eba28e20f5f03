"""GRPO on one GPU (issue 51 item 3): titan_mm's RL loop against TRL's GRPOTrainer, on the same model, prompts and G.

Both sides start from one HF folder written here: a random-weight Qwen3 flavor (1.7B on the GPU; the GPU machine
has no hub weights, and the timing does not need trained ones), with the built-in Qwen3 tokenizer and the chatml
template. Prompts: the built-in QA's training part (``builtin:qa``), rendered by the chat template as plain text, so
both sides feed the same token ids. Every step samples ``--prompts`` prompts x G = 8 completions of at most
``--max-tokens`` tokens at temperature 1 (a random model seldom stops early, so completions have about that length
on both sides) and takes one optimizer step (AdamW, constant lr, no KL, clip 0.2 / 0.28, the token-mean loss).
The reward is ``operator.lt(completion, reference)``: it varies within a group on random text, so both sides train
on real gradients (exact match would be 0 everywhere, every group flat).

- ``titan``: ``python -m titan_mm.launch.train`` with train_configs/debug_rl_qwen3.toml and the flavor / shape
  overrides; rollouts from titan_mm's own engine on the live weights. Per step (metrics.jsonl): rollout
  (``data/rl/generate_s``), sync (``data/rl/sync_s``), train (step time - the data wait).
- ``trl``: ``trl.GRPOTrainer`` (generation by ``transformers`` ``generate``: TRL's path without vLLM, which the
  GPU machine lacks), fp32 master weights with bf16 autocast, as the trainer's. Rollout time is its ``_generate``
  (timed by a subclass), train = step - rollout; sync is 0 (one model generates and trains).

The first ``--warmup`` steps of each side are left out of the means (compiles, graph capture, allocator growth).
Rows: seconds per step (rollout / train / sync), rollout tokens / s (completion tokens sampled / rollout seconds),
steps per hour, and titan / trl's ratio of steps per hour.

    source scripts/gpu_setup.sh && python3 bench/rl.py --out $OUT/rl.json        # H100, 1.7B, ~2 min
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/rl.py --cpu --tiny --out /tmp/rl.json   # smoke (TRL if it imports)

TRL, accelerate, datasets and their dependencies are carried to the GPU machine by scripts/fetch_wheels.sh.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import operator
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_mm.config import load_config  # noqa: E402
from titan_mm.data.builtin import builtin_records  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer  # noqa: E402
from titan_mm.export import hf_folder_files  # noqa: E402
from titan_mm.loader import model_from_config, tokenizer_path  # noqa: E402
from titan_mm.nn.init import seeded_init  # noqa: E402
from titan_mm.observe.metrics import read_metrics  # noqa: E402

CONFIG = ROOT / "train_configs" / "debug_rl_qwen3.toml"
# the tiny model of the CPU smoke: one layer, hidden 64, on the real tokenizer (as tests/unit/test_rl.py)
TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}
SHAPES = {"gpu": dict(flavor="1.7B", prompts=8, group=8, max_tokens=64, micro=16, steps=8, warmup=2, lr=1e-6),
          "cpu": dict(flavor="debug", prompts=2, group=8, max_tokens=4, micro=8, steps=3, warmup=1, lr=1e-4)}


def job_args(a, out: Path, hf: Path | None = None) -> list[str]:
    """The [rl] job of the titan side from ``hf`` (None: the flavor's own config, which the HF folder is made of)."""
    seq_len = 32 + a.max_tokens  # the longest QA prompt is 19 tokens with the chatml template
    args = ["--config", str(CONFIG), "--model.flavor", a.flavor, "--data.seq_len", str(seq_len),
            "--data.micro_batch_size", str(a.micro), "--training.global_batch_size", str(a.prompts * a.group),
            "--training.steps", str(a.steps), "--optimizer.lr", str(a.lr), "--rl.prompts_per_step", str(a.prompts),
            "--rl.group_size", str(a.group), "--rl.max_tokens", str(a.max_tokens), "--rl.rewards",
            '{"operator:lt": 1.0}', "--checkpoint.enable", "False", "--metrics.enable_tensorboard", "False",
            "--job.dump_folder", str(out), "--job.name", "titan"]
    if a.tiny:
        args += ["--model.overrides", json.dumps(TINY)]
    if not a.cpu:  # bf16 compute over fp32 master weights, as TRL's bf16 autocast (and fp32 flex at head dim 128
        # finds no kernel config on torch 2.11: the H200 run of 2026-12-06 stopped there)
        args += ["--training.param_dtype", "bfloat16", "--compile.enable", "True"]  # compiled, as a GPU run trains
    return args + shlex.split(a.titan_args) + (["--model.hf_path", str(hf)] if hf else [])


def write_init(a, out: Path) -> Path:
    """The shared starting point: the flavor's seeded random init as an HF folder, with the tokenizer files."""
    hf = out / "init_hf"
    cfg = load_config(job_args(a, out))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec, model_cfg = model_from_config(cfg, dev)
    with torch.device("meta"):
        model = spec.build(model_cfg)
    model.to_empty(device=dev)
    with torch.no_grad(), seeded_init(cfg.training.seed):
        model.init_weights(buffer_device=dev)
    hf.mkdir(parents=True, exist_ok=True)
    spec.save_hf(model, model_cfg, str(hf))
    for name, body in hf_folder_files(cfg).items():
        (hf / name).write_bytes(body.read_bytes() if isinstance(body, Path) else body.encode())
    del model
    if dev.type == "cuda":  # the titan side's process needs the memory this one's allocator would keep
        torch.cuda.empty_cache()
    return hf


def prompt_texts(a, hf: Path, out: Path) -> tuple[list[str], list[str]]:
    """The QA prompts rendered as the titan side renders them (the assistant's turn opened), and their answers."""
    cfg = load_config(job_args(a, out, hf))
    tok = load_tokenizer(tokenizer_path(cfg))
    spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
    proc = Processor(tok, ProcessorConfig(cfg.data, spec.data_needs(model_cfg)))
    recs = builtin_records("qa")
    texts = [proc.render(parse_record({"messages": r["messages"][:-1]}), add_generation_prompt=True)[0] for r in recs]
    return texts, [r["answer"] for r in recs]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summary(rollout: list[float], train: list[float], sync: list[float], tokens: list[float], warmup: int) -> dict:
    """Means over the steps after ``warmup``."""
    r, t, s, n = (x[warmup:] for x in (rollout, train, sync, tokens))
    step = _mean(r) + _mean(t) + _mean(s)
    return {"rollout_s": _mean(r), "train_s": _mean(t), "sync_s": _mean(s), "step_s": step,
            "rollout_tok_s": sum(n) / max(sum(r), 1e-9), "steps_per_hour": 3600.0 / step, "steps_timed": len(r)}


def run_titan(a, hf: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "titan_mm.launch.train", *job_args(a, out, hf)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=a.timeout)
    if p.returncode:
        raise RuntimeError(f"titan_mm's run failed ({p.returncode}): {p.stderr[-3000:]}")
    rows = read_metrics(out / "titan" / "metrics.jsonl")
    steps = sorted(rows)
    n = a.prompts * a.group
    roll = [rows[s]["data/rl/generate_s"] for s in steps]
    sync = [rows[s]["data/rl/sync_s"] for s in steps]
    train = [rows[s]["step_time_s"] - rows[s]["data_wait_s"] for s in steps]
    tokens = [rows[s]["data/rl/completion_len"] * n for s in steps]
    # logprob_gap: mean |engine - trainer| logprob of the sampled tokens (on-policy: the bf16 serving mismatch)
    return {**summary(roll, train, sync, tokens, a.warmup),
            "reward_mean": [rows[s]["data/rl/reward_mean"] for s in steps],
            "logprob_gap": [rows[s]["loss/logprob_gap"] for s in steps]}


def run_trl(a, hf: Path, out: Path) -> dict:
    # TRL, accelerate and datasets are bench-only dependencies (carried to the GPU machine as wheels)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    texts, answers = prompt_texts(a, hf, out)
    times: dict[str, list[float]] = {"step": [], "rollout": [], "tokens": []}

    class Timed(GRPOTrainer):
        """GRPOTrainer whose generation is timed (the rollout part of a step)."""

        def _generate(self, prompts):
            t0 = time.perf_counter()
            res = super()._generate(prompts)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times["rollout"].append(time.perf_counter() - t0)
            return res

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times["step"].append(time.perf_counter() - self.t0)

    def lt(completions, reference, **kw):
        return [float(operator.lt(c, r)) for c, r in zip(completions, reference)]

    tok = AutoTokenizer.from_pretrained(str(hf))
    tok.padding_side = "left"
    ds = Dataset.from_list([{"prompt": t, "reference": r} for t, r in zip(texts, answers)])
    gpu = torch.cuda.is_available()
    cfg = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=a.micro,
                     gradient_accumulation_steps=a.prompts * a.group // a.micro, num_generations=a.group,
                     max_completion_length=a.max_tokens, temperature=1.0, learning_rate=a.lr, beta=0.0,
                     epsilon=0.2, epsilon_high=0.28, loss_type="dapo", max_steps=a.steps, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to="none",
                     save_strategy="no", bf16=gpu, use_cpu=not gpu, seed=0, model_init_kwargs={"dtype": "float32"},
                     dataloader_num_workers=0)
    trainer = Timed(model=str(hf), reward_funcs=lt, args=cfg, train_dataset=ds, processing_class=tok,
                    callbacks=[StepTimes()])
    trainer.train()
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    times["tokens"] = [x * a.prompts * a.group for x in lens]
    train = [s - r for s, r in zip(times["step"], times["rollout"])]
    return summary(times["rollout"], train, [0.0] * len(train), times["tokens"], a.warmup)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def host_cpu() -> str:
    """The host's CPU model and core count: TRL's generate launches from the host, and its speed moved between
    machines of the same GPU."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else 'unknown'} x {os.cpu_count()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU shapes (a smoke of every path)")
    ap.add_argument("--tiny", action="store_true", help="a one-layer model of hidden 64 (with --cpu)")
    ap.add_argument("--sides", default="titan,trl", help="comma-separated: titan, trl")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--micro", type=int, help="rows per micro-batch on both sides (default: the shape's; the step's "
                    "prompts x group rows are split into micro-batches of this size)")
    ap.add_argument("--dir", default="/tmp/bench_rl", help="scratch folder (the HF init, both runs)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the titan side's run")
    ap.add_argument("--titan-args", default="", help="more config overrides for the titan side, e.g. "
                    "'--model.attn_backend sdpa --compile.enable True'")
    ap.add_argument("--out", default=str(ROOT / "bench/results/rl.json"))
    a = ap.parse_args(argv)
    shape = SHAPES["cpu" if a.cpu else "gpu"]
    if not a.cpu and not torch.cuda.is_available():
        print("bench/rl.py: no CUDA device here; run with --cpu --tiny for the smoke", file=sys.stderr)
        return 2
    if a.tiny and not a.cpu:
        print("bench/rl.py: --tiny is the CPU smoke's model; add --cpu", file=sys.stderr)
        return 2
    sides = [s for s in a.sides.split(",") if s]
    if not sides or set(sides) - {"titan", "trl"}:
        print(f"bench/rl.py: --sides {a.sides!r}: give titan, trl or both, comma-separated", file=sys.stderr)
        return 2
    micro = a.micro
    for k, v in shape.items():
        setattr(a, k, v)
    if micro is not None:
        if micro < 1 or (a.prompts * a.group) % micro:
            print(f"bench/rl.py: --micro {micro} must divide the step's {a.prompts * a.group} rows", file=sys.stderr)
            return 2
        a.micro = micro
    if a.steps is None:
        a.steps = shape["steps"]
    a.steps = max(a.steps, a.warmup + 1)
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = write_init(a, out)
    res = {"device": device_name(), "host_cpu": host_cpu(), "torch": torch.__version__, "model": "tiny" if a.tiny else a.flavor,
           "shape": {k: getattr(a, k) for k in ("prompts", "group", "max_tokens", "micro", "steps", "warmup", "lr")},
           "titan_args": a.titan_args,
           "sides": {}}
    for side in sides:
        if side == "trl" and importlib.util.find_spec("trl") is None:
            res["sides"]["trl"] = {"skipped": "trl does not import here (scripts/fetch_wheels.sh carries it)"}
            continue
        t0 = time.perf_counter()
        try:
            res["sides"][side] = (run_titan if side == "titan" else run_trl)(a, hf, out)
        except Exception as e:  # a failing side records its error; the other still runs
            res["sides"][side] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        res["sides"][side]["wall_s"] = time.perf_counter() - t0
        print(side, json.dumps(res["sides"][side])[:600], flush=True)
    both = [res["sides"].get(s, {}).get("steps_per_hour") for s in ("titan", "trl")]
    if all(both):
        res["titan_over_trl_steps_per_hour"] = both[0] / both[1]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"| side | rollout s | train s | sync s | step s | rollout tok/s | steps/h |  ({res['device']})")
    for s, r in res["sides"].items():
        if "step_s" in r:
            print(f"| {s} | {r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.4f} | {r['step_s']:.3f} | "
                  f"{r['rollout_tok_s']:.0f} | {r['steps_per_hour']:.0f} |")
    if "titan_over_trl_steps_per_hour" in res:
        print(f"titan / trl steps per hour: {res['titan_over_trl_steps_per_hour']:.2f}x")
    return 1 if any("error" in r for r in res["sides"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
