"""Speculative decoding: a proposer guesses up to k next tokens of a decoding sequence, the target model scores
them all in one forward (the last token plus the k guesses), and exact rejection sampling keeps a prefix of them
plus one token of its own.

Proposers:
  * "ngram" (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from ngram_max down to ngram_min). The draft distribution is a point mass on each guess.
  * "draft": a small model of the same vocabulary, run autoregressively for k tokens with the request's sampling
    settings. Its KV pool has the target's block layout and uses the same block tables, so the block manager
    serves both; ``Sequence.draft_computed`` counts the tokens whose k/v the draft pool holds.

Verification (Leviathan et al.; vLLM's rejection sampler): guess d_i drawn from q_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)), p_i the target's processed distribution (penalties count the kept guesses before it).
At the first rejection the token is drawn from normalize(max(0, p_i - q_i)). If every guess is kept, a bonus
token is drawn from p_k. The emitted tokens are distributed exactly as the target's own sampling. Greedy keeps a
guess iff it is the target's argmax, so the greedy output is token-identical with and without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_mm.serve.runner.sampler import RowSampling, Sampled, sample, target_probs
from titan_mm.serve.core.scheduler import Row


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens (longest n first)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n: start + n + k]
    return []


@dataclass
class Verified:
    emitted: list[Sampled]
    """The kept guesses, then the target's own token."""
    accepted: int


def verify(logits: torch.Tensor, rows: list[RowSampling], drafts: list[list[int]], q: list[torch.Tensor | None],
           generator: torch.Generator | None = None) -> list[Verified]:
    """``logits`` [R, K+1, V]: the target's logits at the last token and after each guess (rows with fewer guesses
    repeat their last position); ``drafts[r]`` the guesses, ``q[r]`` their draft distributions [k_r, V] (None: point
    masses). One host transfer at the end."""
    R, K1, V = logits.shape
    dev = logits.device
    logits = logits.float()
    flat_rows = []
    for r, d in zip(rows, drafts):  # position i: the output so far plus the guesses before it
        for i in range(K1):
            flat_rows.append(RowSampling(r.params, r.prompt_ids, r.output_ids + d[:i], r.generator))
    p = target_probs(logits.reshape(R * K1, V), flat_rows).view(R, K1, V)
    logp = logits.log_softmax(-1)
    k = torch.tensor([len(d) for d in drafts], device=dev)
    d_pad = torch.tensor([d + [0] * (K1 - 1 - len(d)) for d in drafts], device=dev, dtype=torch.long).view(R, K1 - 1)
    q_full = torch.zeros(R, max(K1 - 1, 1), V, device=dev)
    for r, (d, qr) in enumerate(zip(drafts, q)):
        if not d:
            continue
        if qr is None:
            q_full[r, torch.arange(len(d), device=dev), torch.tensor(d, device=dev)] = 1.0
        else:
            q_full[r, : len(d)] = qr.float()
    q_full = q_full[:, : K1 - 1]
    greedy = torch.tensor([r.params.greedy for r in rows], device=dev)
    u = torch.empty(R, max(K1, 1), device=dev)
    e = torch.empty(R, V, device=dev)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), u.shape[1], device=dev, generator=generator)
        e[shared] = torch.empty(len(shared), V, device=dev).exponential_(generator=generator)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(u.shape[1], device=dev, generator=r.generator)
            e[i] = torch.empty(V, device=dev).exponential_(generator=r.generator)
    pos = torch.arange(K1 - 1, device=dev)[None]
    p_d = p[:, :-1].gather(2, d_pad[..., None])[..., 0]  # [R, K]
    q_d = q_full.gather(2, d_pad[..., None])[..., 0]
    keep = torch.where(greedy[:, None], p[:, :-1].argmax(-1) == d_pad, u[:, : K1 - 1] * q_d < p_d)
    keep = keep & (pos < k[:, None])
    a = keep.long().cumprod(1).sum(1)  # guesses kept: up to the first rejection
    p_a = p[torch.arange(R, device=dev), a]  # [R, V]
    q_a = q_full[torch.arange(R, device=dev), a.clamp(max=max(K1 - 2, 0))] if K1 > 1 else torch.zeros_like(p_a)
    rejected = (a < k)[:, None]
    resid = torch.where(rejected, (p_a - q_a).clamp(min=0), p_a)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)  # p == q exactly: any draw of p is right
    last = torch.where(greedy, p_a.argmax(-1), (resid / e.clamp(min=1e-30)).argmax(-1))
    toks = torch.cat([d_pad, torch.zeros(R, 1, dtype=torch.long, device=dev)], 1)
    toks[torch.arange(R, device=dev), a] = last
    lp = logp.gather(2, toks[..., None])[..., 0]
    toks_l, lp_l, a_l = toks.tolist(), lp.tolist(), a.tolist()
    out = []
    for i, r in enumerate(rows):
        n = r.params.logprobs
        emitted = []
        for j in range(a_l[i] + 1):
            top = None
            if n is not None:
                v, ix = logp[i, j].topk(n)
                top = dict(zip(ix.tolist(), v.tolist()))
                top[toks_l[i][j]] = lp_l[i][j]
            emitted.append(Sampled(toks_l[i][j], lp_l[i][j], top))
        out.append(Verified(emitted, a_l[i]))
    return out


class DraftProposer:
    """Guesses from a small model whose KV pool shares the target's block tables (runner/model_runner.py)."""

    def __init__(self, runner):
        self.runner = runner

    @torch.inference_mode()
    def propose(self, rows: list[Row], samplings: list[RowSampling], copies) -> list[tuple[list[int], torch.Tensor]]:
        """For each row (a decoding sequence with ``lookahead`` slots): catch the draft cache up to the sequence's
        last token, then draw ``lookahead`` guesses one forward at a time. -> [(guesses, q [k, V])]."""
        self.runner.copy_blocks(copies)
        guesses: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        todo = [i for i, r in enumerate(rows) if r.lookahead > 0]
        steps = []
        for i in todo:  # catch-up: every token the draft has not seen, the last one included
            s = rows[i].seq
            steps.append(Row(rows[i].req, s, s.draft_computed, len(s.tokens) - s.draft_computed))
        k_max = max((rows[i].lookahead for i in todo), default=0)
        for j in range(k_max):
            if not steps:
                break
            logits = self.runner.run(steps, [])
            rs = [RowSampling(samplings[i].params, samplings[i].prompt_ids, samplings[i].output_ids + guesses[i],
                              samplings[i].generator) for i in todo]
            q = target_probs(logits, rs)
            drawn = sample(logits, rs)
            nxt_todo, nxt_steps = [], []
            for t, i in enumerate(todo):
                guesses[i].append(drawn[t].token)
                qs[i].append(q[t])
                s = rows[i].seq
                if j == 0:
                    s.draft_computed = len(s.tokens)
                if len(guesses[i]) < rows[i].lookahead:  # the guess's own k/v for the next one
                    nxt_todo.append(i)
                    nxt_steps.append(Row(rows[i].req, s, len(s.tokens) + j, 1, draft=list(guesses[i])))
            todo, steps = nxt_todo, nxt_steps
        return [(g, torch.stack(q) if q else None) for g, q in zip(guesses, qs)]
