"""The qwen2 family's plan over gloo: FSDP2 (2 ranks) and TP (2 ranks; with and without sequence parallel + loss
parallel, untied and tied head, a sliding-window layer) give the same three SGD-momentum steps on packed batches
as the world-1 run: losses, grad norms and the gradient of every parameter, q/k/v biases included (fp32, 1e-5)."""

import dataclasses
import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import check_cells, make_packed_batches, run_cells, train_steps

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128)


def _cfg(**kw):
    from titan_mm.models.qwen2 import FLAVORS

    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                loss_chunk_size=64, tie_word_embeddings=False)
    return FLAVORS["debug"].replace(**{**base, **kw})


def _build(cfg):
    """The registered build, then init_weights and random q/k/v biases (init zeroes them), same on every rank."""
    from titan_mm.registry import get_model_spec

    torch.manual_seed(0)
    model = get_model_spec("qwen2").build(cfg)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _step(model, b):
    from titan_mm.nn.attention import build_attn_meta

    meta = build_attn_meta(b, "sdpa", "cpu", sliding_window=model.cfg.attn_sliding_window)
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"]).loss_sum


@functools.lru_cache(maxsize=None)
def _reference(cfg_kw):
    return train_steps(_build(_cfg(**dict(cfg_kw))), BATCHES, _step)


def _run_cell(world, cfg_kw, dims):
    from titan_mm.config import JobConfig
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import get_model_spec

    dims = dict(dims)
    sp = dims.pop("sp", True)
    cfg = _cfg(**dict(cfg_kw))
    model = _build(cfg)
    job = JobConfig()
    job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, sequence_parallel=sp, loss_parallel=sp))
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, get_model_spec("qwen2").plan(cfg), pd, job)
    if pd.tp > 1:  # the q/k/v biases are sharded with their weights
        from torch.distributed.tensor import DTensor, Shard

        b = model.layers["0"].attn.wq.bias
        assert isinstance(b, DTensor) and b.placements[-1] == Shard(0), b
    batch_mesh = pd.mesh("batch")
    return train_steps(model, BATCHES, _step, dp_rank=batch_mesh.get_local_rank(), dp_size=batch_mesh.size(),
                       loss_group=batch_mesh.get_group())


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


UNTIED, TIED = (), (("tie_word_embeddings", True),)
WINDOW = (("use_sliding_window", True), ("sliding_window", 5), ("max_window_layers", 1))
# (name, config overrides, parallel dims): every cell runs in the same 2 processes, one after another
CELLS = (
    ("fsdp2", UNTIED, dict(dp_shard=2)),
    ("fsdp2-tied-window", TIED + WINDOW, dict(dp_shard=2)),
    ("tp2-sp-lossparallel", UNTIED, dict(dp_shard=1, tp=2)),
    ("tp2-nosp-nolossparallel", UNTIED, dict(dp_shard=1, tp=2, sp=False)),
    ("tp2-tied-sp-lossparallel", TIED, dict(dp_shard=1, tp=2)),
    ("tp2-window-sp", WINDOW, dict(dp_shard=1, tp=2)),
)


@pytest.mark.parametrize("world,cells", [(2, CELLS)], ids=["world2"])
def test_qwen2_plan_matches_world1(world, cells):
    got = run_multiproc(_worker, world, args=(cells,))
    check_cells(cells, got, lambda cell: _reference(cell[1]))
