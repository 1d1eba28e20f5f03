"""Asynchronous steps (serve.async_scheduling): each step is launched before the previous step's tokens are read
back, its decode rows taking those tokens on the device. The outputs must be what the steps in turn give: the same
tokens, text, logprobs and finish reasons for greedy, seeded sampling, stops (EOS, stop strings, max_tokens),
n > 1, penalties (counting the pending token on the device), chunked prefill and preemption; aborts and deadlines
meet a step in flight; no output ever shows a pending token; blocks return to idle."""

import pytest

from tests.unit._serve_helpers import engine, prompt
from titan_mm.serve.engine import Engine
from titan_mm.serve.core.handlers import Sampling
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.sequence import PENDING

EOS = tuple(range(0, 256, 9))  # ~11% of the vocabulary: some sequences stop early


def workload():
    ps = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=20),
          SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=15),
          SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=10, logprobs=2),
          SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=9, stop=["e", "a"]),
          SamplingParams(temperature=0.8, n=2, seed=6, max_tokens=7),
          SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, max_tokens=1)]
    return [prompt(3 + 7 * i, seed=i) for i in range(len(ps))], ps


def outputs(e: Engine, approx: bool = False):
    """Per output: tokens, text, logprobs, finish reason, cumulative logprob. ``approx``: the logprobs as expected
    values to 1e-5. An asynchronous step keeps a row for a sequence the previous step's tokens ended (void), so its
    batch shape differs from the step in turn's, and fp32 CPU matmuls regroup their sums by shape: the logits
    (|x| < 16, ulp ~1e-6) may move by a few ulp. Tokens, text and finish reasons stay exact."""
    ids, ps = workload()
    outs = e.generate(ids, ps)
    assert e.stats()["kv_blocks_used"] == 0
    near = (lambda v, tol: pytest.approx(v, abs=tol)) if approx else (lambda v, tol: v)
    return [[(c.token_ids, c.text, [{t: near(v, 1e-5) for t, v in lp.items()} for lp in c.logprobs or []],
              c.finish_reason, near(c.cumulative_logprob, 1e-4)) for c in o.outputs] for o in outs]


def counting(monkeypatch) -> list:
    calls = []
    real = Sampling.resolve
    monkeypatch.setattr(Sampling, "resolve", lambda self, *a: (calls.append(1), real(self, *a)))
    return calls


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4},
                                 {"num_blocks": 24, "enable_prefix_caching": False}],
                         ids=["plain", "chunked", "preempting"])
def test_async_steps_give_the_outputs_of_steps_in_turn(cfg, monkeypatch):
    sync = outputs(engine(eos=EOS, async_scheduling=False, **cfg), approx=True)
    calls = counting(monkeypatch)
    e = engine(eos=EOS, **cfg)
    assert outputs(e) == sync
    assert len(calls) > 10  # steps did overlap
    if "num_blocks" in cfg:
        assert e.stats()["num_preemptions"] > 0


def test_penalized_steps_overlap_and_count_the_pending_token(monkeypatch):
    """Repetition, presence and frequency penalties, greedy and seeded, over prompts that repeat their tokens: the
    asynchronous steps (whose last output token is still on the device when the next one is drawn) give the
    tokens of steps in turn, and every step after the first overlaps."""
    ps = [SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.5, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=1.5, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=14, presence_penalty=1.8, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=7, max_tokens=14, repetition_penalty=0.7, frequency_penalty=-1.0,
                         ignore_eos=True, logprobs=1)]
    ids = [prompt(4, seed=i) * 3 for i in range(len(ps))]

    def run(e):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in e.generate(ids, ps)]

    sync = run(engine(async_scheduling=False))
    calls = counting(monkeypatch)
    assert run(engine()) == sync
    assert len(calls) >= 13  # 14 tokens: each step after the first resolved its predecessor's


def test_streamed_outputs_never_show_a_pending_token():
    e = engine(eos=EOS)
    ids, ps = workload()
    for i, (x, p) in enumerate(zip(ids, ps)):
        e.add_request(str(i), x, p)
    got: dict = {}
    final = {}
    while e.has_unfinished():
        for o in e.step():
            for c in o.outputs:
                assert PENDING not in c.new_token_ids and PENDING not in c.token_ids
                got[(o.request_id, c.index)] = got.get((o.request_id, c.index), []) + c.new_token_ids
            if o.finished:
                final[o.request_id] = o
    assert len(final) == len(ids)
    for (rid, k), toks in got.items():
        assert toks == final[rid].outputs[k].token_ids


def test_abort_and_deadline_meet_a_step_in_flight():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    e = engine(clock=clock)
    e.add_request("a", prompt(10), SamplingParams(temperature=0.0, max_tokens=40))
    e.add_request("d", prompt(12, seed=1), SamplingParams(temperature=0.0, max_tokens=40), deadline_s=5.0)
    e.add_request("b", prompt(8, seed=2), SamplingParams(temperature=0.0, max_tokens=6))
    for _ in range(4):
        e.step()
    assert e.core.inflight is not None  # a step is in flight now
    e.abort("a")
    clock.t = 10.0
    final = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                final[o.request_id] = o.outputs[0]
    assert final["a"].finish_reason == "abort" and final["d"].finish_reason == "abort"
    assert final["b"].finish_reason == "length" and len(final["b"].token_ids) == 6
    for c in final.values():
        assert PENDING not in c.token_ids
    assert e.stats()["kv_blocks_used"] == 0
