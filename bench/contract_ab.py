"""Before / after a refactor, side by side: bench/mfu.py rows of the same cases from two trees in one device call.

On the GPU, in one device call (the old tree unpacked beside the new one, ``git archive <rev> | tar -x -C .before``,
carried with ``.whl``):

    PYTHONPATH=$PWD/.before:/tmp/site python3 .before/bench/mfu.py --cases C --stacks titan --out $OUT/before.json
    python3 bench/mfu.py --cases C --stacks titan --out $OUT/after.json

then here:

    python bench/contract_ab.py --before before.json --after after.json --label "issue 18" \
        --out bench/results/mfu_contract.json --doc docs/benchmarks.md
    python bench/contract_ab.py --render bench/results/mfu_contract.json --doc docs/benchmarks.md   # the table again
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.devices import device_label, device_of  # noqa: E402

def replace_between(doc: Path, marker: str, text: str) -> None:
    """Put ``text`` between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` in ``doc`` (appended once)."""
    a, b = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    s = doc.read_text()
    if a not in s:
        s += f"\n{a}\n{b}\n"
    doc.write_text(s[: s.index(a) + len(a)] + "\n" + text + "\n" + s[s.index(b):])


def pair(before: list[dict], after: list[dict]) -> list[dict]:
    """One row per (case, stack, ac) measured in both trees, with after / before."""
    key = lambda r: (r["case"], r["stack"], r.get("ac", "none"))  # noqa: E731
    old = {key(r): r for r in before if "error" not in r}
    out = []
    for r in after:
        b = old.get(key(r))
        if b is None or "error" in r:
            continue
        out.append({"case": r["case"], "stack": r["stack"], "ac": r.get("ac", "none"), "device": device_of(r),
                    "before_tokens_per_s": b["tokens_per_s"], "after_tokens_per_s": r["tokens_per_s"],
                    "ratio": r["tokens_per_s"] / b["tokens_per_s"],
                    "before_peak_gb": b["peak_mem_gb"], "after_peak_gb": r["peak_mem_gb"],
                    "before_loss": b["last_loss"], "after_loss": r["last_loss"]})
    return out


def render(res: dict) -> str:
    """The table; a row without its own device takes the file's (``device``: results written before rows named it)."""
    lines = [f"{res['label']} ({res['when']}): one device call, every case on the old tree, then on the new one.", "",
             "| case | device | stack | before tok/s | after tok/s | after / before | peak GB before / after |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        peak = f"{r['before_peak_gb']:.1f} / {r['after_peak_gb']:.1f}"
        lines.append(f"| {r['case']} | {device_label(device_of(r, res.get('device')))} | {r['stack']} | {r['before_tokens_per_s']:,.0f} | "
                     f"{r['after_tokens_per_s']:,.0f} | {r['ratio']:.3f} | {peak} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="")
    ap.add_argument("--after", default="")
    ap.add_argument("--render", default="", help="a results JSON of this script: its table (with --doc: into the doc)")
    ap.add_argument("--label", default="before / after")
    ap.add_argument("--when", default="")
    ap.add_argument("--out", default=str(ROOT / "bench/results/mfu_contract.json"))
    ap.add_argument("--doc", default="", help="replace the table between <!-- mfu-contract:begin/end --> here")
    a = ap.parse_args()
    if a.render:
        res = json.loads(Path(a.render).read_text())
    elif a.before and a.after:
        rows = pair(json.loads(Path(a.before).read_text())["rows"], json.loads(Path(a.after).read_text())["rows"])
        res = {"label": a.label, "when": a.when, "rows": rows}
        Path(a.out).write_text(json.dumps(res, indent=1))
    else:
        ap.error("give --before and --after (two bench/mfu.py results), or --render RESULTS.json")
    table = render(res)
    print(table)
    if a.doc:
        replace_between(Path(a.doc), "mfu-contract", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
