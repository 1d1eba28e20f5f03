"""Pipeline parallelism without processes: the split and its one-line errors, the schedules' action lists (bubble,
activations in flight, forward order), the pruned stage model (names, plan, init order), the mesh degrees, and the
memory estimator's pipeline terms on the 4D recipes."""

from __future__ import annotations

import types

import pytest
import torch

from titan_mm.config import load_config
from titan_mm.parallel.pipeline import StageBuilder, balanced_split, make_layout
from titan_mm.parallel.pp_schedule import SCHEDULES, action_lists, replay, virtual_stages


def _par(**kw):
    base = dict(pp=2, pp_schedule="1F1B", pp_virtual_stages=0, pp_layers_per_stage=[], pp_split_points=[],
                fsdp_reshard_after_forward="always")
    return types.SimpleNamespace(**{**base, **kw})


def _unit_replay(name, pp, m):
    v = virtual_stages(name)
    unit = [1.0 / v] * (pp * v)
    return replay(action_lists(name, pp, v, m), unit, unit, unit, act_bytes=unit)


# ---------------------------------------------------------------------------------------------- the split
def test_balanced_split():
    assert balanced_split(8, 4, [1.0] * 4, [0.0] * 4) == [2, 2, 2, 2]
    # a first stage that holds more besides its blocks (embedding, vision tower) gets fewer of them
    n = balanced_split(12, 4, [1.0] * 4, [3.0, 0.0, 0.0, 0.0])
    assert sum(n) == 12 and n[0] < min(n[1:])
    # blocks that cost more where more micro-batches are in flight (1F1B's first stages) go to the later stages
    n = balanced_split(16, 4, [4.0, 3.0, 2.0, 1.0], [0.0] * 4)
    assert n == sorted(n) and sum(n) == 16
    assert balanced_split(2, 4, [1.0] * 4, [0.0] * 4)[1:3] == [1, 1]  # middle stages take one, the ends may be empty


def test_layout_from_config_fields():
    lay = make_layout(_par(pp_layers_per_stage=[1, 3]), 4, 4)
    assert lay.ranges == ((0, 1), (1, 4)) and lay.local(1) == [1]
    lay = make_layout(_par(pp_schedule="Interleaved1F1B", pp_split_points=[1, 2, 3]), 4, 4)
    assert lay.virtual == 2 and lay.ranges == ((0, 1), (1, 2), (2, 3), (3, 4)) and lay.local(0) == [0, 2]
    lay = make_layout(_par(pp_schedule="ZBVZeroBubble"), 8, 8)
    assert lay.local(0) == [0, 3] and lay.local(1) == [1, 2]  # the V
    assert make_layout(_par(), 5, 2).ranges == ((0, 3), (3, 5))  # no split given: the balance (even here)


