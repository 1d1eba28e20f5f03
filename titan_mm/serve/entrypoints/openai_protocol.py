"""The OpenAI request bodies of /v1/completions and /v1/chat/completions as strict pydantic models.

A body is read with :func:`parse_body`. Every mistake becomes one :class:`RequestError` that names the field, as
OpenAI's API does:
- a field the API does not have -> ``unknown field 'max_token'; did you mean 'max_tokens'?``
- an OpenAI field this server does not run (tools, response_format, ...) -> ``'tools' is not supported``
- a wrong JSON type -> ``'max_tokens' must be an integer, got a string`` (strict: "5" is not 5, 5.0 is not 5)
This module checks shapes and JSON types only. Value ranges (temperature >= 0, n >= 1, ...) are checked once, by
``SamplingParams.validate``; prompt lengths against the context by the engine.

Beyond OpenAI's fields, both requests take vLLM's sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``use_beam_search``) and the engine's admission
fields ``priority`` and ``deadline_s``.
"""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from titan_mm.serve.errors import BadRequest


class RequestError(BadRequest):
    """A body the server refuses with HTTP 400 before the engine sees it: ``field`` is its path
    (``messages[0].content[1]``, empty for the whole body), ``message`` the whole line that names it."""

    def __init__(self, field: str, message: str, code: str = "invalid_request"):
        super().__init__(field, message)
        self.code = code


# OpenAI fields this server does not implement: named as such, not as unknown
UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
               "audio", "modalities", "prediction", "web_search_options", "reasoning_effort", "verbosity"}
_JSON_TYPE = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object", type(None): "null"}


# A string stands for a one-element list (stop, content), as OpenAI accepts; kept out of pydantic unions so that
# an error names the one expected type.
def _as_list(v: Any) -> Any:
    if v is None or isinstance(v, list):
        return v
    if isinstance(v, str):
        return [v]
    raise PydanticCustomError("stop_type", "must be a string or an array of strings")


def _text_part(v: Any) -> Any:
    if v is None or isinstance(v, list):
        return v
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    raise PydanticCustomError("content_type", "must be a string or an array of content parts")


def _prompt(v: Any) -> list[str] | list[list[int]]:
    """A completions prompt as a list of prompts: strings, or token-id lists."""
    if v in ("", []) or isinstance(v, list) and any(x in ("", []) for x in v):  # nothing to continue from
        raise PydanticCustomError("empty", "must not be empty (nor any prompt in its list): give some text or "
                                  "token ids")
    if isinstance(v, str):
        return [v]
    ok_int = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return v
        if all(ok_int(x) for x in v):
            return [v]
        if all(isinstance(x, list) and all(ok_int(t) for t in x) for x in v):
            return v
    raise PydanticCustomError("prompt_type", "must be a string, a list of strings, a list of token ids or a list "
                              "of token-id lists")


def _only_empty(why: str) -> AfterValidator:
    """A field the server does not implement: empty or null passes, anything else is refused with ``why``."""
    def check(v):
        if v:
            raise PydanticCustomError("unsupported", why)
        return v
    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ImageURL(_Strict):
    url: str
    """A ``data:image/...;base64,...`` URI (the server fetches nothing)."""
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(_Strict):
    url: str
    """A ``data:video/...;base64,...`` URI of an encoded clip (mp4, webm, ...: what PyAV decodes; the server fetches
    nothing); its frames are sampled as in training."""


class InputAudio(_Strict):
    data: str
    """The encoded clip in base64, as OpenAI sends it (no ``data:`` prefix); decoded by PyAV, resampled to 16 kHz
    mono and turned into log-mel features as in training."""
    format: Literal["wav", "flac"]


PAYLOADS = ("text", "image_url", "video_url", "input_audio")
"""A content part's payload fields: the one its type names is required, the others refused."""


