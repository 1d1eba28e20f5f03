"""The host side of parallel.encoder_balance (titan_mm/parallel/encoder_balance.py): the assignment is deterministic,
places every image exactly once and leaves no rank more than the largest image's cost above the mean; the per-rank
plans agree with each other (what one rank sends another receives) and, replayed through a simulated all-to-all,
give every rank its own features back in its own order; a batch without images anywhere plans nothing; the config
switch is refused with one line where it cannot apply. ``PYTHONPATH=. python tests/unit/test_encoder_balance.py``
prints the max / mean per-rank ViT cost of a skewed batch before and after."""

import random

import pytest
import torch

from titan_mm.config import ConfigError, JobConfig, Parallel, validate
from titan_mm.parallel.encoder_balance import assign, image_cost, plan_from_grids

MERGE = 4  # patches per merged token (spatial_merge_size 2)


def _random_grids(seed, ranks=4, empty=(1,)):
    rng = random.Random(seed)
    out = []
    for r in range(ranks):
        n = 0 if r in empty else rng.randint(1, 6)
        out.append([(rng.choice([1, 1, 1, 2, 4]), 2 * rng.randint(1, 16), 2 * rng.randint(1, 16)) for _ in range(n)])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_assign_places_every_image_once_and_balances(seed):
    grids = _random_grids(seed)
    costs = [[image_cost(*g) for g in gl] for gl in grids]
    dest = assign(costs)
    assert dest == assign([list(c) for c in costs])  # deterministic
    assert [len(d) for d in dest] == [len(g) for g in grids]
    assert all(0 <= d < len(grids) for ds in dest for d in ds)
    load = [0.0] * len(grids)
    for cs, ds in zip(costs, dest):
        for c, d in zip(cs, ds):
            load[d] += c
    mean, cmax = sum(load) / len(load), max(c for cs in costs for c in cs)
    assert max(load) <= mean + cmax + 1e-9
    assert max(load) <= max(map(sum, costs)) + 1e-9  # never worse than no balance


def test_balanced_ranks_keep_their_images():
    grids = [[(1, 8, 8), (1, 4, 4)], [(1, 4, 4), (1, 8, 8)]]
    assert assign([[image_cost(*g) for g in gl] for gl in grids]) == [[0, 0], [1, 1]]
    plan, recv = plan_from_grids(grids, 0, MERGE)
    assert not plan.moves and recv.tolist() == [[1, 8, 8], [1, 4, 4]]