@pytest.mark.parametrize("par,n_micro,fsdp,match", [
    (dict(pp_layers_per_stage=[1, 1, 2]), 4, False, "has 3 entries; 2 stages"),
    (dict(pp_layers_per_stage=[1, 2]), 4, False, r"must be >= 0 and sum to the model's 4"),
    (dict(pp_schedule="Interleaved1F1B", pp_layers_per_stage=[1, 0, 2, 1]), 4, False, "leaves a middle stage"),
    (dict(pp_layers_per_stage=[2, 2], pp_split_points=[2]), 4, False, "not both"),
    (dict(pp_split_points=[1, 2]), 4, False, "need 1"),
    (dict(), 1, False, "at least 2"),
    (dict(pp_schedule="1F1B", pp_virtual_stages=2), 4, False, "one stage per rank"),
    (dict(pp_schedule="ZBVZeroBubble", pp_virtual_stages=3), 4, False, "exactly 2 stages per rank"),
    (dict(pp_schedule="Interleaved1F1B", pp_virtual_stages=1), 4, False, "at least 2 stages per rank"),
    (dict(pp_schedule="Bogus"), 4, False, "is not a schedule"),
    (dict(pp_schedule="ZBVZeroBubble"), 4, True, "fsdp_reshard_after_forward = never"),
    (dict(pp_schedule="DualPipeV"), 2, False, "DualPipeV requires at least as many microbatches as stages"),
])
def test_layout_errors_are_one_line(par, n_micro, fsdp, match):
    with pytest.raises(ValueError, match=match) as e:
        make_layout(_par(**par), 4, n_micro, fsdp=fsdp)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- the schedules
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_bubbles_follow_the_textbook(pp, m):
    """Unit costs (forward 1, backward 2 per rank): GPipe and 1F1B (p-1)/(m+p-1), Interleaved1F1B with v stages per
    rank (p-1)/v over m+(p-1)/v; the zero-bubble schedules less than 1F1B."""
    assert _unit_replay("GPipe", pp, m).bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert _unit_replay("1F1B", pp, m).bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert _unit_replay("Interleaved1F1B", pp, m).bubble == pytest.approx((pp - 1) / 2 / (m + (pp - 1) / 2))
    for zb in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert _unit_replay(zb, pp, m).bubble < _unit_replay("1F1B", pp, m).bubble / 2


def test_activations_in_flight():
    """1F1B: stage s holds pp - s micro-batches (torch's loop warms up pp - s forwards); GPipe all of them."""
    t = _unit_replay("1F1B", 4, 8)
    assert [t.in_flight[s] for s in range(4)] == [4, 3, 2, 1]
    assert set(_unit_replay("GPipe", 4, 8).in_flight.values()) == {8}
    zbv = _unit_replay("ZBVZeroBubble", 4, 8)
    assert zbv.peak_bytes[0] <= t.peak_bytes[0]  # rank 0 holds stages 0 and 7: at most 1F1B's first stage


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_stage_runs_its_forwards_in_order(name):
    """What docs/parallel.md states: under every schedule a stage's forwards run micro-batch 0, 1, ..., M-1 (the stage
    modules look their micro-batch up by the index the schedule passes, so this is a fact, not a requirement)."""
    v = virtual_stages(name)
    fwd = {}
    for acts in action_lists(name, 2, v, 8).values():
        for k, s, m in acts:
            if k == "F":
                fwd.setdefault(s, []).append(m)
    assert set(fwd) == set(range(2 * v)) and all(ms == list(range(8)) for ms in fwd.values())


def test_bubble_table_script():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import pp_bubbles

    rows = pp_bubbles.bubble_table(pps=(2,), micro=(8,))
    assert {r["schedule"] for r in rows} == set(SCHEDULES)
    assert all(0 <= r["bubble"] < 0.2 for r in rows)
    assert "| 1F1B | 1 | 2 | 0.111 |" in pp_bubbles.markdown(rows)


# ---------------------------------------------------------------------------------------------- the stage model
def _meta_qwen3(**kw):
    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3")
    cfg = spec.flavor("debug")
    import dataclasses

    cfg = dataclasses.replace(cfg, tie_word_embeddings=False, **kw)
    with torch.device("meta"):
        return spec, cfg, spec.build(cfg)


def test_prune_keeps_names_and_restricts_the_plan():
    spec, cfg, model = _meta_qwen3()
    lay = make_layout(_par(pp_layers_per_stage=[1, 3]), 4, 4)
    b = StageBuilder(spec.plan(cfg), lay, 1, spec.dims(cfg))
    plan = b.prune(model)
    names = {n for n, _ in model.named_parameters()}
    assert all(n.startswith(("layers.1.", "layers.2.", "layers.3.", "norm.", "output.")) for n in names)
    assert "layers.3.attn.wq.weight" in names and not any(n.startswith("tok_embeddings") for n in names)
    assert "tok_embeddings" not in plan.tp and plan.loss_parallel == "output"
    assert b.kept() == ["layers.1", "layers.2", "layers.3", "norm", "output"]
    first = StageBuilder(spec.plan(cfg), lay, 0, spec.dims(cfg))
    _, cfg0, model0 = _meta_qwen3()
    assert first.prune(model0).loss_parallel is None and "output" not in dict(model0.named_modules())


