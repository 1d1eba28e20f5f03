"""The built-in text QA: short question / answer chats with one exact answer, for sampler evals (exact match) and
debug runs that must show learning on a CPU within minutes.

    "What number comes after 347?" -> "348"        "What number comes before 347?" -> "346"

Numbers are 100 .. 999 and every answer has three digits (Qwen3's tokenizer writes one token per digit), so a
diffusion sampler's fixed answer canvas is exactly the answer plus <|im_end|>. The rule is per digit (copy, +-1,
carry / borrow), so held-out questions are learnable: the records are shuffled once with a fixed seed (so every
kind x last digit, carries included, is in the training part) and every 5th (index % 5 == 0, 360 of 1798) is held out
in ``qa_test``; the rest is ``qa``. Records carry ``answer`` and ``index``, like ``digits``.
"""

from __future__ import annotations

import random

QUESTIONS = {"after": "What number comes after {n}?", "before": "What number comes before {n}?"}


def qa_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """Every (question, answer), in a fixed shuffled order (the same on every machine and Python version)."""
    pairs = [(QUESTIONS["after"].format(n=n), str(n + 1)) for n in range(100, 999)]
    pairs += [(QUESTIONS["before"].format(n=n), str(n - 1)) for n in range(101, 1000)]
    random.Random(seed).shuffle(pairs)
    return pairs


def qa_records(test: bool = False) -> list[dict]:
    """Chats user question -> assistant answer; held out: index % 5 == 0."""
    out = []
    for i, (q, a) in enumerate(qa_pairs()):
        if (i % 5 == 0) != test:
            continue
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                    "answer": a, "index": i})
    return out
