"""Requests, their sequences and what the engine hands back (:class:`RequestOutput`).

A request starts with one sequence (its prompt). At its first token it forks into ``params.width`` sequences
(n > 1, best_of, beam search) that share the prompt's blocks. Each sequence keeps all its tokens, so a preempted
request is recomputed from them (prefix caching finds what is still cached).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from titan_mm.registry import ImageSplit
from titan_mm.serve.core.block_manager import BlockTable
from titan_mm.serve.sampling_params import SamplingParams


PENDING = -1
"""A token sampled on the device and not read back yet (serve.async_scheduling): the last token of a sequence
whose next step was scheduled before its tokens reached the host. The runner feeds it from the device."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Image:
    """One image or video of a prompt, processed: where its tokens sit in the expanded prompt and its patches."""

    start: int
    end: int
    """Its tokens at prompt positions start .. end-1."""
    pixel_values: torch.Tensor
    """[patches, patch_dim] float32 (CPU)."""
    grid_thw: torch.Tensor
    """[1, 3] int64 (CPU)."""
    key: int
    """Content hash (kind, pixels and grid): part of the prefix keys of the blocks it overlaps."""
    kind: str = "image"
    """"image" or "video" (pixel_values_videos / video_grid_thw; its span holds its whole placeholder, frame
    groups and their timestamps included)."""
    split: ImageSplit | None = None
    """A family of image splits (DataNeeds.splits): the image as its tokens, tensors and attention span
    (pixel_values and grid_thw are then empty)."""