def test_pruned_init_draws_the_full_models_weights():
    """seeded_init under pipeline parallelism: a rank's weights are pp = 1's weights at the same names."""
    from titan_mm.nn.init import seeded_init

    spec, cfg, _ = _meta_qwen3()
    full = spec.build(cfg)
    with torch.no_grad(), seeded_init(7):
        full.init_weights()
    lay = make_layout(_par(pp_layers_per_stage=[3, 1]), 4, 4)
    for rank in (0, 1):
        b = StageBuilder(spec.plan(cfg), lay, rank, spec.dims(cfg))
        with torch.device("meta"):
            model = spec.build(cfg)
        b.prune(model)
        b.modules()
        b.materialize(torch.device("cpu"))
        with torch.device("meta"):
            skeleton = spec.build(cfg)
        with torch.no_grad(), seeded_init(7):
            b.init_weights(skeleton, torch.device("cpu"))
        want = full.state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), k
        assert torch.equal(model.rope_inv_freq, full.rope_inv_freq)


def test_stage_builder_refusals():
    spec, cfg, _ = _meta_qwen3()
    lay = make_layout(_par(), 4, 4)
    import dataclasses

    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied input / output embeddings"):
        StageBuilder(spec.plan(tied), lay, 0, spec.dims(tied))
    with pytest.raises(ValueError, match="names no pp_blocks"):
        StageBuilder(dataclasses.replace(spec.plan(cfg), pp_blocks=None), lay, 0, spec.dims(cfg))
    _, _, model = _meta_qwen3()
    bad = dataclasses.replace(spec.plan(cfg), pp_last=("norm",))  # the output head belongs to no part
    with pytest.raises(ValueError, match="'output.weight' belongs to no pipeline part"):
        StageBuilder(bad, lay, 0, spec.dims(cfg)).prune(model)


# ---------------------------------------------------------------------------------------------- the mesh
def test_parallel_dims_pp():
    from titan_mm.parallel.mesh import ParallelDims

    pd = ParallelDims(world_size=16, pp=2, tp=2)
    assert pd.dp_shard == 4 and pd.pp_enabled
    with pytest.raises(ValueError, match=r"pp\(3\) \* dp_replicate"):
        ParallelDims(world_size=16, pp=3)
    with pytest.raises(ValueError, match="parallel.pp must be an integer >= 1"):
        ParallelDims(world_size=4, pp=0)


def test_pp_microbatches_and_global_batch():
    from titan_mm.config import ConfigError
    from titan_mm.train.setup import grad_accum_steps

    cfg = load_config(["--config", "debug_qwen3.toml", "--training.global_batch_size", "0",
                       "--parallel.pp_microbatches", "8"])
    assert grad_accum_steps(cfg, 2) == 8
    cfg = load_config(["--config", "debug_qwen3.toml", "--training.global_batch_size", "32",
                       "--parallel.pp_microbatches", "8"])
    with pytest.raises(ConfigError, match="set one of them only"):
        grad_accum_steps(cfg, 1)


