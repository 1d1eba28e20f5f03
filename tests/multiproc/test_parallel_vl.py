"""Qwen3-VL-MoE and Qwen3-VL (dense) on tiny configs with packed image / video + text rows, over gloo: three
SGD-momentum steps give the same losses, grad norms and every gradient (ViT, mergers and embeddings included) as the
world-1 run (fp32, 1e-5) under ep2, tp2, cp2 (Ulysses, ring, all-gather), fsdp x ep / tp / cp and cp combined with
tp and ep. Under CP the vision tower runs on all images and videos on every cp rank and each rank keeps its own
positions (titan_mm.parallel.cp)."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import assert_close_runs, check_cells, run_cells, train_steps

from titan_mm.config import JobConfig, Parallel

ROWS = 4  # one row per data-parallel rank at dp 4


@functools.lru_cache(maxsize=None)
def _cfg(moe=True):
    """The debug flavor (ViT depth 2, DeepStack into LLM layers 0 and 1; MoE or dense) cut to 2 LLM layers, 4 experts
    and a 512-token vocabulary (special tokens moved into it), so that every cell stays a few seconds on 2 CPU cores."""
    import dataclasses

    from titan_mm.models.qwen3_vl.config import FLAVORS, MOE_FLAVORS

    cfg = (MOE_FLAVORS if moe else FLAVORS)["debug"]
    text = dataclasses.replace(cfg.text, moe_aux_loss=False, attn_backend="sdpa", loss_chunk_size=64, vocab_size=512,
                               num_hidden_layers=2, num_experts=4 if moe else 0)
    return dataclasses.replace(cfg, text=text, vision_start_token_id=500, vision_end_token_id=501,
                               image_token_id=502, video_token_id=503)


def _row(cfg, seed, video):
    """One packed row of 32 tokens: two image+text samples, or (``video``) an image+text sample and a video
    (2 temporal patches, a timestamp token before each frame) + text sample."""
    from titan_mm.models.qwen3_vl.synthetic import make_sample, pack, synthetic_vl_batch

    if not video:
        return synthetic_vl_batch(cfg, num_tokens=32, rows=1, image_hw=(4, 4), text_per_sample=8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    samples = [make_sample(cfg, [("image", (4, 4)), ("text", 8)], g),
               make_sample(cfg, [("video", (2, 4, 4)), ("text", 4)], g)]
    return pack(samples, cfg, seq_len=32)


def _batches(moe):
    """3 steps x ROWS rows; odd rows carry a video, so every data-parallel and cp split sees videos."""
    cfg = _cfg(moe)
    return [[_row(cfg, 10 * s + r, video=r % 2 == 1) for r in range(ROWS)] for s in range(3)]


def _merge(rows):
    out = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "doc_ids")}
    out["position_ids"] = torch.cat([r["position_ids"] for r in rows], dim=1)
    for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):  # row-major, as the pads
        parts = [r[k] for r in rows if k in r]
        if parts:
            out[k] = torch.cat(parts)
    return out


def _select(gb, dp_rank, dp_size):
    ntok = sum((r["labels"] != -100).sum() for r in gb)
    return _merge(gb[dp_rank::dp_size]), ntok


def _step(model, b, pd=None, mode=None):
    """As titan_mm.train.step: the family's host-side prepare_batch, then the CP split (prepare_cp_batch, which
    cuts its sequence keys) or build_attn_meta, and every other batch key as a model input."""
    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.models.qwen3_vl.model import prepare_batch
    from titan_mm.parallel.cp import prepare_cp_batch
    from titan_mm.train.step import NOT_MODEL_KWARGS

    b = prepare_batch(model.cfg, b, "cpu")
    if pd is not None and pd.cp_enabled:
        b, meta = prepare_cp_batch(b, pd, "sdpa", "cpu", mode=mode, seq_keys=("visual_index",))
    else:
        meta = build_attn_meta(b, "sdpa", "cpu")
    extra = {k: v for k, v in b.items() if k not in NOT_MODEL_KWARGS}
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"], **extra).loss_sum


def _build(moe, seed=0):
    from titan_mm.models.qwen3_vl.model import build

    torch.manual_seed(seed)
    m = build(_cfg(moe))
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference(moe):
    return train_steps(_build(moe), _batches(moe), _step, select=_select)


def _run_cell(world, moe, dims, mode):
    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build(moe)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(_cfg(moe)), pd, JobConfig())
    bm = pd.mesh("batch")
    return train_steps(model, _batches(moe), functools.partial(_step, pd=pd, mode=mode), dp_rank=bm.get_local_rank(),
                       dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


# (launch id, world, cells); a cell is (name, moe, dims, cp_mode), the cells of a launch run one after another in the
# same processes. JobConfig(): TP cells run with the defaults (sequence parallel and loss parallel on, vision tower
# replicated); test_vl_tp_modes_match_world1 below sets the switches explicitly. Ulysses needs cp * tp to divide the
# kv heads (2 here), so cp x tp uses ring / all-gather.
LAUNCHES = [
    ("world2", 2, (
        ("ep2", True, dict(dp_shard=2, ep=2), None),
        ("tp2", True, dict(dp_shard=1, tp=2), None),
        ("cp2-ulysses", True, dict(dp_shard=1, cp=2), "ulysses"),
        ("cp2-ring", True, dict(dp_shard=1, cp=2), "ring"),
        ("cp2-allgather", True, dict(dp_shard=1, cp=2), "allgather"),
        ("cp2xep2-ulysses", True, dict(dp_shard=1, cp=2, ep=2), "ulysses"),  # ep borrows the cp ranks
        ("dense-tp2", False, dict(dp_shard=1, tp=2), None),
        ("dense-cp2-ulysses", False, dict(dp_shard=1, cp=2), "ulysses"),
        ("dense-cp2-ring", False, dict(dp_shard=1, cp=2), "ring"),
    )),
    ("world4", 4, (
        ("fsdp2xep2", True, dict(dp_shard=4, ep=2), None),  # experts: ep 2 x ep_fsdp 2
        ("fsdp2xtp2", True, dict(dp_shard=2, tp=2), None),
        ("fsdp2xcp2-ulysses", True, dict(dp_shard=2, cp=2), "ulysses"),
        ("fsdp2xcp2-ring", True, dict(dp_shard=2, cp=2), "ring"),
        ("tp2xep2", True, dict(dp_shard=2, tp=2, ep=2), None),
        ("cp2xtp2-ring", True, dict(dp_shard=1, cp=2, tp=2), "ring"),
        ("cp2xtp2xep2-allgather", True, dict(dp_shard=1, cp=2, tp=2, ep=2), "allgather"),
        ("dense-fsdp2xtp2", False, dict(dp_shard=2, tp=2), None),
        ("dense-fsdp2xcp2-ring", False, dict(dp_shard=2, cp=2), "ring"),
    )),
]


@pytest.mark.parametrize("world,cells", [c[1:] for c in LAUNCHES], ids=[c[0] for c in LAUNCHES])
def test_vl_matches_world1(world, cells):
    got = run_multiproc(_worker, world, args=(cells,), timeout_s=600)
    check_cells(cells, got, lambda cell: _reference(cell[1]))


# ---- TP modes (parallel.sequence_parallel / loss_parallel / encoder_tp) on Qwen3-VL dense and Qwen3-VL-MoE ----
@functools.lru_cache(maxsize=None)
def _cfg_family(family):
    """"moe": _cfg(True) (tied head); "dense": _cfg(False) with an untied head, so that both kinds of head (the token
    embedding, the ``output`` linear) run under loss parallel."""
    import dataclasses

    if family == "moe-biasgelu":  # the ViT MLP's bias + GELU op on (CPU: its reference), fc1 sharded by encoder_tp
        return dataclasses.replace(_cfg(True), kernels="bias_gelu")
    return _cfg(True) if family == "moe" else dataclasses.replace(_cfg(False), tie_word_embeddings=False)


def _build_family(family):
    from titan_mm.models.qwen3_vl.model import build

    torch.manual_seed(0)
    m = build(_cfg_family(family))
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference_family(family):
    return train_steps(_build_family(family), _batches(family != "dense"), _step, select=_select)


def _worker_modes(rank, world, family, dims, switches, mode):
    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build_family(family)
    pd = ParallelDims(world_size=world, **dims)
    job = JobConfig(parallel=Parallel(cp_mode=mode or "ulysses", **switches))
    parallelize(model, plan(_cfg_family(family)), pd, job)
    bm = pd.mesh("batch")
    return train_steps(model, _batches(family != "dense"), functools.partial(_step, pd=pd, mode=mode),
                       dp_rank=bm.get_local_rank(), dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(),
                       select=_select)


_SP_LP = dict(sequence_parallel=True, loss_parallel=True)
# (name, world, family, dims, switches, cp_mode)
MODE_CASES = [
    ("dense-tp2-sp-lp", 2, "dense", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=False), None),
    ("dense-tp2-sp-lp-encodertp", 2, "dense", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=True), None),
    ("moe-tp2-sp-lp-encodertp", 2, "moe", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=True), None),
    ("moe-tp2-encodertp-biasgelu", 2, "moe-biasgelu", dict(dp_shard=1, tp=2), dict(_SP_LP, encoder_tp=True), None),
    ("moe-tp2-nosp-nolp", 2, "moe", dict(dp_shard=1, tp=2),
     dict(sequence_parallel=False, loss_parallel=False, encoder_tp=False), None),
    ("dense-cp2xtp2-sp-lp", 4, "dense", dict(dp_shard=1, cp=2, tp=2), dict(_SP_LP, encoder_tp=False), "allgather"),
]


@pytest.mark.parametrize("name,world,family,dims,switches,mode", MODE_CASES, ids=[c[0] for c in MODE_CASES])
def test_vl_tp_modes_match_world1(name, world, family, dims, switches, mode):
    got = run_multiproc(_worker_modes, world, args=(family, dims, switches, mode), timeout_s=600)
    for r in got:
        assert_close_runs(_reference_family(family), r)
