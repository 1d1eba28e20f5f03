"""Wan and BAGEL through pipeline parallelism on 2 gloo processes, by the trainer's own setup(cfg) and train_step: three
SGD-momentum steps of each debug flavor (2 blocks) on the family's synthetic rows give world 1's losses, grad norms and
final weights (so every gradient) under 1F1B, GPipe, interleaved 1F1B with the zero-block first and last stages
0 | 1 | 1 | 0 and the zero-bubble V schedule (split backward; stages 0 and 3 on rank 0); and on 4 processes pp 2 x
FSDP2 dp 2 and pp 2 x tp 2.

Wan (flow matching over whole clips): stage 0 embeds the clips, the text and the timesteps; the text states, the
modulation and the time embedding travel with the stream (``Stream.cond``) to every stage, through stages without
blocks too, and their gradients back to the embedders; the last stage runs the modulated output norm, ``proj_out``
and the loss. Both with one t per clip (the modulation [B, 1, 6, D]) and with a t per patch (``first_frame_clean``:
[B, S, 6, D]). BAGEL (CE on the text + flow matching on the latents, under the segment mask): stage 0 runs the
token embedding, the ViT and the latent embedding; every stage routes its layers by the micro-batch's host-built
permutation (``spec.ROUTING_KEYS``); the last stage runs both experts' final norms, the LM head and llm2vae.

Tolerance as tests/multiproc/test_parallel_pp.py's: the stages compute the same fp32 products in the same order;
only the micro-batches' gradient sums may regroup, 1e-5.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import make_optimizer, run_cells
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow  # spawned processes on 2 shared cores, about three minutes

STEPS, MICRO = 3, 4  # 4 one-row micro-batches per step
KINDS = {  # family, model.overrides, seq_len (Wan: 2 latent frames of 4 x 4 patches; BAGEL: its three samples)
    "wan-clip": ("wan", {}, 32),
    "wan-patch": ("wan", {"first_frame_clean": True}, 32),
    "bagel": ("bagel", {}, 48),
}
CELLS = {  # world -> cells, run one after another in the same processes
    2: (
        ("pp2-1F1B", dict(pp=2)),
        ("pp2-GPipe", dict(pp=2, pp_schedule="GPipe")),
        ("pp2-interleaved-0|1|1|0", dict(pp=2, pp_schedule="Interleaved1F1B", pp_layers_per_stage=[0, 1, 1, 0])),
        ("pp2-ZBV-0|1|1|0", dict(pp=2, pp_schedule="ZBVZeroBubble", pp_layers_per_stage=[0, 1, 1, 0])),
    ),
    4: (
        ("pp2xdp2", dict(pp=2, dp_shard=2)),  # FSDP2 roots per stage: the carried conditioning's gradients sharded
        ("pp2xtp2", dict(pp=2, tp=2)),
    ),
}


def _job(kind: str, par: dict):
    from titan_mm.config import load_config

    name, ov, seq = KINDS[kind]
    argv = ["--model.name", name, "--model.flavor", "debug", "--model.overrides", json.dumps(ov),
            "--data.dataset", "synthetic", "--data.seq_len", str(seq), "--data.micro_batch_size", "1",
            "--training.global_batch_size", str(MICRO), "--lr_scheduler.name", "constant",
            "--lr_scheduler.warmup_steps", "0", "--checkpoint.async_mode", "disabled"]
    for k, v in par.items():
        argv += [f"--parallel.{k}", *map(str, v)] if isinstance(v, list) else [f"--parallel.{k}", str(v)]
    return load_config(argv)


@functools.lru_cache(maxsize=None)
def _batches(kind: str) -> list[list[dict]]:
    """The family's synthetic rows (ModelSpec.synthetic), one per micro-batch."""
    from titan_mm.registry import get_model_spec, override

    name, ov, seq = KINDS[kind]
    spec = get_model_spec(name)
    make = spec.synthetic(override(spec.flavor("debug"), ov), seq)
    return [[make([torch.Generator().manual_seed(100 * s + r)]) for r in range(MICRO)] for s in range(STEPS)]


def _run(kind: str, par: dict):
    """STEPS steps -> (per step (loss, grad norm), the weights this rank holds)."""
    from titan_mm.train.setup import setup
    from titan_mm.train.state import TrainState
    from titan_mm.train.step import train_step

    run = setup(_job(kind, par))
    opt = make_optimizer(run.model)
    state = TrainState(run.model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    out = {}
    while state.step < STEPS:
        step = state.step
        mine = _batches(kind)[step][run.dp_rank * run.n_micro:(run.dp_rank + 1) * run.n_micro]
        r = train_step(state, mine, run.ctx)
        out[step] = (r.loss, r.grad_norm)
    return out, {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in run.model.state_dict().items()}


@functools.lru_cache(maxsize=None)
def _reference(kind: str):
    return _run(kind, {})


def _worker(rank, world, kind):
    return run_cells(CELLS[world], functools.partial(_run, kind))


@pytest.mark.parametrize("world", list(CELLS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_pp2_matches_world1(kind, world):
    ref_steps, ref_w = _reference(kind)
    got = run_multiproc(_worker, world, args=(kind,), timeout_s=900)
    for i, (name, _) in enumerate(CELLS[world]):
        w = {}
        for rank in range(world):
            steps, held = got[rank][i]
            for s, (loss, gnorm) in steps.items():
                want_loss, want_gnorm = ref_steps[s]
                assert abs(loss - want_loss) <= 1e-5 * (1 + abs(want_loss)), (name, rank, s, loss, want_loss)
                assert abs(gnorm - want_gnorm) <= 1e-5 * (1 + abs(want_gnorm)), (name, rank, s, gnorm, want_gnorm)
            w.update(held)
        assert set(w) == set(ref_w), f"{name}: weights differ in names: {sorted(set(w) ^ set(ref_w))}"
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}, {k}: {m}")
