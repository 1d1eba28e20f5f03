"""Sampling: SamplingParams.validate names the field; the processed distribution equals transformers' logits
processors (repetition penalty, temperature, top-k, top-p, min-p) and OpenAI's presence / frequency penalties; the
sampler's draws follow that distribution (chi-square); seeded rows do not depend on the batch; logprobs are the
model's. In the engine: seeds reproduce, n outputs differ and share the prompt's blocks, best_of keeps the most
likely, stop strings / stop tokens end the text, and streamed deltas add up to the final output."""

import math

import pytest
import torch
from scipy.stats import chisquare

from tests.unit._serve_helpers import engine, prompt
from titan_mm.serve.errors import BadRequest
from titan_mm.serve.runner.sampler import RowSampling, sample, target_probs
from titan_mm.serve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=2, best_of=1), "best_of"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(use_beam_search=True, stop=["x"]), "stop"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(max_tokens=True), "max_tokens"),
])
def test_validate_names_the_field(kw, field):
    with pytest.raises(BadRequest) as e:
        SamplingParams(**kw).validate()
    assert e.value.field == field and e.value.message


def rows_for(params, prompt_ids=(1, 2, 3), output_ids=(3, 5, 5)):
    return [RowSampling(p, list(prompt_ids), list(output_ids)) for p in params]


def test_processed_distribution_is_transformers():
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    V = 32
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(top_p=0.6), SamplingParams(min_p=0.1, temperature=0.5),
              SamplingParams(repetition_penalty=1.7, temperature=0.9, top_k=9, top_p=0.8, min_p=0.05)]
    ours = target_probs(logits, rows_for(params))
    ids = torch.tensor([[1, 2, 3, 3, 5, 5]])
    for i, p in enumerate(params):
        chain = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(p.repetition_penalty)] if
                                    p.repetition_penalty != 1.0 else [])
        chain.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            chain.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            chain.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            chain.append(MinPLogitsWarper(p.min_p))
        ref = chain(ids, logits[i:i + 1].clone()).softmax(-1)[0]
        torch.testing.assert_close(ours[i], ref, atol=1e-6, rtol=1e-5, msg=f"{p}")


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 8)
    probs = target_probs(logits, rows_for([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]))
    expect = torch.zeros(8)
    expect[3] -= 0.5 + 0.25  # output holds 3 once, 5 twice; prompt tokens are not penalized
    expect[5] -= 0.5 + 0.5
    torch.testing.assert_close(probs[0], expect.softmax(-1))


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.8), SamplingParams(top_k=4),
                               SamplingParams(top_p=0.7, temperature=1.5), SamplingParams(min_p=0.15),
                               SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)],
                         ids=["temperature", "top_k", "top_p", "min_p", "penalties"])
def test_draws_follow_the_target_distribution(p):
    V, R = 12, 30000
    logits = (torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 1.5).expand(R, V)
    rows = [RowSampling(p, [1, 2], [3, 3]) for _ in range(R)]
    got = [s.token for s in sample(logits, rows, torch.Generator().manual_seed(2))]
    want = target_probs(logits[:1], rows[:1])[0].double()
    counts = torch.bincount(torch.tensor(got), minlength=V).double()
    assert counts[want == 0].sum() == 0  # never a token the processors removed
    keep = want > 0
    stat = chisquare(counts[keep].numpy(), (want[keep] / want[keep].sum() * R).numpy())
    assert stat.pvalue > 1e-3, (counts.tolist(), (want * R).tolist())


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=7)

    def draws(batch: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        rows = [RowSampling(p, [], [], gen)] + [RowSampling(SamplingParams(), [], []) for _ in range(batch - 1)]
        return [sample(logits[:batch], rows)[0].token for _ in range(6)]

    alone = draws(1)
    assert draws(4) == alone and len(set(alone)) > 1


def test_logprobs_are_the_models():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))
    out = sample(logits, rows_for([SamplingParams(temperature=0.0, logprobs=3),
                                   SamplingParams(temperature=0.5, top_k=2, logprobs=0)]))
    lp = logits.log_softmax(-1)
    for i, s in enumerate(out):
        assert math.isclose(s.logprob, lp[i, s.token].item(), rel_tol=1e-6)
    assert out[0].token == int(logits[0].argmax()) and len(out[0].top) == 3
    assert list(out[0].top)[:3] == lp[0].topk(3).indices.tolist()
    assert out[1].top == {out[1].token: out[1].logprob}
    # a batch whose rows all ask for their own logprob only (RL's rollouts): no top-k pass, and no crash without one
    alone = sample(logits, rows_for([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert [s.top for s in alone] == [{s.token: s.logprob} for s in alone]
    assert alone[0].token == out[0].token and math.isclose(alone[0].logprob, out[0].logprob, rel_tol=1e-6)


# ---- in the engine ----
def test_seed_reproduces_whatever_runs_beside_it():
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=11)
    alone = engine().generate([prompt(7)], p)[0].outputs[0].token_ids
    crowd = engine().generate([prompt(5, 1), prompt(7), prompt(9, 2)],
                              [SamplingParams(temperature=1.0, max_tokens=12), p, SamplingParams(temperature=0.0)])
    assert crowd[1].outputs[0].token_ids == alone
    other = engine().generate([prompt(7)], SamplingParams(temperature=1.0, max_tokens=12, seed=12))
    assert other[0].outputs[0].token_ids != alone


def test_n_outputs_share_the_prompt_blocks():
    e = engine(block_size=4)
    e.add_request("r", prompt(16), SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=0))
    e.step()  # the prompt's 4 blocks, then the fork: 3 sequences, 1 token each
    assert e.stats()["num_running_seqs"] == 3
    assert e.stats()["kv_blocks_used"] == 4  # the prompt (16 tokens = 4 full blocks) is shared
    e.step()  # each sequence writes its 17th token: a block of its own
    assert e.stats()["kv_blocks_used"] == 4 + 3
    while e.has_unfinished():
        e.step()
    outs = e.generate([prompt(16)], SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=0))[0].outputs
    assert len(outs) == 3 and len({tuple(c.token_ids) for c in outs}) == 3
    assert [c.index for c in outs] == [0, 1, 2]


