"""Audio in served prompts on a GPU: the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers of
tests/parity/test_serve_omni.py (clips beside text and an image): every model step of the engine runs under
torch.cuda.set_sync_debug_mode("error") (a host sync raises), whole and under a 16-token chunked-prefill budget,
and the fp32 greedy tokens equal transformers' thinker generate on the CPU.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_omni_gpu.py
"""

from __future__ import annotations

import copy

import pytest

from tests.gpu.test_serve_gpu import _checked
from tests.parity.test_serve_omni import CASES, DATA, MAX_NEW, reference
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_audio_steps_have_no_host_sync_and_match_hf(family, case, tmp_path_factory):
    tm, spec, cfg, ps, refs = reference(family, tmp_path_factory)
    serve = ServeConfig(max_model_len=256, dtype="float32", **CASES[case])
    engine = Engine(copy.deepcopy(tm), spec, cfg, serve, device="cuda", data=DATA)
    _checked(engine.runner)
    outs = engine.generate([p[0] for p in ps], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                           images=[p[2] for p in ps], audios=[p[1] for p in ps])
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert engine.stats()["kv_blocks_used"] == 0
