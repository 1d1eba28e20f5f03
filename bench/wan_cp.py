"""Context-parallel scaling of Wan's 81-frame 480p clip: what does each cp rank send, and what step time would that
give on H100s? (issue 48: "the CP scaling of the 81-frame case on gloo-simulated or ... several GPUs")

Two parts:

1. **Counted on gloo.** The Wan model's CP path (``prepare_cp_batch`` as the train step calls it, the flow-matching
   forward and backward of one clip) on 1, 2 and 4 gloo processes in Ulysses and ring mode, with the collectives of
   ``titan_mm.parallel.cp`` wrapped to count the bytes each rank hands them: Ulysses' all-to-alls (forward; the
   backward's all-to-all of each output's gradient, counted by a hook on that gradient) and the ring's p2p shifts
   (forward and backward). The clip keeps the 81-frame clip's 21 latent frames, its patch and its layout; its sides
   and the widths are cut so that 2 shared CPU cores run it (the full 32,760 patches cost about 17 s per attention
   call there, and the ring's plain-PyTorch blocks would need gigabytes per rank). The counted bytes must equal
   ``cp_bytes`` (the formula from the shapes) exactly, or the script fails.
2. **Projected for H100s**, clearly not a measurement: ``cp_bytes`` and ``per_rank_flops`` at the real shapes
   (Wan2.1-1.3B and the 14B's widths at 21 x 60 x 104 latents = 32,760 patches, 512 text states, bf16) and a step
   time of per-rank FLOPs / (the measured MFU x 989 TFLOP/s) + off-rank bytes / the link bandwidth, with no overlap
   (Ulysses' all-to-alls sit on the critical path; the ring's p2p is not overlapped with compute: cp.py). The MFU is
   bench/results/mfu_wan.json's titan_opt row (40.5% at 1.3B, 33 frames, on an H200; the H100 has the same bf16
   peak, assumed to reach the same fraction); the bandwidths are stated assumptions (ASSUMED).

    PYTHONPATH=$PWD python3 bench/wan_cp.py [--worlds 1 2 4] [--out bench/results/wan_cp.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_mm.launch.train import exit_worker  # noqa: E402
from titan_mm.models.wan import spec as wan_spec  # noqa: E402
from titan_mm.models.wan.config import FLAVORS, WanConfig  # noqa: E402
from titan_mm.models.wan.data import latent_batch  # noqa: E402
from titan_mm.models.wan.flops import matmul_params  # noqa: E402
from titan_mm.models.wan.memory import block_bytes, head_bytes  # noqa: E402
from titan_mm.models.wan.model import build  # noqa: E402
from titan_mm.objectives import FlowMatching  # noqa: E402
from titan_mm.parallel import cp as cp_mod  # noqa: E402
from titan_mm.parallel.cp import prepare_cp_batch  # noqa: E402
from titan_mm.parallel.memory import Topology  # noqa: E402
from titan_mm.parallel.mesh import ParallelDims  # noqa: E402
from titan_mm.train.step import model_inputs  # noqa: E402

MODES = ("ulysses", "ring")
LATENT_81F = (21, 60, 104)  # 81 frames of 832 x 480 through Wan2.1's VAE (4x in time, 8x in space)
TEXT_LEN = 512
PEAK_TFLOPS = 989.0  # H100 SXM bf16 dense (bench/mfu.py's peak; the H200's is the same)
ASSUMED = {
    "nvlink_GBps": 360.0,  # per-GPU all-to-all / p2p bandwidth within one 8-GPU H100 node (NVLink 4: 450 GB/s
                           # per direction nominal; NCCL all-to-all reaches about 80% of it)
    "ib_GBps": 45.0,  # per-GPU across nodes: one 400 Gb/s NDR NIC per GPU (50 GB/s nominal) at about 90%
    "mfu": None,  # filled from bench/results/mfu_wan.json (the measured single-GPU fraction of peak)
}
# the counted run: the 81-frame clip's 21 latent frames, sides and widths cut for a CPU (module docstring)
SMALL = dataclasses.replace(FLAVORS["debug"], num_attention_heads=4, attention_head_dim=8, ffn_dim=64,
                            num_layers=2)
SMALL_LATENT = (21, 8, 8)  # 21 x 4 x 4 = 336 patches: a multiple of 2 x cp for cp 1, 2, 4 (and 8)
SMALL_TEXT = 16
OBJ = FlowMatching(sampler="uniform", seed=0, mask="bidirectional")


def patches(cfg: WanConfig, latent: tuple[int, int, int]) -> int:
    n = 1
    for s, p in zip(latent, cfg.patch_size):
        n *= s // p
    return n


def cp_bytes(cfg: WanConfig, S: int, cp: int, mode: str, act_bytes: int) -> dict:
    """Bytes one cp rank hands its CP collectives in one forward + backward of one clip of S patches: ``payload``
    (what the calls are given) and ``off_rank`` (what leaves the rank). Per self-attention layer, with the rank's
    q / k / v / output each S/cp x D:
      ulysses: forward q, k, v and the output through an all-to-all, the backward the four gradients: 8 S/cp D
               elements, of which (cp - 1) / cp go to other ranks;
      ring:    forward cp - 1 shifts of the k / v pair (2 S/cp D), backward cp - 1 shifts of it again and cp shifts
               of its fp32 gradient accumulators (the ring keeps them in fp32 whatever the dtype); all off-rank."""
    if cp == 1:
        return {"payload": 0, "off_rank": 0}
    blk, L = S // cp * cfg.dim, cfg.num_layers
    if mode == "ulysses":
        payload = 8 * blk * act_bytes * L
        return {"payload": payload, "off_rank": payload * (cp - 1) // cp}
    ring = (2 * (cp - 1) * 2 * blk * act_bytes + cp * 2 * blk * 4) * L
    return {"payload": ring, "off_rank": ring}


def per_rank_flops(cfg: WanConfig, S: int, cp: int, text_len: int = TEXT_LEN) -> dict:
    """Training FLOPs one cp rank runs (titan_mm.models.wan.flops with the bidirectional mask's pairs, as the MFU
    counts them): the per-token GEMMs and both attentions split over cp (Ulysses: all S queries of H/cp heads;
    ring: S/cp queries of every head), the per-clip GEMMs (text embedder, cross-attention k / v of the text states,
    the time MLP) whole on every rank."""
    tok, text, t = matmul_params(cfg)
    D, L = cfg.dim, cfg.num_layers
    return {"gemm": 6 * S * tok / cp + 6 * (text_len * text + t),
            "self_attention": 12 * D * L * S * S / cp, "cross_attention": 12 * D * L * S * text_len / cp}


def per_rank_gib(cfg: WanConfig, S: int, cp: int) -> float:
    """An estimate of one cp rank's memory: 16 bytes per parameter (bf16 weight and gradient, fp32 master and two
    AdamW moments) sharded over cp (FSDP's mesh is dp_shard x cp), and the saved activations of S/cp patches
    without AC (models/wan/memory.py, compiled blocks)."""
    params = sum(matmul_params(cfg))
    act = cfg.num_layers * block_bytes(cfg, Topology(ac="none")).kept + head_bytes(cfg)
    return (16 * params / cp + act * S / cp) / 2**30


class Counter:
    """Wraps the collectives titan_mm.parallel.cp calls (module globals, looked up at call time) and sums bytes."""

    def __init__(self):
        self.payload = 0

    def _add(self, t: torch.Tensor) -> None:
        self.payload += t.numel() * t.element_size()

    def install(self) -> None:
        a2a, shift = cp_mod.all_to_all_single_autograd, cp_mod._ring_shift

        def all_to_all(x, *args):
            self._add(x)
            out = a2a(x, *args)
            if out.requires_grad:  # its backward is an all-to-all of the output's gradient
                out.register_hook(lambda g: self._add(g))
            return out

        def ring_shift(t, *args):
            self._add(t)
            return shift(t, *args)

        cp_mod.all_to_all_single_autograd, cp_mod._ring_shift = all_to_all, ring_shift


def _clip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, SMALL.in_channels, *SMALL_LATENT, generator=g)
    b = latent_batch(SMALL, x, torch.randn(1, SMALL_TEXT, SMALL.text_dim, generator=g))
    for k in ("cu_seqlens", "max_seqlen"):  # the packer's varlen keys: the sdpa backend reads doc_ids
        b.pop(k)
    return wan_spec.prepare_batch(SMALL, OBJ.prepare([b], 0)[0], "cpu")


def _worker(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build(SMALL)
    model.init_weights()
    pd = ParallelDims(world_size=world, dp_shard=1, cp=world)
    counter = Counter()
    counter.install()
    b, meta = prepare_cp_batch(_clip(), pd, "sdpa", "cpu", mode=mode, seq_keys=wan_spec.SCHEMA.seq + OBJ.seq_keys,
                               kind="bidirectional")
    out = model(None, position_ids=b["position_ids"], attn=meta, loss=OBJ.bind(b), **model_inputs(b, OBJ))
    out.terms["mse"].backward()
    loss = out.terms["mse"].detach().reshape(1)
    dist.all_reduce(loss)
    got = torch.tensor([counter.payload], dtype=torch.float64)
    every = [torch.zeros_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    if rank == 0:
        Path(out_dir, f"{mode}_{world}.json").write_text(json.dumps(
            {"payload_per_rank": [int(x) for x in every], "loss_sum": float(loss)}))
    dist.destroy_process_group()
    exit_worker()  # gloo's native threads can abort the interpreter's finalization (SIGABRT, seen under load)


def counted(worlds: list[int], out_dir: Path) -> list[dict]:
    """One clip's forward + backward per (mode, world); each rank's counted payload against cp_bytes."""
    S = patches(SMALL, SMALL_LATENT)
    rows = []
    for mode in MODES:
        for w in worlds:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(w, port, mode, str(out_dir)), nprocs=w)
            r = json.loads((out_dir / f"{mode}_{w}.json").read_text())
            (out_dir / f"{mode}_{w}.json").unlink()
            want = cp_bytes(SMALL, S, w, mode, act_bytes=4)
            if set(r["payload_per_rank"]) != {want["payload"]}:
                raise SystemExit(f"{mode} cp {w}: counted {r['payload_per_rank']} bytes per rank, the formula says "
                                 f"{want['payload']}")
            rows.append(dict(mode=mode, cp=w, patches=S, **r, formula_payload=want["payload"],
                             formula_off_rank=want["off_rank"]))
            print(f"counted {mode} cp {w}: {r['payload_per_rank'][0]:,} B per rank (= formula), loss sum "
                  f"{r['loss_sum']:.6f}")
    return rows


def projected(mfu: float, cps=(1, 2, 4, 8)) -> list[dict]:
    """The H100 projection at the real shapes (module docstring); not a measurement."""
    big = {"wan2.1_1.3b": FLAVORS["1.3B"],
           "wan2.1_14b": dataclasses.replace(FLAVORS["1.3B"], num_attention_heads=40, ffn_dim=13824, num_layers=40)}
    rate = mfu * PEAK_TFLOPS * 1e12
    rows = []
    for name, cfg in big.items():
        S = patches(cfg, LATENT_81F)
        for mode in MODES:
            for cp in cps:
                f = per_rank_flops(cfg, S, cp)
                by = cp_bytes(cfg, S, cp, mode, act_bytes=2)
                compute = sum(f.values()) / rate
                row = dict(model=name, mode=mode, cp=cp, patches=S, per_rank_tflops=round(sum(f.values()) / 1e12, 2),
                           **{f"{k}_tflops": round(v / 1e12, 2) for k, v in f.items()},
                           off_rank_gb=round(by["off_rank"] / 1e9, 3), compute_s=round(compute, 3),
                           est_mem_gib=round(per_rank_gib(cfg, S, cp), 1))
                for link in ("nvlink", "ib"):
                    comm = by["off_rank"] / (ASSUMED[f"{link}_GBps"] * 1e9)
                    row[f"step_s_{link}"] = round(compute + comm, 3)
                rows.append(row)
    for r in rows:  # speedup against the same model's cp 1
        one = next(x for x in rows if x["model"] == r["model"] and x["mode"] == r["mode"] and x["cp"] == 1)
        for link in ("nvlink", "ib"):
            r[f"speedup_{link}"] = round(one[f"step_s_{link}"] / r[f"step_s_{link}"], 2)
    return rows


def measured_mfu() -> float:
    rows = json.loads((ROOT / "bench/results/mfu_wan.json").read_text())["rows"]
    return next(r["mfu"] for r in rows if r["case"] == "wan2.1_1.3b" and r["stack"] == "titan_opt")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "wan_cp.json"))
    args = ap.parse_args(argv)
    if any(w < 1 or patches(SMALL, SMALL_LATENT) % (2 * w) or SMALL.num_attention_heads % w for w in args.worlds):
        raise SystemExit(f"--worlds {args.worlds}: each must divide the {SMALL.num_attention_heads} heads and "
                         f"{patches(SMALL, SMALL_LATENT)} / 2 patches (use 1, 2, 4)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mfu = measured_mfu()
    res = {
        "what": "counted: bytes each cp rank hands titan_mm.parallel.cp's collectives in one forward + backward of "
                "a cut Wan clip on gloo (equal to cp_bytes); projected: H100 step time of the 81-frame 480p clip "
                "from the measured single-GPU MFU and ASSUMED bandwidths (a projection, not a measurement)",
        "device_counted": "CPU (gloo, shared 2-core machine)",
        "device_projected": "NVIDIA H100 SXM (projection)",
        "assumed": dict(ASSUMED, mfu=mfu, mfu_source="bench/results/mfu_wan.json wan2.1_1.3b titan_opt (H200)",
                        overlap="none: compute + off-rank bytes / bandwidth", fsdp="parameter all-gathers and "
                        "gradient reduce-scatters over dp_shard x cp not counted (FSDP2 prefetch overlaps them)",
                        ring_kernel="the ring's blocks are plain PyTorch fp32 today; its rows assume attention at "
                        "the measured MFU, which a fused ring kernel would need"),
        "counted_config": dict(dataclasses.asdict(SMALL), latent=SMALL_LATENT, text_len=SMALL_TEXT, dtype="fp32"),
        "counted": counted(args.worlds, out.parent),
        "projected": projected(mfu),
    }
    out.write_text(json.dumps(res, indent=1) + "\n")
    for r in res["projected"]:
        print(f"projected {r['model']} {r['mode']} cp {r['cp']}: {r['per_rank_tflops']} TFLOP, "
              f"{r['off_rank_gb']} GB off-rank, {r['step_s_nvlink']} s (NVLink) / {r['step_s_ib']} s (IB)")
    return res


if __name__ == "__main__":
    main()
