"""Tensor parallelism for the engine: the model split by its family's plan over a 1-D tp mesh (the trainer's
``parallelize``), and the control channel that keeps every rank's scheduler in step with rank 0's.

Every rank holds a whole engine (scheduler, block manager, sampler, a KV pool of its local kv heads) and runs the
same steps on the same inputs. Rank 0 alone takes requests. Each step, rank 0 broadcasts what the step applies
first (the requests added and aborted since the last one, as ``add_request``'s arguments) and its clock, so that
deadlines fall in the same step everywhere. The forward runs sharded. Its logits are all-gathered over the
vocabulary (the plan's loss-parallel head), so they are the same bytes on every rank. Every rank samples from
them with the same generators (the engine's seed is rank 0's; a seeded request's is its seed), so every rank
takes the same tokens, forks, stops and preemptions without a second message.

    tp = tensor_parallel(2, device)                 # torchrun with 2 processes (gloo on CPU, nccl on CUDA)
    model = tp.shard(model, spec, model_cfg)        # spec.plan(model_cfg) through titan_mm.parallel.apply
"""

from __future__ import annotations

import datetime
import functools
import os

import torch
import torch.distributed as dist

from titan_mm.config import ConfigError, JobConfig, Parallel, Training
from titan_mm.parallel.apply import parallelize
from titan_mm.parallel.mesh import ParallelDims, init_distributed

# workers wait in the control broadcast for as long as the server idles: no timeout that an idle night reaches
CONTROL_TIMEOUT = datetime.timedelta(days=30)


class TensorParallel:
    """The tp mesh (``ParallelDims(tp=size)``: the trainer's meshes, tp the only axis), the job config the trainer's
    ``parallelize`` reads, and a gloo group for the control messages (host objects, also under nccl)."""

    def __init__(self, size: int, device: torch.device):
        if not dist.is_initialized() and "RANK" not in os.environ:
            raise ConfigError(f"serve.tensor_parallel_size={size} needs {size} processes; launch with torchrun "
                              f"--nproc-per-node {size}")
        self.rank, world = init_distributed("gloo" if device.type == "cpu" else None)
        if world != size:
            raise ConfigError(f"serve.tensor_parallel_size={size} but {world} processes were launched; start "
                              f"torchrun with --nproc-per-node {size}")
        self.size = size
        self.dims = ParallelDims(dp_shard=1, tp=size, world_size=size)
        # sequence parallel off: it splits the residual stream along the sequence, which a decode step does not
        # have (one token per row); loss parallel on: the head is vocabulary-sharded, and its logits gathered
        self.job = JobConfig(parallel=Parallel(tp=size, sequence_parallel=False, loss_parallel=True),
                             training=Training(param_dtype="float32"))  # fp32 params: no FSDP wrap; the engine casts
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def check(self, spec, model_cfg, what: str = "the model") -> None:
        """ConfigError when ``what``'s heads, kv heads or vocabulary do not split over tp."""
        d = spec.dims(model_cfg)
        try:
            self.dims.check_model(num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, vocab_size=d.vocab_size)
        except ValueError as e:
            raise ConfigError(f"serve.tensor_parallel_size={self.size} cannot split {what}: {e}") from None

    def shard(self, model: torch.nn.Module, spec, model_cfg, what: str = "the model") -> torch.nn.Module:
        """``model`` (on meta, or materialised and the same on every rank) split by its family's plan."""
        self.check(spec, model_cfg, what)
        if not spec.plan(model_cfg).loss_parallel:  # the logits must be the same bytes on every rank (above)
            raise ConfigError(f"serve.tensor_parallel_size={self.size}: the plan of {spec.name!r} names no head to "
                              "shard (plan.loss_parallel)")
        return parallelize(model, spec.plan(model_cfg), self.dims, self.job)

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min(self, n: int) -> int:
        """The smallest ``n`` of the ranks (KV pool sizes from each rank's free memory)."""
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)


@functools.cache
def tensor_parallel(size: int, device_type: str = "cpu") -> TensorParallel:
    """This process's tp group (one per process: the world is the tp group), made on first use (collective)."""
    return TensorParallel(size, torch.device(device_type))
