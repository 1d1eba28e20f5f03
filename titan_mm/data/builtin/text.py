"""The built-in text corpus: small, deterministic, natural-ish and repetitive enough that a debug model
visibly learns from it within a few hundred steps on a CPU. Nothing is downloaded; the documents are
generated from fixed templates with a fixed seed (the same on every machine and Python version).
"""

from __future__ import annotations

import random

_ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "bear", "duck", "goat", "mouse", "wolf", "frog"]
_COLORS = ["red", "brown", "white", "black", "grey", "golden", "small", "young", "old", "quiet"]
_PLACES = ["the river", "the old barn", "the green hill", "the garden", "the forest", "the village",
           "the lake", "the meadow", "the bridge", "the market"]
_VERBS = ["walked to", "ran across", "looked at", "slept near", "jumped over", "waited by", "sang near",
          "played in", "searched", "rested beside"]
_TIMES = ["In the morning", "At noon", "In the evening", "At night", "One day", "Later", "After the rain",
          "Before sunrise"]
_FOODS = ["apples", "bread", "carrots", "fish", "berries", "corn", "cheese", "honey"]
_NUM_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
              "eleven", "twelve"]


def _story(r: random.Random) -> str:
    a, b = r.sample(_ANIMALS, 2)
    ca, cb = r.choice(_COLORS), r.choice(_COLORS)
    sents = [f"Once there was a {ca} {a} who lived near {r.choice(_PLACES)}."]
    for _ in range(r.randint(3, 7)):
        k = r.randint(0, 4)
        if k == 0:
            sents.append(f"{r.choice(_TIMES)}, the {a} {r.choice(_VERBS)} {r.choice(_PLACES)}.")
        elif k == 1:
            sents.append(f"The {a} met a {cb} {b}, and the {b} said hello to the {a}.")
        elif k == 2:
            n = r.randint(2, 9)
            sents.append(f"The {a} found {_NUM_WORDS[n]} {r.choice(_FOODS)} and ate them all.")
        elif k == 3:
            sents.append(f"The {b} {r.choice(_VERBS)} {r.choice(_PLACES)} with the {a}.")
        else:
            sents.append(f"{r.choice(_TIMES)}, the {a} was happy.")
    sents.append(f"The end of the story of the {a} and the {b}.")
    return " ".join(sents)


def _arithmetic(r: random.Random) -> str:
    lines = []
    for _ in range(r.randint(4, 10)):
        x, y = r.randint(0, 20), r.randint(0, 20)
        if r.random() < 0.5:
            lines.append(f"{x} plus {y} is {x + y}.")
        else:
            hi, lo = max(x, y), min(x, y)
            lines.append(f"{hi} minus {lo} is {hi - lo}.")
    return " ".join(lines)


def _counting(r: random.Random) -> str:
    start = r.randint(0, 50)
    step = r.choice([1, 2, 5, 10])
    n = r.randint(6, 16)
    return "Counting: " + ", ".join(str(start + i * step) for i in range(n)) + "."


def _alphabet(r: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = r.randint(0, 16)
    return "The letters are " + " ".join(letters[s : s + r.randint(5, 10)]) + "."


def text_corpus(num_docs: int = 2000, seed: int = 1234) -> list[str]:
    """``num_docs`` documents (about 400 KB of text for the default) built from templates."""
    r = random.Random(seed)
    kinds = [_story, _story, _story, _arithmetic, _counting, _alphabet]
    return [r.choice(kinds)(r) for _ in range(num_docs)]
