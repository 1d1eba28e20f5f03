"""Where a serving step's time goes (issue 20): the engine on nano-vllm's workload (bench/serve.py part A), with
each phase of ``Engine._step_at`` timed behind a device sync, then a torch.profiler trace of a few decode steps (the
timers removed: its idle is what the asynchronous engine leaves) and its split by kernel category
(bench/profile_split.py: GEMMs, attention, norms, other (titan's fp8 casts), idle).

    source scripts/gpu_setup.sh && python3 bench/serve_profile.py --out $OUT/serve_profile.json
    python3 bench/serve_profile.py --flavor 8B --serve_quantization fp8_rowwise_fused --kv_cache_dtype fp8_e4m3 ...
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/serve_profile.py --cpu          # smoke, tiny model
    PYTHONPATH=$PWD python bench/serve_profile.py --host --out bench/results/serve_host_cpu.json  # host side, CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serve as sb  # noqa: E402
from bench.profile_split import split  # noqa: E402
from bench.trace_gaps import load_events  # noqa: E402


def timed(obj, name: str, acc: dict, device):
    """Wrap ``obj.name`` so that each call adds its synced wall time to ``acc[name]``; -> what undoes it."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        sb.sync(device)
        t = time.perf_counter()
        out = fn(*a, **kw)
        sb.sync(device)
        acc[name] += time.perf_counter() - t
        return out

    setattr(obj, name, wrapper)
    return lambda: setattr(obj, name, fn)


def batch1_kernels(spec, cfg, model, device, shape, vocab, steps: int = 20) -> dict:
    """One 512-token request decoding alone: kernels launched and GPU busy time per decode step (profiler)."""
    g = torch.Generator().manual_seed(1)
    prompt = sb.random_ids(g, 512, vocab)
    engine = sb.titan_engine(model, spec, cfg, [prompt], [steps + 8], device, shape)
    return sb.decode_step_kernels(engine, prompt, steps)


