"""Wan (the debug flavor, flow matching over whole clips) on 2 gloo processes: three SGD-momentum steps give the
world-1 losses, grad norms and every gradient under FSDP2, context parallelism over the video tokens (Ulysses, ring,
all-gather) and tensor parallelism (titan_mm/models/wan/plan.py).

The forward is the train step's: the CP split of the sequence keys (the family's BatchSchema and flow matching's
``seq_keys``: latents, latent_mask, noise_unit, grid_fhw, noisy_latents, timesteps, flow_target, flow_weight) with
the text states whole on every cp rank; each rank's RoPE angles come from its own grid_fhw rows.

Tolerance: every cell computes the same fp32 products; only sums are regrouped (the gradients of a weight summed
over two ranks' tokens instead of one pass over all, the ring's online softmax over two key blocks, TP's halves of
each contraction and of the q / k RMS). Reassociating an fp32 sum of n terms moves it by at most about n x 6e-8
of the terms' magnitude; with n <= 96 (tokens per clip, text tokens, features) that is below 1e-5, the bound used.
"""

import functools
import os
import subprocess
from pathlib import Path

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import check_cells, run_cells, train_steps

from titan_mm.config import JobConfig
from titan_mm.models.wan import plan as wan_plan
from titan_mm.models.wan import spec as wan_spec
from titan_mm.models.wan.config import FLAVORS
from titan_mm.models.wan.model import build
from titan_mm.models.wan.synthetic import clip_batch
from titan_mm.nn.attention import build_attn_meta
from titan_mm.objectives import FlowMatching
from titan_mm.observe.metrics import read_metrics
from titan_mm.parallel.apply import parallelize
from titan_mm.parallel.cp import prepare_cp_batch
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.train.step import model_inputs

pytestmark = pytest.mark.slow  # spawned processes: 30 s for the cells, 2 min for the launcher runs on 2 shared cores
ROOT = Path(__file__).resolve().parents[2]

CFG = FLAVORS["debug"]  # 2 heads of 12, 2 blocks, qk RMSNorm over all heads, cross-attention norm
FRAMES = 3  # 3 latent frames x 4 x 4 patches: S = 48, a multiple of 2 x cp
OBJ = FlowMatching(sampler="uniform", seed=0, mask="bidirectional")
SEQ_KEYS = wan_spec.SCHEMA.seq + OBJ.seq_keys


def _batches():
    """3 global batches of 2 clips, corrupted once for all worlds (the noise is data here)."""
    out = []
    for s in range(3):
        gens = [torch.Generator().manual_seed(100 * s + r) for r in range(2)]
        b = clip_batch(CFG, gens, FRAMES)
        for k in ("cu_seqlens", "max_seqlen"):  # the packer's varlen keys: the sdpa backend reads doc_ids
            b.pop(k)
        out.append(OBJ.prepare([b], s)[0])
    return out


BATCHES = _batches()


def _select(gb, dp_rank, dp_size):
    local = {k: v[dp_rank::dp_size] if v.dim() else v for k, v in gb.items()}
    return local, gb["num_latent_elements"]


def _step(pd, mode, per_clip, model, b):
    """The train step's forward for one (corrupted) micro-batch: the loss sum of this rank's tokens. ``per_clip``:
    the family's prepare_batch turns the clips' shared t into clip_timesteps [B] (whole on every cp rank); else
    the time MLP runs on timesteps [B, S] (Wan2.2 TI2V's path), cut with the tokens."""
    if per_clip:
        b = wan_spec.prepare_batch(CFG, b, "cpu")
    if pd is not None and pd.cp_enabled:
        b, meta = prepare_cp_batch(b, pd, "sdpa", "cpu", mode=mode, seq_keys=SEQ_KEYS, kind="bidirectional")
    else:
        meta = build_attn_meta(b, "sdpa", "cpu", kind="bidirectional")
    out = model(None, position_ids=b["position_ids"], attn=meta, loss=OBJ.bind(b), **model_inputs(b, OBJ))
    return out.terms["mse"]


def _build():
    torch.manual_seed(0)
    m = build(CFG)
    m.init_weights()
    for p in m.parameters():  # init's zero biases would leave their paths untested
        p.data.add_(0.05 * torch.randn_like(p))
    return m


@functools.lru_cache(maxsize=None)
def _reference(per_clip):
    return train_steps(_build(), BATCHES, functools.partial(_step, None, None, per_clip), select=_select)


def _run_cell(world, dims, mode, per_clip):
    model = _build()
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, wan_plan.plan(CFG), pd, JobConfig())
    bm = pd.mesh("batch")
    return train_steps(model, BATCHES, functools.partial(_step, pd, mode, per_clip), dp_rank=bm.get_local_rank(),
                       dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


# (name, dims, cp_mode, per_clip); the cells run one after another in the same 2 processes
CELLS = (
    ("fsdp2", dict(dp_shard=2), None, True),
    ("cp2-ulysses", dict(dp_shard=1, cp=2), "ulysses", True),
    ("cp2-ring", dict(dp_shard=1, cp=2), "ring", True),
    ("cp2-allgather", dict(dp_shard=1, cp=2), "allgather", True),
    ("cp2-ulysses-t-per-patch", dict(dp_shard=1, cp=2), "ulysses", False),
    ("tp2", dict(dp_shard=1, tp=2), None, True),
    ("tp2-t-per-patch", dict(dp_shard=1, tp=2), None, False),
)


def test_wan_parallel_matches_world1():
    got = run_multiproc(_worker, 2, args=(CELLS,), timeout_s=600)
    check_cells(CELLS, got, lambda cell: _reference(cell[3]))


def _launch(tmp_path, name: str, nproc: int, *args: str) -> dict[int, tuple[float, float]]:
    """run_train.sh --config debug_wan for 3 steps; {step: (loss, grad norm)}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), "--config", "debug_wan", "--metrics.enable_tensorboard", "False",
                        "--training.steps", "3", "--checkpoint.enable", "False", "--job.dump_folder", str(tmp_path),
                        "--job.name", name, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {s: (m["loss"], m["grad_norm"]) for s, m in read_metrics(tmp_path / name / "metrics.jsonl").items()}


def test_debug_wan_through_the_launcher_cp_and_tp_match_one_process(tmp_path):
    """The trainer's own wiring (setup's sequence keys, the objective's, the plan through parallelize): debug_wan on
    2 processes with cp 2 (ring) and with tp 2 and compiled blocks (the q / k norms' all-reduce traced) follows the
    1-process run (same global batch and noise)."""
    one = _launch(tmp_path, "one", 1)
    for name, args in (("cp2-ring", ("--parallel.cp", "2", "--parallel.cp_mode", "ring")),
                       ("tp2-compiled", ("--parallel.tp", "2", "--compile.enable", "True"))):
        got = _launch(tmp_path, name, 2, *args)
        assert sorted(got) == sorted(one) == [1, 2, 3]
        for s, (loss, norm) in one.items():
            assert got[s][0] == pytest.approx(loss, rel=1e-5) and got[s][1] == pytest.approx(norm, rel=1e-5), \
                (name, s, one[s], got[s])
