"""BAGEL understanding (text) through the serving engine on CUDA: fp32 greedy tokens equal the training forward re-run
per token on the same card (tests/unit/test_serve_bagel.py's reference), every model step under
set_sync_debug_mode("error"); bf16 decode steps replayed from CUDA graphs give the eager steps' tokens."""

from __future__ import annotations

import copy

import pytest

from tests.gpu.test_serve_gpu import drive
from tests.unit.test_serve_bagel import (
    ANSWER,
    BOS,
    CFG,
    EOS,
    MODEL,
    _prompts,
    _reference,
)
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0.0, max_tokens=ANSWER - 1)


def _engine(model, **cfg) -> Engine:
    return Engine(model, get_model_spec("bagel"), CFG, ServeConfig(**{"block_size": 4, "num_blocks": 96, **cfg}),
                  device="cuda", eos_token_ids=[EOS])


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
