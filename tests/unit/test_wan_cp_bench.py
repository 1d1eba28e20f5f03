"""bench/wan_cp.py's formulas: the per-rank FLOPs are the trainer's count split over cp, the bytes follow the
shapes. That the formula equals the bytes counted on gloo is tests/multiproc/test_wan_cp_bytes.py (slow)."""

import dataclasses

import pytest

from bench.wan_cp import LATENT_81F, cp_bytes, patches, per_rank_flops
from titan_mm.models.wan.config import FLAVORS
from titan_mm.models.wan.flops import matmul_params
from titan_mm.objectives import FlowMatching
from titan_mm.registry import get_model_spec

CFG = FLAVORS["1.3B"]


def test_81_frames_at_480p_are_32760_patches():
    assert patches(CFG, LATENT_81F) == 21 * 30 * 52 == 32760


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, num_attention_heads=40, ffn_dim=13824, num_layers=4)])
def test_cp1_flops_are_the_trainers(cfg):
    """At cp 1 the rank runs the whole step: the count bench/mfu.py divides by (flow matching's bidirectional
    pairs over titan_mm.models.wan.flops)."""
    S = patches(cfg, LATENT_81F)
    want = FlowMatching(mask="bidirectional").flops(get_model_spec("wan"), cfg, [S])
    assert sum(per_rank_flops(cfg, S, 1).values()) == pytest.approx(want, rel=1e-12)


def test_cp_splits_all_but_the_per_clip_gemms():
    S = patches(CFG, LATENT_81F)
    one = per_rank_flops(CFG, S, 1)
    _, text, time = matmul_params(CFG)
    per_clip = 6 * (512 * text + time)
    for cp in (2, 4, 8):
        f = per_rank_flops(CFG, S, cp)
        assert f["self_attention"] * cp == pytest.approx(one["self_attention"])
        assert f["cross_attention"] * cp == pytest.approx(one["cross_attention"])
        # the text embedder, the cross-attention's text k / v and the time MLP run whole on every rank
        assert f["gemm"] - one["gemm"] / cp == pytest.approx(per_clip * (1 - 1 / cp))


def test_bytes_follow_the_shapes():
    """Ulysses: 8 all-to-alls of S/cp x D a layer, (cp - 1) / cp of them off the rank, so the off-rank bytes fall
    with cp; the ring's grow towards 8 S D (fp32 gradients) + 4 S D a per layer."""
    S, D, L = 32760, CFG.dim, CFG.num_layers
    assert cp_bytes(CFG, S, 1, "ulysses", 2) == cp_bytes(CFG, S, 1, "ring", 2) == {"payload": 0, "off_rank": 0}
    assert cp_bytes(CFG, S, 2, "ulysses", 2) == {"payload": 8 * S // 2 * D * 2 * L, "off_rank": 4 * S // 2 * D * 2 * L}
    uly = [cp_bytes(CFG, S, cp, "ulysses", 2)["off_rank"] for cp in (2, 4, 8)]
    ring = [cp_bytes(CFG, S, cp, "ring", 2)["off_rank"] for cp in (2, 4, 8)]
    assert uly[0] > uly[1] > uly[2] and ring[0] < ring[1] < ring[2] < (8 * S * D + 4 * S * D * 2) * L
