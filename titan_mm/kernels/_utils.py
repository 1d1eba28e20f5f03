"""Small helpers shared by the kernel files: row views, buffer allocation, and the launch-config tuner."""

from __future__ import annotations

import functools
import os as _os
import time

import torch


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


# ---------------------------------------------------------------------------------------------- tuning

INTERPRET = _os.environ.get("TRITON_INTERPRET", "0") == "1"
# TITAN_KERNELS_TUNE=0: no timing, every kernel takes its first (default) config
TUNE = _os.environ.get("TITAN_KERNELS_TUNE", "1") != "0"
# Tests set this to an int i: every tuner returns config i (modulo its list) without timing or caching, so
# the interpreter checks can run each config's code path.
FORCE_CONFIG: int | None = None
MAX_CONFIGS = 4  # candidates per kernel and key (keeps tuning within seconds; the tests sweep them all)


class Tuner:
    """Launch-config choice for one kernel, per key (hidden size / head layout and dtype, never the token
    count, so training does not retune per batch).

    `configs(key)` lists candidate dicts of launch parameters (constexprs and `num_warps`); the first is the
    default. On the first call for a key on a GPU, `pick(key, launch)` times `launch(cfg)` for every candidate
    (triton.testing.do_bench, L2 flushed, device time) and keeps the fastest; later calls are a dict lookup.
    Configs that fail to compile (e.g. out of registers / shared memory) are skipped and recorded in
    `timings`; if all fail the first error is raised. Under TRITON_INTERPRET=1 (CPU) or TITAN_KERNELS_TUNE=0
    the first config is used. Unlike triton.autotune, the launcher knows the chosen config before it sizes
    its grid and any per-program partial buffers.
    """

    registry: list["Tuner"] = []

    def __init__(self, name: str, configs):
        self.name = name
        self._configs = configs
        self.best: dict = {}
        self.timings: dict = {}
        self.last = None  # (key, config) of the latest pick: the benchmark reports it
        Tuner.registry.append(self)

    def configs(self, key) -> list[dict]:
        return self._configs(key) if callable(self._configs) else list(self._configs)

    def pick(self, key, launch) -> dict:
        if FORCE_CONFIG is not None:  # tests: neither read nor written to the cache
            cands = self.configs(key)
            cfg = cands[FORCE_CONFIG % len(cands)]
            self.last = (key, cfg)
            return cfg
        cfg = self.best.get(key)
        if cfg is None:
            cands = self.configs(key)
            assert 1 <= len(cands) <= MAX_CONFIGS, f"{self.name}: {len(cands)} configs"
            if INTERPRET or not TUNE or len(cands) == 1 or not torch.cuda.is_available():
                cfg = cands[0]
            else:
                cfg = self._tune(key, cands, launch)
            self.best[key] = cfg
        self.last = (key, cfg)
        return cfg

    def _tune(self, key, cands, launch) -> dict:
        import triton.testing

        t0 = time.perf_counter()
        times, res, first_err = [], {}, None
        for cfg in cands:
            try:
                ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=25, return_mode="median")
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
