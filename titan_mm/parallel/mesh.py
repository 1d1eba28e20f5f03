"""Device meshes: one description of how the world is split, and the DTensor meshes that follow from it.

Axes (outer to inner): ``pp`` (pipeline stages), ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP),
``cp`` (context parallel, sequence split), ``tp`` (tensor parallel). ``ep`` (expert parallel) is not an extra
factor of the world: it *borrows* ranks from ``dp_shard x cp``; the remaining ``ep_fsdp = dp_shard * cp / ep``
ranks shard the experts FSDP-style, so experts live on ``[ep_fsdp, ep]`` and EP x FSDP need not equal the
expert count.

    world = pp * dp_replicate * dp_shard * cp * tp
    dense  mesh  [dp_replicate, dp_shard, cp, tp]     (+ flattened "dp_shard_cp", "batch", "loss")
    sparse mesh  [dp_replicate, ep_fsdp, ep, tp]      (only when ep > 1)

``pp`` is outermost, so one pipeline stage's ranks are contiguous and its neighbours differ by
``world / pp``. With pp > 1 the meshes above are this rank's slice of a ``[pp, ...]`` root mesh: every other
named mesh stays within one stage (FSDP, TP, CP, EP, the data and loss groups never cross stages), and "pp"
holds the ranks of one pipeline (the stages' point-to-point group).

Named meshes, by what uses them:

    "fsdp"     dp_shard x cp                 FSDP2 of dense params (CP ranks also shard params)
    "hsdp"     [dp_replicate, fsdp]          FSDP2 of dense params with HSDP
    "tp"       tp                            TP, sequence parallel, loss parallel
    "cp"       cp                            ring / Ulysses attention
    "ep"       ep                            expert sharding, token all-to-all
    "ep_fsdp"  ep_fsdp                       FSDP2 of expert params (+ dp_replicate as "ep_hsdp")
    "batch"    dp_replicate x dp_shard       data loading: ranks that read different rows
    "loss"     dp_replicate x dp_shard x cp  ranks whose losses / token counts are summed
    "pp"       pp                            pipeline stages' send / recv, the pp sum of the loss and grad norm

World size 1: no process group is needed. ``ParallelDims(world_size=1).build_meshes()`` returns no
meshes (``mesh(name)`` gives ``None``) and :func:`titan_mm.parallel.apply.parallelize` then applies only
AC / compile / float8 (no FSDP). Call :func:`init_distributed` first when you want FSDP2's mixed
precision on a single GPU; it then builds real 1-rank meshes.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_mm.config import Parallel

__all__ = ["ParallelDims", "init_distributed", "device_type"]


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; returns ``(rank, world_size)``.

    ``backend=None`` picks ``nccl`` when CUDA is available and ``gloo`` otherwise. Without torchrun's
    variables (a plain ``python`` run) a 1-rank group is created on a free localhost port, so the same
    code path (meshes, FSDP2, DCP) runs in one process. Idempotent: returns the current rank and size if
    a group already exists. On CUDA it also selects ``cuda:LOCAL_RANK``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("init_distributed(backend='nccl') needs CUDA; use backend='gloo' (or None) on CPU.")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if "RANK" not in os.environ:
        # the store binds the port itself (0: any free one), so no other process can take it between a probe and
        # the bind (a probed port was taken so once on the H100). The environment stays as it was: a child process
        # (a run launched from this one) would inherit RANK and this store's port and fail to bind it (EADDRINUSE)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ParallelDims:
    """Degrees of each parallel axis. ``dp_shard=-1`` takes whatever the other axes leave of the world."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: int = 1
    pp: int = 1
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _built: bool = field(default=False, repr=False)

    def __post_init__(self):
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "ep", "pp", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {v!r}.")
        pp = f"pp({self.pp}) * " if self.pp > 1 else ""
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"{pp}dp_replicate({self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) = {rest} does not divide "
                    f"world_size({self.world_size}); choose degrees whose product divides the number of processes."
                )
            self.dp_shard = self.world_size // rest
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"parallel.dp_shard must be -1 (infer) or an integer >= 1, got {self.dp_shard!r}.")
        prod = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if prod != self.world_size:
            raise ValueError(
                f"{pp}dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) = "
                f"{prod} != world_size({self.world_size}); set dp_shard=-1 to infer it or fix the degrees."
            )
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep({self.ep}) does not divide dp_shard({self.dp_shard}) * cp({self.cp}) = {self.dp_shard * self.cp}: "
                "expert parallelism borrows its ranks from the dp_shard x cp ranks; pick ep among the divisors "
                f"of {self.dp_shard * self.cp}."
            )

    def check_model(self, *, num_heads: int, num_kv_heads: int, num_experts: int = 0, seq_len: int | None = None,
                    vocab_size: int | None = None, cp_ulysses: bool = False) -> None:
        """Reject degrees that a model's shapes cannot take, naming the product that does not divide. ``seq_len`` is
        the padded row length the batches have (titan_mm.data.packing.padded_seq_len), not data.seq_len."""
        if num_heads % self.tp:
            raise ValueError(f"tp({self.tp}) does not divide num_attention_heads({num_heads}).")
        if num_kv_heads % self.tp:
            raise ValueError(f"tp({self.tp}) does not divide num_key_value_heads({num_kv_heads}).")
        if self.ep > 1:
            if num_experts == 0:
                raise ValueError(f"ep({self.ep}) > 1 but the model has no experts; set parallel.ep = 1.")
            if num_experts % self.ep:
                raise ValueError(f"ep({self.ep}) does not divide num_experts({num_experts}).")
        if seq_len is not None:
            div = self.seq_len_divisor
            if seq_len % div:
                raise ValueError(
                    f"the padded row length {seq_len} (data.seq_len rounded up by the data pipeline) is not a multiple "
                    f"of tp({self.tp}) * 2 * cp({self.cp}) = {div} (sequence parallel splits rows by tp, load-balanced "
                    "CP into 2*cp chunks); pick data.seq_len so that it is."
                )
        if cp_ulysses and self.cp > 1:
            if num_heads % (self.cp * self.tp) or num_kv_heads % (self.cp * self.tp):
                raise ValueError(
                    f"Ulysses CP needs cp({self.cp}) * tp({self.tp}) to divide num_attention_heads({num_heads}) and "
                    f"num_key_value_heads({num_kv_heads}); use cp_mode='ring' or smaller degrees."
                )
        if vocab_size is not None and vocab_size % self.tp:
            raise ValueError(f"tp({self.tp}) does not divide vocab_size({vocab_size}) (loss parallel shards the vocabulary).")

    # ---------------------------------------------------------------- derived sizes
    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def ep_fsdp(self) -> int:
        return self.fsdp // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp > 1 or self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def seq_len_divisor(self) -> int:
        return self.tp * 2 * self.cp if self.cp > 1 else self.tp

    # ---------------------------------------------------------------- meshes
    def build_meshes(self) -> dict[str, DeviceMesh]:
        """Create the named meshes (collective: every rank must call it). Needs a process group unless world is 1."""
        if self._built:
            return self._meshes
        self._built = True
        if not dist.is_initialized():
            if self.world_size == 1:
                return self._meshes
            raise RuntimeError(
                f"ParallelDims(world_size={self.world_size}) needs torch.distributed; call "
                "titan_mm.parallel.mesh.init_distributed() (or run under torchrun) before build_meshes()."
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims.world_size({self.world_size}) != torch.distributed world size ({dist.get_world_size()})."
            )
        dev = device_type()
        ranks = torch.arange(self.world_size)
        inner = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        names = ("dp_replicate", "dp_shard", "cp", "tp")
        # pp > 1: a [pp, ...] root whose slices below are this rank's stage; pp == 1: the 4-D mesh itself
        pp = self.pp > 1
        root = DeviceMesh(dev, ranks.view(self.pp, *inner) if pp else ranks.view(*inner),
                          mesh_dim_names=(("pp",) if pp else ()) + names)
        m = self._meshes
        m["dense"] = root[names] if pp else root
        if pp:
            m["pp"] = root["pp"]
            m["world"] = root
        m["dp_replicate"] = root["dp_replicate"]
        m["dp_shard"] = root["dp_shard"]
        m["cp"] = root["cp"]
        m["tp"] = root["tp"]
        m["fsdp"] = root["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.dp_replicate > 1:
            with warnings.catch_warnings():  # torch>=2.11 warns about slicing a flattened dim; it still works
                warnings.simplefilter("ignore", UserWarning)
                m["hsdp"] = root["dp_replicate", "dp_shard_cp"]
        m["batch"] = root["dp_replicate", "dp_shard"]._flatten("batch")
        m["loss"] = root["dp_replicate", "dp_shard", "cp"]._flatten("loss")
        if self.ep > 1:
            # the same ranks, regrouped: dp_shard x cp (flattened, row-major) = ep_fsdp x ep
            sp_inner = (self.dp_replicate, self.ep_fsdp, self.ep, self.tp)
            sp_names = ("dp_replicate", "ep_fsdp", "ep", "tp")
            sparse = DeviceMesh(dev, ranks.view(self.pp, *sp_inner) if pp else ranks.view(*sp_inner),
                                mesh_dim_names=(("pp",) if pp else ()) + sp_names)
            m["sparse"] = sparse[sp_names] if pp else sparse
            m["ep"] = sparse["ep"]
            m["ep_fsdp"] = sparse["ep_fsdp"]
            if self.dp_replicate > 1:
                m["ep_hsdp"] = sparse["dp_replicate", "ep_fsdp"]
            m["ep_tp"] = sparse["tp"]
        return m

    def mesh(self, name: str) -> DeviceMesh | None:
        """A named mesh (see the module docstring), or ``None`` at world size 1 without a process group."""
        meshes = self.build_meshes()
        if not meshes:
            return None
        if name not in meshes:
            raise KeyError(f"No mesh named {name!r}; available: {sorted(meshes)} (\"ep*\" meshes exist only when ep > 1).")
        return meshes[name]

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh dense params are fully_shard-ed on: HSDP when dp_replicate > 1, else the flat fsdp axis."""
        if not self.build_meshes():
            return None
        return self.mesh("hsdp") if self.dp_replicate > 1 else self.mesh("fsdp")

    def ep_fsdp_mesh(self) -> DeviceMesh | None:
        if not self.build_meshes() or self.ep == 1:
            return None
        return self.mesh("ep_hsdp") if self.dp_replicate > 1 else self.mesh("ep_fsdp")

    @classmethod
    def from_config(cls, par: Parallel, world_size: int | None = None) -> "ParallelDims":
        """From the ``[parallel]`` config section; ``world_size`` defaults to the process group's (1 without one)."""
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        return cls(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp, tp=par.tp, ep=par.ep,
                   world_size=world_size, pp=par.pp)
