"""serve.graph_sampling on a GPU (written, not run yet): the greedy pick inside each decode step's CUDA graph.
bf16 greedy tokens with the pick in the graph equal the eager steps' (the same static-buffer step without graphs)
and the unfused engine's; a decode step with the pick, its draw and the copy out run without a host sync; and per
decode step the host launches at least one kernel fewer (greedy_pick no longer follows the replay) while the GPU
runs the same kernels (the pick moved into the graph).

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_graph_sampling_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.parity.test_serve_generate import MAX_NEW, text_setup
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.runner.sampler import Draw
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(tm, spec, data, eos, **cfg) -> Engine:
    return Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, num_blocks=64, **cfg),
                  device="cuda", eos_token_ids=eos, data=data)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_graph_pick_tokens_equal_eager(moe):
    tm, spec, prompts, _, eos, _, data = text_setup(moe)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = {}
    for name, cfg in {"unfused": {}, "eager_pick": {"graph_sampling": True, "cuda_graphs": False},
                      "graph_pick": {"graph_sampling": True}}.items():
        engine = _engine(tm, spec, data, [eos], **cfg)
        assert engine.dtype == torch.bfloat16 and engine.runner.graphs == cfg.get("cuda_graphs", True)
        outs[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert engine.stats()["kv_blocks_used"] == 0
    assert outs["graph_pick"] == outs["eager_pick"] == outs["unfused"]


def test_graph_pick_step_has_no_host_sync(monkeypatch):
    """Each decode step (inputs, replay with the pick) and each draw's copy out run under
    set_sync_debug_mode("error"); only Draw.results waits, for the tokens."""
    tm, spec, prompts, _, eos, _, data = text_setup(False)
    engine = _engine(tm, spec, data, [eos], graph_sampling=True)
    runner = engine.runner

    def checked(fn):
        def run(*a, **k):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return run

    steps = []
    decode = runner.decode
    runner.decode = checked(lambda *a, **k: (steps.append(1), decode(*a, **k))[1])
    monkeypatch.setattr(Draw, "copy_out", checked(Draw.copy_out))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert len(steps) >= MAX_NEW - 1 and all(o.outputs[0].token_ids for o in outs)


def _per_step(engine: Engine, prompt: list[int], steps: int = 16) -> tuple[float, float]:
    """(GPU kernels, host kernel launches) per decode step of one greedy request alone (graph replays count as the
    kernels inside them on the GPU side, and as one cudaGraphLaunch on the host side, not a kernel launch)."""
    engine.add_request("k", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # the prefill and a few decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort("k")
    while engine.has_unfinished():
        engine.step()
    ev = prof.events()
    kern = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]
    launches = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and "LaunchKernel" in e.name]
    return len(kern) / steps, len(launches) / steps


def test_graph_pick_launches_fewer_kernels_per_decode_step():
    tm, spec, prompts, _, _, _, data = text_setup(False)
    off = _per_step(_engine(tm, spec, data, []), prompts[0])
    on = _per_step(_engine(tm, spec, data, [], graph_sampling=True), prompts[0])
    print(f"per decode step: GPU kernels {off[0]} -> {on[0]}, host kernel launches {off[1]} -> {on[1]}")
    assert on[0] == off[0]  # the same kernels, the pick now inside the graph
    assert on[1] <= off[1] - 1
