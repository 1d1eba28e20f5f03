"""serve.graph_sampling: the engine hands the runner a step's draw (a DrawPlan) before the forward; a decode step of
exactly those rows draws them itself (inside its CUDA graphs on a GPU, the same static-buffer steps eagerly here)
and returns the tokens in its output (Executed.tokens), which the sampler takes instead of drawing after the step.
Greedy rows take the step's greedy pick; sampled rows (temperature, top-k, top-p, seeded or not) take the draw over
the static knobs and the noise their generators drew into the static buffer. The outputs equal the unfused
engine's; a batch with a penalty, min-p or logprobs keeps the old draw."""

import pytest
import torch

from tests.unit._serve_helpers import engine, prompt
from titan_mm.config import ConfigError
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.runner import sampler
from titan_mm.serve.runner.sampler import RowSampling, draw
from titan_mm.serve.sampling_params import SamplingParams

EOS = tuple(range(0, 256, 9))
SEED = 1234  # the engine generator's, for the unseeded rows (each engine draws its own otherwise)
MODES = {"async": {}, "in_turn": {"async_scheduling": False}, "chunked": {"max_num_batched_tokens": 16,
                                                                            "max_num_seqs": 4}}


def counting(monkeypatch, name: str) -> list:
    """Calls of ``titan_mm.serve.runner.sampler.<name>`` (greedy_pick: the draw's own greedy pass; knobs: its full
    sampling pass)."""
    calls = []
    real = getattr(sampler, name)
    monkeypatch.setattr(sampler, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def drew(e) -> list[bool]:
    """Per step from now on: whether the runner's output carried the step's own tokens."""
    steps, real = [], e.runner.execute

    def execute(*a, **k):
        out = real(*a, **k)
        steps.append(out.tokens is not None)
        return out

    e.runner.execute = execute
    return steps


def run(e, ps):
    e.core.generator.manual_seed(SEED)
    outs = e.generate([prompt(3 + 5 * i, seed=i) for i in range(len(ps))], ps)
    assert e.stats()["kv_blocks_used"] == 0
    return [[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs] for o in outs]


def close(a, b):
    """Tokens and finish reasons exact; cumulative logprobs to 1e-5: the greedy pick's logsumexp runs over the
    padded decode batch, the unfused one over its real rows, and a CPU reduction may split a row's sum differently
    by batch shape (|logprob| < 30 over <= 20 tokens of 256-term fp32 sums: ulps ~1e-6 each)."""
    assert [[(t, f) for t, f, _ in o] for o in a] == [[(t, f) for t, f, _ in o] for o in b]
    assert [[lp for *_, lp in o] for o in a] == [[pytest.approx(lp, abs=1e-5) for *_, lp in o] for o in b]


GREEDY = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=i % 2 == 0) for i in range(5)]
PLAIN = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),  # softmax branch: no top-k / top-p
         SamplingParams(temperature=0.9, seed=3, max_tokens=9),
         SamplingParams(temperature=1.3, max_tokens=7, ignore_eos=True),  # unseeded: the engine's generator
         SamplingParams(temperature=0.6, seed=5, max_tokens=10, n=2)]  # forks at the first token, then in-step
TRUNCATED = [SamplingParams(temperature=0.0, max_tokens=8),  # sorted branch
             SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=9),
             SamplingParams(temperature=0.7, top_p=0.8, seed=4, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=1.1, top_k=40, top_p=0.9, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=6, seed=6)]


@pytest.mark.parametrize("cfg", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("ps", [GREEDY, PLAIN, TRUNCATED], ids=["greedy", "plain", "truncated"])
def test_decode_steps_draw_their_rows(ps, cfg, monkeypatch):
    """Greedy, seeded and unseeded sampled rows, mixed in one batch (softmax and sorted branches): the same tokens
    as the unfused engine, and only steps that hold prefill rows draw after the step."""
    after = counting(monkeypatch, "knobs" if ps is not GREEDY else "greedy_pick")
    unfused = run(engine(eos=EOS, **cfg), ps)
    draws = len(after)  # one per step that samples
    after.clear()
    e = engine(eos=EOS, graph_sampling=True, **cfg)
    steps = drew(e)
    close(run(e, ps), unfused)
    # e.g. greedy: 18 draws after the step -> 1 (chunked: 24 -> 5); sampled: 9 -> 1 (chunked: 16 -> 3 or 5)
    assert draws >= 8 and len(after) == draws - sum(steps) and sum(steps) >= 2 * draws // 3


@pytest.mark.parametrize("odd", [{"repetition_penalty": 1.3}, {"logprobs": 2}, {"min_p": 0.05},
                                 {"presence_penalty": 0.5}], ids=["repetition", "logprobs", "min_p", "presence"])
def test_a_row_the_graph_cannot_draw_keeps_the_old_path(odd, monkeypatch):
    """One row with a penalty, logprobs or min-p in a batch of greedy and seeded rows: no step draws itself, every
    draw is the full pass after the step, with the same tokens as without the flag."""
    ps = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=30, seed=2, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.0 if "logprobs" not in odd else 0.7, seed=9, max_tokens=7, ignore_eos=True,
                         **odd)]
    unfused = run(engine(), ps)
    full = counting(monkeypatch, "knobs")
    e = engine(graph_sampling=True)
    steps = drew(e)
    close(run(e, ps), unfused)
    assert len(full) == 7 and steps and not any(steps)


