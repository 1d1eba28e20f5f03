"""serve.graph_sampling on a GPU (written, not run yet): a decode step draws its rows itself, greedy rows by the pick
inside its CUDA graph, sampled rows (temperature, top-k, top-p; seeded or not) by a second graph over static knob and
noise buffers. bf16 tokens with the draw in the graphs equal the eager steps' (the same static buffers without
graphs) and the unfused engine's, greedy and sampled; a decode step with its draw and the copy out run without a
host sync; per greedy decode step the host launches at least one kernel fewer (greedy_pick no longer follows the
replay) while the GPU runs the same kernels (the pick moved into the graph), and per sampled step many fewer.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_graph_sampling_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.parity.test_serve_generate import MAX_NEW, text_setup
from tests.unit.test_serve_graph_sampling import drew
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.runner.sampler import Draw
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
SEED = 77  # the engine generator's, for unseeded rows


def _sampled(n: int) -> list[SamplingParams]:
    """Greedy, seeded and unseeded rows with temperature, top-k and top-p, mixed in one batch."""
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.9, "top_k": 20, "seed": 2},
             {"temperature": 0.7, "top_p": 0.8, "seed": 3}, {"temperature": 1.1, "top_k": 40, "top_p": 0.9}]
    rows = [kinds[i % len(kinds)] for i in range(n)]
    return [SamplingParams(max_tokens=MAX_NEW, **{**k, **({"seed": 10 + i} if "seed" in k else {})})
            for i, k in enumerate(rows)]


def _engine(tm, spec, data, eos, **cfg) -> Engine:
    return Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, num_blocks=64, **cfg),
                  device="cuda", eos_token_ids=eos, data=data)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_graph_pick_tokens_equal_eager(moe, kind):
    tm, spec, prompts, _, eos, _, data = text_setup(moe)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW) if kind == "greedy" else _sampled(len(prompts))
    outs = {}
    for name, cfg in {"unfused": {}, "eager_pick": {"graph_sampling": True, "cuda_graphs": False},
                      "graph_pick": {"graph_sampling": True}}.items():
        engine = _engine(tm, spec, data, [eos], **cfg)
        assert engine.dtype == torch.bfloat16 and engine.runner.graphs == cfg.get("cuda_graphs", True)
        engine.core.generator.manual_seed(SEED)
        steps = drew(engine)
        outs[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert engine.stats()["kv_blocks_used"] == 0
        assert any(steps) == (name != "unfused")  # the steps drew their rows themselves
    assert outs["graph_pick"] == outs["eager_pick"] == outs["unfused"]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_graph_pick_step_has_no_host_sync(monkeypatch, kind):
    """Each decode step (inputs, knobs and noise, replays with the draw) and each draw's copy out run under
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
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW) if kind == "greedy" else _sampled(len(prompts))
    outs = engine.generate(prompts, params)
    assert len(steps) >= MAX_NEW - 1 and all(o.outputs[0].token_ids for o in outs)


def _per_step(engine: Engine, prompt: list[int], steps: int = 16, **params) -> tuple[float, float]:
    """(GPU kernels, host kernel launches) per decode step of one request alone (graph replays count as the kernels
    inside them on the GPU side, and as one cudaGraphLaunch on the host side, not a kernel launch); ``params``:
    its sampling (default greedy)."""
    params = {"temperature": 0.0, **params}
    engine.add_request("k", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True, **params))
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


def test_sampled_draw_in_graph_launches_fewer_kernels_per_decode_step():
    """A seeded top-p row: the draw after the replay (~25 kernels: sort, softmaxes, cumsum, the race, log-softmax)
    becomes one graph launch plus the noise draw and the knob copies."""
    tm, spec, prompts, _, _, _, data = text_setup(False)
    params = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    off = _per_step(_engine(tm, spec, data, []), prompts[0], **params)
    on = _per_step(_engine(tm, spec, data, [], graph_sampling=True), prompts[0], **params)
    print(f"sampled, per decode step: GPU kernels {off[0]} -> {on[0]}, host kernel launches {off[1]} -> {on[1]}")
    assert on[1] <= off[1] - 10
