"""bench/mfu.py's diffusers stack (issue 48's peer: diffusers' WanTransformer3DModel + FSDP2, a diffusers training
loop's step) trains on the same flow-matching loss as titan_mm: on the same weights and the bench case's clips, its
step-1 loss is titan's train_step's (fp32 on CPU, FSDP2 on a gloo world of 1, no compile)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

pytest.importorskip("diffusers")  # the optional extra [diffusers]

from bench.mfu import CASES, case_batch, model_config  # noqa: E402
from bench.peers import build_diffusers_wan  # noqa: E402
from titan_mm.config import JobConfig  # noqa: E402
from titan_mm.models.wan import WanModel  # noqa: E402
from titan_mm.models.wan.hf import from_diffusers  # noqa: E402
from titan_mm.objectives import build_objective  # noqa: E402
from titan_mm.train.state import TrainState  # noqa: E402
from titan_mm.train.step import StepContext, train_step  # noqa: E402


def peer_and_titan_losses(tmp_path, device: torch.device, compile_blocks: bool,
                          checkpoint_blocks: int = 0) -> tuple[float, float]:
    """(the diffusers stack's step-1 loss, titan's train_step's) on the same random weights (N(0, 0.2)) and the
    debug_wan case's clips, fp32, on a one-process world (gloo; NCCL on CUDA)."""
    case = CASES["debug_wan"]
    spec, mc = model_config(case)
    objective = build_objective(JobConfig(), spec, mc)  # what the titan stacks train with (seed, sampler)
    batch = case_batch(case, spec, mc, torch.device("cpu"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        peer, peer_step = build_diffusers_wan(mc.to_hf_dict(), device, objective, mp=MixedPrecisionPolicy(),
                                              compile_blocks=compile_blocks, checkpoint_blocks=checkpoint_blocks)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # diffusers zero-inits no bias here, but make every weight matter
            for p in peer.parameters():
                p.to_local().copy_(torch.randn(p.shape, generator=g) * 0.2)
        model = WanModel(mc).to(device)
        model.load_state_dict(from_diffusers({k: v.full_tensor() for k, v in peer.state_dict().items()}))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        ctx = StepContext(device=device, objective=objective, seq_keys=spec.schema().seq)
        titan = float(train_step(state, [batch], ctx).loss)
        return float(peer_step(batch, 0)), titan
    finally:
        dist.destroy_process_group()


def assert_same_loss(peer_loss: float, titan: float) -> None:
    # the predictions agree within the parity bound d = 1e-5 (tests/unit/test_wan.py); the MSE of two predictions
    # of one target then differs by at most 2 d sqrt(MSE) + d^2 (Cauchy-Schwarz)
    d = 1e-5
    assert abs(peer_loss - titan) <= 2 * d * math.sqrt(titan) + d * d, (peer_loss, titan)
    assert titan > 0.5  # a real loss: E|eps - x0|^2 is about 2 for unit latents


@pytest.mark.parametrize("checkpoint_blocks", [0, 1])
def test_diffusers_peer_loss_at_step_1_is_titans(tmp_path, checkpoint_blocks):
    """Also with the first block checkpointed (the peer's --ac full:N): same weights in, same loss out."""
    assert_same_loss(*peer_and_titan_losses(tmp_path, torch.device("cpu"), compile_blocks=False,
                                            checkpoint_blocks=checkpoint_blocks))
