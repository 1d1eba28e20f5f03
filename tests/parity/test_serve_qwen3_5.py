"""The serving engine on Qwen3.5 (Gated DeltaNet + gated attention): greedy outputs token-identical to transformers'
``generate`` (fp32, CPU, the tiny random dense and MoE models of test_qwen3_5_parity) for prompts of 1 .. 70 tokens
run together (one crosses the rule's 64-token chunk; an EOS met mid-way frees slots while others run), with
one-token rows through the static decode step and through the general path, with chunked prefill under a 16-token
budget, and with preemption forced by a tiny block pool (also in the middle of chunked prefills). n > 1 forks copy
the state slot (top-k 1 draws: every fork equals HF); beam search equals HF's, also under preemption; seeded
sampling with n > 1 runs; an abort frees the slot; speculative decoding is refused. After every run the KV blocks
and the state slots are back to idle. And, in float64, chunks through the cached conv and rule (right-padded) equal
the whole sequence through the training forms.

Run: OMP_NUM_THREADS=2 pytest -q tests/parity/test_serve_qwen3_5.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.parity.test_qwen3_5_parity import models  # noqa: E402
from tests.parity.test_serve_generate import left_padded, with_eos  # noqa: E402
from titan_mm.config import ConfigError  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 8
LENS = (3, 17, 40, 1, 70, 9, 25, 12)
CASES = {
    "decode_step": dict(block_size=4, num_blocks=256),  # prefix caching asked for: the engine turns it off
    "general_path": dict(block_size=4, num_blocks=256, paged_decode=False),
    "chunked_prefill": dict(block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8),
    "preemption": dict(block_size=2, num_blocks=40, max_num_seqs=8),
    "preemption_chunked": dict(block_size=2, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=24),
}
_REF: dict = {}


def reference(moe: bool = False):
    """(titan model, config, prompts, HF greedy outputs of the left-padded batch), built once per kind."""
    if moe not in _REF:
        hf, tm, cfg = models(moe)
        hf.config.text_config.output_router_logits = False  # batched generate: no aux loss over padded rows
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 150, (n,), generator=g).tolist() for n in LENS]
        ids, mask = left_padded(prompts)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        refs = out[:, ids.shape[1]:].tolist()
        eos, cut = with_eos(refs)
        _REF[moe] = dict(tm=tm, cfg=cfg, prompts=prompts, refs=refs, eos=eos, refs_eos=cut)
    return _REF[moe]


def engine(moe: bool = False, eos: bool = False, **fields) -> Engine:
    r = reference(moe)
    return Engine(r["tm"], get_model_spec("qwen3_5_moe" if moe else "qwen3_5"), r["cfg"],
                  ServeConfig(max_model_len=128, **fields), eos_token_ids=[r["eos"]] if eos else [])


def assert_idle(eng: Engine) -> None:
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0, st
    assert st["state_slots_used"] == 0 and st["state_slots_total"] == eng.cfg.max_num_seqs, st


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_generate(case, moe):
    r = reference(moe)
    eng = engine(moe, eos=True, **CASES[case])
    outs = eng.generate(r["prompts"], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    got, refs = [o.outputs[0].token_ids for o in outs], r["refs_eos"]
    bad = [i for i in range(len(LENS)) if got[i] != refs[i]]
    assert not bad, f"prompts {bad} differ from HF: got {[got[i] for i in bad]}, HF {[refs[i] for i in bad]}"
    assert {o.outputs[0].finish_reason for o in outs} == {"stop", "length"}  # EOS met mid-way, and the length
    st = eng.stats()
    assert st["prefix_cache_hit_tokens"] == 0 and st["kv_blocks_cached"] == 0  # off for linear-attention families
    if case.startswith("preemption"):
        assert st["num_preemptions"] > 0, st
    assert_idle(eng)


def test_forks_copy_the_state():
    """n = 3 with top_k = 1 (a draw from one token: the argmax): each request prefills once and forks; every fork
    goes on from the copied state slot, so all three completions equal HF's greedy output. Seeded sampling with
    n = 2 and best_of = 3 runs to length."""
    r = reference()
    eng = engine(block_size=4, num_blocks=256, max_num_seqs=12)
    prompts, refs = r["prompts"][:4], r["refs"][:4]
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, top_k=1, n=3, max_tokens=MAX_NEW))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[ref] * 3 for ref in refs]
    assert_idle(eng)
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, n=2, best_of=3, seed=5, max_tokens=MAX_NEW))
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == MAX_NEW for c in o.outputs) for o in outs)
    assert_idle(eng)


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_beam_search_matches_transformers(pool):
    """Beam search (width 3, two returned) equals HF's generate(num_beams=3): forked beams take a slot each with
    the parent's state, dropped beams give theirs back, also when beams are preempted and recomputed."""
    r = reference()
    hf = models(False)[0]
    ids, mask = left_padded(r["prompts"])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0, early_stopping=False,
                          length_penalty=1.0)
    eng = engine(**(dict(block_size=4, num_blocks=256, max_num_seqs=24) if pool == "roomy" else
                    dict(block_size=2, num_blocks=120, max_num_seqs=24)))
    outs = eng.generate(r["prompts"], SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=MAX_NEW))
    assert [c.token_ids for o in outs for c in o.outputs] == out[:, ids.shape[1]:].tolist()
    if pool == "preempting":
        assert eng.stats()["num_preemptions"] > 0
    assert_idle(eng)


