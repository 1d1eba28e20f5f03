"""TP style colwise_norm on CUDA over NCCL (titan_mm.parallel.tp.ShardedRMSNorm; its world-2 equality on gloo is
tests/multiproc/test_parallel_wan.py): on a one-rank NCCL mesh, eager and compiled, it is torch's RMSNorm in bf16
(values and gradients), and its functional all-reduce traces into the compiled graph."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from titan_mm.parallel.tp import ShardedRMSNorm

pytestmark = pytest.mark.gpu

D = 1536  # Wan2.1-1.3B's q / k norm width


@pytest.fixture
def nccl_mesh():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sharded_rms_norm_is_rms_norm_on_nccl(nccl_mesh, compiled):
    torch.manual_seed(0)
    ref = nn.RMSNorm(D, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.1)
    norm = ShardedRMSNorm(ref, nccl_mesh)
    run = torch.compile(norm, fullgraph=True) if compiled else norm  # fullgraph: no break at the all-reduce
    x = torch.randn(2, 256, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    want = ref(x)
    (gx_want, gw_want) = torch.autograd.grad(want, (x, ref.weight), g)
    got = run(x)
    (gx, gw) = torch.autograd.grad(got, (x, norm.weight), g)
    # both normalize in fp32 and round once to bf16: at most one bf16 step (2^-8 relative) apart; the weight's
    # gradient sums 512 rows in fp32 before its one rounding
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(gx, gx_want, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(gw.full_tensor(), gw_want, rtol=2**-7, atol=1e-2)