@dataclass
class Audio:
    """One audio clip of a prompt, processed: where its pad tokens sit in the expanded prompt and its log-mel
    features (titan_mm.data.audio, the family's front end)."""

    start: int
    end: int
    """Pad tokens at prompt positions start .. end-1 (one per output token of the family's audio tower)."""
    features: torch.Tensor
    """[frames, n_mels] float32 (CPU)."""
    key: int
    """Content hash (features): part of the prefix keys of the blocks it overlaps."""


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int]
    """Prompt then generated tokens."""
    num_prompt: int
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    """Tokens whose k/v are in the cache."""
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    text: str = ""
    """Detokenized output, cut before a stop string."""
    detok_offsets: tuple[int, int] = (0, 0)
    """Incremental detokenization: output tokens [a, b) are the context of the next tokens' text, and text holds
    the decoding of output[:b]."""
    detok_tail: bytes = b""
    """A byte-level tokenizer's bytes of output[:b] after the last whole UTF-8 character (not in ``text`` yet)."""
    sent_text: int = 0
    sent_tokens: int = 0
    """How much of text / output the previous RequestOutput held (the deltas)."""
    draft_computed: int = 0
    """Speculative decoding with a draft model: tokens whose k/v the draft's pool holds."""
    pending: torch.Tensor | None = None
    """Beam search: the logprobs [V] at the end of this beam, waiting for the other beams of the step."""
    state_slot: int | None = None
    """Linear-attention families: the sequence's slot of the state pool while it runs (None: none taken)."""
    _output: list[int] = field(default_factory=list, repr=False)

    @property
    def output(self) -> list[int]:
        """The generated tokens: one list, extended as ``tokens`` grows (tokens are only appended), so a step
        costs O(new tokens), not a slice of the whole output per use. Read it; never mutate it."""
        o, n = self._output, len(self.tokens) - self.num_prompt
        if len(o) != n:
            o.extend(self.tokens[self.num_prompt + len(o):])
        return o

    def put(self, token: int) -> None:
        """The token its last step sampled: it takes the place of a :data:`PENDING` token, else is appended."""
        if self.tokens[-1] != PENDING:
            self.tokens.append(token)
            return
        self.tokens[-1] = token
        if len(self._output) == len(self.tokens) - self.num_prompt:
            self._output[-1] = token

    def drop_pending(self) -> None:
        """A sequence that ended before its pending token was read: the token is not part of it."""
        if self.tokens[-1] == PENDING:
            self.tokens.pop()
            del self._output[len(self.tokens) - self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    deadline_exceeded: bool = False
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted / proposed guesses of speculative decoding (None: nothing proposed)."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.first_scheduled

    @property
    def decode_s(self) -> float | None:
        return None if self.finished is None or self.first_token is None else self.finished - self.first_token


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    """The expanded prompt (one pad token per merged visual token)."""
    params: SamplingParams
    priority: int
    deadline: float | None
    """Absolute time (the engine's clock) after which the request is dropped."""
    metrics: RequestMetrics
    seqs: list[Sequence]
    images: list[Image] = field(default_factory=list)
    """The prompt's images and videos, in prompt order."""
    positions: torch.Tensor | None = None
    """[axes, len(prompt)] positions of the prompt: M-RoPE's, or a family's image splits' (None: 1-D positions
    that count the tokens)."""
    rope_delta: int = 0
    """Position of token p >= len(prompt) is p + rope_delta (on every axis)."""
    status: Status = Status.WAITING
    beam: object | None = None
    """titan_mm.serve.beam.BeamState of a beam-search request."""
    forked: bool = False
    abort_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end a sequence: params.stop_token_ids, and the model's EOS tokens unless ignore_eos."""
    audios: list[Audio] = field(default_factory=list)
    """The prompt's audio clips, in prompt order."""
    media: list[Image | Audio] = field(init=False, repr=False)
    """Every media span of the prompt (what a chunk never cuts and a block's prefix key includes): made once, as
    the scheduler and the runner read it for every row of every step."""

    def __post_init__(self):
        self.media = [*self.images, *self.audios]

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def seats(self) -> int:
        """Sequences it counts against max_num_seqs: all it will run (beam search: always its width)."""
        return len(self.live) if self.forked and self.beam is None else self.params.width

    @property
    def sort_key(self) -> tuple:
        """Served first: higher class (lower number), then earliest deadline, then arrival."""
        return (self.priority, self.deadline if self.deadline is not None else float("inf"), self.metrics.arrival,
                self.request_id)


class CompletionOutput:
    """One sequence's output so far. ``token_ids`` and ``logprobs`` hold the sequence's own lists (which only grow)
    and the lengths they had, and copy that prefix when first read: a streamed output is mostly read for its
    deltas only, and copying the whole output into each one costs O(length) per token (and the garbage
    collector's walks over those copies)."""

    __slots__ = ("index", "text", "new_token_ids", "new_text", "finish_reason", "cumulative_logprob", "_ids", "_lps",
                 "_lens")

    def __init__(self, index: int, token_ids: list[int], text: str, new_token_ids: list[int], new_text: str,
                 logprobs: list[dict[int, float]] | None, finish_reason: str | None, cumulative_logprob: float):
        self.index = index
        self.text = text
        """The text so far (a stop string and what follows it left out)."""
        self.new_token_ids = new_token_ids
        """The tokens since this request's previous output."""
        self.new_text = new_text
        """The text since the previous output (text that may still turn out to start a stop string is held back)."""
        self.finish_reason = finish_reason
        """"stop" | "length" | "abort", None while running."""
        self.cumulative_logprob = cumulative_logprob
        self._ids, self._lps = token_ids, logprobs
        self._lens = (len(token_ids), len(logprobs) if logprobs is not None else 0)  # None: copied

    def as_index(self, index: int) -> CompletionOutput:
        """This output as choice ``index`` (greedy n > 1: one sequence stands for n identical outputs)."""
        c = CompletionOutput.__new__(CompletionOutput)
        for k in self.__slots__:
            setattr(c, k, getattr(self, k))
        c.index = index
        return c

    def _copy(self) -> None:
        if self._lens is not None:
            n, k = self._lens
            self._ids, self._lps, self._lens = self._ids[:n], None if self._lps is None else self._lps[:k], None

    @property
    def token_ids(self) -> list[int]:
        """Every generated token so far (a stop token included)."""
        self._copy()
        return self._ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        self._copy()
        return self._lps

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, token_ids={self.token_ids}, text={self.text!r}, "
                f"new_token_ids={self.new_token_ids}, new_text={self.new_text!r}, logprobs={self.logprobs}, "
                f"finish_reason={self.finish_reason!r}, cumulative_logprob={self.cumulative_logprob})")


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics


def now() -> float:
    return time.monotonic()
