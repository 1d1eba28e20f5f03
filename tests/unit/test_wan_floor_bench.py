"""bench/wan_floor.py times the GEMMs that the Wan FLOP counter counts (the GPU timing itself runs on the GPU)."""

import pytest

wan_floor = pytest.importorskip("bench.wan_floor")


def test_floor_gemms_are_the_counted_matmul_flops():
    from bench.mfu import CASES, model_config
    from titan_mm.models.wan.flops import TEXT_LEN, flops, matmul_params

    spec, cfg = model_config(CASES["wan2.1_1.3b"])
    n = 14040
    forms = wan_floor.linears(cfg, n)
    fl = {k: sum(6 * rows * i * o for rows, pairs in groups for i, o in pairs) for k, groups in forms.items()}
    assert fl["qkv"] == fl["qkv_fused"]
    timed = cfg.num_layers * (fl["qkv"] + fl["rest"]) + fl["edge"]
    _, text, time = matmul_params(cfg)
    attn = 3 * 4 * cfg.dim * cfg.num_layers * (n * (n + 1) // 2 + n * TEXT_LEN)
    # the counter's rest: the text embedder (per text token) and the time MLP (per clip), which the floor leaves out
    left_out = 6 * (TEXT_LEN * (cfg.text_dim * cfg.dim + cfg.dim * cfg.dim) + time)
    assert timed + attn + left_out == flops(cfg, [n])
    assert text == cfg.text_dim * cfg.dim + cfg.dim * cfg.dim + cfg.num_layers * 2 * cfg.dim * cfg.dim
