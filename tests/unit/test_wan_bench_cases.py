"""bench/mfu.py's Wan cases (issue 48): each row's token count is what its frames, resolution and patch give, and
the 14B cut has Wan2.1-T2V-14B's widths. No GPU: the host batch only."""

import pytest

from bench.mfu import CASES, clip_batch, model_config

# 480p (832 x 480) through Wan2.1's VAE (4x in time, 8x in space): (1 + 4k) frames -> 1 + k latent frames
VAE_T, VAE_S = 4, 8
WAN_CASES = {  # case: (video frames, width, height, layers)
    "wan2.1_1.3b": (33, 832, 480, 30),
    "wan2.1_1.3b_81f": (81, 832, 480, 30),
    "wan2.1_14b_4l": (33, 832, 480, 4),
    "wan2.1_14b_4l_81f": (81, 832, 480, 4),
}


@pytest.mark.parametrize("name", sorted(WAN_CASES))
def test_wan_case_tokens_are_frames_times_resolution_over_the_patch(name):
    frames, width, height, layers = WAN_CASES[name]
    case = CASES[name]
    _, mc = model_config(case)
    pt, ph, pw = mc.patch_size
    lf, lh, lw = 1 + (frames - 1) // VAE_T, height // VAE_S, width // VAE_S
    tokens = (lf // pt) * (lh // ph) * (lw // pw)
    assert case["seq"] == tokens and (case["clip"]["frames"], case["clip"]["hw"]) == (lf, (lh, lw))
    b = clip_batch(mc, case["batch"], case["clip"])
    assert b["latents"].shape == (case["batch"], tokens, mc.in_channels * pt * ph * pw)
    assert b["grid_fhw"][0, -1].tolist() == [lf // pt - 1, lh // ph - 1, lw // pw - 1]
    assert b["text_states"].shape == (case["batch"], 512, 4096)
    assert mc.num_layers == layers


def test_the_14b_cut_has_wan2_1_14b_widths():
    """Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json: 40 heads x 128, FFN 13824, 16 latent channels,
    UMT5's 4096-wide states, 256 frequencies; only num_layers (40) is cut."""
    hf = model_config(CASES["wan2.1_14b_4l_81f"])[1].to_hf_dict()
    want = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, patch_size=[1, 2, 2], num_layers=4)
    assert {k: (list(hf[k]) if k == "patch_size" else hf[k]) for k in want} == want
