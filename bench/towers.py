"""The encoders alone: each vision tower and audio encoder at a bench shape, forward + backward, with MFU on its own
FLOPs and a profile split (GEMM, attention, norms + elementwise, idle) from torch.profiler.

A multimodal step's MFU counts the encoders in, and the VL / Omni rows of docs/efficiency.md sit well under the
text models' (docs/efficiency.md: "MFU" against "MFU (LLM only)"): this says which tower holds them down, away
from the decoder. Each tower is built the family's way (``spec.build`` of the flavor on meta, the tower's module
taken out, materialized on the device and initialized by its own ``init_weights``), with the trainer's runtime:
bf16 on CUDA (fp32 on the CPU), kernels on CUDA (``kernels.ops`` all; their launch configs tuned in one eager
step first, as the trainer's ``tune_kernels`` picks them before its first step), the encoders' attention backend the
trainer picks (``vision_backend``: varlen on CUDA when torch has it, else flex; sdpa on the CPU), compiled on CUDA
as ``--compile`` says: ``blocks`` (the default, the trainer's compile units: one per block), ``whole`` (the tower as
one graph: no per-block guards and autograd nodes on the host), ``graphs`` (the whole tower under CUDA graphs,
``mode="reduce-overhead"``: the inputs repeat, so the host launches one graph a direction), ``autotune`` (the same
with ``mode="max-autotune"``: inductor times Triton GEMM templates against cuBLAS per shape and fuses pointwise
epilogues, a bias + GELU or a residual add, into the templates it picks) or ``none``. Its host
metadata is built once, before the timed steps, as the trainer's ``prepare_batch`` does. The loss is the mean
square of the tower's outputs (the DeepStack features included), so the backward reaches every parameter. Each step
starts with the gradients at None, as the trainer's update leaves them (``zero_grad(set_to_none=True)``); rows
without ``fresh_grads`` (before 2026-12-07 05:00 UTC) added each step's gradients into the last step's, an
``add_`` a parameter that the host launches one by one (most of the Qwen3-VL ViT's idle on the H100). The
timed steps run back to back (bench/timing.py: CUDA events, no sync between steps; rows with ``timing: "events"``,
earlier ones synchronized after each step).

FLOPs are the family's own counter (titan_mm/models/<family>/flops.py: ``vision_flops`` / ``audio_flops``,
training FLOPs = 3x forward), MFU against 989 TFLOP/s (the H100 SXM's and the H200's dense bf16 peak; none on the
CPU). The profile split is bench/profile_split.py's over two profiled steps on CUDA (GPU kernels by name; idle =
the span minus the kernels' union); on the CPU the ops' self times by the same kind of rules (idle = wall time not
in any op: the host's Python).

``--floor`` adds the tower's floor, as bench/floor.py's for the 8B: every linear's three training GEMMs (forward,
input and weight gradient) at the shapes one forward calls them with, each timed alone with cuBLAS (torch.mm),
and every convolution's forward and backward alone, plus the attention kernels' time from the same run's
profile; MFU at that floor is the most the tower can reach with these GEMMs and this attention, whatever runs
between them. The same GEMMs with K and N rounded up to a
multiple of 64 (``gemm_aligned_ms``) say what odd widths cost (Qwen2.5-VL's ViT MLP is 3,420 wide: its rows are
not 16-byte aligned for cuBLAS). Towers (``TOWERS``; the bench shapes are the VL / Omni cases' of bench/mfu.py):

  qwen3_vl_vit          Qwen3-VL-2B's ViT (24 x 1024, DeepStack): 8 images of 512 x 512 (8,192 patches)
  qwen2_5_vl_vit        Qwen2.5-VL-7B's windowed ViT (32 x 1280, full attention in 4 blocks): 8 images of 504 x 504
  qwen2_5_omni_audio    Qwen2.5-Omni-7B's audio encoder (32 x 1280, Whisper blocks per 2 s chunk): 8 clips, 10-30 s
  qwen3_omni_moe_audio  Qwen3-Omni-30B-A3B's audio encoder (conv stem, windowed Whisper blocks): the same clips
  bagel_vit             BAGEL-7B-MoT's SigLIP NaViT (26 x 1152, each image attending to itself, the model's attention
                        backend): 8 images of 32 x 32 patches (448 px; 8,192 patches), as bench/mfu.py's BAGEL case

  python3 bench/towers.py                                  # on the GPU: bench/results/towers_<device>.json
  python3 bench/towers.py --towers qwen3_vl_vit --profile-dir DIR   # + each tower's kernel table
  python3 bench/towers.py --compile whole --floor          # the tower as one graph, and each tower's floor
  python3 bench/towers.py --compile autotune --kernel-ops all,-bias_gelu,-swiglu,-rms_norm   # inductor's GEMMs,
                                                           # its epilogues free to take the activations
  python3 bench/towers.py --towers qwen3_vl_vit --vary 8 [--bucket 4096]   # sizes that change every step,
                                                           # without and with bucketed patch counts (same outputs)
  python3 bench/towers.py --cpu --tiny --out /tmp/t.json   # the smoke (debug flavors, a few steps)
  python3 bench/towers.py --render bench/results/towers_h100.json --doc docs/efficiency.md   # the table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.attention import bench as cuda_ms  # noqa: E402  (median CUDA-event ms of fn())
from bench.devices import device_label, device_of, device_slug  # noqa: E402
from bench.floor import gemm_list  # noqa: E402
from bench.profile_split import split as split_gpu  # noqa: E402
from bench.timing import step_times, timing_label  # noqa: E402
from bench.trace_gaps import load_events, summarize  # noqa: E402
from titan_mm.kernels import tuning as kernel_tuning  # noqa: E402
from titan_mm.models.bagel import flops as bagel_flops  # noqa: E402
from titan_mm.models.bagel.model import flat_positions  # noqa: E402
from titan_mm.models.bagel.spec import vit_meta  # noqa: E402
from titan_mm.models.qwen2_5_omni import audio as omni_audio, flops as omni_flops  # noqa: E402
from titan_mm.models.qwen2_5_vl import flops as vl25_flops  # noqa: E402
from titan_mm.models.qwen2_5_vl.vision import build_window_meta  # noqa: E402
from titan_mm.models.qwen3_omni_moe import audio as omni3_audio, flops as omni3_flops  # noqa: E402
from titan_mm.models.qwen3_vl import flops as vl3_flops  # noqa: E402
from titan_mm.models.qwen3_vl.model import vision_backend  # noqa: E402
from titan_mm.models.qwen3_vl.vision import build_vision_meta  # noqa: E402
from titan_mm.registry import get_model_spec, resolve_model  # noqa: E402

PEAK_TFLOPS = 989.0
CLIPS = (1000, 1500, 2000, 2500, 3000, 1200, 1800, 2200)  # mel frames (100 a second): 10-30 s, as bench/mfu.py's Omni
TINY_CLIPS = (37, 120, 260)

# name -> family (registry model), flavor, the tower's module in the built model, its inputs (grids in patches
# (t, h, w), clips in mel frames, or images as (h, w) patches), the host metadata builder and the family's FLOP
# counter; buckets: its metadata takes --bucket (build_vision_meta's / build_window_meta's bucketed patch counts);
# tiny: the smoke's
TOWERS: dict[str, dict] = {
    "qwen3_vl_vit": dict(model="qwen3_vl", flavor="2B", module="visual", grids=[(1, 32, 32)] * 8,
                         meta=build_vision_meta, flops=vl3_flops.vision_flops, buckets=True,
                         tiny=dict(flavor="debug", grids=[(1, 8, 8), (1, 4, 6), (1, 6, 10)])),
    "qwen2_5_vl_vit": dict(model="qwen2_5_vl", flavor="7B", module="visual", grids=[(1, 36, 36)] * 8,
                           meta=build_window_meta, flops=vl25_flops.vision_flops, buckets=True,
                           tiny=dict(flavor="debug", grids=[(1, 8, 8), (1, 4, 6), (1, 6, 10)])),
    "qwen2_5_omni_audio": dict(model="qwen2_5_omni", flavor="7B", module="audio_tower", clips=CLIPS,
                               meta=omni_audio.build_audio_meta, flops=omni_flops.audio_flops,
                               tiny=dict(flavor="debug", clips=TINY_CLIPS)),
    "qwen3_omni_moe_audio": dict(model="qwen3_omni_moe", flavor="30B-A3B", module="audio_tower", clips=CLIPS,
                                 meta=omni3_audio.build_audio_meta, flops=omni3_flops.audio_flops,
                                 tiny=dict(flavor="debug", clips=TINY_CLIPS)),
    "bagel_vit": dict(model="bagel", flavor="7B-MoT", module="vit", images=[(32, 32)] * 8, meta=vit_meta,
                      flops=bagel_flops.vit_flops, tiny=dict(flavor="debug", images=[(4, 4), (2, 3), (3, 5)])),
}

COMPILE = ("blocks", "whole", "graphs", "autotune", "none")
"""--compile's modes (module docstring); the rows record theirs (``compile``)."""
WHOLE = {"whole": {}, "graphs": {"mode": "reduce-overhead"}, "autotune": {"mode": "max-autotune"}}
"""The modes that compile the tower as one graph -> torch.compile's arguments (the last two under CUDA graphs)."""
ALIGN = 64
"""The floor's aligned GEMMs round K and N up to a multiple of this."""

