"""Fit the workload-balancing cost model (titan_mm.data.balance.CostCoefficients) on the GPU, then check it on
batches of the skewed mix of bench/balance_sim.py.

1. Design: single packed rows that move each RowCost term on its own: tokens (rows of 1/4, 1/2 and all of
   ``--seq-len``), sum L^2 (1 to 16 documents per row), and for vision families patches and sum P^2 (images of
   1/8 to all of the largest side that fits half a row, few large or many small, text around them). Each row is
   timed alone, forward + backward through the train step's own path (titan_mm.train.step.forward_backward:
   the family's prepare_batch, the attention metadata, the loss), with CUDA events after one warm-up run, the
   median of ``--reps``.
2. Depth: the decoder is cut to each of ``--layers`` (default 4 and 8 blocks) and the design timed at each; the
   vision tower keeps its full depth. At depth n a row costs
       c_row + n c_layer + tokens (f_tok + n l_tok) + n l_attn sum L^2 + v_patch patches + v_attn sum P^2
   (c_*: fixed per row, launches and host-side metadata; f_tok: embedding, head and loss), fitted by
   non-negative least squares on the relative error (numpy). The file's entry is the full depth N:
   a_tok = f_tok + N l_tok + (c_row + N c_layer) / seq_len (every row the loader makes is seq_len long),
   a_attn = N l_attn, the vision terms as fitted.
3. Validation: ``--batches`` batches of ``--rows`` rows of the skewed mix (its text documents only for a text
   family), packed by BestFitPacker into rows of ``--seq-len`` and padded as the loader pads them; each row is a
   micro-batch of the same forward_backward call. The fit at the deepest measured depth (or at
   ``--validate-depth``, e.g. the full one, which checks the extrapolation too) predicts each batch
   from its rows' RowCosts (padding not counted, as the loader would count it); the JSON holds the relative
   error per batch, its mean and max against the 10% target.

Runtime: eager blocks (no torch.compile: the design's many row shapes would recompile), bf16 parameters (fp32
on the CPU), decoder attention ``--attn`` (default varlen on CUDA: any row length without a compile; the
trainer's default flex compiles one kernel per shape), the vision tower's own choice (varlen on CUDA), the
Triton kernels ("all", tuned once as the trainer does) on CUDA.

Writes ``--out`` (timings, fit, validation) and next to it ``cost_coefficients.json``: the shipped file
(titan_mm/data/cost_coefficients.json) with the fitted entries put in, the others kept; copy it over the
shipped one to adopt the fit.

    source scripts/gpu_setup.sh && python3 bench/cost_model.py --out $OUT/cost_model.json   # H200, ~4 min
    OMP_NUM_THREADS=1 python bench/cost_model.py --cpu --out /tmp/cm.json                  # debug models, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.balance_sim import MIXES  # noqa: E402
from titan_mm.data.balance import COEFFICIENTS_FILE, CostCoefficients, RowCost, save_coefficients  # noqa: E402
from titan_mm.data.packing import BestFitPacker, Doc, collate_rows  # noqa: E402

TARGET_REL_ERR = 0.10
MIX = "skewed"
# key of the coefficient file -> registry model, flavor, config path of the decoder depth (cut by override), extra
# overrides, the module whose make_sample / pack build the family's image+text samples (None: text family)
VL_SYNTHETIC = "titan_mm.models.qwen3_vl.synthetic"
CASES = {
    "qwen3:1.7b": dict(model="qwen3", flavor="1.7B", depth=("num_hidden_layers",)),
    "qwen3_vl:2b": dict(model="qwen3_vl", flavor="2B", depth=("text", "num_hidden_layers"), synthetic=VL_SYNTHETIC),
    # CPU smoke: a small vocabulary (the LM head dominates a debug model otherwise), the vision ids moved inside it,
    # vision_start lowest (the synthetic text tokens are drawn below it)
    "qwen3:debug": dict(model="qwen3", flavor="debug", depth=("num_hidden_layers",), overrides={"vocab_size": 512}),
    "qwen3_vl:debug": dict(model="qwen3_vl", flavor="debug", depth=("text", "num_hidden_layers"),
                           synthetic=VL_SYNTHETIC, overrides={
                               "image_token_id": 502, "video_token_id": 503, "vision_start_token_id": 500,
                               "vision_end_token_id": 501, "text": {"vocab_size": 512}}),
}
GPU_CASES, CPU_CASES = "qwen3:1.7b,qwen3_vl:2b", "qwen3:debug,qwen3_vl:debug"


# ---------------------------------------------------------------- rows: a row is a list of docs (tokens, [patches])
def row_cost(docs) -> RowCost:
    return RowCost.of([n for n, _ in docs], [p for _, segs in docs for p in segs])


def _even(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


def design_rows(seq_len: int, merge: int, vision: bool, quick: bool = False) -> list[list[tuple[int, list[int]]]]:
    """Text rows: k equal documents in rows of 1/4, 1/2 and all of seq_len. Vision rows (full length): images of
    side s (patches, 1/8 to all of the largest side whose merged tokens fit half a row) filling about 1/4, 1/2 or
    3/4 of the row, one image per document with text to the row's end, and two rows mixing one large image with
    many small ones."""
    rows = []
    for frac in (0.5, 1.0) if quick else (0.25, 0.5, 1.0):
        n = int(seq_len * frac)
        for k in (1, 4, 16) if quick else (1, 2, 4, 8, 16):
            rows.append([(n // k + (i < n % k), []) for i in range(k)])
    if not vision:
        return rows
    tok = lambda s: s * s // merge**2 + 2  # noqa: E731 (merged tokens + vision start / end)
    s_max = _even(math.sqrt(seq_len / 2) * merge, merge)
    sides = sorted({_even(s_max / 2**i, merge) for i in range(4)})
    for s in sides[::2] if quick else sides:
        for fill in (0.5,) if quick else (0.25, 0.5, 0.75):
            k = max(1, min(int(fill * seq_len) // tok(s), (seq_len - 1) // (tok(s) + 1)))
            per = seq_len // k
            rows.append([(per + (seq_len - per * k if i == k - 1 else 0), [s * s]) for i in range(k)])
    small, big = sides[0], sides[-1]
    for n_small in (4, 16):
        used = tok(big) + n_small * tok(small)
        if used < seq_len:
            rows.append([(tok(big) + (seq_len - used) // 2, [big * big]),
                         (n_small * tok(small) + seq_len - used - (seq_len - used) // 2, [small * small] * n_small)])
    return list({row_cost(r): r for r in rows}.values())  # a large image fills any share alike: time it once


def mix_rows(n_rows: int, seq_len: int, vision: bool, seed: int) -> list[list[tuple[int, list[int]]]]:
    """``n_rows`` rows of balance_sim's skewed mix as BestFitPacker packs them (docs longer than a row dropped;
    a text family keeps the mix's text documents only)."""
    rng = np.random.default_rng([seed, 1])
    packer, docs, rows = BestFitPacker(seq_len), [], []
    while len(rows) < n_rows:
        n, segs = MIXES[MIX](rng)
        if n > seq_len or (segs and not vision):
            continue
        ids = np.broadcast_to(np.int64(0), (n,))  # the packer reads lengths only
        packer.add(Doc(ids, ids, sample_id=str(len(docs)), n_patches=sum(segs)))
        docs.append((n, segs))
        while packer.ready and len(rows) < n_rows:
            rows.append([docs[int(d.sample_id)] for d in packer.ready.popleft()])
    return rows


