"""Images and videos in served prompts on a GPU: Qwen2.5-VL (windowed ViT, chunked M-RoPE) with images, and
videos for Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (tests/parity/test_serve_vl_media.py's prompts): every model
step of the engine runs under torch.cuda.set_sync_debug_mode("error") (a host sync raises), packed and under a
16-token chunked-prefill budget, and the fp32 greedy tokens equal transformers' generate on the CPU.

Run: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_serve_media_gpu.py
"""

from __future__ import annotations

import copy

import pytest

from tests.gpu.test_serve_gpu import _checked
from tests.parity.test_serve_vl_media import DATA, GREEDY, check, image_case, models, video_case
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine

pytestmark = pytest.mark.gpu

CASES = {"qwen2_5_vl_images": ("qwen2_5_vl", image_case),
         "qwen2_5_vl_videos": ("qwen2_5_vl", lambda: video_case("qwen2_5_vl")),
         "qwen3_vl_videos": ("qwen3_vl", lambda: video_case("qwen3_vl")),
         "qwen3_vl_moe_videos": ("qwen3_vl_moe", lambda: video_case("qwen3_vl_moe"))}


@pytest.mark.parametrize("chunked", [False, True], ids=["packed", "chunked"])
@pytest.mark.parametrize("case", list(CASES))
def test_media_steps_have_no_host_sync_and_match_hf(case, chunked):
    family, make = CASES[case]
    _, spec, cfg, tm = models(family)
    prompts, images, videos, expanded, refs = make()
    serve = ServeConfig(block_size=4, num_blocks=128, max_model_len=256, dtype="float32",
                        **(dict(max_num_batched_tokens=16, max_num_seqs=2) if chunked else {}))
    engine = Engine(copy.deepcopy(tm), spec, cfg, serve, device="cuda", data=DATA)
    _checked(engine.runner)
    check(engine.generate(prompts, GREEDY, images=images, videos=videos), expanded, refs)
    assert engine.stats()["kv_blocks_used"] == 0
