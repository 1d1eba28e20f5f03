"""TP, EP and their compositions with FSDP2 over gloo: three SGD-momentum steps on tiny Qwen3 / Qwen3-MoE with packed
batches give the same losses, grad norms and gradients as the world-1 run (fp32, 1e-5)."""

import functools

import pytest
import torch
from _harness import run_multiproc
from _parallel_common import (assert_close_runs, build_tiny_qwen3, check_cells, make_packed_batches, qwen3_step,
                              run_cells, tiny_qwen3_config, train_steps)

from titan_mm.config import JobConfig, Parallel

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


def _run_cell(world, moe, dims):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    dims = dict(dims)
    cfg = tiny_qwen3_config(moe, kernels=dims.pop("kernels", False), moe_float8=dims.pop("moe_float8", False))
    model = build_tiny_qwen3(cfg)
    if cfg.kernels:  # the Triton kernels run (through the interpreter), not the reference fallback
        from titan_mm.kernels import use_triton

        assert use_triton(torch.empty(1)), "TRITON_INTERPRET=1 did not reach the worker"
    sp = dims.pop("sp", True)
    job = JobConfig(parallel=Parallel(sequence_parallel=sp, loss_parallel=sp))
    pd = ParallelDims(world_size=world, **dims)
    parallelize(model, _plan(cfg), pd, job)
    batch_mesh = pd.mesh("batch")
    dp_rank, dp = batch_mesh.get_local_rank(), batch_mesh.size()
    if cfg.kernels:  # launch configs picked before the steps, for this rank's shapes (config 0 in the interpreter)
        from titan_mm import kernels as K
        from titan_mm.registry import spec_for_config

        spec = spec_for_config(cfg)
        K.tune_for_model(spec.kernel_shapes(cfg, tp=pd.tp), spec.runtime(cfg).kernels, 4 * 32, torch.float32, "cpu")
        K.share_picks()
    out = train_steps(model, BATCHES, qwen3_step, dp_rank=dp_rank, dp_size=dp, loss_group=batch_mesh.get_group())
    if cfg.kernels:  # tune_for_model derived every key the tp ranks met (heads and MLP width per rank)
        assert not K.untuned_keys(), f"keys the steps met untuned: {K.untuned_keys()}"
    return out


def _worker(rank, world, cells):
    return run_cells(cells, functools.partial(_run_cell, world))


# (launch id, world, cells); a cell is (name, moe, dims) and the cells of a launch run one after another in the same
# processes. SP + loss parallel are on unless dims say sp=False. Qwen3-MoE under tp: the MoE input is all-gathered
# over tp (seq_gather_local) and every tp rank runs all experts; without ep the experts are plain replicated weights.
LAUNCHES = [
    ("world2", 2, (
        ("tp2-dense-sp-lossparallel", False, dict(dp_shard=1, tp=2)),
        ("tp2-dense-nosp-nolossparallel", False, dict(dp_shard=1, tp=2, sp=False)),
        ("tp2-moe", True, dict(dp_shard=1, tp=2)),
        ("ep2", True, dict(dp_shard=2, ep=2)),
        # the float8 experts' padded layout (groups of 16 rows) on the local experts; the loop GEMMs on the CPU
        ("ep2-float8-layout", True, dict(dp_shard=2, ep=2, moe_float8=True)),
    )),
    ("world4", 4, (
        ("fsdp2xtp2-dense", False, dict(dp_shard=2, tp=2)),
        ("fsdp2xtp2-moe", True, dict(dp_shard=2, tp=2)),
        ("fsdp2xep2", True, dict(dp_shard=4, ep=2)),  # experts: ep 2 x ep_fsdp 2
        ("tp2xep2", True, dict(dp_shard=2, tp=2, ep=2)),
    )),
    # the Triton kernels (through the interpreter: TRITON_INTERPRET=1 in the workers) on the sequence shards:
    # RMSNorm on the embedding's reduce-scattered output, the fused residual add + ffn_norm on wo's, SwiGLU, RoPE;
    # the reference is the kernels-off world-1 run
    ("world2-kernels", 2, (
        ("tp2-dense-sp-kernels", False, dict(dp_shard=1, tp=2, kernels=True)),
    )),
]


@pytest.mark.parametrize("world,cells", [c[1:] for c in LAUNCHES], ids=[c[0] for c in LAUNCHES])
def test_matches_world1(world, cells):
    env = {"TRITON_INTERPRET": "1"} if any(c[2].get("kernels") for c in cells) else None
    got = run_multiproc(_worker, world, args=(cells,), env=env)
    check_cells(cells, got, lambda cell: _reference(cell[1]))


# ---- tied head (tie_word_embeddings): loss parallel shards the token embedding over the vocabulary ----
@functools.lru_cache(maxsize=None)
def _reference_tied():
    return train_steps(build_tiny_qwen3(tiny_qwen3_config(tie_word_embeddings=True)), BATCHES, qwen3_step)


def _worker_tied(rank, world, dims, switches):
    from titan_mm.parallel.apply import parallelize
    from titan_mm.parallel.mesh import ParallelDims

    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    model = build_tiny_qwen3(cfg)
    job = JobConfig(parallel=Parallel(**switches))
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
