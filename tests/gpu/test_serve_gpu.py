"""The serving engine on a GPU (run on the H200): the model step of every engine iteration runs under
torch.cuda.set_sync_debug_mode("error") (a host sync raises), for Qwen3, Qwen3-MoE and Qwen3-VL with images, with
chunked prefill, forced preemption and both speculative methods (the target's step; the draft's forwards run
through the same runner), and the greedy tokens (fp32) equal transformers' generate on the CPU; the
KV pool sized from the memory left after the weights fits in gpu_memory_utilization.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.parity._qwen3_helpers import titan_twin
from tests.parity.test_serve_generate import CASES, MAX_NEW, draft_model, text_reference, text_setup, vl_setup
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

SETUPS = {"qwen3": lambda: text_setup(False), "qwen3_moe": lambda: text_setup(True), "qwen3_vl": lambda: vl_setup(False)}


def _checked(runner) -> None:
    """Run ``runner``'s model step (its inputs are built before, on the host) under set_sync_debug_mode("error")."""
    forward = runner.forward

    def checked(x):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    runner.forward = checked


def drive(engine: Engine, prompts, params, images, check: bool = True) -> list[list[int]]:
    """engine.generate with every model step, the draft model's too, checked for host syncs (``check``)."""
    if check:
        _checked(engine.runner)
        if engine.proposer is not None:
            _checked(engine.proposer.runner)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, images=images)]


@pytest.mark.parametrize("case", ["prefix_cache", "preemption", "chunked_prefill", "spec_ngram", "spec_draft"])
@pytest.mark.parametrize("model", list(SETUPS))
def test_engine_step_has_no_host_sync_and_matches_hf(model, case):
    tm, spec, prompts, images, eos, refs, data = SETUPS[model]()
    cfg = ServeConfig(max_model_len=256, dtype="float32", **CASES[case])
    draft = None
    if cfg.speculative_method == "draft":
        d, d_spec, d_cfg = draft_model(tm.language_model if model == "qwen3_vl" else tm)
        draft = (copy.deepcopy(d), d_spec, d_cfg)
    engine = Engine(copy.deepcopy(tm), spec, tm.cfg, cfg, device="cuda", eos_token_ids=[eos], data=data, draft=draft)
    # fp32 MoE experts run through titan_mm.kernels.grouped_mm (torch._grouped_mm is bf16 on CUDA): checked too
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    got = drive(engine, prompts, params, images)
    assert got == refs
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_sampling_step_bf16_has_no_host_sync(moe):
    tm, spec, prompts, _, eos, _, data = text_setup(moe)
    engine = Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, block_size=16, num_blocks=64),
                    device="cuda", eos_token_ids=[eos], data=data)
    assert engine.dtype == torch.bfloat16
    outs = drive(engine, prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_NEW, seed=0), None)
    assert all(1 <= len(o) <= MAX_NEW for o in outs)


def test_pool_from_memory_fits_the_utilization():
    tm, spec, *_ = text_setup(False)
    torch.cuda.empty_cache()
    engine = Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, gpu_memory_utilization=0.05),
                    device="cuda", eos_token_ids=[])
    free, total = torch.cuda.mem_get_info()
    assert engine.blocks.num_blocks > 1000
    assert total - free <= 0.05 * total + 512 * 2**20  # the allocator's slack


@pytest.mark.parametrize("kernels", [False, True], ids=["torch_ops", "kernels"])
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_cuda_graph_decode_equals_eager(moe, kernels):
    """bf16 greedy tokens with decode steps replayed from CUDA graphs (every size captured at start-up) equal the
    eager engine's (the same kernels; pad rows of each captured size write to the scratch block only), with the
    model's plain ops and with the fused titan_mm.kernels ops that from_pretrained serves with."""
    tm, spec, prompts, _, eos, _, data = text_setup(moe)
    if kernels:
        tm = titan_twin(text_reference(moe)[0], kernels=True)
    outs = []
    for graphs in (False, True):
        engine = Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, num_blocks=64,
                                                                     cuda_graphs=graphs),
                        device="cuda", eos_token_ids=[eos], data=data)
        assert engine.runner.graphs == graphs
        assert all((st.graph is not None) == graphs for st in engine.runner._decode.values())
        if graphs:
            assert sorted(engine.runner._decode) == engine.runner.sizes
        # the start-up line counts them (issue 49)
        assert f"captured graphs {len(engine.runner.sizes) if graphs else 0}" in engine.describe()
        outs.append(drive(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), None, check=False))
        assert engine.stats()["kv_blocks_used"] == 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_async_steps_wait_only_for_their_tokens(moe, monkeypatch):
    """serve.async_scheduling in bf16 with CUDA graphs: whole engine steps (scheduling, the forward, sampling,
    stop checks, outputs) run under set_sync_debug_mode("error") but for the wait on the previous step's tokens,
    and the greedy tokens equal the steps in turn (EOS ignored, so both run the same batches); a third of the
    requests are penalized (their counts read the pending token on the device)."""
    from titan_mm.serve.runner.sampler import Draw

    tm, spec, prompts, _, _, _, data = text_setup(moe)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True,
                             repetition_penalty=1.3 if i % 3 == 0 else 1.0, frequency_penalty=0.5 if i % 3 == 1 else 0.0)
              for i in range(len(prompts))]
    outs = []
    for overlap in (False, True):
        engine = Engine(copy.deepcopy(tm), spec, tm.cfg, ServeConfig(max_model_len=256, num_blocks=64,
                                                                     async_scheduling=overlap),
                        device="cuda", eos_token_ids=[], data=data)
        if overlap:
            results = Draw.results

            def waited(self):  # the one wait an asynchronous step makes
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return results(self)
                finally:
                    torch.cuda.set_sync_debug_mode("error")

            monkeypatch.setattr(Draw, "results", waited)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert engine.stats()["kv_blocks_used"] == 0
    assert outs[0] == outs[1]
    assert [len(o) for o in outs[1]] == [p.max_tokens for p in params]


@pytest.mark.parametrize("R", [1, 7, 256])
def test_greedy_pick_kernel_on_cuda(R):
    """titan_mm.kernels.greedy_pick's Triton kernel on bf16 logits of Qwen3's vocabulary: the reference's tokens,
    its logprobs to fp32 rounding, and no host sync."""
    from titan_mm.kernels import greedy_pick

    x = (4 * torch.randn(R, 151936, device="cuda")).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tok, lp = greedy_pick(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = x.float()
    want = ref.argmax(1)
    assert torch.equal(tok, want)
    torch.testing.assert_close(lp, ref.gather(1, want[:, None])[:, 0] - ref.logsumexp(1), atol=1e-4, rtol=1e-5)