# the CPU's ops (self time) by kind; first match wins, the rest is elementwise
CPU_RULES = (("attention", ("attention", "sdpa", "flash", "softmax")),
             ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "convolution", "aten::_convolution")),
             ("norms", ("norm", "rsqrt")))
# the table's columns: bench/profile_split.py's categories, norms and the memory-bound rest taken together
COLUMNS = (("GEMM", ("gemm",)), ("attention", ("attention",)),
           ("norms + elementwise", ("norms", "elementwise", "copies")),
           ("other", ("other", "loss", "moe_routing", "moe_permute", "optimizer", "comm")), ("idle", ("idle",)))


def tower_config(name: str, tiny: bool, device: torch.device, kernel_ops: str = "all"):
    """(tower spec with the tiny shape applied, family config with the trainer's runtime on ``device``; on CUDA
    the kernels ``kernel_ops`` names, titan_mm.kernels.resolve_ops' spec)."""
    t = dict(TOWERS[name])
    small = t.pop("tiny")
    if tiny:
        t.update(small)
    cuda = device.type == "cuda"
    _, cfg = resolve_model(t["model"], t["flavor"], attn_backend="flex" if cuda else "sdpa",
                           kernels=kernel_ops if cuda else False)
    return t, cfg


def encoder_config(t: dict, cfg):
    return cfg.audio if "clips" in t else cfg.vit_config if "images" in t else cfg.vision


