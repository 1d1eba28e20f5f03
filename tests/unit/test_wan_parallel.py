"""The Wan plan names modules of every flavor (apply_tp and apply_cp refuse a pattern that matches none), and the
bench's Wan2.1-1.3B case is the clip it says (the multi-process equality is tests/multiproc/test_parallel_wan.py)."""

import dataclasses
import fnmatch

import pytest
import torch

from bench.mfu import CASES, clip_batch, model_config
from titan_mm.models.wan.config import FLAVORS
from titan_mm.models.wan.model import build
from titan_mm.models.wan.plan import plan


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_plan_names_modules_of_every_flavor(flavor):
    cfg = FLAVORS[flavor]
    with torch.device("meta"):
        names = [n for n, _ in build(cfg).named_modules()]
    p = plan(cfg)
    for pat in list(p.tp) + list(p.cp):
        assert any(fnmatch.fnmatchcase(n, pat) for n in names), pat
    # only the self-attention crosses cp shards; the cross-attention reads text states whole on every rank
    assert [n for n in names if fnmatch.fnmatchcase(n, "blocks.*.attn1")] == \
        [n for n in names if any(fnmatch.fnmatchcase(n, c) for c in p.cp)]
    assert sum(style == "colwise_norm" for style in p.tp.values()) == 4  # q / k norms of both attentions


def test_plan_without_qk_norm_has_no_norm_entries():
    assert "colwise_norm" not in plan(dataclasses.replace(FLAVORS["debug"], qk_norm=None)).tp.values()


def test_bench_wan_case_is_33_frames_at_480p():
    """33 frames of 832 x 480 through Wan2.1's VAE (4x time, 8x space) are 9 x 60 x 104 latents: 14,040 patches."""
    case = CASES["wan2.1_1.3b"]
    _, mc = model_config(case)
    b = clip_batch(mc, case["batch"], case["clip"])
    assert b["latents"].shape == (1, case["seq"], 64) and b["text_states"].shape == (1, 512, 4096)
    assert b["grid_fhw"][0, -1].tolist() == [8, 29, 51]
