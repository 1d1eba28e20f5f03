"""TP, EP and their compositions with FSDP2 over gloo: three SGD-momentum steps on tiny Qwen3 / Qwen3-MoE with packed
batches give the same losses, grad norms and gradients as the world-1 run (fp32, 1e-5)."""

import functools
from types import SimpleNamespace

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import (assert_close_runs, build_tiny_qwen3, make_packed_batches, qwen3_step, tiny_qwen3_config,
                              train_steps)

BATCHES = make_packed_batches(3, batch=4, seq=32, vocab=128)


def _plan(cfg):
    try:
        from titan_mm.models.qwen3.plan import plan
    except ImportError:
        from titan_mm.parallel.plan import ParallelizePlan

        tp = {"tok_embeddings": "embedding_rowwise", "layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise",
              "layers.*.attn.wv": "colwise", "layers.*.attn.wo": "rowwise", "layers.*.attn.q_norm": "grad_sum",
              "layers.*.attn.k_norm": "grad_sum"}
        if cfg.num_experts == 0:
            tp.update({"layers.*.mlp.w1": "colwise", "layers.*.mlp.w3": "colwise", "layers.*.mlp.w2": "rowwise"})
        return ParallelizePlan(fsdp_units=("layers.*",), ac_units=("layers.*",), compile_units=("layers.*",), tp=tp,
                               ep={"layers.*.moe.experts": "experts"} if cfg.num_experts else {})
    return plan(cfg)


@functools.lru_cache(maxsize=None)
def _reference(moe):
    cfg = tiny_qwen3_config(moe)
    return train_steps(build_tiny_qwen3(cfg), BATCHES, qwen3_step)


def _worker(rank, world, moe, dims):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(moe)
    model = build_tiny_qwen3(cfg)
    dims = dict(dims)
    sp = dims.pop("sp", True)
    job = SimpleNamespace(parallel=SimpleNamespace(sequence_parallel=sp, loss_parallel=sp, backend="auto"))
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, _plan(cfg), pd, job)
    batch_mesh = pd.mesh("batch")
    dp_rank, dp = batch_mesh.get_local_rank(), batch_mesh.size()
    return train_steps(model, BATCHES, qwen3_step, dp_rank=dp_rank, dp_size=dp, loss_group=batch_mesh.get_group())


# tp2 on Qwen3-MoE alone is covered by tp2xep2 (MoE + SP + TP); kept out for the CPU budget
CASES = [
    ("tp2-dense-sp-lossparallel", 2, False, dict(dp_shard=1, tp=2)),
    ("tp2-dense-nosp-nolossparallel", 2, False, dict(dp_shard=1, tp=2, sp=False)),
    ("ep2", 2, True, dict(dp_shard=2, ep=2)),
    ("fsdp2xtp2-dense", 4, False, dict(dp_shard=2, tp=2)),
    ("fsdp2xep2", 4, True, dict(dp_shard=4, ep=2)),
    ("tp2xep2", 4, True, dict(dp_shard=2, tp=2, ep=2)),
]


@pytest.mark.parametrize("name,world,moe,dims", CASES, ids=[c[0] for c in CASES])
def test_matches_world1(name, world, moe, dims):
    got = run_multiproc(_worker, world, args=(moe, dims))
    ref = _reference(moe)
    for r in got:
        assert_close_runs(ref, r)


# ---- tied head (tie_word_embeddings): loss parallel shards the token embedding over the vocabulary ----
@functools.lru_cache(maxsize=None)
def _reference_tied():
    return train_steps(build_tiny_qwen3(tiny_qwen3_config(tie_word_embeddings=True)), BATCHES, qwen3_step)


def _worker_tied(rank, world, dims, switches):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    model = build_tiny_qwen3(cfg)
    job = SimpleNamespace(parallel=SimpleNamespace(backend="auto", **switches))
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, _plan(cfg), pd, job)
    batch_mesh = pd.mesh("batch")
    return train_steps(model, BATCHES, qwen3_step, dp_rank=batch_mesh.get_local_rank(), dp_size=batch_mesh.size(),
                       loss_group=batch_mesh.get_group())


# (name, world, dims, switches): the embedding becomes embedding_rowwise_seq under SP, embedding_rowwise without
TIED_CASES = [
    ("tied-tp2-sp-lossparallel", 2, dict(dp_shard=1, tp=2), dict(sequence_parallel=True, loss_parallel=True)),
    ("tied-tp2-nosp-lossparallel", 2, dict(dp_shard=1, tp=2), dict(sequence_parallel=False, loss_parallel=True)),
]


@pytest.mark.parametrize("name,world,dims,switches", TIED_CASES, ids=[c[0] for c in TIED_CASES])
def test_tied_head_matches_world1(name, world, dims, switches):
    got = run_multiproc(_worker_tied, world, args=(dims, switches))
    for r in got:
        assert_close_runs(_reference_tied(), r)