def host_cost(rows: int = 256, new: int = 1000, warm: int = 300, steps: int = 500,
              freeze_gc: bool = True) -> dict:
    """The host side of an engine step at ``rows`` decoding sequences, on the CPU: a 1-layer debug model with a
    1024-token vocabulary (so the model step is small) and its time subtracted; what is left is scheduling,
    planning, sampling bookkeeping, detokenization and outputs, measured after ``warm`` steps (outputs that long).
    host_ms from wall time, host_cpu_ms from the process's CPU time (steadier when other work shares the cores),
    host_max_ms the longest step's, full_collections how many of Python's oldest-generation collections ran (one in
    about 500 steps here: ``steps`` spans that)."""
    import dataclasses
    import gc

    from titan_mm.registry import get_model_spec
    from titan_mm.serve.sampling_params import SamplingParams

    cpu = torch.device("cpu")
    spec = get_model_spec("qwen3")
    cfg = dataclasses.replace(spec.flavor("debug"), vocab_size=1024, num_hidden_layers=1)
    model = sb.random_weights(spec, cfg, cpu, 0)
    g = torch.Generator().manual_seed(0)
    prompts = [sb.random_ids(g, 8, 1000) for _ in range(rows)]
    engine = sb.titan_engine(model, spec, cfg, prompts, [new] * rows, cpu, dict(sb.SHAPES["gpu"], max_num_seqs=rows),
                             freeze_gc=freeze_gc)
    for i, p in enumerate(prompts):
        engine.add_request(f"h{i}", p, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    acc: dict = defaultdict(float)
    step = engine.runner._model_step

    def model_step(x):  # wall and CPU time (CPU: what the process itself spent, when other work shares the cores)
        t, c = time.perf_counter(), time.process_time()
        out = step(x)
        acc["wall"] += time.perf_counter() - t
        acc["cpu"] += time.process_time() - c
        return out

    engine.runner._model_step = model_step
    for _ in range(warm):
        engine.step()
    acc.clear()
    longest, full = 0.0, gc.get_stats()[2]["collections"]
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t0, m0 = time.perf_counter(), acc["wall"]
        engine.step()
        longest = max(longest, time.perf_counter() - t0 - (acc["wall"] - m0))
    wall, model = (time.perf_counter() - t) / steps, acc["wall"] / steps
    cpu_host = ((time.process_time() - c) - acc["cpu"]) / steps
    return dict(rows=rows, output_tokens=warm + steps, freeze_gc=freeze_gc, wall_ms=round(wall * 1e3, 2),
                model_ms=round(model * 1e3, 2), host_ms=round((wall - model) * 1e3, 2),
                host_cpu_ms=round(cpu_host * 1e3, 2), host_max_ms=round(longest * 1e3, 2),
                full_collections=gc.get_stats()[2]["collections"] - full)


def prefill_padding(reps: int = 5) -> dict:
    """Workload A's prefill steps as the scheduler forms them (the bench's seed, budget and seats; a 1-layer debug
    model on the CPU: only the lengths matter): per step the real prompt tokens against the padded rows' B x S,
    and the host time of planning the first step's cache metadata padded (its [B, 1, S, L] mask) against packed
    (cu_seqlens, what the varlen kernel reads)."""
    import dataclasses

    from titan_mm.nn.kv_cache import plan_step
    from titan_mm.registry import get_model_spec
    from titan_mm.serve.sampling_params import SamplingParams

    cpu = torch.device("cpu")
    spec = get_model_spec("qwen3")
    cfg = dataclasses.replace(spec.flavor("debug"), vocab_size=1024, num_hidden_layers=1)
    s = sb.SHAPES["gpu"]["A"]
    g = torch.Generator().manual_seed(0)
    plens, news = sb.uniform(g, s["n"], s["lo"], s["hi"]), sb.uniform(g, s["n"], s["lo"], s["hi"])
    prompts = [[t % 1024 for t in sb.random_ids(g, n, sb.text_vocab())] for n in plens]
    engine = sb.titan_engine(sb.random_weights(spec, cfg, cpu, 0), spec, cfg, prompts, news, cpu, sb.SHAPES["gpu"])
    for i, (pr, n) in enumerate(zip(prompts, news)):
        engine.add_request(f"r{i}", pr, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    steps, prepare = [], engine.runner.prepare

    def record(rows, *a, **k):
        steps.append(dict(rows=len(rows), tokens=sum(r.n for r in rows), padded=len(rows) * max(r.n for r in rows),
                          lens=[(r.start, r.n) for r in rows]))
        return prepare(rows, *a, **k)

    engine.runner.prepare = record
    while sum(st["tokens"] for st in steps) < sum(plens):  # decode rows never reach prepare (paged decode)
        engine.step()
    cache, first = engine.runner.cache, steps[0]["lens"]
    tables = torch.arange(len(first) * 70).view(len(first), 70)  # 70 blocks of 16 hold 1,024 + the lookahead
    new, cached = [n for _, n in first], [a for a, _ in first]
    timing = {}
    for name, kw in (("padded_mask", {}), ("packed_varlen", dict(packed=True, varlen=True))):
        t = time.perf_counter()
        for _ in range(reps):
            plan_step(cache, new, cached_lens=cached, block_tables=tables, **kw)
        timing[name + "_ms"] = round((time.perf_counter() - t) / reps * 1e3, 2)
    real, padded = sum(st["tokens"] for st in steps), sum(st["padded"] for st in steps)
    return dict(prefill_steps=len(steps), prompt_tokens=real, padded_tokens=padded,
                padded_over_real=round(padded / real, 3), first_step_rows=steps[0]["rows"],
                plan_first_step=timing, steps=[{k: v for k, v in st.items() if k != "lens"} for st in steps])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--flavor", default="")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kernels", type=int, default=1, help="the fused titan_mm.kernels ops (as bench/serve.py)")
    ap.add_argument("--host", action="store_true", help="only the host side of a 256-row step, on the CPU")
    ap.add_argument("--freeze_gc", type=int, default=1, help="--host: serve.freeze_gc of its engine")
    ap.add_argument("--prefill_padding", action="store_true", help="only workload A's prefill steps: real against "
                    "padded tokens, and the host time of planning one packed or padded (CPU)")
    ap.add_argument("--async_scheduling", type=int, default=1, help="serve.async_scheduling of the engines (as "
                    "bench/serve.py)")
    ap.add_argument("--packed_prefill", type=int, default=0, help="serve.packed_prefill (as bench/serve.py)")
    ap.add_argument("--batch1", type=int, default=1, help="0: skip the batch-1 kernel count (a second engine: at 8B "
                    "its copy of the weights beside part A's pool nears 80 GB)")
    ap.add_argument("--serve_quantization", default="none", choices=sb.QUANTIZATIONS, help="as bench/serve.py's")
    ap.add_argument("--kv_cache_dtype", default="auto", choices=("auto", *sb.KV_CACHE_DTYPES),
                    help="as bench/serve.py's")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.host or a.prefill_padding:
        torch.set_num_threads(1)
        res = host_cost(freeze_gc=bool(a.freeze_gc)) if a.host else prefill_padding()
        print(json.dumps(res))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    from titan_mm.registry import get_model_spec

    device = torch.device("cpu" if a.cpu else "cuda")
    shape = dict(sb.SHAPES["cpu" if a.cpu else "gpu"], kernels=bool(a.kernels), async_scheduling=bool(a.async_scheduling),
                 packed_prefill=bool(a.packed_prefill))
    flavor = a.flavor or shape["flavors"][0]
    spec = get_model_spec("qwen3")
    cfg = spec.flavor(flavor)
    s = shape["A"]
    g = torch.Generator().manual_seed(0)
    vocab = sb.text_vocab()
    plens, news = sb.uniform(g, s["n"], s["lo"], s["hi"]), sb.uniform(g, s["n"], s["lo"], s["hi"])
    prompts = [sb.random_ids(g, n, vocab) for n in plens]
    model = sb.random_model(spec, flavor, device, 0, shape["kernels"])
    engine = sb.titan_engine(model, spec, cfg, prompts, news, device, shape, quantization=a.serve_quantization,
                             kv_cache_dtype=a.kv_cache_dtype)
    from titan_mm.serve.sampling_params import SamplingParams

    engine.generate([sb.random_ids(g, 16, vocab) for _ in range(2)], SamplingParams(temperature=0.0, max_tokens=4))
    acc: dict = defaultdict(float)
    undo = [timed(engine.scheduler, "schedule", acc, device)]
    for name in ("prepare", "decode", "forward"):  # decode: the one-token rows (its eager forward inside)
        undo.append(timed(engine.runner, name, acc, device))
    for name in ("_launch", "_update"):  # EngineCore: the asynchronous launch, then the tokens into the sequences
        undo.append(timed(engine.core, name, acc, device))
    undo.append(timed(engine.core.outputs, "output", acc, device))  # each touched request's RequestOutput
    for i, (p, n) in enumerate(zip(prompts, news)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    rows = []
    for step in range(a.steps):
        before = dict(acc)
        sb.sync(device)
        t = time.perf_counter()
        outs = engine.step()
        sb.sync(device)
        wall = time.perf_counter() - t
        st = engine.stats()
        rows.append(dict(step=step, wall_ms=round(wall * 1e3, 2), running=st["num_running_seqs"],
                         tokens=sum(len(o.outputs[0].new_token_ids) for o in outs),
                         **{k: round((acc[k] - before.get(k, 0.0)) * 1e3, 2) for k in acc}))
        print(json.dumps(rows[-1]), flush=True)
    trace = floor = b1 = decode_split = None
    if not a.cpu:
        floor = round(sb.launch_floor_us(device), 3)
        b1 = batch1_kernels(spec, cfg, model, device, shape, vocab) if a.batch1 else None
        print(json.dumps(dict(launch_floor_us=floor, batch1=b1)), flush=True)
        from torch.profiler import ProfilerActivity, profile

        steps, running = 5, engine.stats()["num_running_seqs"]
        for u in undo:  # the profiled steps without the phases' syncs: idle is what the asynchronous engine leaves
            u()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sb.sync(device)
        chrome = Path(a.out or "serve_profile.json").with_suffix(".trace.json")
        prof.export_chrome_trace(str(chrome))
        ms, top = split(load_events(chrome), steps)
        decode_split = dict(running=running, steps=steps, ms_per_step=ms, kernels=top)
        print(json.dumps(decode_split), flush=True)
        trace = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        print(trace)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(flavor=flavor, kernels=shape["kernels"], launch_floor_us=floor,
                                               serve_quantization=a.serve_quantization,
                                               kv_cache_dtype=a.kv_cache_dtype, batch1=b1, rows=rows,
                                               decode_split=decode_split, trace=trace), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