def attn_backend(t: dict, cfg, device: torch.device) -> str:
    """The tower's attention backend as the trainer picks it: the VL / Omni encoders' own (``vision_backend``),
    BAGEL's ViT the model's."""
    return cfg.attn_backend if "images" in t else vision_backend(cfg, device)


def build_tower(t: dict, cfg, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The family's tower: the whole model built on meta (its own ops and kernels), the tower taken out,
    materialized here and initialized by its own init_weights (audio: its sinusoid table too)."""
    with torch.device("meta"):
        model = get_model_spec(t["model"]).build(cfg)
    tower = model.get_submodule(t["module"])
    tower.to_empty(device=device)
    tower.init_weights()
    if "clips" in t:
        tower.init_buffers(device)
    return tower.to(dtype)


def tower_inputs(t: dict, cfg, device: torch.device, seed: int = 0, bucket: int = 0):
    """(input tensor, the tower's other inputs (its host metadata on the device), training FLOPs, inputs'
    description, encoder tokens). ``bucket``: the patch count rounded up to a multiple of it (towers with
    ``buckets``); the FLOPs stay the real patches' (the padding is work the bucket adds, not the model's)."""
    g = torch.Generator().manual_seed(seed)
    enc = encoder_config(t, cfg)
    backend = attn_backend(t, cfg, device)
    if "clips" in t:
        lens = torch.tensor(t["clips"])
        x = torch.randn(enc.num_mel_bins, int(lens.sum()), generator=g)
        meta = t["meta"](lens, enc, backend, device)
        return x.to(device), (meta,), t["flops"](enc, lens), f"{len(lens)} clips, {int(lens.sum())} mel frames", \
            int(meta.attn.cu_seqlens[-1])
    if "images" in t:  # BAGEL's NaViT: patches side by side, their position-table indices, the per-image mask
        lens = torch.tensor([h * w for h, w in t["images"]])
        n = int(lens.sum())
        pos = torch.cat([flat_positions(h, w, cfg.vit_max_num_patch_per_side) for h, w in t["images"]])
        x = torch.randn(n, enc.patch_dim, generator=g)
        return x.to(device), (pos.to(device), t["meta"](cfg, lens, device)), t["flops"](cfg, lens), \
            f"{len(lens)} images, {n} patches", n
    grid = torch.tensor(t["grids"])
    n = int(grid.prod(-1).sum())
    x = torch.randn(n, enc.patch_dim, generator=g)
    meta = t["meta"](grid, enc, backend, device, bucket=bucket)
    return x.to(device), (meta,), t["flops"](enc, grid), f"{len(grid)} images, {n} patches", n


def varied(t: dict, i: int, tiny: bool) -> dict:
    """Input set ``i`` of --vary: as many images (clips) as the tower's, of sizes drawn from seed ``i``: image sides
    16-48 patches (tiny: 2-10; BAGEL's 2-8) in steps of 2 (the merge), clips 10-30 s (tiny: 20-300 frames)."""
    g = torch.Generator().manual_seed(1000 + i)
    if "clips" in t:
        lo, hi = (20, 300) if tiny else (1000, 3000)
        return dict(t, clips=tuple(torch.randint(lo, hi + 1, (len(t["clips"]),), generator=g).tolist()))
    key = "images" if "images" in t else "grids"
    lo, hi = (1, 4 if key == "images" else 5) if tiny else (8, 24)  # the debug BAGEL's position table: 8 a side
    sides = (2 * torch.randint(lo, hi + 1, (len(t[key]), 2), generator=g)).tolist()
    return dict(t, **{key: [(h, w) if key == "images" else (1, h, w) for h, w in sides]})


def compile_tower(tower: torch.nn.Module, mode: str) -> None:
    if mode == "blocks":  # the trainer's compile units
        for blk in tower.blocks:
            blk.compile()
    elif mode in WHOLE:
        tower.compile(**WHOLE[mode])


class _Calls(TorchDispatchMode):
    """Records the shapes of every 2-D matmul (aten.mm / aten.addmm: the linears, whichever way they are called, a
    module or F.linear inside a fused op; attention's batched products are not 2-D) as (M, K, N), and every
    convolution's arguments (input and weight shapes, bias, stride, padding, dilation, groups)."""

    def __init__(self):
        super().__init__()
        self.mms: list[tuple[int, int, int]] = []
        self.convs: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2:]
            self.mms.append((a.shape[0], a.shape[1], b.shape[1]))
        elif func is torch.ops.aten.convolution.default:
            x, w, b, stride, padding, dilation, _transposed, _out_pad, groups = args
            self.convs.append((tuple(x.shape), tuple(w.shape), b is not None, tuple(stride), tuple(padding),
                               tuple(dilation), groups))
        return func(*args, **(kwargs or {}))


