"""The Omni thinkers (tiny configs) over gloo on 2 ranks: three SGD-momentum steps give the world-1 losses, grad
norms and every gradient (both towers included; fp32, 1e-5) under FSDP2, TP 2 (the decoder split by the family's
plan, sequence + loss parallel on; with parallel.encoder_tp also the audio encoder and the ViT) and, for
Qwen3-Omni-MoE, EP 2 (the experts over ep, FSDP2 over the rest). Where the ranks read different rows (FSDP2, EP),
rank 0's row carries an image and two audio clips and rank 1's row is text only: rank 1 runs both encoders on
their stand-in inputs, so every FSDP collective of the towers has its partner (a hang here would time the test
out). Under TP both ranks read the same rows. Qwen2.5-Omni and Qwen3-Omni-MoE, all cells in the same 2
processes."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import check_cells, run_cells, train_steps

from tests.parity import test_qwen2_5_omni_parity as q25
from tests.parity import test_qwen3_omni_moe_parity as q3


@functools.lru_cache(maxsize=None)
def _cfg(family):
    import tempfile

    from titan_mm.registry import get_model_spec

    with tempfile.TemporaryDirectory() as d:
        (q25 if family == "qwen2_5_omni" else q3).hf_config().save_pretrained(d)
        return get_model_spec(family).config_from_hf(d, vision_attn_backend="sdpa")


def _labels(ids, special):
    """Next token, media and special tokens not predicted, nor the padding (id 0 past the text)."""
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    labels[torch.isin(labels, torch.tensor(special))] = -100
    return labels


def _rows_qwen2_5_omni(seed):
    """(media row, text row) of 48 tokens each: the parity test's samples, the text row padded."""
    cfg, out = _cfg("qwen2_5_omni"), []
    for segments in ([("text", 3), ("image", (4, 4)), ("text", 2), ("audio", 13), ("text", 2), ("audio", 9),
                      ("text", 4)], [("text", 48)]):
        b = q25.titan_batch(q25.make_sample(cfg, segments, torch.Generator().manual_seed(seed)))
        ids = b["input_ids"][0]
        pad = 48 - ids.numel()
        ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
        labels = _labels(ids, list(q25.TOK.values()))
        labels[47 - pad:] = -100
        out.append({**b, "input_ids": ids[None], "labels": labels[None]})
        seed += 1
    return out


def _rows_qwen3_omni_moe(seed):
    """(media row, text row) of 60 tokens each, by the parity test's batch maker."""
    out = []
    for parts in ([3, "image", 2, "audio60", 2, "audio130", 18], [60]):
        b, _ = q3.make_batch([parts], seed)
        out.append({**b, "labels": _labels(b["input_ids"][0], [q3.AUD, q3.AS, q3.AE, q3.IMG, q3.VID, q3.VS,
                                                                q3.VE])[None]})
        seed += 1
    return out


ROWS = {"qwen2_5_omni": _rows_qwen2_5_omni, "qwen3_omni_moe": _rows_qwen3_omni_moe}


def _batches(family):
    return [ROWS[family](10 * s) for s in range(3)]


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


def _build(family):
    from titan_mm.registry import get_model_spec

    torch.manual_seed(0)
    model = get_model_spec(family).build(_cfg(family))
    model.init_weights(buffer_device="cpu")
    return model


def _step(family, model, b):
    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.registry import get_model_spec

    b = get_model_spec(family).prepare_batch(model.cfg, b, "cpu")
    extra = {k: v for k, v in b.items() if k not in ("input_ids", "position_ids", "labels")}
    return model(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu"),
                 labels=b["labels"], **extra).loss_sum


@functools.lru_cache(maxsize=None)
def _reference(family):
    return train_steps(_build(family), _batches(family), functools.partial(_step, family), select=_select)


def _run_cell(world, family, dims, switches):
    from titan_mm.config import JobConfig, Parallel
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import get_model_spec

    model = _build(family)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, get_model_spec(family).plan(model.cfg), pd, JobConfig(parallel=Parallel(**switches)))
    bm = pd.mesh("batch")
    return train_steps(model, _batches(family), functools.partial(_step, family), dp_rank=bm.get_local_rank(),
                       dp_size=bm.size(), loss_group=pd.mesh("loss").get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


_OFF = dict(sequence_parallel=False, loss_parallel=False)
# (name, family, parallel dims, [parallel] switches); all run one after another in the same 2 processes. "text-only
# rank": the batch mesh has 2 ranks and rank 1 reads the text row; under tp (batch mesh 1) both read both rows.
CELLS = tuple(c for family in ROWS for c in (
    (f"{family}-fsdp2-text-only-rank", family, dict(dp_shard=2), {}),
    (f"{family}-tp2-sp-lp", family, dict(dp_shard=1, tp=2), {}),
    (f"{family}-tp2", family, dict(dp_shard=1, tp=2), _OFF),
    (f"{family}-tp2-sp-lp-encodertp", family, dict(dp_shard=1, tp=2), dict(encoder_tp=True)),
)) + (
    ("qwen3_omni_moe-ep2-text-only-rank", "qwen3_omni_moe", dict(dp_shard=2, ep=2), {}),
)


@pytest.mark.parametrize("world,cells", [(2, CELLS)], ids=["world2"])
def test_omni_parallel_with_a_text_only_rank_matches_world1(world, cells):
    got = run_multiproc(_worker, world, args=(cells,), timeout_s=600)
    check_cells(cells, got, lambda cell: _reference(cell[1]))
