"""Incremental detokenization (Engine._new_text): the texts added token by token, multi-byte characters split
across tokens included, concatenate to the decoding of the whole output, with the real Qwen3 tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from titan_mm.serve.engine import Engine
from titan_mm.serve.sequence import Sequence


@pytest.mark.parametrize("text", ["héllo wörld, 世界和平 🎉🎉 done.", "plain ascii text with spaces  and\nnewlines"])
def test_incremental_text_equals_the_full_decode(text):
    from titan_mm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode(text)
    if text.startswith("h"):
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # some character spans tokens
    engine = SimpleNamespace(tokenizer=tok)
    seq = Sequence(0, [], 0)
    got = ""
    for n in range(1, len(ids) + 1):
        new = Engine._new_text(engine, seq, ids[:n], True, final=n == len(ids))
        assert "\ufffd" not in new
        got += new
    assert got == tok.decode(ids, skip_special_tokens=True)
