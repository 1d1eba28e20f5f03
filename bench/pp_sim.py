"""Step time and memory of each pipeline schedule, predicted from measured per-block costs.

Two parts:

``measure`` (one H200; ``--device cpu --tiny`` for a smoke test): for each shape below, builds titan_mm's own model
(registry flavor, one decoder block, the tensor-parallel shard's widths: heads, kv heads, MLP and vocabulary / tp;
bf16, flex attention, the Triton kernels) and times with CUDA events, at the shape's micro-batch: one block's
forward, its full backward and its input-gradient-only backward (``autograd.grad`` w.r.t. the block input; the
weight-gradient part W = B - I), the embedding's forward / backward, the head + loss forward / backward, and for the
VL recipe the vision tower on its patches per micro-batch. It records the bytes one block saves for its backward
(saved-tensor hooks) and the activation bytes sent between stages.

``simulate`` (anywhere, seconds): replays each schedule's own action list (titan_mm.parallel.pp_schedule) with those
costs for 8 to 64 stages (pp ranks x stages per rank): a stage of n blocks costs n x block (+ the embedding / vision
tower on stage 0, the head and loss on the last; the blocks are split so that the stages' times come out even), a
send between ranks costs bytes / link bandwidth. Reports the step time, the bubble, the tokens / s per GPU relative
to 1F1B, the peak activations of the worst rank, and the worst rank's total peak from the memory estimator
(titan_mm.parallel.memory with the shape's topology). Also the same replay for the Llama-3.1-405B shape torchtitan
published (512 H100: 8 pp x 8 tp x 8 FSDP; Interleaved1F1B +28% over 1F1B), from a 405B block measured the same way.
Schedules are compared on the same ranks (pp) and micro-batches: tokens / s per GPU relative to 1F1B.

    python bench/pp_sim.py measure --out bench/results/pp_blocks_h200.json        # on the H200 (minutes)
    python bench/pp_sim.py simulate --blocks bench/results/pp_blocks_h200.json    # -> bench/results/pp_sim.json
    python bench/pp_sim.py measure --device cpu --tiny --out /tmp/b.json        # CPU smoke, then:
    python bench/pp_sim.py simulate --blocks /tmp/b.json --out /tmp/s.json

Not modelled: tensor-parallel and expert-parallel collectives inside a block (the block is timed on its tp shard
alone), FSDP all-gathers / reduce-scatters, overlap of sends with compute, DualPipeV's overlapped F + B pairs (run
one after the other here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# name -> registry model / flavor, tp (widths divided by it), micro-batch rows x tokens, vision patches per
# micro-batch (0: text), the topology of the estimate, and the stage counts simulated. Qwen3-32B: the 4D recipe
# (train_configs/qwen3_32b_4d.toml: dp 2 x tp 8 x pp 4); Qwen3-VL-30B-A3B: the PP recipe (qwen3_vl_moe_pp.toml).
SHAPES: dict[str, dict] = {
    "qwen3_8b": dict(model="qwen3", flavor="8B", tp=1, rows=1, seq=8192, patches=0,
                     topo=dict(dp_shard=8, ac="selective"), pp=(4, 8, 16, 32)),
    "qwen3_32b": dict(model="qwen3", flavor="32B", tp=8, rows=1, seq=8192, patches=0,  # no AC, as its recipe
                      topo=dict(dp_shard=2, tp=8), pp=(4, 8, 16, 32)),
    "qwen3_vl_30b_a3b": dict(model="qwen3_vl_moe", flavor="30B-A3B", tp=1, rows=1, seq=8192, patches=16384,
                             topo=dict(dp_shard=8, ep=8, ac="full"), pp=(4, 8, 16, 24)),
    # torchtitan's published 405B run (Llama-3.1-405B shapes on a Qwen3 block without qk-norm: same matmuls)
    "llama3_405b": dict(model="qwen3", flavor="32B", tp=8, rows=1, seq=8192, patches=0,
                        overrides=dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=53248,
                                       vocab_size=128256, qk_norm=False),
                        topo=dict(dp_shard=8, tp=8, ac="full"), pp=(8,)),
}
TINY = dict(model="qwen3", flavor="debug", tp=1, rows=1, seq=128, patches=0, topo=dict(), pp=(2,), min_stages=2,
            overrides={"vocab_size": 1024})
TINY_VL = dict(model="qwen3_vl_moe", flavor="debug", tp=1, rows=1, seq=256, patches=64, topo=dict(), pp=(2,),
               min_stages=2,
               overrides={"tie_word_embeddings": False})
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
NVLINK_GBS, IB_GBS = 400.0, 45.0  # per-GPU unidirectional bandwidth for stage sends (within / across 8-GPU nodes)


# ------------------------------------------------------------------------------------------------ measure
def _local_overrides(spec, full, tp: int) -> dict:
    """One decoder block at the tp shard's widths: heads, kv heads, MLP and vocabulary / tp."""
    d = spec.dims(full)
    text = dict(num_hidden_layers=1, num_attention_heads=max(1, d.num_heads // tp),
                num_key_value_heads=max(1, d.num_kv_heads // tp), vocab_size=d.vocab_size // tp)
    if d.intermediate_size:
        text["intermediate_size"] = d.intermediate_size // tp
    return {"text": text} if d.vision is not None else text


def _timer(device):
    import torch

    if device.type == "cuda":
        def run(fn, iters):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3 / iters
    else:
        def run(fn, iters):
            fn()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters
    return run


def measure_shape(name: str, shape: dict, device, iters: int) -> dict:
    import torch

    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.nn.output import Stream
    from titan_mm.registry import get_model_spec, override, resolve_model

    spec = get_model_spec(shape["model"])
    cuda = device.type == "cuda"
    _, full = resolve_model(shape["model"], shape["flavor"], None, None, attn_backend="flex" if cuda else "sdpa",
                            kernels="all" if cuda else False)
    if shape.get("overrides"):
        full = override(full, shape["overrides"])
    mc = override(full, _local_overrides(spec, full, shape["tp"]))
    dt = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build(mc)
    model.to(dt)
    model.init_weights(buffer_device=device)
    dims = spec.dims(mc)
    B, S, D = shape["rows"], shape["seq"], dims.hidden_size
    ids = torch.randint(0, dims.vocab_size, (B, S), device=device)
    batch = {"input_ids": ids.cpu(), "labels": ids.roll(-1, 1).cpu(), "doc_ids": torch.zeros(B, S, dtype=torch.int32)}
    attn = build_attn_meta(batch, spec.runtime(mc).attn_backend, device)
    pos = torch.arange(S, device=device)[None].expand(B, S)
    rope = model.rope(pos, dt)
    run = _timer(device)
    h0 = torch.randn(B, S, D, device=device, dtype=dt, requires_grad=True)
    g = torch.randn_like(h0)
    blk = model.trunk

    def fwd():
        return blk(Stream(h0), rope, attn, 0, 1).h

    out = {"name": name, "shape": {k: v for k, v in shape.items() if k != "pp"}, "device": str(device),
           "dtype": str(dt), "tokens": B * S, "send_bytes": B * S * D * h0.element_size()}
    with torch.no_grad():
        out["block_fwd_s"] = run(fwd, iters)
    y = fwd()
    out["block_bwd_s"] = run(lambda: torch.autograd.backward(y, g, retain_graph=True), iters)
    out["block_bwd_input_s"] = run(lambda: torch.autograd.grad(y, h0, g, retain_graph=True), iters)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()
    out["block_saved_bytes"] = sum(saved.values())
    model.zero_grad(set_to_none=True)
    # embedding (+ the vision tower for VL) and head + loss
    extra, ids_d = {}, ids
    if shape["patches"] and dims.vision is not None:  # a packed image + text row: its ids hold the image pads
        extra, ids_d = _vision_inputs(spec, mc, shape, device, dt)

    def emb():
        return model.embed(ids_d, **extra).h

    with torch.no_grad():
        out["embed_fwd_s"] = run(emb, iters)
    e = emb()
    ge = torch.randn_like(e)
    out["embed_bwd_s"] = run(lambda: torch.autograd.backward(e, ge, retain_graph=True), iters)
    labels = batch["labels"].to(device)
    hh = torch.randn(B, S, D, device=device, dtype=dt, requires_grad=True)

    def head():
        return model.head(Stream(hh), attn, labels).loss_sum

    with torch.no_grad():
        out["head_fwd_s"] = run(head, iters)
    lo = head()
    out["head_bwd_s"] = run(lambda: torch.autograd.backward(lo, retain_graph=True), iters)
    out["layers"] = spec.dims(full).num_layers
    return out


def _vision_inputs(spec, mc, shape, device, dt):
    import torch

    from titan_mm.models.qwen3_vl.synthetic import make_sample, pack  # a family's synthetic rows (bench only)

    side = int((shape["patches"]) ** 0.5)
    g = torch.Generator().manual_seed(0)
    m2 = spec.data_needs(mc).merge_size ** 2
    n_tok = shape["patches"] // m2
    sample = make_sample(mc, [("image", (side, side)), ("text", max(1, shape["seq"] - n_tok - 2))], g)
    b = pack([sample], mc, seq_len=shape["seq"])
    b = spec.prepare_batch(mc, b, device)
    return ({"pixel_values": b["pixel_values"].to(device, dt), "vision_meta": b["vision_meta"],
             "visual_index": b["visual_index"].to(device)}, b["input_ids"].to(device))


def cmd_measure(a) -> None:
    import torch

    device = torch.device(a.device)
    shapes = {"tiny": TINY, "tiny_vl": TINY_VL} if a.tiny else {k: SHAPES[k] for k in (a.shapes or SHAPES)}
    rows = []
    for name, shape in shapes.items():
        rows.append(measure_shape(name, shape, device, a.iters))
        print(json.dumps(rows[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()
                                       if device.type == "cuda" else "cpu", "rows": rows}, indent=1))
    print(f"wrote {a.out}")


# ------------------------------------------------------------------------------------------------ simulate
def stage_costs(m: dict, counts: list[int]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage (F, I, W, saved activation bytes per micro-batch) of a split ``counts`` (blocks per stage)."""
    f, bi = m["block_fwd_s"], m["block_bwd_input_s"]
    bw = max(0.0, m["block_bwd_s"] - bi)
    F = [n * f for n in counts]
    I = [n * bi for n in counts]  # noqa: E741
    W = [n * bw for n in counts]
    A = [n * m["block_saved_bytes"] for n in counts]
    F[0] += m["embed_fwd_s"]
    I[0] += m["embed_bwd_s"]  # the embedding / vision tower have no input gradient to hand on: all of it here
    F[-1] += m["head_fwd_s"]
    I[-1] += m["head_bwd_s"]
    return F, I, W, A


def simulate_shape(m: dict, micro=(8, 16, 32, 64)) -> list[dict]:
    """Every schedule at each pipeline degree of the shape (ranks; stages = pp x stages per rank, 8 to 64, and
    Interleaved1F1B also with 4 stages per rank) and micro-batch count."""
    from titan_mm.parallel.pipeline import balanced_split
    from titan_mm.parallel.pp_schedule import action_lists, replay, virtual_stages

    shape = SHAPES.get(m["name"]) or (TINY if m["name"] == "tiny" else TINY_VL)
    L = m["layers"]
    rows = []
    for pp in shape["pp"]:
        for sched in SCHEDULES:
            for v in ((2, 4) if sched == "Interleaved1F1B" else (virtual_stages(sched),)):
                n_stages = pp * v
                if n_stages > L + 2 or n_stages < shape.get("min_stages", 8):
                    continue
                # the split that evens out the stages' time (the embedding / vision tower and the head are fixed time
                # of the first / last stage): what parallel.pp_layers_per_stage would be set to for speed
                blk = m["block_fwd_s"] + m["block_bwd_s"]
                fixed = [0.0] * n_stages
                fixed[0] += m["embed_fwd_s"] + m["embed_bwd_s"]
                fixed[-1] += m["head_fwd_s"] + m["head_bwd_s"]
                counts = balanced_split(L, n_stages, [blk] * n_stages, fixed)
                F, I, W, A = stage_costs(m, counts)
                # consecutive pp ranks sit on other nodes once a stage's tp group fills a node (8 GPUs)
                bw = NVLINK_GBS if pp * shape["topo"].get("tp", 1) <= 8 else IB_GBS
                comm = m["send_bytes"] / (bw * 1e9)
                for M in micro:
                    row = dict(shape=m["name"], schedule=sched, pp=pp, v=v, stages=n_stages, micro=M)
                    if M < pp:
                        continue
                    try:
                        t = replay(action_lists(sched, pp, v, M), F, I, W, comm=comm, act_bytes=A)
                    except ValueError as e:
                        rows.append(dict(row, error=str(e)))
                        continue
                    rows.append(dict(row, split=counts, step_s=t.makespan, bubble=t.bubble,
                                     act_peak_gib=max(t.peak_bytes.values()) / 2**30,
                                     tokens_per_s_per_rank=M * m["tokens"] / t.makespan / pp))
    # throughput relative to 1F1B on the same ranks and micro-batches
    base = {(r["pp"], r["micro"]): r["tokens_per_s_per_rank"] for r in rows
            if r["schedule"] == "1F1B" and "step_s" in r}
    for r in rows:
        if "step_s" in r and (r["pp"], r["micro"]) in base:
            r["vs_1f1b"] = r["tokens_per_s_per_rank"] / base[(r["pp"], r["micro"])]
    return rows


def estimator_peaks(m: dict, rows: list[dict]) -> None:
    """The memory estimator's worst-rank peak (GiB) for each row's pipeline on the shape's topology."""
    from titan_mm.parallel.memory import GiB, Topology, estimate_phases, peak_phase
    from titan_mm.registry import get_model_spec, override

    shape = SHAPES.get(m["name"])
    if shape is None:
        return
    spec = get_model_spec(shape["model"])
    mc = spec.flavor(shape["flavor"])
    if shape.get("overrides"):
        mc = override(mc, shape["overrides"])
    plan = spec.plan(mc)
    for r in rows:
        if "step_s" not in r:
            continue
        topo = Topology(**shape["topo"], pp=r["pp"], pp_schedule=r["schedule"], pp_virtual=r["v"], pp_micro=r["micro"])
        try:
            ph = estimate_phases(mc, plan, topo, shape["seq"], shape["rows"], 2, vision_patches=shape["patches"],
                                 kernels=True)
        except ValueError as e:
            r["estimate_error"] = str(e)
            continue
        k = peak_phase(ph)
        r["estimate_peak_gib"], r["estimate_peak_at"] = ph[k]["total"] / GiB, k


def markdown(rows: list[dict], micro: int = 32) -> str:
    out = ["| shape | stages | schedule | pp x v | micro | step s | bubble | vs 1F1B | act peak GiB | est. peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "step_s" not in r or r["micro"] != micro:
            continue
        est = f"{r['estimate_peak_gib']:.1f}" if "estimate_peak_gib" in r else "-"
        out.append(f"| {r['shape']} | {r['stages']} | {r['schedule']} | {r['pp']} x {r['v']} | {r['micro']} | "
                   f"{r['step_s']:.3f} | {r['bubble']:.3f} | {r.get('vs_1f1b', 1.0):.3f} | {r['act_peak_gib']:.2f} | "
                   f"{est} |")
    return "\n".join(out)


def cmd_simulate(a) -> None:
    blocks = json.loads(Path(a.blocks).read_text())
    rows = []
    for m in blocks["rows"]:
        r = simulate_shape(m)
        if not a.no_estimate:
            estimator_peaks(m, r)
        rows += r
    Path(a.out).write_text(json.dumps({"blocks": a.blocks, "measured_on": blocks.get("gpu"), "rows": rows}, indent=1))
    print(markdown(rows, a.micro))
    print(f"wrote {a.out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--device", default="cuda")
    m.add_argument("--tiny", action="store_true", help="tiny CPU shapes (smoke test)")
    m.add_argument("--shapes", nargs="*", help=f"subset of {list(SHAPES)}")
    m.add_argument("--iters", type=int, default=10)
    m.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp_blocks_h200.json"))
    s = sub.add_parser("simulate")
    s.add_argument("--blocks", default=str(ROOT / "bench" / "results" / "pp_blocks_h200.json"))
    s.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp_sim.json"))
    s.add_argument("--micro", type=int, default=32, help="micro-batches of the printed table")
    s.add_argument("--no-estimate", action="store_true", help="skip the memory estimator column")
    a = ap.parse_args(argv)
    (cmd_measure if a.cmd == "measure" else cmd_simulate)(a)


if __name__ == "__main__":
    main()
