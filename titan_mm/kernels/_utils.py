"""Small helpers shared by the kernel files: row views, buffer allocation, and the launch-config tuner."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os as _os
import time

import torch
from torch.library import wrap_triton as _wrap


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as [rows, last_dim] with unit stride on the last dim (copies only when it must)."""
    if x.dim() == 0:
        x = x.reshape(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: a few programs exercise the multi-program reduction paths


# Tests set TITAN_KERNELS_POISON=1: every output buffer starts NaN-filled, so an element a kernel forgets
# to write shows up as NaN instead of stale memory that happens to look right.
POISON = _os.environ.get("TITAN_KERNELS_POISON", "0") == "1"


def new_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# ------------------------------------------------------------------------------------ triton_op launches

_TWINS: dict = {}


def _interpreter_twin(kernel):
    """Under TRITON_INTERPRET=1 `triton.jit` returns an InterpretedFunction, which torch's triton tracing
    cannot wrap. The twin is a JITFunction of the same Python function whose launches run the interpreted
    kernel, so the ops trace into triton_kernel_wrapper nodes on CPU too (the CPU tests; never on a GPU)."""
    twin = _TWINS.get(id(kernel))
    if twin is None:
        from triton.runtime.jit import JITFunction  # optional: triton is absent on some CPU machines

        class _Twin(JITFunction):
            def run(self, *args, grid, warmup, **kwargs):
                return kernel.run(*args, grid=grid, warmup=warmup, **kwargs)

        twin = _TWINS[id(kernel)] = _Twin(kernel.fn)
        # JITFunction's cache key walks the kernel's globals and rejects the interpreted helpers it calls;
        # the twin is never compiled, so a hash of its own source stands in (torch hashes kernels it records)
        twin.hash = hashlib.sha256(twin.src.encode()).hexdigest()
    return twin


# kernel name -> the pointer arguments it stores through (the rest it only reads). torch finds the written
# arguments of a traced launch itself by compiling the kernel to TTIR; the CPU interpreter cannot, so the
# interpreter tests use this table instead (titan_mm.tools.kernel_checks), and on the GPU check_graph checks that
# torch's analysis agrees with it.
WRITES: dict[str, tuple[str, ...]] = {}


def writes(kernel, *names: str):
    """Declare the arguments ``kernel`` stores through (see WRITES); returns the kernel."""
    WRITES[kernel.fn.__name__] = names
    return kernel


def wrap_triton(kernel):
    """The launcher of ``kernel`` inside the body of a `torch.library.triton_op`: while the op is traced
    (fake / functional tensors: torch.compile's AOT dispatcher, make_fx, opcheck) a
    `torch.library.wrap_triton` wrapper, whose launches become triton_kernel_wrapper_mutation / _functional
    nodes of the graph (inductor then emits the launch in its own wrapper code); when the op runs eagerly
    (triton_op's dispatcher implementation turns wrapping off) the kernel itself. ``wrap_triton(k) is not k``
    therefore means "being traced": no timing and no host syncs then (Tuner.pick with launch=None)."""
    k = _interpreter_twin(kernel) if INTERPRET else kernel
    w = _wrap(k)
    return kernel if w is k else w


def two_input_op(name: str, fwd, bwd, function_name: str):
    """(``titan_mm::<name>``, the eager autograd.Function ``function_name``) of an op y = fwd(a, b) whose backward
    (da, db) = bwd(dy, a, b) needs only the two inputs. fwd / bwd take ``op=True`` from the triton_op bodies
    (launches through `wrap_triton`); the Function calls them plainly, without the dispatcher's overhead."""

    # triton_op: the body is the fake implementation too, and under torch.compile it is traced into the graph.
    @torch.library.triton_op(f"titan_mm::{name}", mutates_args=())
    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fwd(a, b, op=True)

    @torch.library.triton_op(f"titan_mm::{name}_bwd", mutates_args=())
    def bwd_op(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bwd(dy, a, b, op=True)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy):
        return bwd_op(dy, *ctx.saved_tensors)

    op.register_autograd(backward, setup_context=setup)

    def eager_forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return fwd(a, b)

    def eager_backward(ctx, dy):
        return bwd(dy, *ctx.saved_tensors)

    # built by name so that autograd names its graph nodes after it (<function_name>Backward)
    function = type(function_name, (torch.autograd.Function,), {
        "__doc__": "The eager fast path (same kernels, without the custom-op dispatcher's overhead).",
        "__module__": fwd.__module__, "forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward)})
    return op, function


# ---------------------------------------------------------------------------------------------- tuning

INTERPRET = _os.environ.get("TRITON_INTERPRET", "0") == "1"
# TITAN_KERNELS_TUNE=0: no timing, every kernel takes its first (default) config
TUNE = _os.environ.get("TITAN_KERNELS_TUNE", "1") != "0"
# Tests set this to an int i: every tuner returns config i (modulo its list) without timing or caching, so
# the interpreter checks can run each config's code path.
FORCE_CONFIG: int | None = None
MAX_CONFIGS = 6  # candidates per kernel and key (keeps tuning within seconds; the tests sweep them all)
# > 0 inside `tuning()`: a key without a cached config is timed there. Outside (the model's forward and
# backward) an untuned key runs its first config: no timing, no host synchronization.
_TUNING = 0


@contextlib.contextmanager
def tuning():
    """Inside this context the first call of a kernel for a key without a cached config times every
    candidate (GPU; config 0 under TRITON_INTERPRET=1 or TITAN_KERNELS_TUNE=0) and caches the fastest.
    Timing synchronizes the GPU: never enter it inside a forward that must stay sync-free, or inside
    CUDA-graph capture. See titan_mm.kernels.tune_for_model."""
    global _TUNING
    _TUNING += 1
    try:
        yield
    finally:
        _TUNING -= 1


def can_time() -> bool:
    """Whether `tuning()` times candidates (a GPU, tuning not disabled, not the interpreter)."""
    return TUNE and not INTERPRET and torch.cuda.is_available()


def bench_ms(fn) -> float:
    """Device time of fn() in ms (median, L2 flushed). Synchronizes: called only inside `tuning()`."""
    import triton.testing  # optional: triton is absent on some CPU machines

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


class Tuner:
    """Launch-config choice for one kernel, per key (hidden size / head layout and dtype, never the token
    count, so training does not retune per batch).

    `configs(key)` lists candidate dicts of launch parameters (constexprs and `num_warps`); the first is the
    default. `pick(key, launch)`:
    - a key with a cached pick: that pick (a dict lookup);
    - inside `tuning()`: times `launch(cfg)` for every candidate (`bench_ms`: triton.testing.do_bench, L2
      flushed, device time), caches the fastest. Configs that fail to compile (out of registers / shared
      memory) are skipped and recorded in `timings`; if all fail the first error is raised. Under
      TRITON_INTERPRET=1 or TITAN_KERNELS_TUNE=0 (or with one candidate) config 0 is cached without timing;
    - otherwise (the model's forward / backward): config 0, with no timing and so no host synchronization;
      the key goes to `untuned` (host-side, not `best`: a later `tuning()` still times it), so the trainer can
      report keys that `tune_for_model` did not cover.
    Unlike triton.autotune, the launcher knows the chosen config before it sizes its grid and any
    per-program partial buffers.
    """

    registry: list["Tuner"] = []

    def __init__(self, name: str, configs):
        self.name = name
        self._configs = configs
        self.best: dict = {}
        self.timings: dict = {}
        self.untuned: dict = {}  # key -> config 0, for keys the forward met outside tuning()
        self.last = None  # (key, config) of the latest pick: the benchmark reports it
        Tuner.registry.append(self)

    def configs(self, key) -> list[dict]:
        return self._configs(key) if callable(self._configs) else list(self._configs)

    def pick(self, key, launch) -> dict:
        """``launch=None``: never time (the body of a triton_op while it is traced: the pick is baked into the
        graph, and fake tensors cannot be timed): the cached pick, or config 0 for an untuned key."""
        if FORCE_CONFIG is not None:  # tests: neither read nor written to the cache
            cands = self.configs(key)
            cfg = cands[FORCE_CONFIG % len(cands)]
            self.last = (key, cfg)
            return cfg
        cfg = self.best.get(key)
        if cfg is None and (not _TUNING or launch is None):  # the forward / tracing: the default, never timed
            cfg = self.untuned.get(key)
            if cfg is None:
                cfg = self.untuned[key] = self._candidates(key)[0]
        elif cfg is None:
            cands = self._candidates(key)
            cfg = self._tune(key, cands, launch) if len(cands) > 1 and can_time() else cands[0]
            self.best[key] = cfg
            self.untuned.pop(key, None)
        self.last = (key, cfg)
        return cfg

    def _candidates(self, key) -> list[dict]:
        cands = self.configs(key)
        assert 1 <= len(cands) <= MAX_CONFIGS, f"{self.name}: {len(cands)} configs"
        return cands

    def _tune(self, key, cands, launch) -> dict:
        t0 = time.perf_counter()
        times, res, first_err = [], {}, None
        for cfg in cands:
            try:
                ms = bench_ms(lambda: launch(cfg))
            except torch.OutOfMemoryError:  # the device's memory, not this config: the caller decides
                raise
            except Exception as e:  # compile / resource failure of this config: recorded, never silent
                first_err = first_err or e
                res[_cfg_str(cfg)] = f"{type(e).__name__}: {e}"[:300]
                times.append(float("inf"))
                continue
            res[_cfg_str(cfg)] = round(ms, 5)
            times.append(ms)
        if min(times) == float("inf"):
            raise RuntimeError(f"{self.name}: no config of {cands} ran for key {key}") from first_err
        self.timings[key] = dict(ms=res, tune_s=round(time.perf_counter() - t0, 2))
        return cands[times.index(min(times))]


def _cfg_str(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def tuned_configs() -> dict:
    """{tuner name: {key: {"config": ..., "timings_ms": ...}}} for everything tuned so far (bench output)."""
    out = {}
    for t in Tuner.registry:
        for key, cfg in t.best.items():
            out.setdefault(t.name, {})[str(key)] = dict(config=cfg, **t.timings.get(key, {}))
    return out


def untuned_keys() -> dict:
    """{tuner name: [key, ...]}: keys that ran their default config outside `tuning()` and are still untuned."""
    return {t.name: sorted(map(str, t.untuned)) for t in Tuner.registry if t.untuned}


def export_picks() -> dict:
    """{tuner name: {key: config}} (picklable: keys hold ints, bools and torch dtypes), for load_picks."""
    return {t.name: dict(t.best) for t in Tuner.registry if t.best}


def load_picks(picks: dict) -> None:
    """Replace the cached picks with `picks` (from export_picks, e.g. broadcast from rank 0 so every rank
    launches the same configs and replicated computations round alike)."""
    by_name = {t.name: t for t in Tuner.registry}
    for t in Tuner.registry:
        t.best.clear()
    for name, best in picks.items():
        if name in by_name:
            by_name[name].best.update(best)
            for key in best:
                by_name[name].untuned.pop(key, None)


def current_picks(picks: dict) -> dict:
    """``picks`` (from export_picks, maybe of an older titan_mm: a checkpoint's) less what this version would not
    launch: a tuner it does not have, or a config outside its key's candidates."""
    by_name = {t.name: t for t in Tuner.registry}
    out: dict = {}
    for name, best in picks.items():
        t = by_name.get(name)
        if t is not None:
            out[name] = {k: cfg for k, cfg in best.items() if cfg in t.configs(k)}
    return out


def reset_tuning() -> None:
    """Forget every pick, timing and untuned key (tests)."""
    for t in Tuner.registry:
        t.best.clear()
        t.timings.clear()
        t.untuned.clear()
        t.last = None
