"""Pipeline parallelism over gloo, through the trainer's own setup(cfg) and train_step: five SGD-momentum steps on
packed rows give world 1's losses, grad norms, MoE aux losses and final weights (fp32, 1e-5) for Qwen3 dense,
Qwen3-MoE (aux loss on) and Qwen3-VL-MoE (images and videos, DeepStack into both LLM layers, aux loss on), under
every schedule, pp x dp (FSDP2), pp x tp (sequence parallel, loss parallel), pp x ep x dp, pp = 4 and 2 stages per
rank; DCP checkpoints resume across pipeline layouts (pp 2 -> 1, 1 -> 2, another split) and export from a pp 2
checkpoint to the full model.

Runs by default: every schedule at pp 2 (dense), the 4-process dense matrix, Qwen3-MoE pp2 x dp2 x ep2 and pp2 x tp2,
Qwen3-VL-MoE pp 2 and 2 stages per rank (zero-block first and last stages), the checkpoint / export test. With
``-m slow``: pp x cp (Ulysses, ring), pp x dp with selective AC, and the rest of the 4-process MoE and VL
matrix. The world-1 references run in the pytest process.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import make_optimizer, make_packed_batches

# about 5 minutes of 4-process gloo runs on 2 cores: in the slow set (`pytest -q -m slow tests`, run by CI)
pytestmark = pytest.mark.slow

STEPS = 5
_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
             loss_chunk_size=64)
_MODELS = {
    "dense": ("qwen3", "debug", dict(_TEXT, moe_aux_loss=False)),
    "moe": ("qwen3_moe", "debug_moe", dict(_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           moe_aux_loss=True, router_aux_loss_coef=0.01)),
    # the debug VL-MoE flavor (ViT depth 2, DeepStack into LLM layers 0 and 1) cut to 2 LLM layers and 4 experts,
    # with an untied head (pp refuses tied embeddings) and a 512-token vocabulary holding the special tokens
    "vl": ("qwen3_vl_moe", "debug", dict(
        tie_word_embeddings=False, vision_start_token_id=500, vision_end_token_id=501, image_token_id=502,
        video_token_id=503, text=dict(moe_aux_loss=True, router_aux_loss_coef=0.01, loss_chunk_size=64,
                                      vocab_size=512, num_hidden_layers=2, num_experts=4,
                                      tie_word_embeddings=False))),
}
ROWS = {"dense": 8, "moe": 8, "vl": 4}  # rows per global batch (micro-batches of 1 row)


def _job(kind: str, par: dict):
    from titan_mm.config import load_config

    name, flavor, ov = _MODELS[kind]
    argv = ["--model.name", name, "--model.flavor", flavor, "--model.overrides", json.dumps(ov),
            "--data.dataset", "synthetic", "--data.seq_len", "32", "--data.micro_batch_size", "1",
            "--training.global_batch_size", str(ROWS[kind]), "--lr_scheduler.name", "constant",
            "--lr_scheduler.warmup_steps", "0", "--checkpoint.async_mode", "disabled"]
    for k, v in par.items():  # [parallel] keys, or section.key
        k = k if "." in k else f"parallel.{k}"
        argv += [f"--{k}", *map(str, v)] if isinstance(v, list) else [f"--{k}", str(v)]
    return load_config(argv)


@functools.lru_cache(maxsize=None)
def _batches(kind: str) -> list[list[dict]]:
    """STEPS global batches of ROWS[kind] one-row micro-batches (packed documents, positions restart per document;
    VL: odd rows carry a video after an image sample)."""
    if kind == "vl":
        import test_parallel_vl as vl

        cfg = _vl_cfg()
        rows = [[vl._merge([vl._row(cfg, 10 * s + r, video=r % 2 == 1)]) for r in range(ROWS[kind])]
                for s in range(STEPS)]
    else:
        rows = [[{k: v[r:r + 1] for k, v in gb.items()} for r in range(ROWS[kind])]
                for gb in make_packed_batches(STEPS, batch=ROWS[kind], seq=32, vocab=128)]
    for step in rows:
        for mb in step:
            mb["num_label_tokens"] = int((mb["labels"] != -100).sum())
    return rows


@functools.lru_cache(maxsize=None)
def _vl_cfg():
    from titan_mm.registry import resolve_model

    name, flavor, ov = _MODELS["vl"]
    return resolve_model(name, flavor, None, json.dumps(ov), attn_backend="sdpa", kernels=False)[1]


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _run(kind: str, par: dict, folder: str | None = None, load: str | None = None, save_at: int | None = None):
    """STEPS steps (from the loaded checkpoint's step when ``load``); -> (per step (loss, grad_norm, aux), the weights
    this rank holds, unsharded). ``save_at``: write a checkpoint under ``folder`` after that many steps."""
    from titan_mm.config import resolved_toml
    from titan_mm.train.checkpoint import CheckpointManager
    from titan_mm.train.setup import setup
    from titan_mm.train.state import TrainState
    from titan_mm.train.step import train_step

    cfg = _job(kind, par)
    run = setup(cfg)
    opt = make_optimizer(run.model)
    state = TrainState(run.model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    ckm = None
    if folder is not None:
        ckm = CheckpointManager(folder, interval=1, keep_last=0, async_mode="disabled", config_toml=resolved_toml(cfg))
    if load is not None:
        ckm.load_into(state, Path(load))
    out = {}
    while state.step < STEPS:
        step = state.step
        mine = _batches(kind)[step][run.dp_rank * run.n_micro:(run.dp_rank + 1) * run.n_micro]
        r = train_step(state, mine, run.ctx)
        out[step] = (r.loss, r.grad_norm, r.aux_loss)
        if save_at is not None and state.step == save_at:
            ckm.save(state, blocking=True)
    if ckm is not None:
        ckm.close()
    return out, _full(run.model)


@functools.lru_cache(maxsize=None)
def _reference(kind: str):
    return _run(kind, {})


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * (1 + abs(b))


def _check(name: str, ref, per_rank: list) -> None:
    """Every rank's per-step values equal world 1's; the union of the ranks' weights is world 1's model."""
    ref_steps, ref_w = ref
    for rank, (steps, _) in enumerate(per_rank):
        for s, vals in steps.items():
            for what, a, b in zip(("loss", "grad_norm", "aux"), vals, ref_steps[s]):
                assert _close(a, b), f"{name}, rank {rank}, step {s + 1}: {what} {a} != world 1's {b}"
    w = {}
    for _, held in per_rank:
        w.update(held)
    assert set(w) == set(ref_w), f"{name}: weights differ in names: {sorted(set(w) ^ set(ref_w))}"
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}, {k}: {m}")


def _worker(rank, world, kind, cells):
    out = []
    for name, par in cells:
        try:
            out.append(_run(kind, par))
        except Exception as e:
            e.add_note(f"in test cell {name!r}")
            raise
    return out


def _launch(kind, world, cells):
    if kind != "dense":  # the router statistics reach a nonzero aux loss through the stages
        assert all(v[2] > 0 for v in _reference(kind)[0].values())
    got = run_multiproc(_worker, world, args=(kind, cells), timeout_s=900)
    for i, (name, _) in enumerate(cells):
        _check(name, _reference(kind), [g[i] for g in got])


SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
# (kind, world, cells); a cell is (name, [parallel] settings); the cells of a launch run one after another in the
# same processes. 4 decoder blocks: pp 2 x 2 stages per rank splits them 1 | 1 | 1 | 1.
LAUNCHES = [
    ("dense", 2, tuple((f"pp2-{s}", dict(pp=2, pp_schedule=s)) for s in SCHEDULES)),
    ("dense", 4, (
        ("pp2xdp2", dict(pp=2, dp_shard=2)),
        ("pp2xtp2", dict(pp=2, tp=2)),
        ("pp4", dict(pp=4)),
        ("pp2xdp2-interleaved-v2", dict(pp=2, dp_shard=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2)),
    )),
    ("moe", 4, (
        ("pp2xdp2xep2", dict(pp=2, dp_shard=2, ep=2)),
        ("pp2xtp2", dict(pp=2, tp=2)),
    )),
    # 2 LLM blocks: the V2 layout 0 | 1 | 1 | 0 leaves the first stage the ViT and the embedding, the last the head;
    # DeepStack's second addition travels from stage 0 to stage 2
    ("vl", 2, (
        ("pp2", dict(pp=2)),
        ("pp2-interleaved-v2-zero-block-ends", dict(pp=2, pp_schedule="Interleaved1F1B",
                                                    pp_layers_per_stage=[0, 1, 1, 0])),
    )),
]
SLOW_LAUNCHES = [
    ("dense", 4, (
        ("pp2xcp2-ulysses", dict(pp=2, cp=2, cp_mode="ulysses")),
        ("pp2xcp2-ring", dict(pp=2, cp=2, cp_mode="ring")),
        ("pp2xdp2-selective-ac", {"pp": 2, "dp_shard": 2, "activation_checkpoint.mode": "selective"}),
    )),
    ("moe", 4, (
        ("pp4", dict(pp=4)),
        ("pp2xdp2-zerobubble-v2", dict(pp=2, dp_shard=2, pp_schedule="InterleavedZeroBubble",
                                       fsdp_reshard_after_forward="never")),
    )),
    ("vl", 4, (
        ("pp2xdp2", dict(pp=2, dp_shard=2)),
        ("pp2xtp2", dict(pp=2, tp=2)),
        ("pp4", dict(pp=4, pp_layers_per_stage=[0, 1, 1, 0])),
        ("pp2xtp2-dualpipev", dict(pp=2, tp=2, pp_schedule="DualPipeV", pp_layers_per_stage=[0, 1, 1, 0])),
    )),
]


@pytest.mark.parametrize("kind,world,cells", LAUNCHES, ids=[f"{k}-world{w}" for k, w, _ in LAUNCHES])
def test_pp_matches_world1(kind, world, cells):
    _launch(kind, world, cells)


@pytest.mark.slow
@pytest.mark.parametrize("kind,world,cells", SLOW_LAUNCHES, ids=[f"{k}-world{w}" for k, w, _ in SLOW_LAUNCHES])
def test_pp_matches_world1_slow(kind, world, cells):
    _launch(kind, world, cells)


# ---- checkpoints across pipeline layouts, and export ----
def _ckpt_worker(rank, world, jobs):
    return [_run(kind, par, folder=folder, load=load, save_at=save_at) for kind, par, folder, load, save_at in jobs]


def test_resume_across_pipeline_layouts_and_export():
    """Qwen3-MoE (router statistics and aux loss in the checkpointed run): saved after 2 steps by pp 2 (1F1B, 2 | 2
    blocks), resumed by one process (pp 2 -> 1); saved by one process, resumed by pp 2 with a 1 | 3 split (1 -> 2);
    the pp 2 checkpoint resumed by pp 2 with a 3 | 1 split under GPipe (another layout). Each continues with world 1's
    losses and ends at its weights. ``python -m titan_mm.export``'s loader builds the full model from the pp 2
    checkpoint (step 2's weights)."""
    from titan_mm.export import export
    from titan_mm.loader import load_model

    kind = "moe"
    ref = _reference(kind)
    with tempfile.TemporaryDirectory() as d:
        pp_dir, one_dir = os.path.join(d, "pp2"), os.path.join(d, "one")
        saved = run_multiproc(_ckpt_worker, 2, args=([(kind, dict(pp=2), pp_dir, None, 2)],), timeout_s=900)
        _check("pp2-saved", ref, [g[0] for g in saved])
        pp_ck, one_ck = os.path.join(pp_dir, "step-00000002"), os.path.join(one_dir, "step-00000002")
        _check("pp2-to-1", ref, [_run(kind, {}, folder=pp_dir, load=pp_ck)])
        two = _run(kind, {}, folder=one_dir, save_at=2)  # world 1 writes step 2
        _check("world1-saved", ref, [two])
        got = run_multiproc(_ckpt_worker, 2, args=([
            (kind, dict(pp=2, pp_layers_per_stage=[1, 3]), one_dir, one_ck, None),
            (kind, dict(pp=2, pp_layers_per_stage=[3, 1], pp_schedule="GPipe"), pp_dir, pp_ck, None),
        ],), timeout_s=900)
        _check("1-to-pp2-split-1-3", ref, [g[0] for g in got])
        _check("pp2-to-pp2-split-3-1-gpipe", ref, [g[1] for g in got])
        for steps, _ in (g[0] for g in got):
            assert sorted(steps) == [2, 3, 4]  # resumed at step 3

        # export: the full model from the pp 2 checkpoint equals the one from world 1's checkpoint of step 2
        got_sd = load_model(pp_ck).model.state_dict()
        want_sd = load_model(one_ck).model.state_dict()
        assert set(got_sd) == set(want_sd)
        for k, v in want_sd.items():
            torch.testing.assert_close(got_sd[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"export {k}: {m}")
        out = export(pp_ck, os.path.join(d, "hf"))
        assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
