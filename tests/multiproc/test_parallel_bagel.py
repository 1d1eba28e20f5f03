"""BAGEL (the debug flavor: CE on the answers + flow matching on the noised latents, one packed row of understanding,
generation and editing samples under the segment mask) on 2 gloo processes: three SGD-momentum steps give the world-1
losses, grad norms and every gradient under FSDP2 (both experts of a layer in one unit, the ViT blocks their own) and
under tensor parallelism inside each expert (titan_mm/models/bagel/plan.py: q/k/v and w1/w3 colwise, o and w2
rowwise, the per-head q/k norms replicated with summed gradients).

Each rank reads its rows of the global batch (the ViT patches of those rows, re-collated), corrupted once for all
worlds; the step's loss is ce / N_ce + mse / N_mse with the global counts. Tolerance: the same fp32 products, sums
regrouped (two ranks' tokens, TP's halves of each contraction): below 1e-5 at these sizes (n <= 128 terms).
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
from titan_mm.data.packing import collate_rows
from titan_mm.models.bagel import plan as bagel_plan
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.model import build
from titan_mm.models.bagel.spec import SCHEMA, objective_options, prepare_batch
from titan_mm.models.bagel.synthetic import ROW_TOKENS, class_images, row
from titan_mm.nn.attention import build_attn_meta
from titan_mm.objectives import CausalLM, Combined, FlowMatching
from titan_mm.observe.metrics import read_metrics
from titan_mm.parallel.apply import parallelize
from titan_mm.parallel.mesh import ParallelDims
from titan_mm.train.step import model_inputs

pytestmark = pytest.mark.slow  # spawned processes on 2 shared cores: 30 s for the cells, 1 min for the launcher
ROOT = Path(__file__).resolve().parents[2]

CFG = FLAVORS["debug"]
OBJ = Combined((CausalLM(), FlowMatching(seed=0, **objective_options(CFG)["flow_matching"])))
MEDIA = ("vit_patches", "vit_pos", "vit_lens")


def _batches():
    """3 global batches of 2 rows: (their docs, the batch corrupted once for all worlds)."""
    pixels, latents = class_images(CFG)
    out = []
    for s in range(3):
        rows = [row(CFG, torch.Generator().manual_seed(100 * s + r), pixels, latents) for r in range(2)]
        out.append((rows, OBJ.prepare([collate_rows(rows, ROW_TOKENS, 0, 1, multiple=1, schema=SCHEMA)], s)[0]))
    return out


BATCHES = _batches()


def _select(gb, dp_rank, dp_size):
    """This rank's rows of the global batch: the per-token keys sliced, the ViT patches of its rows re-collated; the
    global counts ride along (the step divides by them itself)."""
    rows, b = gb
    local = {k: v[dp_rank::dp_size] if v.dim() >= 2 else v for k, v in b.items() if k not in MEDIA}
    mine = collate_rows(rows[dp_rank::dp_size], ROW_TOKENS, 0, 1, multiple=1, schema=SCHEMA)
    local.update({k: mine[k] for k in MEDIA})
    local["cu_seqlens"], local["max_seqlen"] = mine["cu_seqlens"], mine["max_seqlen"]
    local["global_counts"] = OBJ.counts(b)
    return local, torch.tensor(1.0)


def _step(model, b):
    counts = b.pop("global_counts")
    b = prepare_batch(CFG, b, "cpu")
    meta = build_attn_meta(b, "sdpa", "cpu", kind=OBJ.mask_kind)
    out = model(b["input_ids"], position_ids=b["position_ids"], attn=meta, loss=OBJ.bind(b), **model_inputs(b, OBJ))
    return out.terms["ce"] / counts["ce"] + out.terms["mse"] / counts["mse"]


def _build():
    torch.manual_seed(0)
    m = build(CFG)
    m.init_weights()
    for p in m.parameters():  # init's zero biases and llm2vae would leave their paths untested
        p.data.add_(0.05 * torch.randn_like(p))
    return m


@functools.lru_cache(maxsize=None)
def _reference():
    return train_steps(_build(), BATCHES, _step, select=_select)


def _run_cell(world, dims):
    model = _build()
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, bagel_plan.plan(CFG), pd, JobConfig())
    bm = pd.mesh("batch")
    return train_steps(model, BATCHES, _step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=pd.mesh("loss").get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


CELLS = (("fsdp2", dict(dp_shard=2)), ("tp2", dict(dp_shard=1, tp=2)))


def test_bagel_parallel_matches_world1():
    got = run_multiproc(_worker, 2, args=(CELLS,), timeout_s=600)
    check_cells(CELLS, got, lambda cell: _reference())


def _launch(tmp_path, name: str, nproc: int, *args: str) -> dict[int, tuple[float, float]]:
    """run_train.sh --config debug_bagel for 3 steps of 2 micro-batches of 2 rows; {step: (loss, grad norm)}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC=str(nproc))
    r = subprocess.run([str(ROOT / "run_train.sh"), "--config", "debug_bagel", "--metrics.enable_tensorboard", "False",
                        "--training.steps", "3", "--checkpoint.enable", "False", "--data.micro_batch_size", "2",
                        "--job.dump_folder", str(tmp_path), "--job.name", name, *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {s: (m["loss"], m["grad_norm"]) for s, m in read_metrics(tmp_path / name / "metrics.jsonl").items()}


def test_default_balance_with_two_dp_ranks_is_refused_before_the_build(tmp_path):
    """data.balance (kk by default) cannot move the flat ViT keys between ranks: preflight says so in one line and
    exits 2 before the process group, the model and the run folder."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2")
    r = subprocess.run([str(ROOT / "run_train.sh"), "--config", "debug_bagel", "--training.steps", "1",
                        "--data.micro_batch_size", "2", "--job.dump_folder", str(tmp_path), "--job.name", "kk"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("config error:")]
    assert r.returncode == 2 and lines, r.stderr[-3000:]
    assert "data.balance='kk'" in lines[0] and "vit_patches" in lines[0] and "--data.balance none" in lines[0]
    assert not (tmp_path / "kk").exists()


def test_debug_bagel_through_the_launcher_fsdp_and_tp_match_one_process(tmp_path):
    """The trainer's own wiring (prepare_batch, the combined objective's noise per global micro-batch slot, the plan
    through parallelize): 2 processes with dp 2 (FSDP2; also compiled: the ViT's graph around its blocks' FSDP hooks)
    and with tp 2 follow 1 process accumulating the same 2 micro-batches, as does 1 process compiled with selective
    AC (the ViT blocks' checkpoints inside the ViT's graph). The balancer cannot move ViT patches between ranks yet:
    dp runs with data.balance none."""
    one = _launch(tmp_path, "one", 1)
    for name, nproc, args in (
            ("dp2", 2, ("--data.balance", "none")), ("tp2", 2, ("--parallel.tp", "2")),
            ("dp2-compiled", 2, ("--data.balance", "none", "--compile.enable", "True")),
            ("ac-compiled", 1, ("--activation_checkpoint.mode", "selective", "--compile.enable", "True"))):
        got = _launch(tmp_path, name, nproc, *args)
        assert sorted(got) == sorted(one) == [1, 2, 3]
        for s, (loss, norm) in one.items():
            assert got[s][0] == pytest.approx(loss, rel=1e-5) and got[s][1] == pytest.approx(norm, rel=1e-5), \
                (name, s, one[s], got[s])
