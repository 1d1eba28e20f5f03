"""One efficiency report for every model family, built from the committed results of bench/mfu.py and bench/dllm.py.

MFU is bench/mfu.py's: the step's training FLOPs from the registry's FLOP counter (titan_mm's counter, docs/flops.md)
over the batch's documents, the vision tower and the audio encoder included, divided by the median step time and by
989 TFLOP/s (the H100 SXM's and the H200's dense bf16 datasheet peak, bench/mfu.py's PEAK_TFLOPS); every row names its
device (bench/devices.py), and an H100 row stands beside an H200 row of the same key. "MFU (LLM only)" counts the decoder's FLOPs alone
(the encoders left out: what lmms-engine reports). The diffusion LM rows (bench/dllm.py) count the objective's FLOPs
(the family's plus the attention pairs its mask adds). Every figure is read from bench/results/; none is typed here.

Which row a (case, stack, AC, kernel ops, reshard, device) shows: the files of RESULTS are read in that order and the first
file that has the key wins; inside one file the last row wins (bench/mfu.py appends a re-run). mfu.json comes first
because it is the reference table of docs/benchmarks.md; the family and experiment files after it only add rows it
lacks. Rows with "error", rows without figures and experiment rows the trainer never runs (skip_guard_eval_unsafe)
are left out; ``reshard always`` is the default and keys as no reshard. The family of a case is its registry model,
bench/mfu.py's CASES[case]["model"]; rows and the "vs best peer" ratio (peers: stacks not starting with "titan",
among the rows of the same case, results file, device and session) are rendered by bench/mfu.py's render(), one
table per file.

  python3 bench/efficiency.py                           # print the markdown
  python3 bench/efficiency.py --doc docs/efficiency.md  # replace the text between the efficiency markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_of  # noqa: E402
from bench.mfu import CASES, PEAK_TFLOPS, render  # noqa: E402

RESULTS = ("mfu.json", "mfu_qwen3_5.json", "mfu_kernels.json", "mfu_reshard.json", "mfu_ac_layers.json",
           "mfu_syncfree.json", "mfu_omni.json", "mfu_omni_moe.json", "mfu_wan.json", "mfu_bagel.json")
DLLM = "dllm.json"  # bench/dllm.py: one row per training objective, MFU of the objective's FLOPs
# not read: mfu_contract.json (before/after ratios, no MFU), mfu_tritonop_probe.json (a branch probe, not main)

# family kind -> the registry models (CASES[case]["model"]) it holds
KINDS = {
    "LLM dense": ("qwen3",),
    "MoE": ("qwen3_moe",),
    "VLM": ("qwen3_vl",),
    "VLM-MoE": ("qwen3_vl_moe",),
    "Qwen3.5 (hybrid linear attention)": ("qwen3_5", "qwen3_5_moe"),
    "Omni (image + audio + text)": ("qwen2_5_omni", "qwen3_omni_moe"),
    "Video diffusion (Wan)": ("wan",),
    "Unified understanding + generation (BAGEL)": ("bagel",),
}
DLLM_KIND = "Diffusion LM (bench/dllm.py)"
# published by lmms-engine for their own runs and hardware; not measured here
PUBLISHED = (("lmms-engine", "text", "50-55%"), ("lmms-engine", "image", "30-40%"), ("lmms-engine", "video", "25-35%"))
BEGIN, END = "<!-- efficiency:begin -->", "<!-- efficiency:end -->"


def _key(r: dict) -> tuple:
    reshard = None if r.get("reshard") == "always" else r.get("reshard")
    return r["case"], r["stack"], r.get("ac"), r.get("kernel_ops"), reshard, device_of(r)


def load(results: Path = ROOT / "bench/results") -> dict[str, list[dict]]:
    """kind -> its rows, each with ``source`` (the file it came from)."""
    merged: dict[tuple, dict] = {}
    for name in RESULTS:
        path = results / name
        if not path.exists():
            continue
        mine: dict[tuple, dict] = {}
        for r in json.loads(path.read_text()).get("rows", []):
            if "error" in r or r.get("tokens_per_s") is None or r.get("mfu") is None \
                    or r.get("skip_guard_eval_unsafe"):
                continue
            mine[_key(r)] = dict(r, reshard=_key(r)[4], source=name)  # the last row of a file wins
        for k, r in mine.items():
            merged.setdefault(k, r)  # the first file wins
    by_kind: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in merged.values():
        model = CASES.get(r["case"], {}).get("model")
        kind = next((k for k, models in KINDS.items() if model in models), None)
        if kind:
            by_kind[kind].append(r)
    dllm = results / DLLM
    rows = json.loads(dllm.read_text()).get("rows", []) if dllm.exists() else []
    by_kind[DLLM_KIND] = [dict(r, ac="none", source=DLLM, stack=f"titan ({r['objective']}"
                               + (f", block {r['block_size']}" if r.get("block_size") else "") + ")")
                          for r in rows if "error" not in r and r.get("mfu") is not None and r.get("objective")]
    return by_kind


def tables(rows: list[dict]) -> list[str]:
    """bench/mfu.py's render() of the rows, one table per source file: the "vs best peer" ratio only compares
    rows of the same results file, device and session (one call's peers), never a titan row of one call with a
    peer of another."""
    out = []
    for src in dict.fromkeys(r["source"] for r in rows):
        out += [f"`bench/results/{src}`:", "", render([r for r in rows if r["source"] == src]), ""]
    return out


def report(results: Path = ROOT / "bench/results") -> str:
    by_kind = load(results)
    out, missing = [], []
    for kind, rows in by_kind.items():
        measured = {r["case"] for r in rows}
        todo = [c for c, spec in CASES.items() if not c.startswith("debug") and spec["model"] in KINDS.get(kind, ())
                and c not in measured]
        if rows:
            out += [f"### {kind}", "", *tables(rows)]
        elif kind == DLLM_KIND:
            missing.append(f"- {kind}: not measured as MFU (bench/results/{DLLM})")
        missing += [f"- {kind}: `{c}` (bench/mfu.py CASES) not measured yet" for c in todo]
    if missing:
        out += ["### Not measured yet", "", *missing, ""]
    out += ["### Published peer figures (reference only)", "",
            "Published by the peer for its own runs on its own hardware; not measured here, not comparable 1:1.", "",
            "| peer | device | data | MFU (published) |", "|---|---|---|---|",
            *(f"| {p} | not stated (the peer's) | {d} | {m} |" for p, d, m in PUBLISHED)]
    return (f"MFU against {PEAK_TFLOPS:.0f} TFLOP/s (dense bf16 datasheet peak of the H100 SXM and the H200); the device "
            "column names each row's card.\n\n" + "\n".join(out).rstrip() + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="", help=f"replace the text between {BEGIN} and {END} in this file")
    args = ap.parse_args()
    text = report()
    if args.doc:
        doc = Path(args.doc).read_text()
        doc = doc[: doc.index(BEGIN) + len(BEGIN)] + "\n" + text + doc[doc.index(END):]
        Path(args.doc).write_text(doc)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
