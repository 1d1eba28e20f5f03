"""Qwen3.5 and Qwen3.5-MoE (both block kinds: a Gated DeltaNet block and a gated full-attention block) on packed
image + text rows over gloo, 2 processes: three SGD-momentum steps give the world-1 losses, grad norms and every
gradient (fp32, 1e-5) under FSDP2, TP (sequence + loss parallel on, and both off) and, for the MoE, EP.

TP splits the linear-attention projections by heads: each rank runs the delta rule on its key heads and their value
heads, with the conv weight and the per-head decays split with the projection rows (titan_mm/models/qwen3_5/plan.py).
"""

import dataclasses
import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import check_cells, run_cells, train_steps

from titan_mm.config import JobConfig, Parallel

ROWS = 2  # one row per data-parallel rank at dp 2
SEQ = 80  # documents cross the rule's 64-token chunk


@functools.lru_cache(maxsize=None)
def _cfg(moe: bool):
    """The debug flavor cut to 2 decoder layers (Gated DeltaNet, then gated attention), an untied head, 4 experts
    and a 512-token vocabulary (special tokens moved into it)."""
    from titan_mm.models.qwen3_5.config import FLAVORS, MOE_FLAVORS

    cfg = (MOE_FLAVORS if moe else FLAVORS)["debug"]
    text = dataclasses.replace(cfg.text, moe_aux_loss=False, attn_backend="sdpa", loss_chunk_size=64, vocab_size=512,
                               num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                               num_experts=4 if moe else 0)
    return dataclasses.replace(cfg, text=text, tie_word_embeddings=False, vision_start_token_id=500,
                               vision_end_token_id=501, image_token_id=502, video_token_id=503,
                               vision_attn_backend="sdpa")


def _batches(moe):
    """3 steps x ROWS packed rows: an image + text sample, a text document longer than a chunk, a short one."""
    from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

    cfg = _cfg(moe)
    out = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        rows = []
        for _ in range(ROWS):
            samples = [make_sample(cfg, [("text", 3), ("image", (4, 4)), ("text", 5)], g),
                       make_sample(cfg, [("text", 66)], g)]
            rows.append(pack(samples, cfg, seq_len=SEQ))
        out.append(rows)
    return out


def _select(gb, dp_rank, dp_size):
    rows = gb[dp_rank::dp_size]
    out = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "doc_ids", "pixel_values",
                                                         "image_grid_thw")}
    out["position_ids"] = torch.cat([r["position_ids"] for r in rows], dim=1)
    return out, sum((r["labels"] != -100).sum() for r in gb)


def _step(model, b):
    """As titan_mm.train.step: the family's prepare_batch on the host, build_attn_meta, the rest as model inputs."""
    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.models.qwen3_5.model import prepare_batch
    from titan_mm.train.step import NOT_MODEL_KWARGS

    b = prepare_batch(model.cfg, b, "cpu")
    meta = build_attn_meta(b, "sdpa", "cpu")
    extra = {k: v for k, v in b.items() if k not in NOT_MODEL_KWARGS}
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"], **extra).loss_sum


def _build(moe):
    from titan_mm.models.qwen3_5.model import build

    torch.manual_seed(0)
    m = build(_cfg(moe))
    m.init_weights()
    return m


@functools.lru_cache(maxsize=None)
def _reference(moe):
    return train_steps(_build(moe), _batches(moe), _step, select=_select)


def _run_cell(world, moe, dims, switches):
    from titan_mm.models.qwen3_5.plan import plan
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    model = _build(moe)
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, plan(_cfg(moe)), pd, JobConfig(parallel=Parallel(**switches)))
    bm = pd.mesh("batch")
    return train_steps(model, _batches(moe), _step, dp_rank=bm.get_local_rank(), dp_size=bm.size(),
                       loss_group=pd.mesh("loss").get_group(), select=_select)


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


_OFF = dict(sequence_parallel=False, loss_parallel=False)
# (name, moe, dims, [parallel] switches); the cells run one after another in the same 2 processes
CELLS = (
    ("dense-fsdp2", False, dict(dp_shard=2), {}),
    ("dense-tp2-sp-lp", False, dict(dp_shard=1, tp=2), {}),
    ("dense-tp2", False, dict(dp_shard=1, tp=2), _OFF),
    ("moe-fsdp2", True, dict(dp_shard=2), {}),
    ("moe-tp2-sp-lp", True, dict(dp_shard=1, tp=2), {}),
    ("moe-ep2", True, dict(dp_shard=2, ep=2), {}),
)


def test_qwen3_5_parallel_matches_world1():
    got = run_multiproc(_worker, 2, args=(CELLS,), timeout_s=600)
    check_cells(CELLS, got, lambda cell: _reference(cell[1]))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_plan_names_modules_of_both_kinds(moe):
    """Every TP / SP / EP pattern of the plan matches a module of the model (apply_tp raises on one that does not);
    the linear-attention projections are split by heads and their row-aligned parameters live in them."""
    import fnmatch

    from titan_mm.models.qwen3_5.model import build
    from titan_mm.models.qwen3_5.plan import plan

    with torch.device("meta"):
        m = build(_cfg(moe))
    names = [n for n, _ in m.named_modules()]
    p = plan(_cfg(moe))
    for pat in list(p.tp) + list(p.sequence_parallel) + list(p.ep):
        assert any(fnmatch.fnmatchcase(n, pat) for n in names), pat
    lin = m.language_model.layers["0"].linear_attn
    assert {n for n, _ in lin.in_proj_qkv.named_parameters()} == {"weight", "conv_weight"}
    assert {n for n, _ in lin.in_proj_a.named_parameters()} == {"weight", "dt_bias", "A_log"}
    assert p.cp == {}
