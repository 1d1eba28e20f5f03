"""Incremental detokenization (Detokenizer): the texts added token by token, multi-byte characters split
across tokens included, concatenate to the decoding of the whole output, with the real Qwen3 tokenizer; the
cached one-token texts save a tokenizer call per token."""

from __future__ import annotations

import pytest

from titan_mm.serve.core.output_processor import Detokenizer
from titan_mm.serve.core.sequence import Sequence


class _Counting:
    """A tokenizer that counts its decode calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", ["héllo wörld, 世界和平 🎉🎉 done.", "plain ascii text with spaces  and\nnewlines"])
def test_incremental_text_equals_the_full_decode(text):
    from titan_mm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode(text)
    if text.startswith("h"):
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # some character spans tokens
    counting = _Counting(tok)
    detok = Detokenizer(counting)
    seq = Sequence(0, [], 0)
    got = ""
    for n in range(1, len(ids) + 1):
        new = detok.new_text(seq, ids[:n], True, final=n == len(ids))
        assert "\ufffd" not in new
        got += new
    assert got == tok.decode(ids, skip_special_tokens=True)
    if text.startswith("p"):  # every token emits: the context is the previous token, its text cached
        assert counting.calls <= len(ids) + len(set(ids))


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("source", ["text", "random"])
def test_byte_level_fast_path_equals_the_full_decode(source, skip, monkeypatch):
    """The byte-level path (Qwen3's tokenizer: token bytes joined, decoded at whole characters) adds up to the
    tokenizer's decode, for real text and for random ids (special tokens, invalid byte runs and ids past the
    tokenizer's vocabulary included), token by token and a few tokens at a time (speculation appends several),
    without calling the tokenizer."""
    import random

    from titan_mm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    detok = Detokenizer(tok)
    assert detok.byte_level
    r = random.Random(skip)
    whole = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("the byte-level path called the tokenizer"))
    for trial in range(40):
        if source == "text":
            ids = tok.encode("héllo wörld, 世界和平 🎉🎉 <think>x</think> done.<|im_end|>")
        else:
            ids = [r.randrange(0, 151936) for _ in range(r.randint(1, 30))]  # the model's vocabulary: past the tokenizer's
        seq = Sequence(0, [], 0)
        got, n = "", 0
        while n < len(ids):
            n = min(len(ids), n + r.choice([1, 1, 1, 2, 3]))
            new = detok.new_text(seq, ids[:n], skip, final=n == len(ids))
            got += new
        assert got == whole(ids, skip_special_tokens=skip), ids