def _simulate(grids, dim=3):
    """Every rank's plan, a host replay of both all-to-alls around an 'encoder' that merges MERGE patches into one
    row; returns (plans, per-rank returned features, per-rank features computed locally)."""
    n = len(grids)
    planned = [plan_from_grids(grids, r, MERGE) for r in range(n)]
    plans = [p for p, _ in planned]
    pix = [torch.randn(sum(t * h * w for t, h, w in gl), dim) for gl in grids]

    def encoder(x):
        return x.reshape(-1, MERGE * dim) * 2.0

    sends = [(x if p.send_index is None else x[p.send_index]).split(p.send_splits) for x, p in zip(pix, plans)]
    recv = [torch.cat([sends[s][d] for s in range(n)]) for d in range(n)]
    for d, (p, (_, rg)) in enumerate(zip(plans, planned)):  # received rows match the grids the rank encodes
        assert recv[d].shape[0] == sum(p.recv_splits) == int(rg.prod(-1).sum())
    outs = [encoder(r).split([s // MERGE for s in p.recv_splits]) for r, p in zip(recv, plans)]
    back = [torch.cat([outs[d][s] for d in range(n)]) for s in range(n)]
    back = [b if p.restore_index is None else b[p.restore_index] for b, p in zip(back, plans)]
    return plans, back, [encoder(x) for x in pix]


@pytest.mark.parametrize("seed", range(10))
def test_plans_agree_and_restore_the_order(seed):
    grids = _random_grids(seed, empty=(1, 3) if seed % 2 else (1,))
    plans, back, local = _simulate(grids)
    n = len(grids)
    for r in range(n):
        for s in range(n):
            assert plans[r].recv_splits[s] == plans[s].send_splits[r]
        torch.testing.assert_close(back[r], local[r], rtol=0, atol=0)
        if plans[r].send_index is not None:
            assert sorted(plans[r].send_index.tolist()) == list(range(local[r].shape[0] * MERGE))
    assert len({p.moves for p in plans}) == 1  # the same decision on every rank


def test_out_of_order_send():
    """Rank 0 keeps its small image and sends its first, large one away: patches leave out of order and the
    returned features are put back in order."""
    grids = [[(1, 8, 8), (1, 4, 4)], []]
    plans, back, local = _simulate(grids)
    assert plans[0].send_index is not None and plans[0].send_splits == [16, 64]
    torch.testing.assert_close(back[0], local[0], rtol=0, atol=0)


def test_zero_image_ranks_and_no_images():
    grids = [[(1, 8, 8), (2, 4, 4), (1, 4, 4)], [], [], []]
    plans, back, local = _simulate(grids)
    assert all(p.moves for p in plans)
    assert [sum(p.send_splits) for p in plans[1:]] == [0, 0, 0]
    assert sum(sum(p.recv_splits) > 0 for p in plans) >= 2
    torch.testing.assert_close(back[0], local[0], rtol=0, atol=0)
    assert all(b.shape[0] == 0 for b in back[1:])
    assert plan_from_grids([[], [], []], 0, MERGE) is None  # no rank has images: no exchange on any rank


@pytest.mark.parametrize("field", ["pp", "cp"])
def test_config_refuses(field):
    with pytest.raises(ConfigError, match=f"encoder_balance is not supported with parallel.{field} > 1") as e:
        validate(JobConfig(parallel=Parallel(encoder_balance=True, **{field: 2})))
    assert "\n" not in str(e.value)
    validate(JobConfig(parallel=Parallel(encoder_balance=False, **{field: 2})))  # off: no check


def test_config_accepts_tp():
    validate(JobConfig(parallel=Parallel(encoder_balance=True, tp=2, encoder_tp=True)))


@pytest.mark.parametrize("model,error", [("qwen3", "has no vision tower"), ("qwen2_5_vl", "is not implemented for"),
                                         ("qwen3_vl", None)])
def test_family_check(model, error):
    from titan_mm.parallel.encoder_balance import check_family
    from titan_mm.registry import get_model_spec

    spec = get_model_spec(model)
    cfg = spec.flavor("debug") if "debug" in spec.flavors else next(iter(spec.flavors.values()))
    if error is None:
        check_family(spec, cfg)
        return
    with pytest.raises(ConfigError, match=error) as e:
        check_family(spec, cfg)
    assert "\n" not in str(e.value)


# A skewed global batch for the 2B's patch 16 / merge 2 (patches = pixels / 256): rank 0 reads rows of large
# documents, rank 1 of medium photos, rank 2 text only, rank 3 many thumbnails and a video.
SKEWED = [
    [(1, 64, 64), (1, 64, 64), (1, 48, 64), (1, 32, 32)],  # 1024^2, 1024^2, 768x1024, 512^2
    [(1, 28, 28)] * 6,  # 448^2 photos
    [],
    [(1, 14, 14)] * 12 + [(8, 24, 24)],  # 224^2 thumbnails and an 8-frame 384^2 video
]


def skewed_ratios(grids=SKEWED):
    plan, _ = plan_from_grids(grids, 0, MERGE)
    mean = sum(plan.cost_before) / len(grids)
    return max(plan.cost_before) / mean, max(plan.cost_after) / mean, plan


def test_skewed_batch_measurement():
    before, after, plan = skewed_ratios()
    print(f"\nskewed batch, 4 dp ranks: ViT cost max/mean {before:.2f} -> {after:.2f} "
          f"(per rank before {[round(c) for c in plan.cost_before]}, after {[round(c) for c in plan.cost_after]})")
    cmax = max(image_cost(*g) for gl in SKEWED for g in gl)
    assert after < before and after <= 1 + cmax / (sum(plan.cost_before) / 4)


if __name__ == "__main__":
    b, a, p = skewed_ratios()
    print(f"ViT cost max/mean before {b:.3f}, after {a:.3f}; per rank before {[round(c) for c in p.cost_before]}, "
          f"after {[round(c) for c in p.cost_after]}")
