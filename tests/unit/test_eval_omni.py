"""The Omni thinkers' eval tasks (dtmf: a key tone; dtmf_digits: a digits image, then a key tone) decode through the
serving engine, the one decoder: its greedy answers equal a greedy re-run of the training forward
(tests/unit/_greedy_forward.py, what titan_mm/eval/forward_decode.py computed before the engine took audio) on the
same tiny random-weight debug thinker, fp32 on the CPU."""

import pytest
import torch

from titan_mm.config import load_config
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.eval.evaluator import engine_texts, eval_engine
from titan_mm.eval.tasks import load_task
from titan_mm.loader import tokenizer_path
from titan_mm.registry import resolve_model

from tests.parity.test_qwen3_vl_parity import randomize_
from tests.unit._greedy_forward import forward_greedy

MAX_NEW = 4


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_dtmf_tasks_decode_through_the_engine_as_the_training_forward(family):
    cfg = load_config(["--config", f"debug_{family}"])
    spec, mcfg = resolve_model(family, "debug")
    mcfg = spec.with_runtime(mcfg, attn_backend="sdpa", kernels=False)
    torch.manual_seed(0)
    model = spec.build(mcfg)
    randomize_(model)  # varied answers (an init of std 0.02 answers the same token everywhere)
    model.init_buffers("cpu")
    model.eval()
    tok = load_tokenizer(tokenizer_path(cfg))
    items = load_task("dtmf", limit=3).items + load_task("dtmf_digits", limit=2).items
    engine = eval_engine(model, spec, mcfg, tok, torch.device("cpu"), cfg.data)
    got = engine_texts(engine, items, MAX_NEW)  # the prompts prefill together; each one's clips encode apart
    proc = Processor(tok, ProcessorConfig(cfg.data, spec.data_needs(mcfg)))
    assert got == forward_greedy(model, spec, mcfg, proc, [it["messages"] for it in items], MAX_NEW)
    assert len(set(got)) > 1, got  # the answers depend on the prompt: a mix-up of clips would show
    assert engine.stats()["kv_blocks_used"] == 0
