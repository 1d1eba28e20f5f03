"""The OpenAI request bodies (serve/entrypoints/openai_protocol.py): every mistake is one RequestError that names the
field; a valid body maps onto SamplingParams with the endpoint's defaults."""

import json

import pytest

from titan_mm.serve.errors import BadRequest
from titan_mm.serve.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                                                        parse_body)
from titan_mm.serve.sampling_params import SamplingParams

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def _err(cls, body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_body(cls, body if isinstance(body, str) else json.dumps(body))
    assert isinstance(e.value, BadRequest)  # the server answers every BadRequest with 400
    return e.value


@pytest.mark.parametrize("cls,body,field,words", [
    (CompletionRequest, COMP | {"max_token": 5}, "max_token", ["unknown field", "did you mean 'max_tokens'"]),
    (ChatCompletionRequest, CHAT | {"tools": []}, "tools", ["not supported"]),
    (CompletionRequest, COMP | {"max_tokens": "5"}, "max_tokens", ["integer", "got a string"]),
    (CompletionRequest, COMP | {"max_tokens": 5.0}, "max_tokens", ["integer", "got a number"]),
    (CompletionRequest, COMP | {"temperature": True}, "temperature", ["number", "got a boolean"]),
    (CompletionRequest, COMP | {"prompt": [1, "a"]}, "prompt", ["token ids"]),
    (CompletionRequest, COMP | {"prompt": []}, "prompt", ["must not be empty"]),
    (CompletionRequest, {"model": "m"}, "prompt", ["required"]),
    (CompletionRequest, COMP | {"suffix": "x"}, "suffix", ["not supported"]),
    (CompletionRequest, COMP | {"logit_bias": {"1": 3}}, "logit_bias", ["not supported"]),
    (ChatCompletionRequest, CHAT | {"messages": []}, "messages", ["at least one message"]),
    (ChatCompletionRequest, CHAT | {"messages": {}}, "messages", ["array", "got an object"]),
    (ChatCompletionRequest, CHAT | {"stop": 5}, "stop", ["string or an array of strings", "got an integer"]),
    (ChatCompletionRequest, CHAT | {"stop": ["a", 1]}, "stop[1]", ["string", "got an integer"]),
    (ChatCompletionRequest, CHAT | {"stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     ["boolean"]),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role",
     ["'user'"]),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     ["a string or an array of content parts"]),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]", ["needs 'text'"]),
    (ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": 3}}]}]},
     "messages[0].content[1].image_url.url", ["string", "got an integer"]),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content[0].type", ["'text', 'image_url'", "'video_url'"]),
])
def test_bad_bodies_name_the_field(cls, body, field, words):
    e = _err(cls, body)
    assert e.field == field, e.message
    assert repr(field) in e.message and "\n" not in e.message
    for w in words:
        assert w in e.message, e.message


def test_bad_json_and_non_objects():
    assert "not valid JSON" in _err(CompletionRequest, '{"model": ').message
    e = _err(ChatCompletionRequest, "[1, 2]")
    assert e.field == "" and "JSON object, got an array" in e.message


def test_prompts_normalize_to_lists():
    assert parse_body(CompletionRequest, json.dumps(COMP)).prompt == ["hi"]
    assert parse_body(CompletionRequest, json.dumps(COMP | {"prompt": ["a", "b"]})).prompt == ["a", "b"]
    assert parse_body(CompletionRequest, json.dumps(COMP | {"prompt": [1, 2]})).prompt == [[1, 2]]
    assert parse_body(CompletionRequest, json.dumps(COMP | {"prompt": [[1], [2, 3]]})).prompt == [[1], [2, 3]]


def test_sampling_fields_and_defaults():
    # completions: OpenAI's 16-token default; nulls keep the SamplingParams defaults
    c = parse_body(CompletionRequest, json.dumps(COMP | {"temperature": None, "stop": "x", "top_k": 5, "n": 2,
                                                          "logprobs": 2}))
    p = SamplingParams(**c.sampling_fields())
    assert (p.max_tokens, p.temperature, p.stop, p.top_k, p.n, p.logprobs) == (16, 1.0, ["x"], 5, 2, 2)
    # chat: no max_tokens -> up to the context (None); top_logprobs only when logprobs is true
    k = parse_body(ChatCompletionRequest, json.dumps(CHAT | {"top_logprobs": 3}))
    p = SamplingParams(**k.sampling_fields())
    assert (p.max_tokens, p.logprobs) == (None, None)
    k = parse_body(ChatCompletionRequest, json.dumps(CHAT | {"logprobs": True, "top_logprobs": 3,
                                                              "max_completion_tokens": 7, "seed": 1}))
    p = SamplingParams(**k.sampling_fields())
    assert (p.max_tokens, p.logprobs, p.seed) == (7, 3, 1)
    # an engine field in a 400 goes by the request's name for it
    assert (k.param_of("logprobs"), k.param_of("max_tokens"), k.param_of("prompt")) == \
        ("top_logprobs", "max_completion_tokens", "messages")
    assert c.param_of("temperature") == "temperature"


def test_value_ranges_are_sampling_params_checks():
    """The protocol checks types only; ranges come from SamplingParams.validate (one check, one place)."""
    c = parse_body(CompletionRequest, json.dumps(COMP | {"temperature": -1.0}))
    with pytest.raises(BadRequest) as e:
        SamplingParams(**c.sampling_fields()).validate()
    assert e.value.field == "temperature"
