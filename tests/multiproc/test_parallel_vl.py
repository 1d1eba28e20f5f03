"""Qwen3-VL-MoE (tiny, packed image+text rows) under ep2, tp2, cp2 (Ulysses, ring), fsdp2 x ep2, fsdp2 x tp2,
fsdp2 x cp2 (Ulysses) and tp2 x ep2 over gloo: three SGD-momentum steps give the same losses, grad norms and
every gradient (ViT, mergers and embeddings included) as the world-1 run (fp32, 1e-5). Under CP the vision
tower runs on all images on every cp rank and each rank keeps its own positions (titan_mm.parallel.cp)."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import assert_close_runs, train_steps

ROWS = 4  # one image+text row per data-parallel rank at dp 4


def _cfg():
    """The MoE debug flavor (ViT depth 2, DeepStack into LLM layers 0 and 1) cut to 2 LLM layers, 4 experts and a
    512-token vocabulary (special tokens moved into it), so that every case stays a few seconds on 2 CPU cores."""
    import dataclasses

    from titan_mm.models.qwen3_vl.config import MOE_FLAVORS

    cfg = MOE_FLAVORS["debug"]
    text = dataclasses.replace(cfg.text, moe_aux_loss=False, attn_backend="sdpa", loss_chunk_size=64, vocab_size=512,
                               num_hidden_layers=2, num_experts=4)
    return dataclasses.replace(cfg, text=text, vision_start_token_id=500, vision_end_token_id=501,
                               image_token_id=502, video_token_id=503)


def _batches():
    from titan_mm.models.qwen3_vl.synthetic import synthetic_vl_batch

    cfg = _cfg()
    return [[synthetic_vl_batch(cfg, num_tokens=32, rows=1, image_hw=(4, 4), text_per_sample=8, seed=10 * s + r)
             for r in range(ROWS)] for s in range(3)]


def _merge(rows):
    keys = ("input_ids", "labels", "doc_ids", "pixel_values", "image_grid_thw")
    out = {k: torch.cat([r[k] for r in rows]) for k in keys}
    out["position_ids"] = torch.cat([r["position_ids"] for r in rows], dim=1)
    return out


def _select(gb, dp_rank, dp_size):
    ntok = sum((r["labels"] != -100).sum() for r in gb)
    return _merge(gb[dp_rank::dp_size]), ntok


def _step(model, b, pd=None, mode=None):
    """As titan_mm.train.step: the CP split (prepare_cp_batch) or build_attn_meta, the model's host-side
    prepare_inputs, and every other batch key as a model input."""
    from titan_mm.models.common.attention import build_attn_meta
    from titan_mm.models.qwen3_vl.model import prepare_inputs
    from titan_mm.parallel.cp import prepare_cp_batch
    from titan_mm.train.step import _NOT_MODEL_KWARGS

    if pd is not None and pd.cp_enabled:
        b, meta = prepare_cp_batch(b, pd, "sdpa", "cpu", mode=mode)
    else:
        meta = build_attn_meta(b, "sdpa", "cpu")
    extra = {k: v for k, v in b.items() if k not in _NOT_MODEL_KWARGS}
    extra.update(prepare_inputs(model.cfg, b, "cpu"))
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"], **extra).loss_sum


def _build():
    from titan_mm.models.qwen3_vl.model import build

    torch.manual_seed(0)
    m = build(_cfg())
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference():
    return train_steps(_build(), _batches(), _step, select=_select)


def _worker(rank, world, dims, mode):
    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build()
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(_cfg()), pd, None)
    bm = pd.mesh("batch")
    return train_steps(model, _batches(), functools.partial(_step, pd=pd, mode=mode), dp_rank=bm.get_local_rank(),
                       dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(), select=_select)


# (name, world, dims, cp_mode). No job config: TP cases run with the defaults (sequence parallel and loss parallel
# on, vision tower replicated); test_vl_tp_modes_match_world1 below sets the switches explicitly.
# ~5 s per world-2 case and ~11 s per world-4 case on 2 idle cores (mostly process start-up and imports).
CASES = [
    ("ep2", 2, dict(dp_shard=2, ep=2), None),
    ("tp2", 2, dict(dp_shard=1, tp=2), None),
    ("cp2-ulysses", 2, dict(dp_shard=1, cp=2), "ulysses"),
    ("cp2-ring", 2, dict(dp_shard=1, cp=2), "ring"),
    ("fsdp2xep2", 4, dict(dp_shard=4, ep=2), None),  # experts: ep 2 x ep_fsdp 2
    ("fsdp2xtp2", 4, dict(dp_shard=2, tp=2), None),
    ("fsdp2xcp2-ulysses", 4, dict(dp_shard=2, cp=2), "ulysses"),
    ("tp2xep2", 4, dict(dp_shard=2, tp=2, ep=2), None),
]


@pytest.mark.parametrize("name,world,dims,mode", CASES, ids=[c[0] for c in CASES])
def test_vl_moe_matches_world1(name, world, dims, mode):
    got = run_multiproc(_worker, world, args=(dims, mode), timeout_s=600)
    for r in got:
        assert_close_runs(_reference(), r)


# ---- TP modes (parallel.sequence_parallel / loss_parallel / encoder_tp) on Qwen3-VL dense and Qwen3-VL-MoE ----
def _cfg_family(family):
    """"moe": _cfg() (tied head); "dense": the dense debug flavor cut the same way, with an untied head, so that
    both kinds of head (the token embedding, the ``output`` linear) run under loss parallel."""
    import dataclasses

    from titan_mm.models.qwen3_vl.config import FLAVORS

    if family == "moe":
        return _cfg()
    cfg = FLAVORS["debug"]
    text = dataclasses.replace(cfg.text, attn_backend="sdpa", loss_chunk_size=64, vocab_size=512, num_hidden_layers=2)
    return dataclasses.replace(cfg, text=text, tie_word_embeddings=False, vision_start_token_id=500,
                               vision_end_token_id=501, image_token_id=502, video_token_id=503)


def _build_family(family):
    from titan_mm.models.qwen3_vl.model import build

    torch.manual_seed(0)
    m = build(_cfg_family(family))
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference_family(family):
    return train_steps(_build_family(family), _batches(), _step, select=_select)


def _worker_modes(rank, world, family, dims, switches, mode):
    from types import SimpleNamespace

    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build_family(family)
    pd = ParallelDims(world_size=world, **dims)
    job = SimpleNamespace(parallel=SimpleNamespace(backend="auto", cp_mode=mode or "ulysses", **switches))
    parallelize(model, plan(_cfg_family(family)), pd, job)
    bm = pd.mesh("batch")
    return train_steps(model, _batches(), functools.partial(_step, pd=pd, mode=mode), dp_rank=bm.get_local_rank(),
                       dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(), select=_select)


_SP_LP = dict(sequence_parallel=True, loss_parallel=True)
# (name, world, family, dims, switches, cp_mode). ~6 s per world-2 case, ~11 s per world-4 case on 2 cores.
MODE_CASES = [
    ("dense-tp2-sp-lp", 2, "dense", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=False), None),
    ("dense-tp2-sp-lp-encodertp", 2, "dense", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=True), None),
    ("moe-tp2-sp-lp-encodertp", 2, "moe", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=True), None),
    ("moe-tp2-nosp-nolp", 2, "moe", dict(dp_shard=1, tp=2),
     dict(sequence_parallel=False, loss_parallel=False, encoder_tp=False), None),
    ("dense-cp2xtp2-sp-lp", 4, "dense", dict(dp_shard=1, cp=2, tp=2), dict(_SP_LP, encoder_tp=False), "allgather"),
]


@pytest.mark.parametrize("name,world,family,dims,switches,mode", MODE_CASES, ids=[c[0] for c in MODE_CASES])
def test_vl_tp_modes_match_world1(name, world, family, dims, switches, mode):
    got = run_multiproc(_worker_modes, world, args=(family, dims, switches, mode), timeout_s=600)
    for r in got:
        assert_close_runs(_reference_family(family), r)
