"""Rewards of RL post-training: registered functions of a completion, summed with the weights of ``rl.rewards``.

    reward = build_reward(cfg.rl)            # ConfigError for an unknown name or an import path that fails
    r = reward(text, reference, ended)       # ended: the completion stopped by itself (EOS / stop string)

Built-in: ``exact_match`` (the stripped completion equals the reference: eval's metric), ``numeric`` (the first
number in the completion equals the reference's), ``char_match`` (partial credit: the share of character positions
where the stripped completion and the reference agree, over the longer of the two), ``format`` (the completion ended by itself and its whole text
matches ``rl.format_regex``). Any other name is ``pkg.module:function`` with function(completion, reference) ->
float, as eval's task metrics; ``register(name, fn)`` adds a built-in.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable

from titan_mm.config import ConfigError, Rl
from titan_mm.eval.tasks import exact_match

Reward = Callable[[str, str, bool], float]
"""reward(completion text, reference, ended by itself) -> float."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_REGISTRY: dict[str, Callable[[Rl], Reward]] = {}


def register(name: str, factory: Callable[[Rl], Reward]) -> None:
    """``factory(rl_section) -> reward`` under ``name`` (re-registering replaces)."""
    _REGISTRY[name] = factory


def first_number(text: str) -> float | None:
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


def numeric(text: str, reference: str) -> float:
    got, want = first_number(text), first_number(reference)
    return float(got is not None and got == want)


def char_match(text: str, reference: str) -> float:
    got, want = text.strip(), reference.strip()
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


def _format(rl: Rl) -> Reward:
    pattern = re.compile(rl.format_regex)
    return lambda text, ref, ended: float(ended and pattern.fullmatch(text) is not None)


register("exact_match", lambda rl: lambda text, ref, ended: exact_match(text, ref))
register("numeric", lambda rl: lambda text, ref, ended: numeric(text, ref))
register("char_match", lambda rl: lambda text, ref, ended: char_match(text, ref))
register("format", _format)


def _imported(path: str) -> Reward:
    mod, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"rl.rewards {path!r}: cannot import it ({e}); give pkg.module:function") from None
    if not callable(fn):
        raise ConfigError(f"rl.rewards {path!r} is not callable; give a function(completion, reference) -> float")
    return lambda text, ref, ended: float(fn(text, ref))


def build_reward(rl: Rl) -> Reward:
    """The weighted sum of ``rl.rewards``."""
    parts = []
    for name, weight in rl.rewards.items():
        if name in _REGISTRY:
            parts.append((_REGISTRY[name](rl), float(weight)))
        elif ":" in name:
            parts.append((_imported(name), float(weight)))
        else:
            near = difflib.get_close_matches(name, list(_REGISTRY), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"rl.rewards: unknown reward {name!r}; {hint}built-in: {', '.join(sorted(_REGISTRY))}, "
                              "or pkg.module:function")
    return lambda text, ref, ended: sum(w * f(text, ref, ended) for f, w in parts)
