"""Optimizer parameter groups and learning-rate schedules."""

import math

import pytest
import torch

from titan_mm.config import JobConfig, LRScheduler
from titan_mm.registry import get_model_spec
from titan_mm.train.optim import build_lr_scheduler, build_optimizer, build_param_groups, lr_factor


def _model(tied=True):
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"].replace(vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                        head_dim=8, tie_word_embeddings=tied, attention_bias=True)
    with torch.device("meta"):
        return spec.build(cfg)


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [True, False])
def test_weight_decay_groups(tied):
    m = _model(tied)
    cfg = JobConfig()
    groups = {g["name"]: g for g in build_param_groups(m, cfg)}
    decay, no = _names(m, groups["decay"]), _names(m, groups["no_decay"])
    assert not decay & no
    assert len(decay | no) == len({id(p) for p in m.parameters()}) or tied
    assert all("norm" not in n and not n.endswith(".bias") and "embed" not in n for n in decay)
    assert any("norm" in n for n in no) and any(n.endswith(".bias") for n in no)
    assert any("embed" in n for n in no)
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == cfg.optimizer.weight_decay
    cfg.optimizer.decay_norms_and_biases = True
    cfg.optimizer.decay_embeddings = True
    groups = build_param_groups(m, cfg)
    assert [g["name"] for g in groups] == ["decay"]


def test_adamw_impl_choice():
    spec = get_model_spec("qwen3")
    m = spec.build(spec.flavors["debug"].replace(vocab_size=64, num_hidden_layers=1, hidden_size=32,
                                                  intermediate_size=64, head_dim=8))
    cfg = JobConfig()
    opt = build_optimizer(m, cfg)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["foreach"] is True
    cfg.optimizer.implementation = "fused"
    with pytest.raises(ValueError, match="fused.*CUDA"):
        build_optimizer(m, cfg)


def test_schedules():
    s = LRScheduler(name="cosine", warmup_steps=10, min_lr_factor=0.1)
    f = [lr_factor(i, 100, s) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[99] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    s = LRScheduler(name="wsd", warmup_steps=10, decay_ratio=0.2, min_lr_factor=0.0)
    f = [lr_factor(i, 100, s) for i in range(100)]
    assert all(x == 1.0 for x in f[10:80]) and f[99] == pytest.approx(0.0) and 0 < f[90] < 1
    s = LRScheduler(name="wsd", decay_ratio=0.5, decay_type="sqrt", min_lr_factor=0.0)
    assert lr_factor(74, 100, s) == pytest.approx(1 - math.sqrt(0.5))
    s = LRScheduler(name="constant", warmup_steps=4, warmup_start_factor=0.5)
    assert [lr_factor(i, 10, s) for i in (0, 3, 4, 9)] == [pytest.approx(0.625), 1.0, 1.0, 1.0]
    s = LRScheduler(name="linear", min_lr_factor=0.0)
    assert lr_factor(50, 100, s) == pytest.approx(0.5)


def test_scheduler_state_does_not_pin_schedule():
    """A resumed run takes its schedule from its own config, only the step count from the checkpoint."""
    spec = get_model_spec("qwen3")
    m = spec.build(spec.flavors["debug"].replace(vocab_size=64, num_hidden_layers=1, hidden_size=32,
                                                  intermediate_size=64, head_dim=8))
    cfg = JobConfig()
    cfg.training.steps = 10
    opt = build_optimizer(m, cfg)
    sch = build_lr_scheduler(opt, cfg)
    for _ in range(3):
        opt.step()
        sch.step()
    sd = sch.state_dict()
    cfg.training.steps = 1000
    opt2 = build_optimizer(m, cfg)
    sch2 = build_lr_scheduler(opt2, cfg)
    sch2.load_state_dict(sd)
    assert sch2.last_epoch == 3
    assert sch2.lr_lambdas[0](5) == lr_factor(5, 1000, cfg.lr_scheduler)