# ---------------------------------------------------------------------------------------------- the estimator
def _estimate(config, *argv, patches=0):
    from titan_mm.parallel.memory import Topology, estimate_phases
    from titan_mm.registry import resolve_model

    cfg = load_config(["--config", config, "--model.hf_path", "", *argv])
    m, p = cfg.model, cfg.parallel
    spec, mc = resolve_model(m.name, m.flavor, None, m.overrides, attn_backend="flex", kernels="all")
    world = {"qwen3_32b_4d.toml": 64, "qwen3_vl_moe_pp.toml": 16}.get(config, 8)
    ds = p.dp_shard if p.dp_shard > 0 else world // (p.pp * p.tp * p.cp * p.dp_replicate)
    topo = Topology(p.dp_replicate, ds, p.cp, p.tp, p.ep, cfg.activation_checkpoint.mode, p.sequence_parallel,
                    p.encoder_tp, 0, p.fsdp_reshard_after_forward, p.pp, p.pp_schedule, p.pp_virtual_stages,
                    p.pp_microbatches or cfg.training.global_batch_size // (ds * p.dp_replicate))
    assert topo.world == world
    return estimate_phases(mc, spec.plan(mc), topo, cfg.data.seq_len, cfg.data.micro_batch_size, 2, compile=True,
                           vision_patches=patches)


@pytest.mark.parametrize("config,patches", [("qwen3_32b_4d.toml", 0), ("qwen3_vl_moe_pp.toml", 16384)])
def test_recipes_fit_an_h200(config, patches):
    """Every pipeline rank of the 4D recipes fits 90% of an H200 (141 GiB) by the memory estimator."""
    from titan_mm.parallel.memory import GiB

    phases = _estimate(config, patches=patches)
    ranks = {k.split(":")[0] for k in phases}
    assert len(ranks) == {"qwen3_32b_4d.toml": 4, "qwen3_vl_moe_pp.toml": 2}[config]
    worst = max(v["total"] for v in phases.values())
    assert 10 * GiB < worst < 0.9 * 141 * GiB


def test_estimator_pipeline_terms():
    """1F1B's first rank holds more micro-batches' activations than its last; GPipe holds all of them; only the first
    rank has the embedding's backward phase and only the last the loss."""
    def acts(schedule, rank):
        ph = _estimate("qwen3_32b_4d.toml", "--parallel.pp_schedule", schedule, "--parallel.pp_virtual_stages", "0",
                       "--parallel.pp_layers_per_stage", *["16"] * 4)
        return max(v["activations"] for k, v in ph.items() if k.startswith(f"pp{rank}:")), ph

    first, ph = acts("1F1B", 0)
    last, _ = acts("1F1B", 3)
    assert first > 2 * last
    assert acts("GPipe", 3)[0] > 3 * last
    assert any(k == "pp0:embedding_backward" for k in ph) and not any(k == "pp3:embedding_backward" for k in ph)
    assert ph["pp3:forward_end"]["loss"] > 0 == ph["pp0:forward_end"]["loss"]


def test_pp_sim_measures_and_replays():
    """bench/pp_sim.py: the CPU smoke of its measurement (tiny Qwen3), and its replay: with block costs only (no
    embedding / head time, no sends) the simulated bubble is the schedule's own, and the tokens / s follow it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import pp_sim

    m = pp_sim.measure_shape("tiny", pp_sim.TINY, torch.device("cpu"), iters=1)
    assert min(m[k] for k in ("block_fwd_s", "block_bwd_s", "block_bwd_input_s", "block_saved_bytes")) > 0
    assert m["send_bytes"] == 128 * 128 * 4 and m["layers"] == 4
    rows = pp_sim.simulate_shape(m, micro=(4,))
    assert {r["schedule"] for r in rows} >= {"1F1B", "GPipe", "ZBVZeroBubble"}
    ideal = dict(m, send_bytes=0, embed_fwd_s=0.0, embed_bwd_s=0.0, head_fwd_s=0.0, head_bwd_s=0.0,
                 block_fwd_s=1.0, block_bwd_s=2.0, block_bwd_input_s=1.0, name="qwen3_8b", layers=32)
    rows = pp_sim.simulate_shape(ideal, micro=(16,))
    one = next(r for r in rows if r["schedule"] == "1F1B" and r["pp"] == 8)
    assert one["split"] == [4] * 8 and one["bubble"] == pytest.approx(7 / 23)
    inter = next(r for r in rows if r["schedule"] == "Interleaved1F1B" and r["pp"] == 8 and r["v"] == 2)
    assert inter["vs_1f1b"] == pytest.approx((16 + 7) / (16 + 3.5))
