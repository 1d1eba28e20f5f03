"""Beam search in the engine's loop, the algorithm of transformers' ``generate(num_beams=W)``.

Each step takes the logprobs [W, V] at the end of every running beam (they may come from different forwards: a
beam waits in ``Sequence.pending`` until its siblings are computed) and keeps the K = max(2, 1 + #eos) x W best
continuations of score = sum of logprobs. Continuations that end (an EOS token, or max length) and rank among the
first W become finished hypotheses scored sum / generated_len ** length_penalty (the best W are kept); the best W
that do not end are the next running beams. The search stops when no running beam can beat the worst of W
finished hypotheses (HF's heuristic with ``early_stopping=False``), when W finished (``early_stopping=True``), or
when every continuation ends. Running beams are the request's sequences: a beam chosen twice is forked (blocks
shared, copy-on-write), a beam not chosen is freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titan_mm.serve.core.sequence import Request, Sequence


@dataclass
class Hypothesis:
    score: float
    output: list[int]
    cum_logprob: float


@dataclass
class BeamState:
    width: int
    eos: frozenset[int]
    max_len: int
    """Prompt + generated tokens at which every continuation ends."""
    finished: list[Hypothesis] = field(default_factory=list)
    can_improve: bool = True
    done: bool = False

    @property
    def k(self) -> int:
        return max(2, 1 + len(self.eos)) * self.width


def beam_step(req: Request, fork, free) -> None:
    """Advance ``req``'s beams by one token (every live beam has ``pending`` logprobs). ``fork(seq) -> Sequence``
    makes a child sharing seq's blocks; ``free(seq)`` drops a beam."""
    st: BeamState = req.beam
    p = req.params
    beams = req.live
    cur_len = len(beams[0].tokens)
    gen_len = cur_len + 1 - len(req.prompt)
    scores = torch.stack([b.pending for b in beams]) + torch.tensor([b.cum_logprob for b in beams],
                                                                    device=beams[0].pending.device)[:, None]
    V = scores.shape[1]
    top_s, top_i = scores.reshape(-1).topk(min(st.k, scores.numel()))
    cands = [(s, i // V, i % V) for s, i in zip(top_s.tolist(), top_i.tolist())]
    ends = [t in st.eos or cur_len + 1 >= st.max_len for _, _, t in cands]

    # finished hypotheses: ending continuations among the first W, unless the search can no longer improve
    full = len(st.finished) == st.width
    if st.can_improve and not (p.early_stopping and full):
        for r, ((s, b, t), e) in enumerate(zip(cands, ends)):
            if e and r < st.width:
                st.finished.append(Hypothesis(s / gen_len ** p.length_penalty, beams[b].output + [t], s))
        st.finished = sorted(st.finished, key=lambda h: -h.score)[: st.width]

    # the next running beams: the best W continuations that do not end
    keep = [(s, b, t) for (s, b, t), e in zip(cands, ends) if not e][: st.width]
    claimed = {b for _, b, _ in keep}
    for b, seq in enumerate(beams):  # dropped beams go first: live beams never exceed the width (state slots)
        seq.pending = None
        if b not in claimed:
            free(seq)
    moved: set[int] = set()
    nxt: list[tuple[Sequence, int, float]] = []
    for s, b, t in keep:
        seq = beams[b] if b not in moved else fork(beams[b])  # forks copy the parent before it moves on
        moved.add(b)
        nxt.append((seq, t, s))
    for seq, t, s in nxt:
        seq.tokens.append(t)
        seq.cum_logprob = s

    # stop?
    best_running = keep[0][0] / max(gen_len, 1) ** p.length_penalty if keep else float("-inf")
    full = len(st.finished) == st.width
    worst = min(h.score for h in st.finished) if full else float("-inf")
    st.can_improve = st.can_improve and best_running > worst
    st.done = not keep or not st.can_improve or (p.early_stopping and full)
