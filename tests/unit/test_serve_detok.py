"""Incremental detokenization (engine.Detokenizer): the texts added token by token, multi-byte characters split
across tokens included, concatenate to the decoding of the whole output, with the real Qwen3 tokenizer; the
cached one-token texts save a tokenizer call per token."""

from __future__ import annotations

import pytest

from titan_mm.serve.engine import Detokenizer
from titan_mm.serve.sequence import Sequence


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