def test_rows_asking_their_own_logprob_draw_in_the_step():
    """RL's rollouts (n seeded completions a prompt, each token's own logprob: logprobs=0): the decode steps draw
    them, with the unfused engine's tokens and each token's logprob to 1e-5 (the draw computes it)."""
    ps = [SamplingParams(temperature=1.0, seed=20 + i, n=3, max_tokens=8, ignore_eos=True, logprobs=0)
          for i in range(3)]

    def outputs(e):
        outs = e.generate([prompt(4 + 3 * i, seed=i) for i in range(len(ps))], ps)
        return [[(c.token_ids, [d[t] for d, t in zip(c.logprobs, c.token_ids)], list(map(len, c.logprobs)))
                 for c in o.outputs] for o in outs]

    unfused = outputs(engine())
    e = engine(graph_sampling=True)
    steps = drew(e)
    fused = outputs(e)
    assert [[(t, n) for t, _, n in o] for o in fused] == [[(t, n) for t, _, n in o] for o in unfused]
    assert all(set(n) == {1} for o in fused for *_, n in o)  # the token's own logprob only
    for a, b in zip(fused, unfused):
        for (_, la, _), (_, lb, _) in zip(a, b):
            assert la == pytest.approx(lb, abs=1e-5)
    assert sum(steps) >= 5  # the forks' first draw runs after the step, the later decode steps draw themselves


def _clone(g: torch.Generator | None) -> torch.Generator | None:
    if g is None:
        return None
    c = torch.Generator(g.device)
    c.set_state(g.get_state())
    return c


def test_step_tokens_equal_the_draw_of_its_logits():
    """Each decode step's own tokens equal draw() of its returned logits over the plan's rows with the generators as
    they stood before the step (pad rows in the step: 3 rows in a decode size of 4); a step with prefill rows
    returns none. The plan leaves the generators where the unfused draw leaves them."""
    e = engine(graph_sampling=True)
    real, checked = e.runner.execute, []

    def execute(rows, copies, per_row=1, fed=None, plan=None):
        before = None if plan is None else ([_clone(r.generator) for r in plan.rows], _clone(plan.generator))
        out = real(rows, copies, per_row, fed, plan)
        if out.tokens is None:
            assert plan is None or any(r.n > 1 for r in rows)
            return out
        gens, shared = before
        rows_again = [RowSampling(r.params, r.prompt_ids, r.output_ids, g) for r, g in zip(plan.rows, gens)]
        again = draw(out.logits, rows_again, shared)
        assert torch.equal(again.tokens, out.tokens.tokens)
        torch.testing.assert_close(again.chosen, out.tokens.logprobs, rtol=0, atol=1e-5)
        for g, g2 in zip(gens + [shared], [r.generator for r in plan.rows] + [plan.generator]):
            assert g is None or torch.equal(g.get_state(), g2.get_state())
        checked.append(len(plan.rows))
        return out

    e.runner.execute = execute
    ps = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.2, max_tokens=5, ignore_eos=True)]
    e.generate([prompt(5, seed=1), prompt(9, seed=2), prompt(4, seed=3)], ps)
    assert checked and set(checked) == {3}


def test_graph_sampling_needs_paged_decode():
    with pytest.raises(ConfigError, match="graph_sampling .* paged_decode") as err:
        ServeConfig(graph_sampling=True, paged_decode=False).check()
    assert "\n" not in str(err.value)


def test_speculation_beside_in_step_draws():
    """n-gram speculation: steps whose rows found no guess run as decode steps that draw themselves, the others
    verify their guesses after the step; the tokens equal the unfused engine's."""
    cfg = {"speculative_method": "ngram", "num_speculative_tokens": 2, "ngram_min": 1}
    ps = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.5, top_k=3, seed=3, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.4, top_p=0.5, max_tokens=16, ignore_eos=True)]
    unfused = run(engine(**cfg), ps)
    e = engine(graph_sampling=True, **cfg)
    steps, verified, real = drew(e), [], e.core.speculative.advance
    e.core.speculative.advance = lambda rows, *a: (verified.append(len(rows)), real(rows, *a))[1]
    close(run(e, ps), unfused)
    assert any(steps) and len(verified) >= 2  # here 11 of 16 steps drew themselves, 4 verified guesses
