"""The bubble of each pipeline schedule, from the schedule's own action list (no timing, so no noise).

For every schedule of titan_mm.parallel.pp_schedule.SCHEDULES (the ones this torch provides), pp in {2, 4, 8} and
8 / 16 / 32 micro-batches, the action lists torch computes (``pipeline_order``; GPipe / 1F1B: their loops' order)
are replayed with unit costs: a rank's forward of a micro-batch takes 1, its backward 2 (input gradients 1, weight
gradients 1), split evenly over its stages (so 2 stages per rank take 1/2 each), no communication time. Reported:
the bubble (idle fraction of the ranks over the step), the step time relative to the no-bubble ideal
(3 x micro-batches), and the micro-batches whose activations the first rank holds at its peak (in units of one
micro-batch through all of a rank's blocks: 1F1B's pp, GPipe's all of them).

    python bench/pp_bubbles.py                      # prints the table, writes bench/results/pp_bubbles.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PPS = (2, 4, 8)
MICRO = (8, 16, 32)


def bubble_table(pps=PPS, micro=MICRO) -> list[dict]:
    from titan_mm.parallel.pp_schedule import SCHEDULES, _available, action_lists, replay, virtual_stages

    rows = []
    for name in SCHEDULES:
        if not _available(name):
            rows.append(dict(schedule=name, error="not in this torch"))
            continue
        v = virtual_stages(name)
        for pp in pps:
            for m in micro:
                row = dict(schedule=name, pp=pp, stages_per_rank=v, micro=m)
                try:
                    orders = action_lists(name, pp, v, m)
                except ValueError as e:
                    rows.append(dict(row, error=str(e)))
                    continue
                n = pp * v
                unit = [1.0 / v] * n
                t = replay(orders, unit, unit, unit, act_bytes=unit)
                rows.append(dict(row, bubble=round(t.bubble, 4), step_vs_ideal=round(t.makespan / (3 * m), 4),
                                 rank0_in_flight=round(t.peak_bytes[0], 3),
                                 stage_in_flight=[t.in_flight[s] for s in range(n)]))
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per (schedule, pp): bubble and rank-0 activations in flight at each micro-batch count."""
    head = "| schedule | stages / rank | pp | " + " | ".join(f"bubble M={m}" for m in MICRO) + " | " + \
           " | ".join(f"rank 0 in flight M={m}" for m in MICRO) + " |"
    out = [head, "|" + "---|" * (3 + 2 * len(MICRO))]
    by = {}
    for r in rows:
        by.setdefault((r["schedule"], r.get("pp")), {})[r.get("micro")] = r
    for (name, pp), cells in by.items():
        if pp is None:
            out.append(f"| {name} | - | - | " + " | ".join(["not in this torch"] * 2 * len(MICRO)) + " |")
            continue
        v = next(iter(cells.values()))["stages_per_rank"]
        b = [f"{cells[m]['bubble']:.3f}" if "bubble" in cells.get(m, {}) else "refused" for m in MICRO]
        f = [f"{cells[m]['rank0_in_flight']:g}" if "bubble" in cells.get(m, {}) else "-" for m in MICRO]
        out.append(f"| {name} | {v} | {pp} | " + " | ".join(b) + " | " + " | ".join(f) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp_bubbles.json"))
    a = ap.parse_args(argv)
    import torch

    rows = bubble_table()
    Path(a.out).write_text(json.dumps({"torch": torch.__version__, "costs": "F=1, I=1, W=1 (B=2) per rank, split "
                                       "over its stages; no communication", "rows": rows}, indent=1))
    print(markdown(rows))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
