"""Wan's time MLP once per clip instead of once per patch: what does it save?

For a Wan config (the 1.3B's widths, layers cut), one clip of S patches with one t: the activation bytes autograd
keeps for backward (a saved-tensors hook sums the distinct storages that are not weights: the count does not depend
on the machine), the time
MLP's FLOPs (per token: freq_dim x D + D^2 + 6 D^2 multiply-adds) and the median forward + backward time, with
``timesteps`` [B, S] (per patch) and with ``clip_timesteps`` [B] (per clip). Every row names its device.

    PYTHONPATH=$PWD python3 bench/wan_time_mlp.py [--flavor 1.3B --layers 2 --tokens 1024] [--out bench/results/wan_time_mlp.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_mm.models.wan.config import FLAVORS  # noqa: E402
from titan_mm.models.wan.flops import matmul_params  # noqa: E402
from titan_mm.models.wan.model import WanModel  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402


def saved_bytes(fn, params) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct activation storages autograd saves for backward while ``fn()`` runs, the weights
    left out, its output)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def run(flavor: str, layers: int, tokens: int, text_len: int, iters: int, dev: torch.device) -> list[dict]:
    cfg = dataclasses.replace(FLAVORS[flavor], num_layers=layers)
    torch.manual_seed(0)
    model = WanModel(cfg).to(dev)
    model.init_weights()
    side = int(tokens**0.5)
    S = side * side
    x = torch.randn(1, S, cfg.in_channels * math.prod(cfg.patch_size), device=dev)
    grid = torch.stack(torch.meshgrid(torch.zeros(1, dtype=torch.long), torch.arange(side), torch.arange(side), indexing="ij"), -1)
    grid = grid.reshape(1, S, 3).to(dev)
    text = torch.randn(1, text_len, cfg.text_dim, device=dev)
    meta = build_attn_meta({"doc_ids": torch.zeros(1, S, dtype=torch.int32)}, "sdpa", dev, kind="bidirectional")
    t = torch.full((1,), 0.7, device=dev)
    kinds = {"per_patch": {"timesteps": t[:, None].expand(1, S)}, "per_clip": {"clip_timesteps": t}}
    time_params = matmul_params(cfg)[2]
    rows = []
    for name, kw in kinds.items():
        def step(kw=kw):
            out = model(attn=meta, noisy_latents=x, text_states=text, grid_fhw=grid, **kw)
            return model.predict_velocity(out, {})

        nbytes, pred = saved_bytes(step, model.parameters())
        pred.square().mean().backward()
        times = []
        for _ in range(iters):
            model.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step().square().mean().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        mlp_tokens = S if name == "per_patch" else 1
        rows.append({"device": device_name(dev), "flavor": flavor, "layers": layers, "tokens": S, "text_len": text_len,
                     "path": name, "activations_saved_MiB": round(nbytes / 2**20, 2),
                     "time_mlp_GFLOP_fwd_bwd": round(6 * mlp_tokens * time_params / 1e9, 3),
                     "fwd_bwd_s_median": round(statistics.median(times), 4), "iters": iters})
        print(rows[-1])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="1.3B")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024, help="patches of the clip (rounded down to a square)")
    ap.add_argument("--text-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = run(a.flavor, a.layers, a.tokens, a.text_len, a.iters, torch.device(a.device))
    if a.out:
        Path(a.out).write_text(json.dumps({"question": "Wan's time MLP per clip vs per patch", "rows": rows},
                                          indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
