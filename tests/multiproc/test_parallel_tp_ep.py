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

    dims = dict(dims)
    cfg = tiny_qwen3_config(moe, kernels=dims.pop("kernels", False))
    model = build_tiny_qwen3(cfg)
    if cfg.kernels:  # the Triton kernels run (through the interpreter), not the reference fallback
        from titan_mm.kernels import use_triton

        assert use_triton(torch.empty(1)), "TRITON_INTERPRET=1 did not reach the worker"
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
    # the Triton kernels (through the interpreter: TRITON_INTERPRET=1 in the workers) on the sequence shards:
    # RMSNorm on the embedding's reduce-scattered output, the fused residual add + ffn_norm on wo's, SwiGLU, RoPE;
    # the reference is the kernels-off world-1 run
    ("tp2-dense-sp-kernels", 2, False, dict(dp_shard=1, tp=2, kernels=True)),
]


@pytest.mark.parametrize("name,world,moe,dims", CASES, ids=[c[0] for c in CASES])
def test_matches_world1(name, world, moe, dims):
    env = {"TRITON_INTERPRET": "1"} if dims.get("kernels") else None
    got = run_multiproc(_worker, world, args=(moe, dims), env=env)
    ref = _reference(moe)
    for r in got:
        assert_close_runs(ref, r)