def test_abort_frees_the_slot():
    eng = engine(block_size=4, num_blocks=64)
    eng.add_request("a", reference()["prompts"][2], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    eng.step()
    assert eng.stats()["state_slots_used"] == 1
    eng.abort("a")
    assert [o.outputs[0].finish_reason for o in eng.step()] == ["abort"]
    assert_idle(eng)


def test_chunks_continue_the_saved_state():
    """float64: a sequence fed in right-padded chunks of 5, 1, 1, 60 and 3 tokens through the cached conv and rule
    (each chunk from the state the previous one left) equals the whole sequence through the training forms."""
    from titan_mm.nn.linear_attention import (causal_conv1d, causal_conv1d_cached, chunk_gated_delta_rule,
                                                         gated_delta_rule_cached)

    g = torch.Generator().manual_seed(0)
    S, C, W, H, HV, K, V = 70, 6, 4, 2, 4, 8, 5
    x, w = torch.randn(1, S, C, generator=g, dtype=torch.float64), torch.randn(C, W, generator=g, dtype=torch.float64)
    q, k = (torch.randn(1, S, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, S, HV, V, generator=g, dtype=torch.float64)
    gl = -torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    y_ref, o_ref = causal_conv1d(x, w), chunk_gated_delta_rule(q, k, v, gl, beta)[0]
    conv, rec = torch.zeros(1, W - 1, C, dtype=torch.float64), torch.zeros(1, HV, K, V, dtype=torch.float64)
    a, ys, os_ = 0, [], []
    for n in (5, 1, 1, 60, 3):
        pad = 2 if n > 1 else 0  # right padding of a batch's shorter row: it must leave the states alone
        sl = [torch.cat([t[:, a:a + n], torch.randn(1, pad, *t.shape[2:], generator=g, dtype=t.dtype)], 1)
              for t in (x, q, k, v, gl, beta)]
        valid = (torch.arange(n + pad) < n)[None]
        y, conv = causal_conv1d_cached(sl[0], w, conv, valid.sum(1))
        o, rec = gated_delta_rule_cached(*sl[1:], valid, rec, "torch")
        ys.append(y[:, :n])
        os_.append(o[:, :n])
        a += n
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(os_, 1), o_ref, rtol=1e-10, atol=1e-10)


def test_speculative_decoding_is_refused():
    with pytest.raises(ConfigError, match="cannot be rolled back"):
        engine(block_size=4, num_blocks=64, speculative_method="ngram")
