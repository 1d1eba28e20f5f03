"""Typed reading of an HF config.json: each family's reader checks the values it reads against their types before it
uses them, so a wrong type is one line naming the key, the value and the type wanted (transformers refuses them
too), never a silent default, a truthy string or a traceback from deep inside the model.

JSON's types: an int is an int (not a bool, not 64.0; a size at least 1), a float is an int or a float, a bool is
true / false, a dict is an object, a tuple / list is an array (each item checked); ``| None`` allows null. A family's
schema is the field types of its config dataclass (:func:`hf_types`) plus the keys HF spells in another form; nested
configs (``text_config``, ``vision_config``, ``audio_config``, ``thinker_config``) are checked inside
:func:`within`, which names the key from the top of the file (``text_config.hidden_size``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Union

from titan_mm.models.hf_io import HFCheckpointError


class HFConfigError(HFCheckpointError):
    """A config.json value of the wrong type: ``key`` (dotted from the top of the file), the value, the type wanted."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        shown = json.dumps(value, default=repr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        got = "" if value is None else f" is {_KINDS.get(type(value), type(value).__name__)}"
        super().__init__(f"{key} = {shown}{got}; it must be {expected} in config.json")


class PositiveInt(int):
    """A schema type: an int >= 1 (sizes and counts: a 0 or negative one fails deep inside the model otherwise)."""


_KINDS = {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list", dict: "a dict"}
_NAMES = {PositiveInt: ("a positive int", "positive ints"), int: ("an int", "ints"), float: ("a number", "numbers"),
          bool: ("a bool (true / false)", "bools"), str: ("a string", "strings"), dict: ("a dict", "dicts"),
          type(None): ("null", "nulls")}

# keys every HF config spells the same way, in the forms HF writes them (a family reads the list forms itself)
COMMON: dict[str, Any] = {
    "bos_token_id": int | None, "eos_token_id": int | list[int] | None, "pad_token_id": int | None,
    "rope_parameters": dict | None, "rope_scaling": dict | None, "rope_theta": float,
    "tie_word_embeddings": bool, "use_cache": bool, "attention_dropout": float, "dtype": str | None,
    "torch_dtype": str | None, "model_type": str,
    # sizes every tower names the same way (a family that lets one be null says so in its extra keys)
    "vocab_size": PositiveInt, "hidden_size": PositiveInt, "num_hidden_layers": PositiveInt,
    "num_attention_heads": PositiveInt, "num_key_value_heads": PositiveInt, "head_dim": PositiveInt,
    "depth": PositiveInt, "num_heads": PositiveInt, "d_model": PositiveInt, "encoder_layers": PositiveInt,
    "encoder_attention_heads": PositiveInt,
}
# the entries of rope_parameters / rope_scaling that HF's rope kinds read
ROPE: dict[str, Any] = {
    "rope_type": str, "type": str, "rope_theta": float, "factor": float, "partial_rotary_factor": float,
    "mrope_section": list[int], "mrope_interleaved": bool, "interleaved": bool,
    "original_max_position_embeddings": int, "attention_factor": float | None, "beta_fast": float,
    "beta_slow": float, "low_freq_factor": float, "high_freq_factor": float, "mscale": float, "mscale_all_dim": float,
    "short_factor": list[float] | None, "long_factor": list[float] | None, "truncate": bool,
}


def hf_types(cls: type, skip: Iterable[str] = (), **extra: Any) -> dict[str, Any]:
    """config.json key -> type: the fields of the config dataclass ``cls`` (less ``skip``: runtime fields, nested
    configs), then :data:`COMMON`, then ``extra`` (keys HF writes in another form than the field, or not a field)."""
    hints = typing.get_type_hints(cls)
    out = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in set(skip)}
    return {**out, **COMMON, **extra}


def check_hf(d: Mapping[str, Any], schema: Mapping[str, Any]) -> None:
    """Raise :class:`HFConfigError` for the first key of ``d`` that ``schema`` names whose value is not of its type;
    the rope dicts' entries are checked too. Keys the schema does not name are the family's business."""
    if not isinstance(d, Mapping):
        raise HFConfigError("(top level)", d, "a dict")
    for k, v in d.items():
        tp = schema.get(k)
        if tp is not None and not conforms(v, tp):
            raise HFConfigError(k, v, describe(tp))
    for k in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(k), dict):
            with within(k):
                check_hf(d[k], ROPE)


@contextlib.contextmanager
def within(key: str):
    """Name the keys of a nested config from the top of the file: an :class:`HFConfigError` raised inside gets
    ``key.`` in front of its key ("": none, for a config that is nested in some files and flat in others)."""
    try:
        yield
    except HFConfigError as e:
        if not key:
            raise
        raise HFConfigError(f"{key}.{e.key}", e.value, e.expected) from None


@contextlib.contextmanager
def part_of(d: Mapping[str, Any], model_type: str, key: str, part_type: str):
    """The dict to read: ``d[key]`` when ``d`` is a ``model_type`` config.json (a full Omni folder's
    ``thinker_config``, its model_type ``part_type`` unless it names one), else ``d`` itself; the keys of errors
    raised inside are named from the top of the file."""
    if d.get("model_type") != model_type:
        yield d
        return
    if key not in d:
        raise ValueError(f"a {model_type} config.json needs {key}; is the file complete?")
    check_hf(d, {key: dict})
    with within(key):
        yield {"model_type": part_type, **d[key]}


def conforms(v: Any, tp: Any) -> bool:
    """``v`` (a value json.load made) is of the type ``tp``, read as JSON's types (module docstring)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(conforms(v, a) for a in args)
    if tp is type(None):
        return v is None
    if tp is PositiveInt:
        return conforms(v, int) and v >= 1
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    if tp is dict or origin is dict:
        return isinstance(v, dict)
    if origin in (tuple, list):
        if not isinstance(v, (list, tuple)):
            return False
        if origin is list or args[-1] is Ellipsis:
            return all(conforms(x, args[0]) for x in v)
        return len(v) == len(args) and all(conforms(x, a) for x, a in zip(v, args))
    raise TypeError(f"no JSON reading for the type {tp!r}")  # a schema mistake, not the user's


def describe(tp: Any) -> str:
    """The type ``tp`` in words: "an int or null", "a list of 3 ints"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is dict:
        return "a dict"
    if origin in (tuple, list):
        if origin is list or args[-1] is Ellipsis:
            return f"a list of {_NAMES[args[0]][1]}"
        return f"a list of {len(args)} {_NAMES[args[0]][1]}"
    return _NAMES[tp][0]
