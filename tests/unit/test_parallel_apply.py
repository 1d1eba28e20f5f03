"""parallelize() at world 1: AC modes keep the math, compile wraps in place, float8 on CPU is a clear error."""

import sys
import typing
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiproc"))
from _parallel_common import StandIn, assert_close_runs, make_batches, train_steps  # noqa: E402

from titan_mm.config import ActivationCheckpoint, Compile, Float8, JobConfig  # noqa: E402
from titan_mm.parallel.apply import parallelize  # noqa: E402
from titan_mm.parallel.mesh import ParallelDims  # noqa: E402
from titan_mm.parallel.plan import ParallelizePlan  # noqa: E402

PLAN = ParallelizePlan(fsdp_units=("layers.?",), ac_units=("layers.?",), compile_units=("layers.?",))
BATCHES = make_batches(2, batch=2, seq=16, vocab=64)


def _cfg(**sections):
    """The job config with these sections (every other one at its defaults)."""
    return JobConfig(**sections)


def _run(cfg):
    torch.manual_seed(0)
    m = parallelize(StandIn(), PLAN, ParallelDims(world_size=1), cfg)
    return m, train_steps(m, BATCHES, lambda mod, b: mod(b["input_ids"], b["labels"]))


@pytest.mark.parametrize("mode,opt", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_ac_keeps_the_math(mode, opt):
    _, ref = _run(_cfg())
    m, got = _run(_cfg(activation_checkpoint=ActivationCheckpoint(mode=mode, selective_option=opt)))
    wrapped = [n for n, _ in m.named_modules() if n.endswith("_checkpoint_wrapped_module")]
    assert len(wrapped) == (1 if opt == "2" else 2)
    assert_close_runs(ref, got, atol=1e-6, rtol=1e-6)


def test_ac_num_layers_wraps_the_first_units():
    """activation_checkpoint.num_layers = 1: only the first unit is wrapped, the math is unchanged."""
    _, ref = _run(_cfg())
    m, got = _run(_cfg(activation_checkpoint=ActivationCheckpoint(mode="selective", num_layers=1)))
    wrapped = [n for n, _ in m.named_modules() if n.endswith("_checkpoint_wrapped_module")]
    assert wrapped == ["layers.0._checkpoint_wrapped_module"]
    assert_close_runs(ref, got, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="num_layers must be >= 0"):
        _run(_cfg(activation_checkpoint=ActivationCheckpoint(mode="full", num_layers=-1)))


def test_bad_selective_option():
    with pytest.raises(ValueError, match="selective_option must be 'op' or a positive integer"):
        _run(_cfg(activation_checkpoint=ActivationCheckpoint(mode="selective", selective_option="half")))


def test_compile_in_place_keeps_names():
    torch.manual_seed(0)
    m = parallelize(StandIn(), PLAN, ParallelDims(world_size=1), _cfg(compile=Compile(enable=True)))
    assert m.layers["0"]._compiled_call_impl is not None
    assert "layers.0.up.weight" in dict(m.named_parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_float8_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="float8.enable=true needs a CUDA GPU"):
        parallelize(StandIn(), PLAN, ParallelDims(world_size=1), _cfg(float8=Float8(enable=True)))


def test_every_float8_recipe_is_one_torchao_builds():
    """Every float8.recipe is a torchao recipe name (apply_float8 hands those but tensorwise to from_recipe_name)."""
    from torchao.float8 import Float8LinearConfig

    recipes = typing.get_args(typing.get_type_hints(Float8)["recipe"])
    assert "tensorwise" in recipes and len(recipes) > 1
    for name in recipes:
        assert Float8LinearConfig.from_recipe_name(name) is not None


def test_plan_pattern_matching_nothing_is_an_error():
    bad = ParallelizePlan(ac_units=("blocks.?",))
    with pytest.raises(ValueError, match="no module matches the plan's ac_units"):
        parallelize(StandIn(), bad, ParallelDims(world_size=1), _cfg(activation_checkpoint=ActivationCheckpoint(
            mode="full")))


def test_parallelize_needs_the_job_config():
    with pytest.raises(TypeError, match="needs the titan_mm.config.JobConfig"):
        parallelize(StandIn(), PLAN, ParallelDims(world_size=1), None)


def test_torch_dtype_names():
    from titan_mm.dtypes import torch_dtype

    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'bf16'; expected one of float32, bfloat16, float16"):
        torch_dtype("bf16")
