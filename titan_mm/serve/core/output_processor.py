"""The output processor: what a sampled token means for its sequence (logprobs, stop tokens, length, incremental
text, stop strings) and what the engine hands back (:class:`RequestOutput`: deltas, held-back text, the n best of
best_of and beam search). vLLM v1's OutputProcessor; the scheduler calls :meth:`OutputProcessor.take` per token
(:meth:`Scheduler.update_from_output`) and frees what it ends."""

from __future__ import annotations

from collections.abc import Callable

from titan_mm.data.tokenizer import Tokenizer
from titan_mm.serve.runner.sampler import Sampled
from titan_mm.serve.core.sequence import CompletionOutput, Request, RequestOutput, Sequence, Status, now


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, clock: Callable[[], float] = now):
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer)
        self.max_model_len = max_model_len
        self.clock = clock

    def ends(self, req: Request, n_tokens: int, n_output: int) -> bool:
        """A sequence of ``n_tokens`` tokens, ``n_output`` of them generated, is at its length limit."""
        return n_output >= (req.params.max_tokens or self.max_model_len) or n_tokens >= self.max_model_len

    def take(self, req: Request, seq: Sequence, got: Sampled) -> bool:
        """``got`` joins ``seq``: its logprobs, text and stop conditions; -> whether it ended the sequence."""
        p = req.params
        if req.metrics.first_token is None:
            req.metrics.first_token = self.clock()
        seq.put(got.token)
        seq.cum_logprob += got.logprob
        if p.logprobs is not None:
            seq.logprobs.append(got.top)
        out = seq.output
        stop = got.token in req.stop_ids
        length = self.ends(req, len(seq.tokens), len(out))
        text = seq.text + self.detok.new_text(seq, out, p.skip_special_tokens, final=stop or length)
        if p.stop and not stop:
            lo = max(0, len(seq.text) - max(map(len, p.stop)))
            hits = [i for i in (text.find(s, lo) for s in p.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                stop = True
        seq.text = text
        if stop or length:
            seq.finish_reason = "stop" if stop else "length"
        return seq.finished

    def output(self, req: Request) -> RequestOutput:
        p = req.params
        done = req.status is Status.FINISHED
        if req.beam is not None or p.width > p.n:
            comps = self._final(req) if done else []
        else:
            comps = [self._completion(i, s, done, p.stop) for i, s in enumerate(req.seqs)]
            if len(comps) < p.n:  # greedy: its one sequence stands for the n identical outputs
                comps = [comps[0].as_index(i) for i in range(p.n)]
        return RequestOutput(req.request_id, comps, req.prompt, done, req.metrics)

    @staticmethod
    def _completion(index: int, s: Sequence, done: bool, stops: list[str]) -> CompletionOutput:
        out = s.output
        hold = 0 if s.finished or done else _held_back(s.text, stops)
        shown = s.text[: len(s.text) - hold]
        comp = CompletionOutput(index, out, shown, out[s.sent_tokens:], shown[s.sent_text:], s.logprobs or None,
                                s.finish_reason, s.cum_logprob)  # token_ids and logprobs: copied when read
        s.sent_tokens, s.sent_text = len(out), max(s.sent_text, len(shown))
        return comp

    def _final(self, req: Request) -> list[CompletionOutput]:
        """The n best of a beam search or of best_of samples (by cumulative logprob), once it finished."""
        p = req.params
        if req.beam is not None:
            hyps = req.beam.finished[: p.n]
            comps = []
            for i, h in enumerate(hyps):
                reason = "stop" if h.output and h.output[-1] in req.beam.eos else "length"
                text = self.tokenizer.decode(h.output, skip_special_tokens=p.skip_special_tokens)
                comps.append(CompletionOutput(i, h.output, text, h.output, text, None, reason, h.cum_logprob))
            if not comps:  # aborted before any beam finished
                comps = [CompletionOutput(0, [], "", [], "", None, "abort", 0.0)]
            return comps
        best = sorted(req.seqs, key=lambda s: -s.cum_logprob)[: p.n]
        return [CompletionOutput(i, s.output, s.text, list(s.output), s.text, s.logprobs or None, s.finish_reason,
                                 s.cum_logprob) for i, s in enumerate(best)]


class Detokenizer:
    """Incremental detokenization. A byte-level tokenizer's (Qwen's) tokens are bytes: a sequence's new tokens
    add their bytes to the ones still waiting, and what ends on a whole UTF-8 character is decoded; the rest waits
    (``Sequence.detok_tail``), all at O(1) per token without a tokenizer call. Others go as vLLM's: the newest
    tokens are decoded after the tokens since the previous emission, as context, and held back while they end
    inside a UTF-8 character (until the ``final`` token); the context's text is cached per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer, Tokenizer) and tokenizer.byte_level
        self._one: dict[tuple[int, bool], str] = {}  # (token, skip_special_tokens) -> its text
        self._pieces: dict[tuple[int, bool], bytes] = {}  # byte-level: (token, skip_special_tokens) -> its bytes

    def decode(self, ids: list[int], skip: bool) -> str:
        if len(ids) != 1:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        key = (ids[0], skip)
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return text

    def _bytes(self, token: int, skip: bool) -> bytes:
        key = (token, skip)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = self.tokenizer.token_bytes(token, skip)
        return got

    def new_text(self, seq: Sequence, out: list[int], skip: bool, final: bool) -> str:
        """The text ``seq``'s newest tokens add (``out``: its output); moves its offsets when there is some."""
        a, b = seq.detok_offsets
        if self.byte_level:
            tail = seq.detok_tail + b"".join([self._bytes(t, skip) for t in out[b:]])
            cut = len(tail) if final else _whole_chars(tail)
            seq.detok_offsets, seq.detok_tail = (b, len(out)), tail[cut:]
            return tail[:cut].decode("utf-8", "replace")
        before = self.decode(out[a:b], skip)
        now = self.decode(out[a:], skip)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        seq.detok_offsets = (b, len(out))
        return now[len(before):]


def _whole_chars(b: bytes) -> int:
    """The length of ``b`` less a last UTF-8 character that more bytes could still complete. Decoding stops
    there and goes on from there later: a cut before a lead byte never changes how the bytes before it decode."""
    for k in range(1, min(4, len(b)) + 1):
        c = b[-k]
        if c & 0xC0 != 0x80:  # a lead byte (or ASCII): the character's length from it
            need = 2 if 0xC2 <= c <= 0xDF else 3 if 0xE0 <= c <= 0xEF else 4 if 0xF0 <= c <= 0xF4 else 1
            return len(b) - k if need > k else len(b)
    return len(b)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to show yet: an incomplete UTF-8 character, or the start of a stop
    string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