def _grid(p: int, m: int) -> tuple[int, int]:
    """(h, w) patches of an image of p patches, both multiples of the merge size, as square as p allows."""
    for h in range(int(math.isqrt(p)) // m * m, 0, -m):
        if p % h == 0 and (p // h) % m == 0:
            return h, p // h
    raise ValueError(f"{p} patches do not form an image of whole {m}x{m} merge windows")


# ---------------------------------------------------------------- fit
def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |A x - b| over x >= 0 by least squares that drops the columns coming out negative (or all zero)
    and solves again, until none is negative."""
    keep = np.abs(A).sum(axis=0) > 0
    while True:
        x = np.zeros(A.shape[1])
        if keep.any():
            x[keep] = np.linalg.lstsq(A[:, keep], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        keep &= x > 0


def fit(rows: list[RowCost], depths: list[int], seconds: list[float], full_depth: int, row_len: int) -> dict:
    """Per-term rates from rows timed at decoder depths ``depths`` (module docstring, step 2), on relative error,
    with a fixed cost per row (c_row + n c_layer: launches, host-side metadata) that the entries spread over the
    ``row_len`` tokens of a full row (every row the loader makes is that long). Returns {"terms": the rates,
    "at": a function depth -> CostCoefficients, "full": the entry at ``full_depth``, "rel_err": per row of the fit}."""
    if len(set(depths)) < 2:
        raise ValueError("fit: time the design at two decoder depths at least (--layers 4,8); one depth cannot "
                         "tell the per-block cost from the embedding and head")
    X = np.array([[1, n, r.tokens, n * r.tokens, n * r.doc_sq, r.patches, r.patch_sq] for r, n in zip(rows, depths)],
                 dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    A = X / t[:, None]  # relative error: every row weighs the same whatever its length
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)  # the terms span 10 decades
    x = nnls(A / scale, np.ones_like(t)) / scale
    names = ("c_row", "c_layer", "f_tok", "l_tok", "l_attn", "v_patch", "v_attn")
    terms = dict(zip(names, (float(v) for v in x)))

    def at(n: int) -> CostCoefficients:
        fixed = (terms["c_row"] + n * terms["c_layer"]) / row_len
        return CostCoefficients(fixed + terms["f_tok"] + n * terms["l_tok"], n * terms["l_attn"], terms["v_patch"],
                                terms["v_attn"], source="")

    return {"terms": terms, "at": at, "full": at(full_depth), "rel_err": ((X @ x - t) / t).tolist()}


# ---------------------------------------------------------------- GPU timing through the train step
class Bench:
    """A family's model cut to one decoder depth, bf16 (fp32 on the CPU), and a timer of forward_backward."""

    def __init__(self, case: dict, depth: int, device, attn: str, kernels):
        import torch

        from titan_mm.registry import resolve_model
        from titan_mm.train.step import StepContext

        over = json.loads(json.dumps(case.get("overrides", {})))  # a copy, to put the depth cut in
        node = over
        for k in case["depth"][:-1]:
            node = node.setdefault(k, {})
        node[case["depth"][-1]] = depth
        self.spec, self.cfg = resolve_model(case["model"], case["flavor"], overrides=over, attn_backend=attn,
                                            kernels=kernels)
        self.case, self.device, self.cuda = case, device, device.type == "cuda"
        with torch.device("meta"):
            model = self.spec.build(self.cfg)
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.init_weights(buffer_device=device)
        dtype = torch.bfloat16 if self.cuda else torch.float32
        with torch.no_grad():  # parameters only: buffers (RoPE tables) stay fp32, as under FSDP's mixed precision
            for p in model.parameters():
                p.data = p.data.to(dtype)
        self.model, self.dtype = model.train(), dtype
        pb = self.spec.prepare_batch
        self.ctx = StepContext(device=device, attn_backend=self.spec.runtime(self.cfg).attn_backend,
                               prepare_batch=functools.partial(pb, self.cfg) if pb else None,
                               seq_keys=self.spec.seq_keys)

    def batch(self, docs, seq_len: int, g) -> dict:
        """The contract batch of one row of ``docs`` padded to ``seq_len``: random tokens and pixels, each image
        as the family's synthetic sample lays it out (text after the images, up to the document's tokens)."""
        import torch

        vocab = self.spec.dims(self.cfg).vocab_size
        if self.case.get("synthetic") is None:
            def doc(n):
                ids = torch.randint(0, vocab, (n + 1,), generator=g).numpy()
                return Doc(ids[:-1], ids[1:])
            return collate_rows([[doc(n) for n, _ in docs]], seq_len, pad_id=0, position_axes=1, multiple=1)
        syn = importlib.import_module(self.case["synthetic"])
        m = self.spec.data_needs(self.cfg).merge_size
        samples = []
        for n, segs in docs:
            text = n - sum(p // m**2 + 2 for p in segs)
            segments = [("image", _grid(p, m)) for p in segs] + [("text", text)] * (text > 0)
            samples.append(syn.make_sample(self.cfg, segments, g))
        batch = syn.pack(samples, self.cfg, seq_len=seq_len, rows=1)
        if self.cuda:  # the loader's batches arrive pinned (data.pin_memory): the pixels' copy is async
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) and k not in ("cu_seqlens", "max_seqlen")
                     else v for k, v in batch.items()}
        return batch

    def tune(self, tokens: int, vision_tokens: int | None) -> dict | None:
        """The Triton kernels' launch configs, once before the first step as the trainer does."""
        kernels = self.spec.runtime(self.cfg).kernels
        if not (self.cuda and kernels):
            return None
        from titan_mm import kernels as K

        return K.tune_for_model(self.spec.kernel_shapes(self.cfg), kernels, tokens, self.dtype, self.device,
                                vision_tokens=vision_tokens)

    def time(self, micro_batches: list[dict], reps: int) -> list[float]:
        """Seconds of one forward_backward over ``micro_batches``: a warm-up run, then ``reps`` timed runs."""
        import torch

        from titan_mm.train.step import forward_backward, local_counts, sdpa_priority

        counts = local_counts(micro_batches, self.ctx.objective)
        out = []
        for i in range(reps + 1):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
            t0 = time.perf_counter()
            with sdpa_priority(self.device):
                forward_backward(self.model, micro_batches, self.ctx, counts)
            if self.cuda:
                end.record()
                torch.cuda.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                dt = time.perf_counter() - t0
            self.model.zero_grad(set_to_none=True)
            if i:
                out.append(dt)
        return out

    def close(self) -> None:
        import torch

        del self.model
        if self.cuda:
            torch.cuda.empty_cache()


def run_case(key: str, a, device, deadline: float) -> dict:
    """Design timings at every depth, the fit, and the validation at --validate-depth (stopped at ``deadline``,
    time.perf_counter seconds, with the batches done so far)."""
    import torch

    case = CASES[key]
    depths = sorted(int(x) for x in a.layers.split(","))
    vision = case.get("synthetic") is not None
    g = torch.Generator().manual_seed(a.seed)
    out: dict = {"design": [], "validation": {"mix": MIX + ("" if vision else " (text documents only)"),
                                             "rows_per_batch": a.rows, "batches": []}}
    kernels = "all" if device.type == "cuda" else False  # the trainer's kernels.ops on CUDA
    for depth in depths:
        b = Bench(case, depth, device, a.attn, kernels)
        if depth == depths[0]:
            rows_d = design_rows(a.seq_len, b.spec.data_needs(b.cfg).merge_size or 1, vision, a.quick)
            t0 = time.perf_counter()
            rep = b.tune(a.seq_len, max(row_cost(r).patches for r in rows_d) or None)
            out["kernel_tuning_s"] = round(time.perf_counter() - t0, 1) if rep is not None else None
            out["full_depth"] = b.spec.dims(b.spec.flavor(case["flavor"])).num_layers
            batches = [b.batch(r, sum(n for n, _ in r), g) for r in rows_d]
        for docs, batch in zip(rows_d, batches):
            ts = b.time([batch], a.reps)
            out["design"].append({"depth": depth, "docs": len(docs), **dataclasses.asdict(row_cost(docs)),
                                  "seconds": float(np.median(ts)), "runs": ts})
        print(f"[{key}] depth {depth}: {len(rows_d)} design rows timed", file=sys.stderr, flush=True)
        if depth != depths[-1]:
            b.close()
    d = out["design"]
    f = fit([RowCost(**{k: r[k] for k in ("tokens", "doc_sq", "patches", "patch_sq")}) for r in d],
            [r["depth"] for r in d], [r["seconds"] for r in d], out["full_depth"], a.seq_len)
    rel = np.abs(f["rel_err"])
    out["fit"] = {"terms": f["terms"], "at_depth": {n: dataclasses.asdict(f["at"](n)) for n in depths},
                  "full": dataclasses.asdict(f["full"]),
                  "design_rel_err": {"mean": float(rel.mean()), "max": float(rel.max())}}
    vdepth = a.validate_depth or depths[-1]
    if vdepth != depths[-1]:  # e.g. the full depth: checks the extrapolation too
        b.close()
        b = Bench(case, vdepth, device, a.attn, kernels)
    coeffs = f["at"](vdepth)
    val = out["validation"]
    rows_v = mix_rows(a.batches * a.rows, a.seq_len, vision, a.seed)
    for i in range(a.batches):
        if time.perf_counter() > deadline:
            val["stopped"] = f"budget: {i} of {a.batches} batches done"
            break
        rows = rows_v[i * a.rows : (i + 1) * a.rows]
        mbs = [b.batch(r, a.seq_len, g) for r in rows]
        measured = float(np.median(b.time(mbs, max(1, a.reps - 1))))
        pred = float(coeffs.costs([row_cost(r) for r in rows]).sum())
        val["batches"].append({"rows": [dataclasses.asdict(row_cost(r)) for r in rows], "predicted_s": pred,
                               "measured_s": measured, "rel_err": (pred - measured) / measured})
    b.close()
    errs = np.abs([x["rel_err"] for x in val["batches"]])
    if errs.size:
        val.update(depth=vdepth, mean_abs_rel_err=float(errs.mean()), max_abs_rel_err=float(errs.max()),
                   target=TARGET_REL_ERR, met=bool(errs.max() <= TARGET_REL_ERR))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help=f"keys of CASES, comma-separated (default {GPU_CASES}; "
                    f"--cpu: {CPU_CASES})")
    ap.add_argument("--layers", default="", help="decoder depths to time, comma-separated, two at least "
                    "(default 4,8; --cpu: 1,2)")
    ap.add_argument("--seq-len", type=int, default=0, help="row length (default 8192; --cpu: 256)")
    ap.add_argument("--reps", type=int, default=0, help="timed runs per design row, after one warm-up run "
                    "(default 2; --quick, --cpu: 1); a validation batch runs one fewer, one at least")
    ap.add_argument("--batches", type=int, default=0, help="validation batches per case (default 20; --quick 8; "
                    "--cpu 3)")
    ap.add_argument("--rows", type=int, default=4, help="rows per validation batch (one micro-batch each)")
    ap.add_argument("--validate-depth", type=int, default=0, help="decoder depth of the validation (default: "
                    "the deepest of --layers; the full depth checks the extrapolation too, at its cost in time)")
    ap.add_argument("--attn", default="", help="decoder attention backend (default varlen on CUDA, sdpa on CPU)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; the validation stops where a case "
                    "runs past its share (the design always runs whole)")
    ap.add_argument("--quick", action="store_true", help="a smaller design (6 rows, 10 with images), one "
                    "timed run per row, 8 batches")
    ap.add_argument("--cpu", action="store_true", help="smoke test: debug models on the CPU, --quick, rows of 256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cost_model.json"))
    ap.add_argument("--coefficients-out", default="", help="the updated coefficient file (default: "
                    "cost_coefficients.json next to --out)")
    a = ap.parse_args(argv)
    a.cases = a.cases or (CPU_CASES if a.cpu else GPU_CASES)
    a.layers = a.layers or ("1,2" if a.cpu else "4,8")
    a.seq_len = a.seq_len or (256 if a.cpu else 8192)
    a.attn = a.attn or ("sdpa" if a.cpu else "varlen")
    a.quick = a.quick or a.cpu
    if len({int(x) for x in a.layers.split(",")}) < 2:
        ap.error("--layers: two decoder depths at least (the fit tells the per-block cost from the rest by them)")
    a.reps = a.reps or (2 if not a.quick else 1)
    a.batches = a.batches or (3 if a.cpu else 8 if a.quick else 20)
    coef_out = Path(a.coefficients_out or Path(a.out).with_name("cost_coefficients.json"))
    if a.cpu and coef_out.resolve() == COEFFICIENTS_FILE.resolve():
        ap.error("--cpu fits debug models: write them anywhere but the shipped coefficient file")

    import torch

    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "device": gpu,
                 "torch": torch.__version__, "seq_len": a.seq_len, "layers": a.layers, "attn": a.attn,
                 "compiled": False, "dtype": "bfloat16" if device.type == "cuda" else "float32",
                 "reps": a.reps, "cases": {}}
    keys = a.cases.split(",")
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    fitted = {}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    coef_out.parent.mkdir(parents=True, exist_ok=True)
    res["coefficients_out"] = str(coef_out)
    for i, key in enumerate(keys):
        try:  # one GPU call runs every case: a failing one is recorded (and the exit status set), the next runs
            r = res["cases"][key] = run_case(key, a, device, t0 + a.budget * (i + 1) / len(keys))
        except Exception as e:
            res["cases"][key] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            traceback.print_exc()
            continue
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        kern = ", Triton kernels" if device.type == "cuda" else ""
        src = (f"fitted by bench/cost_model.py on {res['date']} ({gpu}, {res['dtype']}, eager, {a.attn} attention"
               f"{kern}; decoder cut to {a.layers} blocks and extrapolated to {r['full_depth']}, vision tower at "
               "full depth)")
        fitted[key] = CostCoefficients(**{**r["fit"]["full"], "source": src})
        v = r["validation"]
        print(f"[{key}] fit {r['fit']['full']}\n[{key}] validation: {len(v['batches'])} batches, mean |rel err| "
              f"{v.get('mean_abs_rel_err', float('nan')):.3f}, max {v.get('max_abs_rel_err', float('nan')):.3f}",
              file=sys.stderr, flush=True)
        # after every case: a run cut short keeps what it measured
        save_coefficients(fitted, coef_out)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: c.get("error") or {"full": c["fit"]["full"], **{x: c["validation"].get(x) for x in (
        "mean_abs_rel_err", "max_abs_rel_err", "met")}} for k, c in res["cases"].items()}, indent=1))
    return res

if __name__ == "__main__":
    sys.exit(1 if any("error" in c for c in main()["cases"].values()) else 0)