def test_greedy_n_gives_n_identical_outputs_from_one_sequence():
    """temperature 0 with n > 1 (and best_of) runs one sequence: its output is every choice, equal to n = 1's."""
    e = engine(block_size=4)
    one = e.generate([prompt(9)], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    e.add_request("r", prompt(9), SamplingParams(temperature=0.0, n=3, best_of=4, max_tokens=6, logprobs=1))
    seen = {i: [] for i in range(3)}
    while e.has_unfinished():
        out = e.step()
        if out:
            assert e.stats()["num_running_seqs"] <= 1
            for c in out[0].outputs:
                seen[c.index] += c.new_token_ids
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(c.token_ids == one.token_ids and c.text == one.text and c.finish_reason == one.finish_reason
               for c in out[0].outputs)
    assert seen == {i: one.token_ids for i in range(3)}  # every choice streams every delta
    assert out[0].outputs[0].logprobs == out[0].outputs[2].logprobs
    assert e.stats()["kv_blocks_used"] == 0


def test_best_of_returns_the_most_likely():
    out = engine().generate([prompt(6)], SamplingParams(temperature=1.0, n=2, best_of=5, max_tokens=5, seed=3))[0]
    allof = engine().generate([prompt(6)], SamplingParams(temperature=1.0, n=5, max_tokens=5, seed=3))[0]
    best = sorted((c.cumulative_logprob for c in allof.outputs), reverse=True)[:2]
    assert [c.cumulative_logprob for c in out.outputs] == best


def test_stop_token_and_stop_string():
    e = engine()
    greedy = e.generate([prompt(8, 5)], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    ids = greedy.token_ids
    cut = e.generate([prompt(8, 5)], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[4]]))
    c = cut[0].outputs[0]
    assert c.token_ids == ids[: ids.index(ids[4]) + 1] and c.finish_reason == "stop"
    tok = e.tokenizer
    stop = tok.decode(ids[5:7])  # a stop string over two tokens
    s = e.generate([prompt(8, 5)], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0].outputs[0]
    full = tok.decode(ids)
    assert s.finish_reason == "stop" and s.text == full[: full.index(stop)] and stop not in s.text
    assert greedy.finish_reason == "length" and len(ids) == 12


def test_streamed_deltas_add_up():
    e = engine()
    e.add_request("a", prompt(9), SamplingParams(temperature=0.8, max_tokens=10, seed=1, logprobs=2))
    e.add_request("b", prompt(4), SamplingParams(temperature=0.0, max_tokens=7))
    toks: dict = {"a": [], "b": []}
    text: dict = {"a": "", "b": ""}
    final = {}
    while e.has_unfinished():
        for o in e.step():
            c = o.outputs[0]
            toks[o.request_id] += c.new_token_ids
            text[o.request_id] += c.new_text
            if o.finished:
                final[o.request_id] = c
    for rid, c in final.items():
        assert toks[rid] == c.token_ids and text[rid] == c.text
    assert len(final["a"].logprobs) == 10 and all(len(d) <= 3 for d in final["a"].logprobs)
