"""Checkpoint checksums on 2 gloo ranks: each rank hashes the files it wrote and rank 0's commit.json lists them
all; on load the ranks split the check and agree, so a file of rank 1 overwritten in place makes both ranks fall
back to the previous checkpoint together (no rank enters dcp.load alone)."""

import os

import pytest
from _harness import run_multiproc


def _state():
    import torch

    from titan_mm.config import JobConfig
    from titan_mm.registry import get_model_spec
    from titan_mm.train.optim import build_lr_scheduler, build_optimizer
    from titan_mm.train.state import TrainState

    spec = get_model_spec("qwen3")
    mcfg = spec.flavors["debug"].replace(vocab_size=128, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         head_dim=8)
    torch.manual_seed(0)
    m = spec.build(mcfg)
    m.init_weights()
    opt = build_optimizer(m, JobConfig())
    return TrainState(model=m, optimizer=opt, scheduler=build_lr_scheduler(opt, JobConfig()))


def _worker(rank, world, root):
    import torch
    import torch.distributed as dist

    from titan_mm.checkpoint_io import read_commit
    from titan_mm.train.checkpoint import CheckpointManager

    st = _state()
    mgr = CheckpointManager(root, interval=1, keep_last=0, async_mode="async")
    st.step = 2
    mgr.save(st)
    with torch.no_grad():
        for p in st.model.parameters():
            p.add_(1.0)
    st.step = 4
    newest = mgr.save(st)
    mgr.close()
    files = sorted(read_commit(newest)["files"]) if rank == 0 else None
    if rank == 0:  # 4 KiB overwritten in the middle of the file rank 1 wrote, same size
        f = newest / "__1_0.distcp"
        with open(f, "r+b") as h:
            h.seek(f.stat().st_size // 2)
            h.write(os.urandom(4096))
    dist.barrier()
    fresh = _state()
    got = CheckpointManager(root, interval=1).resume(fresh)
    return {"files": files, "step": got, "param0": next(fresh.model.parameters()).detach().clone()}


@pytest.mark.slow  # two spawned gloo processes: 30-60 s on the shared 2-core machine
def test_checksums_are_gathered_and_verified_across_ranks(tmp_path, capfd):
    res = run_multiproc(_worker, world_size=2, args=(str(tmp_path),))
    assert res[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.toml"]
    assert [r["step"] for r in res] == [2, 2]
    import torch

    ref = next(_state().model.parameters())
    assert torch.equal(res[0]["param0"], ref) and torch.equal(res[1]["param0"], ref)  # step 2's weights
    err = capfd.readouterr().err
    assert "step-00000004 is corrupt or unreadable (CheckpointError: __1_0.distcp: checksum mismatch" in err