def tower_calls(tower: torch.nn.Module, t: dict, cfg, device: torch.device, bucket: int = 0) -> _Calls:
    """The GEMMs and convolutions of one forward of the (not yet compiled) tower on ``t``'s inputs. BAGEL's ViT
    attends through sdpa here: flex's eager path runs under torch.compile, which refuses a dispatch mode (the
    attention's products are not recorded either way)."""
    if "images" in t:
        cfg = dataclasses.replace(cfg, attn_backend="sdpa")
    x, inputs = tower_inputs(t, cfg, device, bucket=bucket)[:2]
    with torch.no_grad(), _Calls() as rec:
        tower(x, *inputs)
    return rec


def _ms(fn, cuda: bool) -> float:
    """Median ms of ``fn()``: CUDA events (bench/attention.py's timer, bench/floor.py's), or one host-timed call."""
    if cuda:
        return cuda_ms(fn)
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def gemm_ms(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, align: int = 1) -> float:
    """ms of the three training GEMMs (bench/floor.py's gemm_list) of every (M, K, N) in ``shapes``, each shape timed
    alone; K and N rounded up to ``align``."""
    up = (lambda n: math.ceil(n / align) * align)
    total = 0.0
    for (m, k, n), count in Counter(shapes).items():
        ops, _ = gemm_list(m, [(up(k), up(n))], False, device=device, dtype=dtype)
        total += count * _ms(lambda: [op() for op in ops], device.type == "cuda")
    return total


