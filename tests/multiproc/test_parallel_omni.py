"""The Qwen2.5-Omni thinker (a tiny config) over gloo with FSDP2 on 2 ranks, where rank 0's rows carry an image and
two audio clips and rank 1's rows are text only: rank 1 runs both encoders on their stand-in inputs, so every
FSDP collective of the towers has its partner (a hang here would time the test out), and three SGD-momentum
steps give the world-1 losses, grad norms and every gradient (both towers included; fp32, 1e-5)."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import check_cells, run_cells, train_steps

from tests.parity.test_qwen2_5_omni_parity import TOK, hf_config, make_sample, titan_batch

SEQ = 48


@functools.lru_cache(maxsize=None)
def _cfg():
    import tempfile

    from titan_mm.registry import get_model_spec

    with tempfile.TemporaryDirectory() as d:
        hf_config().save_pretrained(d)
        return get_model_spec("qwen2_5_omni").config_from_hf(d, vision_attn_backend="sdpa")


def _row(cfg, segments, seed):
    """One row of SEQ tokens (text padded at the end), labels = next token, media and pads not predicted."""
    s = make_sample(cfg, segments, torch.Generator().manual_seed(seed))
    b = titan_batch(s)
    ids = b["input_ids"][0]
    pad = SEQ - ids.numel()
    assert pad >= 0, ids.numel()
    ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[torch.isin(labels, torch.tensor(list(TOK.values())))] = -100
    labels[SEQ - 1 - pad:] = -100
    return {**b, "input_ids": ids[None], "labels": labels[None]}


MEDIA = [("text", 3), ("image", (4, 4)), ("text", 2), ("audio", 13), ("text", 2), ("audio", 9), ("text", 4)]
TEXT = [("text", SEQ)]


def _batches():
    cfg = _cfg()
    return [[_row(cfg, MEDIA, 10 * s), _row(cfg, TEXT, 10 * s + 1)] for s in range(3)]


def _merge(rows):
    out = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels")}
    for k in ("pixel_values", "image_grid_thw", "audio_feature_lengths"):
        parts = [r[k] for r in rows if k in r]
        if parts:
            out[k] = torch.cat(parts)
    if any("input_features" in r for r in rows):
        out["input_features"] = torch.cat([r["input_features"] for r in rows if "input_features" in r], dim=1)
    return out


def _select(gb, dp_rank, dp_size):
    ntok = sum((r["labels"] != -100).sum() for r in gb)
    return _merge(gb[dp_rank::dp_size]), ntok


def _build():
    from titan_mm.registry import get_model_spec

    torch.manual_seed(0)
    model = get_model_spec("qwen2_5_omni").build(_cfg())
    model.init_weights(buffer_device="cpu")
    return model


def _step(model, b):
    from titan_mm.models.common.attention import build_attn_meta
    from titan_mm.registry import get_model_spec

    b = get_model_spec("qwen2_5_omni").prepare_batch(model.cfg, b, "cpu")
    extra = {k: v for k, v in b.items() if k not in ("input_ids", "position_ids", "labels")}
    return model(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu"),
                 labels=b["labels"], **extra).loss_sum


@functools.lru_cache(maxsize=None)
def _reference():
    return train_steps(_build(), _batches(), _step, select=_select)


def _run_cell(world, dims):
    from titan_mm.config import JobConfig
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import get_model_spec

    model = _build()
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, get_model_spec("qwen2_5_omni").plan(model.cfg), pd, JobConfig())
    bm = pd.mesh("batch")
    return train_steps(model, _batches(), _step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=bm.get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


CELLS = (("fsdp2-text-only-rank", dict(dp_shard=2)),)


@pytest.mark.parametrize("world,cells", [(2, CELLS)], ids=["world2"])
def test_omni_fsdp_with_a_text_only_rank_matches_world1(world, cells):
    got = run_multiproc(_worker, world, args=(cells,))
    check_cells(cells, got, lambda cell: _reference())
