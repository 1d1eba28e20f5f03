"""serve.graph_sampling: a decode step ends with the greedy pick of its logits (inside its CUDA graph on a GPU, the
same static-buffer step eagerly here), and a batch of plain greedy rows takes that pick instead of launching one
after the step. The outputs equal the unfused engine's; batches that sample, penalize or ask for logprobs keep the
old draw."""

import pytest
import torch

from tests.unit._serve_helpers import engine, prompt
from titan_mm.config import ConfigError
from titan_mm.kernels import greedy_pick
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.runner import sampler
from titan_mm.serve.runner.sampler import RowSampling, draw
from titan_mm.serve.sampling_params import SamplingParams

EOS = tuple(range(0, 256, 9))


def counting(monkeypatch, name: str) -> list:
    """Calls of ``titan_mm.serve.runner.sampler.<name>`` (the draw's own greedy pick, or its full sampling pass)."""
    calls = []
    real = getattr(sampler, name)
    monkeypatch.setattr(sampler, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def run(e, ps):
    outs = e.generate([prompt(3 + 5 * i, seed=i) for i in range(len(ps))], ps)
    assert e.stats()["kv_blocks_used"] == 0
    return [[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs] for o in outs]


def close(a, b):
    """Tokens and finish reasons exact; cumulative logprobs to 1e-5: the fused pick's logsumexp runs over the padded
    decode batch, the unfused one over its real rows, and a CPU reduction may split a row's sum differently by
    batch shape (|logprob| < 30 over <= 20 tokens of 256-term fp32 sums: ulps ~1e-6 each)."""
    assert [[(t, f) for t, f, _ in o] for o in a] == [[(t, f) for t, f, _ in o] for o in b]
    assert [[lp for *_, lp in o] for o in a] == [[pytest.approx(lp, abs=1e-5) for *_, lp in o] for o in b]


@pytest.mark.parametrize("cfg", [{}, {"async_scheduling": False}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}],
                         ids=["async", "in_turn", "chunked"])
def test_greedy_batches_take_the_steps_pick(cfg, monkeypatch):
    ps = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=i % 2 == 0) for i in range(5)]
    picks = counting(monkeypatch, "greedy_pick")
    unfused = run(engine(eos=EOS, **cfg), ps)
    draws = len(picks)  # one pick per step that samples
    picks.clear()
    e = engine(eos=EOS, graph_sampling=True, **cfg)
    assert e.runner.graph_sampling
    close(run(e, ps), unfused)
    # decode steps' draws took the step's pick: only steps with prefill rows picked afresh (18 draws -> 1 here,
    # 24 -> 5 chunked)
    assert draws >= 18 and len(picks) <= draws // 4


def test_sampling_penalties_and_logprobs_keep_the_old_draw(monkeypatch):
    """Seeded sampling (temperature, top-k, top-p, min-p), a penalized greedy row, logprobs and n > 1 in one batch:
    the draw runs its full pass every step, and the tokens equal the unfused engine's."""
    ps = [SamplingParams(temperature=0.0, max_tokens=8),
          SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=9),
          SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=7, logprobs=2),
          SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=6),
          SamplingParams(temperature=0.8, n=2, seed=6, max_tokens=5),
          SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3)]
    unfused = run(engine(eos=EOS), ps)
    full = counting(monkeypatch, "target_probs")
    picks = counting(monkeypatch, "greedy_pick")
    close(run(engine(eos=EOS, graph_sampling=True), ps), unfused)
    assert full and not picks  # never a plain-greedy batch: the fused pick is never taken


def test_penalized_batch_alone_takes_the_old_path(monkeypatch):
    """A batch of greedy rows of which one has a repetition penalty: not graph-safe, so every draw is the full
    pass, with the same tokens as without the flag."""
    ps = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.5)]
    unfused = run(engine(), ps)
    full = counting(monkeypatch, "target_probs")
    close(run(engine(graph_sampling=True), ps), unfused)
    assert len(full) == 7


def test_decode_logits_carry_their_pick_and_a_slice_drops_it():
    """The runner's decode step returns its real rows' logits with the pick of exactly those rows (equal to
    greedy_pick of them); draw takes it for plain-greedy rows; a gather of the rows is picked afresh."""
    e = engine(graph_sampling=True)
    ps = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    e.generate([prompt(5, seed=1), prompt(9, seed=2), prompt(4, seed=3)], [ps] * 3)  # warm the decode sizes
    runner = e.runner
    seen = []
    real = runner.decode

    def decode(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    runner.decode = decode
    e.generate([prompt(5, seed=1), prompt(9, seed=2), prompt(4, seed=3)], [ps] * 3)
    assert seen
    rows = [RowSampling(ps, [], []) for _ in range(3)]
    for logits in seen:
        picked = logits.picked
        tokens, logprobs = greedy_pick(logits)
        assert torch.equal(picked.tokens, tokens)
        torch.testing.assert_close(picked.logprobs, logprobs, rtol=0, atol=1e-5)
        got = draw(logits, rows[: len(logits)])
        assert got.tokens is picked.tokens  # taken, not recomputed
        assert "picked" not in logits[[0]].__dict__


def test_graph_sampling_needs_paged_decode():
    with pytest.raises(ConfigError, match="graph_sampling .* paged_decode") as err:
        ServeConfig(graph_sampling=True, paged_decode=False).check()
    assert "\n" not in str(err.value)
