"""Speculative decoding: the n-gram lookup; exact rejection sampling (the first emitted token follows the target
distribution whatever the draft distribution, point masses included, and a bonus token after all guesses are kept
follows the last one); greedy keeps exactly the guesses the target would pick; and in the engine, sampling with a
draft model keeps the target's distribution of the second token (chi-square against the exact marginal), while a
draft that is the target itself is always accepted."""

import copy

import pytest
import torch
from scipy.stats import chisquare

from tests.unit._serve_helpers import VOCAB, engine, prompt, tiny_model
from titan_mm.nn.attention import build_attn_meta
from titan_mm.registry import get_model_spec
from titan_mm.serve.runner.sampler import RowSampling, target_probs
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.spec_decode import ngram_propose, verify


def test_ngram_lookup_takes_the_latest_longest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_propose(toks, 3, n_max=3, n_min=1) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert ngram_propose(toks, 2, n_max=1, n_min=1) == [7, 8]  # "3" latest earlier occurrence
    assert ngram_propose([4, 5, 6], 2, 3, 1) == []
    assert ngram_propose([5, 5], 3, 2, 1) == [5]  # a guess never reaches past the sequence


def _chi2(tokens, probs, n):
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    pk = probs[keep].double()
    return chisquare(counts[keep].numpy(), (pk / pk.sum() * n).numpy()).pvalue


@pytest.mark.parametrize("draft", ["model", "point_mass", "exact"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    V, K, R = 6, 3, 40000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    p = logits.softmax(-1)
    if draft == "model":
        q = (torch.randn(K, V, generator=g) * 1.5).softmax(-1)
    elif draft == "exact":
        q = p[:K]
    else:  # n-gram: a fixed guess per position
        q = torch.zeros(K, V).scatter_(1, torch.tensor([[2], [0], [5]]), 1.0)
    guesses = torch.stack([torch.multinomial(q[i], R, replacement=True, generator=g) for i in range(K)], 1)
    rows = [RowSampling(SamplingParams(temperature=1.0), [], []) for _ in range(R)]
    out = verify(logits[None].expand(R, K + 1, V), rows, guesses.tolist(),
                 [None if draft == "point_mass" else q] * R, torch.Generator().manual_seed(1))
    assert _chi2([v.emitted[0].token for v in out], p[0], R) > 1e-3
    if draft == "exact":  # every guess kept, then a bonus draw from the last distribution
        assert all(v.accepted == K for v in out)
        assert _chi2([v.emitted[K].token for v in out], p[K], R) > 1e-3
    else:
        acc = sum(v.accepted > 0 for v in out) / R
        expect = float(torch.minimum(p[0], q[0]).sum())  # P(first guess kept) = sum min(p, q)
        assert abs(acc - expect) < 0.01


def test_greedy_keeps_exactly_the_targets_choices():
    V = 10
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1).tolist()
    drafts = [best[0][:2] + [(best[0][2] + 1) % V], [(best[1][0] + 1) % V, 3, 3]]
    rows = [RowSampling(SamplingParams(temperature=0.0), [], []) for _ in range(2)]
    out = verify(logits, rows, drafts, [None, None])
    assert out[0].accepted == 2 and [s.token for s in out[0].emitted] == best[0][:3]
    assert out[1].accepted == 0 and [s.token for s in out[1].emitted] == best[1][:1]


def _exact_second_token(p0_params: SamplingParams, ids: list[int]) -> torch.Tensor:
    """P(token 2) = sum over token 1 of p(t1 | prompt) p(t2 | prompt, t1), by the model's full forward."""
    m = tiny_model()
    with torch.no_grad():
        x = torch.tensor([ids])
        l1 = m(x, attn=build_attn_meta({"input_ids": x}, "sdpa", "cpu")).logits[0, -1]
        p1 = target_probs(l1[None], [RowSampling(p0_params, ids, [])])[0]
        firsts = p1.nonzero().squeeze(1)
        xs = torch.cat([x.expand(len(firsts), -1), firsts[:, None]], 1)
        l2 = m(xs, attn=build_attn_meta({"input_ids": xs}, "sdpa", "cpu")).logits[:, -1]
        p2 = target_probs(l2, [RowSampling(p0_params, ids, [int(t)]) for t in firsts])
    return (p1[firsts, None] * p2).sum(0)


def test_engine_sampling_with_a_draft_model_keeps_the_distribution():
    m = tiny_model()
    draft = copy.deepcopy(m)  # the target plus noise: some guesses kept, some rejected
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=g))
    e = engine(speculative_method="draft", num_speculative_tokens=2, max_num_seqs=64, num_blocks=512, max_queue_len=4096,
               draft=(draft, get_model_spec("qwen3"), m.cfg))
    ids = prompt(6, 9)
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3)
    N = 2000
    outs = e.generate([ids] * N, params)
    second = [o.outputs[0].token_ids[1] for o in outs]
    want = _exact_second_token(params, ids)
    assert _chi2(second, want, N) > 1e-3
    acc = [o.metrics.spec_acceptance for o in outs]
    assert all(a is not None for a in acc) and 0 < sum(acc) / N < 1


def test_a_draft_that_is_the_target_is_always_accepted():
    m = tiny_model()
    e = engine(speculative_method="draft", num_speculative_tokens=3, draft=(m, get_model_spec("qwen3"), m.cfg))
    plain = engine().generate([prompt(5, i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=9))
    outs = e.generate([prompt(5, i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=9))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.metrics.spec_acceptance == 1.0 for o in outs)
    assert e.stats()["kv_blocks_used"] == 0 and VOCAB == m.cfg.vocab_size
