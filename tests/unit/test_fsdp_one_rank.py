"""FSDP2 on a one-rank mesh (one GPU): titan_mm leaves FSDP2's reduction defaults, under which it reduces nothing;
a set divide factor (the sum contract of titan_mm.parallel.apply for real meshes) made it divide every unit's
gradients by 1.0 each step. Gradients still equal the unsharded model's, bit for bit (gloo, one process)."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_mm.parallel.apply import _sum_reduction

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)])
        model.load_state_dict(ref.state_dict())
        mesh = init_device_mesh("cpu", (1,))
        for mod in (model[0], model[2], model):
            _sum_reduction(fully_shard(mod, mesh=mesh), mesh)
        x = torch.randn(5, 8)
        ref(x).pow(2).sum().backward()

        class Divs(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Divs.n += func.__name__.startswith("div")
                return func(*args, **(kwargs or {}))

        with Divs():
            model(x).pow(2).sum().backward()
        out["divs"] = Divs.n
        out["equal"] = all(torch.equal(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    finally:
        dist.destroy_process_group()


def test_one_rank_mesh_divides_no_gradient():
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=1, join=True)
        assert out["equal"] and out["divs"] == 0, dict(out)