class ContentPart(_Strict):
    type: Literal["text", "image_url", "video_url", "input_audio"]
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="after")
    def _one_payload(self):
        if getattr(self, self.type) is None:
            raise PydanticCustomError("missing_payload", f"a '{self.type}' part needs '{self.type}'")
        for other in PAYLOADS:
            if other != self.type and getattr(self, other) is not None:
                raise PydanticCustomError("extra_payload", f"a '{self.type}' part takes no '{other}'")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[ContentPart] | None, BeforeValidator(_text_part)] = None
    name: str | None = None
    tool_call_id: str | None = None


class _Sampling(_Strict):
    """The sampling and admission fields both endpoints share (None: the engine's default)."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Annotated[list[str] | None, BeforeValidator(_as_list)] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: Annotated[dict[str, float] | None,
                          _only_empty("is not supported by this server (only empty or null)")] = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    use_beam_search: bool | None = None
    # admission control (titan_mm.serve.engine)
    priority: int | None = None
    deadline_s: float | None = None
    """Seconds from arrival after which the request is dropped unfinished."""

    _SHARED = ("temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "seed", "top_k",
               "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "use_beam_search")

    def sampling_fields(self) -> dict[str, Any]:
        """The fields by their ``SamplingParams`` names (absent and null fields keep its defaults, except each
        endpoint's own defaults: 16 tokens for completions, up to the context for chat)."""
        out = {k: getattr(self, k) for k in self._SHARED if getattr(self, k) is not None}
        return out | self._own_fields()  # each endpoint's own fields (subclasses)

    def param_of(self, field: str) -> str:
        """The request's name for a ``SamplingParams`` / engine field (to name it in a 400)."""
        return field


class CompletionRequest(_Sampling):
    prompt: Annotated[list[str] | list[list[int]], BeforeValidator(_prompt)]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: Annotated[str | None, _only_empty("(insertion) is not supported by this server")] = None

    def _own_fields(self) -> dict[str, Any]:
        return {"max_tokens": 16 if self.max_tokens is None else self.max_tokens,  # OpenAI's default
                "logprobs": self.logprobs, "best_of": self.best_of}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise PydanticCustomError("empty", "must hold at least one message")
        return v

    def _own_fields(self) -> dict[str, Any]:
        top = self.top_logprobs or 0
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return {"max_tokens": mt, "logprobs": top if self.logprobs else None}  # max_tokens None: to the context

    def param_of(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs", "prompt": "messages"}.get(field, field)


def _path(loc: tuple) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _explain(err: dict) -> RequestError:
    loc = tuple(err["loc"])
    kind = err["type"]
    path = _path(loc)
    if kind == "json_invalid":
        return RequestError("", f"the body is not valid JSON ({err['ctx']['error']})", "invalid_json")
    if not loc:
        got = _JSON_TYPE.get(type(err["input"]), "a value")
        return RequestError("", f"the body must be a JSON object, got {got}")
    name = loc[-1]
    if kind == "extra_forbidden":
        if name in UNSUPPORTED:
            return RequestError(path, f"{path!r} is not supported by this server", "unsupported")
        known = {f for c in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, ImageURL,
                             VideoURL, InputAudio, StreamOptions) for f in c.model_fields}
        near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return RequestError(path, f"unknown field {path!r}{hint}", "unknown_field")
    if kind == "missing":
        return RequestError(path, f"{path!r} is required", "missing")
    msg = err["msg"].replace("Input should be", "must be")
    if kind.endswith("_type"):
        msg += f", got {_JSON_TYPE.get(type(err['input']), type(err['input']).__name__)}"
    sep = " " if msg.startswith("must") else ": "
    return RequestError(path, f"{path!r}{sep}{msg}", "invalid_type" if kind.endswith("_type") else kind)


def parse_body(cls: type[BaseModel], body: bytes | str) -> BaseModel:
    """The request ``cls`` from a JSON body; the first mistake as a :class:`RequestError`."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        raise _explain(e.errors(include_url=False)[0]) from None


def error_body(message: str, param: str | None, code: str, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
