"""Requests in: the checks of a request that can never run as given (:class:`BadRequest`), its images, videos
and audio clips expanded by the family's processor, chat messages through the training chat template, and
admission (:class:`QueueFull`: the waiting queue is full or the token rate is spent). vLLM v1's input processor."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_mm.config import Data
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import SkipSample
from titan_mm.serve.core.beam import BeamState
from titan_mm.serve.core.block_manager import BlockManager
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.errors import BadRequest, QueueFull
from titan_mm.serve.core.media import after_media, expand_audio, expand_media
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.sequence import Request, RequestMetrics, Sequence


class InputProcessor:
    def __init__(self, cfg: ServeConfig, vocab_size: int, needs, data: Data, tokenizer, eos: frozenset[int],
                 max_model_len: int, blocks: BlockManager, seq_ids, seq_generator: Callable, clock: Callable):
        self.cfg, self.V, self.needs, self.data, self.tokenizer = cfg, vocab_size, needs, data, tokenizer
        self.eos, self.max_model_len, self.blocks, self.seq_ids = eos, max_model_len, blocks, seq_ids
        self.seq_generator, self.clock = seq_generator, clock
        self._bucket = cfg.token_rate_limit * cfg.token_rate_burst_s
        self._bucket_t = clock()

    def make(self, request_id, prompt_ids, params, images, videos, priority, deadline_s,
             t: float | None = None, audios=None) -> tuple[Request, int]:
        """(the checked, expanded request arriving at ``t`` (default: now, after its checks), its tokens: prompt +
        max_tokens x width); BadRequest for one that can never run. The same on every tp rank."""
        if not isinstance(request_id, str) or not request_id:
            raise BadRequest("request_id", f"must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise BadRequest("params", f"must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        V, levels = self.V, self.cfg.priority_levels
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise BadRequest("prompt", "must be a non-empty list of token ids")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise BadRequest("prompt", f"token ids must be ints in 0 .. {V - 1} (the model's vocabulary), got {bad[0]!r}")
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise BadRequest("stop_token_ids", f"{bad[0]} is outside the vocabulary (0 .. {V - 1})")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority < levels:
            raise BadRequest("priority", f"must be an int in 0 .. {levels - 1} (0 first), got {priority!r}")
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                       or deadline_s <= 0):
            raise BadRequest("deadline_s", f"must be a positive number of seconds, got {deadline_s!r}")
        for field, given in (("images", images), ("videos", videos), ("audios", audios)):
            if given is not None and not isinstance(given, (list, tuple)):
                raise BadRequest(field, f"must be a list of {field}, got {type(given).__name__}")
        prompt, clips = expand_audio(list(prompt_ids), list(audios or []), self.needs, self.data)
        prompt, imgs, positions, delta = expand_media(prompt, list(images or []), list(videos or []),
                                                      self.needs, self.data, self.tokenizer)
        clips = after_media(clips, imgs)
        L, cap = len(prompt), self.max_model_len
        if L >= cap:
            raise BadRequest("prompt", f"has {L} tokens{' after expanding its media' if imgs or clips else ''}; the "
                             f"engine takes at most {cap - 1} (max_model_len {cap} includes the output)")
        max_new = params.max_tokens if params.max_tokens is not None else cap - L
        if L + max_new > cap:
            raise BadRequest("max_tokens", f"prompt ({L}) + max_tokens ({max_new}) exceeds max_model_len ({cap}); "
                             f"ask for at most {cap - L} tokens")
        need = params.width * self.blocks.blocks_for(L + max_new)
        if need > self.blocks.num_blocks:
            raise BadRequest("max_tokens", f"{params.width} sequence(s) of {L + max_new} tokens need up to {need} KV "
                             f"blocks but the pool holds {self.blocks.num_blocks}; lower max_tokens or n / best_of")
        t = self.clock() if t is None else t
        seq = Sequence(next(self.seq_ids), list(prompt), L, generator=self.seq_generator(params, 0))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        req = Request(request_id, prompt, params, priority, None if deadline_s is None else t + deadline_s,
                      RequestMetrics(arrival=t), [seq], imgs, positions, delta, stop_ids=stop_ids, audios=clips)
        if params.use_beam_search:
            req.beam = BeamState(params.width, stop_ids, L + max_new)
        return req, L + max_new * params.width

    def admit(self, waiting: int, cost: int, t: float) -> None:
        """QueueFull when ``waiting`` requests already wait, or ``cost`` tokens arriving at ``t`` would overdraw
        the token rate (call under the engine's lock)."""
        cfg = self.cfg
        if waiting >= cfg.max_queue_len:
            raise QueueFull(f"{waiting} requests are waiting (serve.max_queue_len={cfg.max_queue_len}); retry later")
        if cfg.token_rate_limit:
            rate = cfg.token_rate_limit
            self._bucket = min(rate * cfg.token_rate_burst_s, self._bucket + (t - self._bucket_t) * rate)
            self._bucket_t = t
            if self._bucket < 0:
                raise QueueFull(f"the token rate limit ({rate:g} tokens/s) is spent; retry in "
                                f"{-self._bucket / rate:.1f}s")
            self._bucket -= cost

    def chat_media(self, messages: list[dict]) -> tuple[list[int], list, list, list]:
        """(prompt ids, images, videos, audios) of OpenAI-style chat ``messages`` through the family's chat template
        (the processors' renderer, as in training), ending with the assistant's turn opened; a family of image
        splits lays the chat out itself (DataNeeds.splits.chat: its training layout)."""
        try:
            sample = parse_record({"messages": messages})
            if self.needs.splits is not None:
                ids = self.needs.splits.chat(sample, self.tokenizer)
                return ids, [p.ref for m in sample.messages for p in m.parts if p.type == "image"], [], []
            text, _, media = Processor(self.tokenizer, ProcessorConfig(self.data, self.needs)).render(
                sample, add_generation_prompt=True)
        except SkipSample as e:
            raise BadRequest("messages", str(e)) from None
        if any(m.use_audio_in_video for m in media):
            raise BadRequest("messages", "a video part with use_audio_in_video is not served yet")
        return (self.tokenizer.encode(text), *([m.ref for m in media if m.type == kind]
                                               for kind in ("image", "video", "audio")))


def seq_generator(device: torch.device) -> Callable[[SamplingParams, int], torch.Generator | None]:
    """Output i of a seeded request draws from its own generator, seeded seed + i (None: the engine's)."""
    def make(params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device).manual_seed(params.seed + index)
    return make
