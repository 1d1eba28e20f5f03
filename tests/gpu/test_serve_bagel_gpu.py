"""BAGEL understanding through the serving engine on CUDA, text and image + question chats: fp32 greedy tokens equal
the training forward re-run per token on the same card (tests/unit/test_serve_bagel.py's reference), every model step
under set_sync_debug_mode("error") (an image's ViT split in the prefill: its host-built metadata, the dense mask of
its bidirectional span); bf16 decode steps replayed from CUDA graphs give the eager steps' tokens."""

from __future__ import annotations

import copy

import pytest

from tests.gpu.test_serve_gpu import drive
from tests.unit.test_serve_bagel import (
    ANSWER,
    BOS,
    CFG,
    DATA,
    EOS,
    MODEL,
    _chat_prompt,
    _image_chats,
    _prompts,
    _reference,
    _reference_chats,
)
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0.0, max_tokens=ANSWER - 1)


def _engine(model, **cfg) -> Engine:
    return Engine(model, get_model_spec("bagel"), CFG, ServeConfig(**{"block_size": 4, "num_blocks": 96, **cfg}),
                  device="cuda", eos_token_ids=[EOS], data=DATA)


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}, {"packed_prefill": True}],
                         ids=["batched", "chunked", "packed"])
def test_engine_fp32_equals_the_training_forward_without_host_sync(cfg):
    model = copy.deepcopy(MODEL).cuda()
    prompts = _prompts(4)
    want = _reference(prompts, model)  # the whole chat re-run per token, on the card
    e = _engine(model, dtype="float32", **cfg)
    assert drive(e, [[BOS, *p, EOS, BOS] for p in prompts], PARAMS, None) == want
    assert e.stats()["kv_blocks_used"] == 0


def test_bf16_graph_decode_equals_eager():
    ids = [[BOS, *p, EOS, BOS] for p in _prompts(4)]
    eager = _engine(copy.deepcopy(MODEL), dtype="bfloat16", cuda_graphs=False)
    graphs = _engine(copy.deepcopy(MODEL), dtype="bfloat16")  # every decode size captured at start-up
    assert graphs.runner.captured
    assert drive(graphs, ids, PARAMS, None, check=False) == drive(eager, ids, PARAMS, None, check=False)


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}, {"packed_prefill": True}],
                         ids=["batched", "chunked", "packed"])
def test_images_fp32_equal_the_training_forward_without_host_sync(cfg):
    model = copy.deepcopy(MODEL).cuda()
    chats = _image_chats(4)
    want = _reference_chats(chats, model)
    e = _engine(model, dtype="float32", **cfg)
    prompts = [_chat_prompt(c) for c in chats]
    assert drive(e, [p for p, _ in prompts], PARAMS, [im for _, im in prompts]) == want
    assert e.stats()["kv_blocks_used"] == 0


def test_images_bf16_graph_decode_equals_eager():
    """bf16 with CUDA graphs: the image chats' prefills run eagerly (dense mask), their decode steps replay."""
    prompts = [_chat_prompt(c) for c in _image_chats(4)]
    ids, images = [p for p, _ in prompts], [im for _, im in prompts]
    eager = _engine(copy.deepcopy(MODEL), dtype="bfloat16", cuda_graphs=False)
    graphs = _engine(copy.deepcopy(MODEL), dtype="bfloat16")
    assert graphs.runner.captured
    assert drive(graphs, ids, PARAMS, images, check=False) == drive(eager, ids, PARAMS, images, check=False)
