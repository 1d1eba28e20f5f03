"""What a request asks of decoding: :class:`SamplingParams` (vLLM's ``sampling_params``), checked once by
:meth:`SamplingParams.validate`. The sampler that runs them is titan_mm.serve.runner.sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_mm.serve.errors import BadRequest

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    """Most tokens to generate; None: until max_model_len."""
    temperature: float = 1.0
    """0: greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1: all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p x the most likely one."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the prompt or the output (HF's rule)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same output, whatever else runs (output i of n uses
    seed + i)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the output ends before the first one (finish_reason "stop")."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end the output (kept in token_ids), besides the model's EOS tokens."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    logprobs: int | None = None
    """Per generated token, its logprob and the ``logprobs`` most likely tokens' (0: only its own)."""
    n: int = 1
    """Outputs returned (greedy: n identical ones, as OpenAI's API answers)."""
    best_of: int | None = None
    """Sequences generated (default n): beam search's width, or with sampling the n of best_of with the highest
    cumulative logprob are returned."""
    use_beam_search: bool = False
    """Beam search over the model's logprobs (HF's algorithm; temperature, top-k/p, min-p and penalties do not
    apply)."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores sum(logprobs) / generated_len ** length_penalty."""
    early_stopping: bool = False
    """Beam search: stop as soon as best_of beams finished (False: while a running beam could still win)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""

    @property
    def width(self) -> int:
        """Sequences a request runs: best_of, else n; greedy sampling runs one, whose output stands for the n
        identical ones."""
        if self.greedy and not self.use_beam_search:
            return 1
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Repetition, presence or frequency penalties: the next token depends on every token before it."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise :class:`BadRequest` naming the first field out of range (the engine checks vocabulary ids and
        lengths against the model)."""

        def num(name, v, lo=None, hi=None, lo_open=False, integer=False, none=False):
            if v is None and none:
                return
            ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok_type:
                raise BadRequest(name, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise BadRequest(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and v > hi:
                raise BadRequest(name, f"must be <= {hi}, got {v}")

        num("max_tokens", self.max_tokens, 1, integer=True, none=True)
        num("temperature", self.temperature, 0.0)
        num("top_k", self.top_k, -1, integer=True)
        num("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        num("min_p", self.min_p, 0.0, 1.0)
        num("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        num("seed", self.seed, integer=True, none=True)
        num("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True, none=True)
        num("n", self.n, 1, integer=True)
        num("best_of", self.best_of, 1, integer=True, none=True)
        num("length_penalty", self.length_penalty)
        if self.best_of is not None and self.best_of < self.n:
            raise BadRequest("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise BadRequest("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise BadRequest("stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if self.use_beam_search and self.stop:
            raise BadRequest("stop", "stop strings do not combine with beam search; use stop_token_ids")
