"""Random init is the same for every world size and layout: the trainer's build_model under FSDP2, TP x FSDP2
and EP x FSDP2 on gloo gives the full state dict of the 1-process build, bit for bit."""

from __future__ import annotations

import pytest
import torch
from _harness import run_multiproc


def _full_sd(name: str, flavor: str, parallel: dict, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from titan_mm.config import load_config
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.train.setup import build_model, model_from_config

    argv = ["--model.name", name, "--model.flavor", flavor, "--job.device", "cpu", "--training.seed", "7",
            "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}']
    for k, v in parallel.items():
        argv += [f"--parallel.{k}", str(v)]
    cfg = load_config(argv)
    device = torch.device("cpu")
    spec, mc = model_from_config(cfg, device)
    pd = ParallelDims.from_config(cfg.parallel, world)
    pd.build_meshes()
    model = build_model(cfg, spec, mc, pd, device)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _worker(rank, world, name, flavor, parallel):
    sd = _full_sd(name, flavor, parallel, world)  # collective on every rank
    return sd if rank == 0 else {}


CASES = [
    ("fsdp2", "qwen3", "debug", {}, 2),
    ("tp2_fsdp2", "qwen3", "debug", {"tp": 2}, 4),
    ("ep2_fsdp2", "qwen3_moe", "debug_moe", {"ep": 2}, 4),
]


@pytest.mark.parametrize("case,name,flavor,parallel,world", CASES, ids=[c[0] for c in CASES])
def test_init_independent_of_world_size(case, name, flavor, parallel, world):
    ref = _full_sd(name, flavor, {}, 1)
    got = run_multiproc(_worker, world_size=world, args=(name, flavor, parallel))[0]
    assert set(got) == set(ref)
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"{case}: parameters differ from the 1-process init: {bad[:5]}"
