"""BAGEL's image sampler with the context in a KV cache: how many FLOPs does each Euler step save?

Counted, not timed (no device): per step and guidance branch, the recomputing sampler ran the whole sample (context
and image query) through the velocity forward; the cached one runs the image query against the cached keys. The
forward FLOPs of a sample are titan_mm.models.bagel.flops.flops (training: x 3) over 3, less the LM head, which the
velocity forward does not run; the saving is the context's forward. BAGEL-7B-MoT's sizes, BAGEL inferencer's
branches: text-to-image (cond, text-unconditional) and editing (cond, the source alone, the prompt alone).

    PYTHONPATH=$PWD python3 bench/bagel_sample_flops.py [--side 1024 --prompt 32] \\
        [--out bench/results/bagel_sample_flops.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_mm.data.packing import collate_rows  # noqa: E402
from titan_mm.models.bagel.config import FLAVORS  # noqa: E402
from titan_mm.models.bagel.data import generation_doc  # noqa: E402
from titan_mm.models.bagel.flops import flops  # noqa: E402
from titan_mm.models.bagel.sample import split_query  # noqa: E402
from titan_mm.models.bagel.spec import SCHEMA  # noqa: E402


def forward_flops(cfg, doc) -> float:
    """One sample through the velocity forward (no LM head)."""
    b = collate_rows([[doc]], len(doc), pad_id=0, position_axes=1, multiple=1, schema=SCHEMA)
    c = cfg.llm_config
    train = flops(cfg, [len(doc)], b.get("vit_lens", ()), b["token_kind"], b["seg_ids"], b["seg_kinds"])
    return train / 3 - 2 * len(doc) * c.hidden_size * c.vocab_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=1024, help="image side in pixels (generated and source)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = FLAVORS["7B-MoT"]
    v = cfg.vit_config
    down = cfg.vae_config.downsample
    lat = torch.zeros(cfg.vae_config.z_channels, a.side // down, a.side // down)
    vit_side = min(a.side, v.patch_size * cfg.vit_max_num_patch_per_side) // v.patch_size * v.patch_size
    source = (lat, torch.zeros(3, vit_side, vit_side))  # the ViT copy at most 70 x 70 patches, as BAGEL resizes it
    prompt = list(range(100, 100 + a.prompt))
    cases = {"t2i": [(prompt, None), (None, None)], "edit": [(prompt, source), (None, source), (prompt, None)]}
    rows = []
    for name, branches in cases.items():
        full = cached = once = 0.0
        for p, src in branches:
            doc = generation_doc(cfg, p, lat, source=src)
            context, _ = split_query(doc)
            ctx = 0.0 if context is None else forward_flops(cfg, context)
            full += forward_flops(cfg, doc)
            cached += forward_flops(cfg, doc) - ctx
            once += ctx
        rows.append({"case": name, "side_px": a.side, "prompt_tokens": a.prompt, "branches": len(branches),
                     "step_tflop_recompute": round(full / 1e12, 1), "step_tflop_cached": round(cached / 1e12, 1),
                     "saved_fraction": round(1 - cached / full, 3), "context_tflop_once": round(once / 1e12, 1),
                     "device": "none (counted)"})
        print(json.dumps(rows[-1]))
    if a.out:
        Path(a.out).write_text(json.dumps({"date": str(date.today()), "model": "bagel 7B-MoT", "rows": rows},
                                          indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
