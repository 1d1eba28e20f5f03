"""The diffusion sampler (titan_mm/serve/dllm_sample.py): low-confidence remasking commits the most confident
predictions first, shifted models read position j from hidden state j - 1, block diffusion finishes blocks in order
with the earlier ones clean, sampling stops after a block where every row stopped; on a real tiny Qwen3, the
block-causal canvas after the current block does not change its predictions (why recomputing is exact)."""

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.output import ModelOutput, Stream
from titan_mm.registry import resolve_model
from titan_mm.serve.dllm_sample import sample
from titan_mm.objectives import DiffusionLM as Objective

V, MASK = 64, 63


class Probe(torch.nn.Module):
    """A stand-in LM with the embed -> trunk -> head contract: at position p it predicts token ``10 + p`` (``stop``
    at position ``stop_at``) with a confidence that grows with p; it records the tokens of every trunk call."""

    def __init__(self, stop_at: int = -1, stop: int = 1):
        super().__init__()
        self.calls, self.stop_at, self.stop = [], stop_at, stop

    def embed(self, ids):
        self.calls.append(ids.clone())
        return Stream(ids.float()[..., None])

    def rope(self, pos, dtype):
        return pos, pos

    def trunk(self, stream, rope, attn):
        return stream

    def head(self, stream, attn, labels=None, logits_at=None):
        B = stream.h.shape[0]
        logits = torch.zeros(B, V)
        tok = torch.where(logits_at == self.stop_at, self.stop, 10 + logits_at)
        logits[torch.arange(B), tok] = 1.0 + logits_at.float()  # later positions: more confident
        return ModelOutput(logits=logits, loss_sum=None, aux_loss=None)


def obj(kind, block_size=None):
    return Objective(kind=kind, mask_id=MASK, block_size=block_size)


def committed(call, a, b):
    return [t != MASK for t in call[0, a:b].tolist()]


def test_low_confidence_remasking_commits_the_most_confident_first():
    m = Probe()
    out = sample(m, [[5, 6, 7]], obj("masked_diffusion"), gen_length=4, steps=4)
    assert out == [[13, 14, 15, 16]]  # the canvas positions 3..6
    # before each step, the positions committed so far: the most confident (the last) first
    assert [committed(c, 3, 7) for c in m.calls] == [[False] * 4, [False, False, False, True],
                                                     [False, False, True, True], [False, True, True, True]]


def test_fewer_steps_commit_several_tokens_per_step_and_semi_ar_blocks_go_in_order():
    m = Probe()
    assert sample(m, [[5, 6, 7]], obj("masked_diffusion"), gen_length=4, steps=2) == [[13, 14, 15, 16]]
    assert len(m.calls) == 2 and committed(m.calls[1], 3, 7) == [False, False, True, True]
    m = Probe()
    sample(m, [[5, 6, 7]], obj("masked_diffusion"), gen_length=4, steps=2, block_length=2)
    assert [committed(c, 3, 7) for c in m.calls] == [[False] * 4, [False, True, False, False],
                                                     [True, True, False, False], [True, True, False, True]]


def test_shifted_models_read_position_j_from_hidden_state_j_minus_1():
    assert sample(Probe(), [[5, 6, 7]], obj("shifted_diffusion"), gen_length=3, steps=3) == [[12, 13, 14]]


def test_block_diffusion_finishes_blocks_in_order_and_stops():
    m = Probe()
    # prompt of 3, blocks of 4 from the document start: [3, 4), [4, 8), [8, 9)
    out = sample(m, [[5, 6, 7]], obj("block_diffusion", 4), gen_length=6, steps=2)
    assert out == [[13, 14, 15, 16, 17, 18]]
    assert len(m.calls) == 3 * 2
    for c in m.calls[2:4]:  # block [4, 8): the one before is clean, the one after still masked
        assert committed(c, 3, 4) == [True] and committed(c, 8, 9) == [False]
    m = Probe(stop_at=5)  # position 5 predicts the stop token: no third block
    out = sample(m, [[5, 6, 7], [5, 6, 7]], obj("block_diffusion", 4), gen_length=6, steps=2, stop_ids=(1,))
    assert out == [[13, 14]] * 2 and len(m.calls) == 2 * 2


def test_rows_with_different_prompt_lengths():
    m = Probe()
    out = sample(m, [[5, 6, 7], [5]], obj("masked_diffusion"), gen_length=2, steps=2)
    assert out == [[13, 14], [11, 12]]


def tiny_qwen3():
    spec, cfg = resolve_model("qwen3", "debug", overrides={"vocab_size": V, "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    return model.eval()


def test_block_causal_canvas_after_the_current_block_does_not_change_it():
    model = tiny_qwen3()
    ids = torch.randint(0, MASK, (1, 14))
    ids[0, 6:] = MASK
    cut = 8  # blocks of 4: the current block is [4, 8)

    def logits(x):
        meta = build_attn_meta({"input_ids": x}, "sdpa", "cpu", kind="block_causal", block_size=4)
        with torch.no_grad():
            return model(x, attn=meta).logits

    torch.testing.assert_close(logits(ids)[:, :cut], logits(ids[:, :cut]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,bs", [("masked_diffusion", None), ("shifted_diffusion", None), ("block_diffusion", 3)])
def test_sampling_a_real_model_fills_the_canvas(kind, bs):
    model = tiny_qwen3()
    out = sample(model, [[1, 2, 3, 4], [5, 6]], obj(kind, bs), gen_length=5, steps=5)
    assert [len(g) for g in out] == [5, 5] and all(MASK not in g for g in out)