def conv_ms(convs: list[tuple], dtype: torch.dtype, device: torch.device) -> float:
    """ms of every convolution's forward and backward (input, weight and bias gradients), each timed alone."""
    total = 0.0
    for (xs, ws, bias, stride, padding, dilation, groups), count in Counter(convs).items():
        x, w = (torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in (xs, ws))
        b = torch.randn(ws[0], device=device, dtype=dtype, requires_grad=True) if bias else None
        leaves = [t for t in (x, w, b) if t is not None]

        def fwd_bwd():
            y = torch.convolution(x, w, b, stride, padding, dilation, False, [0] * len(stride), groups)
            return torch.autograd.grad(y, leaves, torch.ones_like(y))

        total += count * _ms(fwd_bwd, device.type == "cuda")
    return total


def floor_row(calls: _Calls, flops: float, attention_ms: float, dtype: torch.dtype, device: torch.device) -> dict:
    """The tower's floor (module docstring): the GEMMs alone, as they are and aligned, and the convolutions alone,
    plus the run's attention."""
    shapes = calls.mms
    gemm, aligned = gemm_ms(shapes, dtype, device), gemm_ms(shapes, dtype, device, align=ALIGN)
    conv = conv_ms(calls.convs, dtype, device)
    cuda = device.type == "cuda"
    row = dict(gemm_ms=round(gemm, 3), gemm_aligned_ms=round(aligned, 3), conv_ms=round(conv, 3),
               attention_ms=attention_ms, gemm_flops=sum(6 * m * k * n for m, k, n in shapes), linears=len(shapes),
               convs=len(calls.convs))
    for key, g in (("", gemm), ("_aligned", aligned)):
        row[f"ms{key}"] = round(g + conv + attention_ms, 3)
        row[f"mfu{key}"] = flops / (row[f"ms{key}"] / 1e3) / 1e12 / PEAK_TFLOPS if cuda else None
    return row


def cpu_split(prof, wall_s: float, steps: int) -> dict:
    """ms per step by kind from the ops' self CPU times; idle = the wall time in no op."""
    ms: dict = defaultdict(float)
    for e in prof.key_averages():
        low = e.key.lower()
        kind = next((k for k, keys in CPU_RULES if any(s in low for s in keys)), "elementwise")
        ms[kind] += e.self_cpu_time_total / 1e3 / steps
    busy = sum(ms.values())
    out = {k: round(v, 3) for k, v in ms.items()}
    out["step"] = round(wall_s * 1e3 / steps, 3)
    out["idle"] = round(max(out["step"] - busy, 0.0), 3)
    return out


