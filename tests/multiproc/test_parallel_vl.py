"""Qwen3-VL-MoE (tiny, packed image+text rows) under tp2 x ep2 over gloo equals the world-1 run."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import assert_close_runs, train_steps

ROWS = 2
# the big tied-off embedding / head gradients are checked through the loss and the global grad norm only
SKIP = ("tok_embeddings", "output")


def _cfg():
    import dataclasses

    from titan_mm.models.qwen3_vl.config import MOE_FLAVORS

    cfg = MOE_FLAVORS["debug"]
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, moe_aux_loss=False, attn_backend="sdpa",
                                                             loss_chunk_size=64))


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


def _step(model, b):
    from titan_mm.models.common.attention import build_attn_meta
    from titan_mm.models.qwen3_vl.model import prepare_inputs

    meta = build_attn_meta(b, "sdpa", "cpu")
    extra = prepare_inputs(model.cfg, b, "cpu")
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"],
                 pixel_values=b["pixel_values"], **extra).loss_sum


def _build():
    from titan_mm.models.qwen3_vl.model import build

    torch.manual_seed(0)
    m = build(_cfg())
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference():
    return train_steps(_build(), _batches(), _step, select=_select, skip_grads=SKIP)


def _worker(rank, world, dims):
    from titan_mm.models.qwen3_vl.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build()
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(_cfg()), pd, None)
    bm = pd.mesh("batch")
    return train_steps(model, _batches(), _step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=bm.get_group(), select=_select, skip_grads=SKIP)


# ep2 alone is covered on Qwen3-MoE (test_parallel_tp_ep.py); keep the CPU budget small
CASES = [("tp2xep2", 4, dict(dp_shard=2, tp=2, ep=2))]


@pytest.mark.parametrize("name,world,dims", CASES, ids=[c[0] for c in CASES])
def test_vl_moe_matches_world1(name, world, dims):
    got = run_multiproc(_worker, world, args=(dims,), timeout_s=600)
    for r in got:
        assert_close_runs(_reference(), r)