def run_tower(name: str, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t, cfg = tower_config(name, args.tiny, device, args.kernel_ops)
    torch.manual_seed(0)
    tower = build_tower(t, cfg, device, dtype)
    sets = [tower_inputs(varied(t, i, args.tiny) if args.vary else t, cfg, device, seed=i, bucket=args.bucket)
            for i in range(max(args.vary, 1))]
    flops = statistics.mean(s[2] for s in sets)
    what, tokens = (sets[0][3], sets[0][4]) if not args.vary else (f"{args.vary} input sets like {sets[0][3]}",
                                                                    round(statistics.mean(s[4] for s in sets)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = [0]
    mode = args.compile if cuda else "none"

    def step():
        x, inputs = sets[calls[0] % len(sets)][:2]  # --vary: the next input set, as a trainer's next micro-batch
        calls[0] += 1
        if WHOLE.get(mode):  # CUDA graphs, a new iteration: the graphs' last outputs are free to overwrite
            torch.compiler.cudagraph_mark_step_begin()
        tower.zero_grad(set_to_none=True)  # as the trainer's update leaves them: no add into last step's
        out = tower(x, *inputs)
        outs = [out[0], *out[1]] if isinstance(out, tuple) else [out]  # the ViTs: (merged, DeepStack features)
        sum(o.float().square().mean() for o in outs).backward()

    if cuda:  # the kernels' launch configs picked before the timed steps, as the trainer's tune_kernels does
        with kernel_tuning():  # (eager: the compiled blocks then find every key tuned)
            step()
        sync()
    calls_seen = tower_calls(tower, varied(t, 0, args.tiny) if args.vary else t, cfg, device, args.bucket) \
        if args.floor else None  # eager, before compile: the first input set's
    compile_tower(tower, mode)
    for _ in range(args.warmup):
        step()
    sync()
    times, _ = step_times(step, args.steps, cuda)  # back to back, as inside a training step (bench/timing.py)
    med = statistics.median(times)
    prof_steps = 2
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(prof_steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    if cuda:
        with tempfile.TemporaryDirectory() as d:
            trace = Path(d) / "trace.json"
            prof.export_chrome_trace(str(trace))
            split_ms, kernels = split_gpu(load_events(trace), steps=prof_steps)
            # what the host ran while the GPU waited (bench/trace_gaps.py): the towers' idle is most of their step
            idle_by_op = dict(list(summarize(trace)["idle_by_host_op_ms"].items())[:5])
    else:
        split_ms, kernels, idle_by_op = cpu_split(prof, wall, prof_steps), {}, None
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        (Path(args.profile_dir) / f"towers_{name}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=100)
            + "\n\n" + json.dumps(kernels, indent=1))
    tflops = flops / med / 1e12
    floor = None if calls_seen is None else floor_row(calls_seen, flops, split_ms.get("attention", 0.0), dtype,
                                                      device)
    return dict(tower=name, model=t["model"], flavor=t["flavor"], inputs=what, tokens=tokens,
                backend=attn_backend(t, cfg, device), compile=mode, floor=floor,
                dtype=str(dtype).removeprefix("torch."), flops=flops, step_time_s=med, tflops=tflops,
                mfu=tflops / PEAK_TFLOPS if cuda else None, profile_ms=split_ms, profile_idle_by_host_op_ms=idle_by_op,
                peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                timing=timing_label(cuda), warmup=args.warmup, steps=args.steps, tiny=args.tiny,
                bucket=args.bucket or None, vary=args.vary or None, fresh_grads=True,
                kernel_ops=args.kernel_ops if cuda and args.kernel_ops != "all" else None)


def render(rows: list[dict]) -> str:
    """The towers table: one row per (tower, device), the split as ms per step."""
    head = ["tower", "device", "flavor", "inputs", "step ms", "TFLOP/s", "MFU", *(c for c, _ in COLUMNS)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (list(TOWERS).index(r["tower"]) if r["tower"] in TOWERS else 99,
                                         device_of(r) or "")):
        dev = device_label(device_of(r))
        if "error" in r:
            out.append(f"| {r['tower']} | {dev} | failed: {r['error'][:80]} |" + " |" * (len(head) - 3))
            continue
        p = r["profile_ms"]
        name = _label(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a (CPU)"
        parts = [f"{sum(p.get(k, 0.0) for k in keys):.1f}" for _, keys in COLUMNS]
        out.append(f"| {name} | {dev} | {r['model']} {r['flavor']} | {r['inputs']} | {1e3 * r['step_time_s']:.1f} "
                   f"| {r['tflops']:.3g} | {mfu} | " + " | ".join(parts) + " |")
    return "\n".join(out)


def _label(r: dict) -> str:
    """The row's name: the tower, and what it ran with besides the defaults (compile: blocks on a GPU)."""
    mode = _mode(r)
    shown = mode != "blocks" and device_of(r) != "cpu"
    return r["tower"] + (f" (bucket {r['bucket']})" if r.get("bucket") else "") \
        + (f" (vary {r['vary']})" if r.get("vary") else "") + (f" (compile {mode})" if shown else "") \
        + (f" (ops {r['kernel_ops']})" if r.get("kernel_ops") else "")


def _mode(r: dict) -> str:
    """The row's --compile mode (rows before the option say ``compiled``: blocks, or none)."""
    return r.get("compile") or ("blocks" if r.get("compiled") else "none")


def render_floor(rows: list[dict]) -> str:
    """The floors' table (rows run with --floor), or "" when there are none."""
    rows = [r for r in rows if r.get("floor")]
    if not rows:
        return ""
    out = ["| tower | device | step ms | MFU | GEMMs alone ms | aligned to 64 | convolutions ms | attention ms | "
           "floor MFU | aligned floor MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
    pct = (lambda v: "n/a (CPU)" if v is None else f"{100 * v:.1f}%")
    for r in rows:
        f = r["floor"]
        out.append(f"| {_label(r)} | {device_label(device_of(r))} | {1e3 * r['step_time_s']:.1f} | {pct(r['mfu'])} "
                   f"| {f['gemm_ms']:.1f} | {f['gemm_aligned_ms']:.1f} | {f['conv_ms']:.1f} | {f['attention_ms']:.1f} "
                   f"| {pct(f['mfu'])} | {pct(f['mfu_aligned'])} |")
    return "\n".join(out)


def render_doc(paths: list[Path]) -> str:
    """The block docs/efficiency.md includes: the GPU results' table, or what to run while there are none."""
    rows = [r for p in paths for r in json.loads(p.read_text())["rows"] if device_of(r) != "cpu"]
    if not rows:
        return ("Not measured on a GPU yet: `python3 bench/towers.py` on the GPU machine writes "
                "`bench/results/towers_<device>.json`; then `python3 bench/towers.py --doc docs/efficiency.md`.")
    return (f"The encoders alone, forward + backward (`bench/towers.py`; "
            f"{', '.join(f'`bench/results/{p.name}`' for p in paths)}): ms per step by kernel kind, MFU of the "
            f"tower's own FLOPs against {PEAK_TFLOPS:.0f} TFLOP/s.\n\n" + render(rows)
            + ("\n\nFloors (`--floor`: the linears' GEMMs timed alone, plus the run's attention kernels):\n\n"
               + render_floor(rows) if render_floor(rows) else ""))


def write_rows(out: Path, rows: list[dict]) -> None:
    """Merge into ``out``: a row replaces the earlier one of its tower, device, shape (tiny or not) and bucket."""
    def key(r):
        return r["tower"], device_of(r), r.get("tiny"), r.get("bucket"), r.get("vary"), _mode(r), r.get("kernel_ops")

    prev = json.loads(out.read_text())["rows"] if out.exists() else []
    new = {key(r) for r in rows}
    keep = [r for r in prev if key(r) not in new]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"peak_tflops": PEAK_TFLOPS, "rows": keep + rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--towers", default=",".join(TOWERS), help=f"comma list of {list(TOWERS)}")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (fp32, eager; with --tiny: the smoke)")
    ap.add_argument("--tiny", action="store_true", help="the families' debug flavors at a few small inputs")
    ap.add_argument("--compile", choices=COMPILE, default="blocks", help="CUDA: compile each block (the trainer's "
                    "units), the whole tower, the whole tower under CUDA graphs (with max-autotune GEMMs: "
                    "autotune), or none (the CPU runs eager)")
    ap.add_argument("--kernel-ops", default="all", help="CUDA: which titan_mm.kernels ops the towers run (a "
                    "kernels.ops spec, e.g. all,-bias_gelu: inductor's own GELU, which --compile autotune can fuse "
                    "into a GEMM); the row records a spec other than all")
    ap.add_argument("--floor", action="store_true", help="also time every linear's GEMMs alone: the tower's floor")
    ap.add_argument("--bucket", type=int, default=0, help="the ViT's patch count rounded up to a multiple of this "
                    "(build_vision_meta's bucket; towers with buckets only); the row records it and keys on it")
    ap.add_argument("--vary", type=int, default=0, help="N input sets of drawn sizes, one per step in turn (a "
                    "trainer's micro-batches: new shapes recompile unless --bucket repeats them); FLOPs: their mean")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="", help="results JSON (default bench/results/towers_<device>.json)")
    ap.add_argument("--profile-dir", default="", help="also write each tower's kernel table here")
    ap.add_argument("--render", default="", help="print the table of this results JSON and exit")
    ap.add_argument("--doc", default="", help="replace the text between the towers markers here (the GPU results "
                    "bench/results/towers_*.json, or --render's file) and exit")
    args = ap.parse_args(argv)
    names = [n for n in args.towers.split(",") if n]
    unknown = [n for n in names if n not in TOWERS]
    if unknown:
        ap.error(f"--towers: unknown {unknown}; choose from {list(TOWERS)}")
    no_bucket = [n for n in names if args.bucket and not TOWERS[n].get("buckets")]
    if no_bucket:
        ap.error(f"--bucket {args.bucket}: {no_bucket} take no bucket; give --towers "
                 f"{','.join(n for n in TOWERS if TOWERS[n].get('buckets'))} with it")
    if args.doc:
        paths = [Path(args.render)] if args.render else sorted((ROOT / "bench/results").glob("towers_*.json"))
        doc = Path(args.doc).read_text()
        a, b = "<!-- towers:begin -->", "<!-- towers:end -->"
        if a not in doc or b not in doc:
            ap.error(f"{args.doc} has no {a} ... {b} markers; add them where the table goes")
        Path(args.doc).write_text(doc[: doc.index(a) + len(a)] + "\n" + render_doc(paths) + "\n" + doc[doc.index(b):])
        return 0
    if args.render:
        print(render(json.loads(Path(args.render).read_text())["rows"]))
        return 0
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device here: run on the GPU machine, or give --cpu (with --tiny for the smoke)")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out = Path(args.out) if args.out else \
        ROOT / "bench/results" / f"towers_{device_slug(torch.cuda.get_device_name() if not args.cpu else 'cpu')}.json"
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            r = run_tower(name, args, device)
        except Exception as e:  # one tower's failure is its row; the others still run
            r = dict(tower=name, device=torch.cuda.get_device_name() if not args.cpu else "cpu",
                     error=f"{type(e).__name__}: {e}", tiny=args.tiny)
        rows.append(r)
        write_rows(out, rows)  # after every tower: a run cut short keeps what it measured
        print(f"[{time.perf_counter() - t0:5.0f}s] {name}: " + (
            f"{1e3 * r['step_time_s']:.1f} ms, {r['tflops']:.1f} TFLOP/s" if "error" not in r else r["error"]),
            flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(render(rows))
    print(render_floor(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
