"""Objectives (titan_mm/objectives): the causal LM through the step is the labels path bit for bit; flow matching's
prepare follows its formulas (t per noise unit from each sampler, x_t, the velocity target, weights, counts) with
noise seeded by (seed, step, global slot); a combined objective (cross-entropy on tokens + velocity MSE on latents in
one packed row) divides each term by its own global count, so accumulation equals one big batch; build_objective's
choices and its one-line mistakes."""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from titan_mm.config import ConfigError, load_config
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.nn.output import ModelOutput
from titan_mm.objectives import CausalLM, Combined, FlowMatching, build_objective, noise_generator
from titan_mm.registry import get_model_spec, resolve_model
from titan_mm.train.state import TrainState
from titan_mm.train.step import StepContext, forward_backward, train_step
from titan_mm.train.synthetic import SyntheticLoader

V, C, D = 32, 3, 8


class TextAndLatents(nn.Module):
    """A position-wise family with both hooks: tokens and latents in one row (BAGEL's shape in miniature)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lat = nn.Embedding(V, D), nn.Linear(C + 1, D)
        self.mix, self.out, self.vel = nn.Linear(D, D), nn.Linear(D, V, bias=False), nn.Linear(D, C)

    def forward(self, input_ids, position_ids=None, attn=None, loss=None, noisy_latents=None, timesteps=None,
                latent_mask=None):
        x = self.lat(torch.cat([noisy_latents, timesteps[..., None].to(noisy_latents.dtype)], -1))
        h = torch.tanh(self.mix(torch.where(latent_mask[..., None], x, self.emb(input_ids))))
        out = ModelOutput(logits=None, loss_sum=None, aux_loss=None, hidden=h)
        return out._replace(terms=loss(self, out))

    def lm_loss(self, h, targets, weights=None, index=None):
        return chunked_cross_entropy(h.reshape(-1, D), self.out.weight, targets.reshape(-1), chunk_size=7)

    def predict_velocity(self, out, batch):
        return self.vel(out.hidden)


def mixed_batch(seed: int, B: int = 2, S: int = 12) -> dict:
    """Rows of tokens with a latent segment (two noise units in row 0, one in row 1); tokens are labeled, latents
    are not."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.bool)
    unit = torch.full((B, S), -1)
    mask[0, 3:6], unit[0, 3:6] = True, 0
    mask[0, 8:10], unit[0, 8:10] = True, 1
    mask[1, 2:2 + seed % 4 + 2], unit[1, 2:2 + seed % 4 + 2] = True, 0
    labels = torch.randint(0, V, (B, S), generator=g).masked_fill(mask, -100)
    labels[:, -(seed % 3 + 1):] = -100
    return {"input_ids": torch.randint(0, V, (B, S), generator=g), "labels": labels,
            "num_label_tokens": (labels != -100).sum(), "latents": torch.randn(B, S, C, generator=g,
                                                                                dtype=torch.float64),
            "latent_mask": mask, "noise_unit": unit}


def merge(mbs: list[dict]) -> dict:
    """The rows of ``mbs`` as one micro-batch (counts added)."""
    return {k: sum(b[k] for b in mbs) if v.dim() == 0 else torch.cat([b[k] for b in mbs]) for k, v in mbs[0].items()}


@pytest.mark.parametrize("sampler", ["uniform", "logit_normal", "shifted"])
def test_flow_matching_prepare_follows_the_formulas(sampler):
    obj = FlowMatching(sampler=sampler, shift=3.0, mean=0.5, std=2.0, weighting="cosmap", seed=11)
    mb = mixed_batch(1)
    out = obj.prepare([mb], 4, dp_rank=1)[0]  # one micro-batch per rank: global slot 1
    g = noise_generator(11, 4, 1, "/flow_matching")
    if sampler == "uniform":
        s = torch.rand(2, 2, generator=g)
    else:
        n = torch.randn(2, 2, generator=g)
        s = torch.sigmoid(0.5 + 2.0 * n) if sampler == "logit_normal" else torch.sigmoid(n)
    t_BU = 3.0 * s / (1 + 2.0 * s)  # every sampler's t, shifted
    eps = torch.randn(2, 12, C, generator=g)
    m, x0 = mb["latent_mask"], mb["latents"]
    for b, s_ in ((0, slice(3, 6)), (0, slice(8, 10)), (1, slice(2, 5))):
        t = t_BU[b, int(mb["noise_unit"][b, s_][0])]
        assert bool((out["timesteps"][b, s_] == t).all())  # one t per (row, unit)
        assert bool((out["flow_weight"][b, s_] == 2 / (math.pi * (1 - 2 * t + 2 * t * t))).all())  # fp32, as t
        t, e = t.double(), eps[b, s_].double()  # fp64 latents mix in fp64
        assert torch.equal(out["noisy_latents"][b, s_], (1 - t) * x0[b, s_] + t * e)
        assert torch.equal(out["flow_target"][b, s_], e - x0[b, s_])
    assert bool((out["timesteps"][~m] == 0).all() and (out["noisy_latents"][~m] == 0).all())
    assert bool((out["flow_weight"][~m] == 0).all() and (out["flow_target"][~m] == 0).all())
    assert obj.counts(out) == {"mse": int(m.sum()) * C} and out["noisy_latents"].dtype == torch.float64


def test_flow_matching_noise_is_seeded_by_step_and_global_slot():
    obj = FlowMatching(seed=2)
    mbs = [mixed_batch(s) for s in range(4)]
    one_rank = obj.prepare(mbs, 5, dp_rank=0)  # 4 micro-batches on 1 rank == rank 1 of 2 reading slots 2, 3
    other = obj.prepare(mbs[2:], 5, dp_rank=1)
    for x, y in zip(one_rank[2:], other):
        assert all(torch.equal(x[k], y[k]) for k in ("noisy_latents", "timesteps", "flow_target"))
    assert not torch.equal(one_rank[2]["timesteps"], obj.prepare(mbs, 6)[2]["timesteps"])
    with pytest.raises(ValueError, match="needs batch field 'noise_unit'"):
        obj.prepare([{k: v for k, v in mbs[0].items() if k != "noise_unit"}], 0)


def _mixed_ctx():
    return StepContext(device=torch.device("cpu"), objective=Combined((CausalLM(), FlowMatching(seed=4))))


def test_combined_terms_are_each_divided_by_their_own_global_count():
    """Cross-entropy on the tokens over the label count, velocity MSE on the latents over the latent elements:
    the step's terms equal the written-out means, and 2 unequal micro-batches accumulate to the merged batch's
    gradient (a float64 model: the gradients differ only in the order of their sums; the logged term sums are
    reduced in fp32)."""
    torch.manual_seed(0)
    model = TextAndLatents().double()
    ctx = _mixed_ctx()
    mbs = [mixed_batch(1), mixed_batch(2)]
    prepared = ctx.objective.prepare(mbs, 0)
    n_ce = sum(int(b["num_label_tokens"]) for b in prepared)
    n_mse = sum(int(b["latent_mask"].sum()) * C for b in prepared)
    ce = mse = 0.0
    with torch.no_grad():
        for b in prepared:
            h = model(b["input_ids"], loss=lambda m, o: {}, noisy_latents=b["noisy_latents"],
                      timesteps=b["timesteps"], latent_mask=b["latent_mask"]).hidden
            keep = b["labels"] != -100
            ce += float(nn.functional.cross_entropy(model.out(h[keep]), b["labels"][keep], reduction="sum"))
            mse += float(((model.vel(h) - b["flow_target"]).square().sum(-1) * b["latent_mask"]).sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    state = TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    res = train_step(state, mbs, ctx)
    assert res.counts == {"ce": n_ce, "mse": n_mse} and list(res.terms) == ["ce", "mse"]
    fp32 = 3 * 2.0**-24  # the step reduces the term sums in fp32: each micro-batch's sum rounded, then their sum
    assert math.isclose(res.terms["ce"], ce / n_ce, rel_tol=fp32)
    assert math.isclose(res.terms["mse"], mse / n_mse, rel_tol=fp32)
    assert res.loss == res.terms["ce"] + res.terms["mse"]

    grads = []
    for batches in (prepared, [merge(prepared)]):
        model.zero_grad(set_to_none=True)
        sums, _ = forward_backward(model, batches, ctx, {"ce": n_ce, "mse": n_mse})
        grads.append((sums, {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=2 * fp32, atol=0)
    for k, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][k], rtol=1e-10, atol=1e-14)


def test_causal_objective_is_the_labels_path_bit_for_bit():
    """The step's causal LM (objective hook lm_loss inside the forward) gives the loss and gradients of the
    forward's labels path divided by the global label count, exactly (the same operations)."""
    spec, cfg = resolve_model("qwen3", "debug", overrides={"vocab_size": 256, "num_hidden_layers": 2})
    torch.manual_seed(0)
    a, b = spec.build(cfg), spec.build(cfg)
    a.init_weights()
    b.load_state_dict(a.state_dict())
    mbs = list(SyntheticLoader(vocab_size=256, seq_len=24, micro_batch_size=2, n_micro=2, seed=3).batch(0)
               for _ in range(1))
    n = int(mbs[0]["num_label_tokens"])
    meta = build_attn_meta(mbs[0], "sdpa", "cpu")
    ref = b(mbs[0]["input_ids"], position_ids=mbs[0]["position_ids"], attn=meta, labels=mbs[0]["labels"]).loss_sum
    (ref.float() / float(n)).backward()
    sums, _ = forward_backward(a, mbs, StepContext(device=torch.device("cpu")), {"ce": n})
    assert torch.equal(sums, ref.detach().float().reshape(1))
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), k


def test_build_objective_choices_and_mistakes():
    cfg = load_config(["--config", "debug_qwen3"])
    spec = get_model_spec("qwen3")
    mc = spec.flavor("debug")
    assert isinstance(build_objective(cfg, spec, mc), CausalLM)
    both = dataclasses.replace(spec, objectives=("causal", "flow_matching"),
                               objective_options=lambda c: {"flow_matching": {"sampler": "shifted", "shift": 3.0}})
    obj = build_objective(cfg, both, mc)
    assert obj.terms == ("ce", "mse") and obj.mask_kind == "causal" and obj.parts[1].shift == 3.0
    for o in (obj, FlowMatching()):  # causal or the family's own mask: the family's FLOPs as they are
        assert o.flops(spec, mc, [7, 9]) == spec.flops(mc, [7, 9])
    dllm = load_config(["--config", "debug_dllm_qwen3"])
    with pytest.raises(ConfigError, match="replaces the causal LM, which model 'qwen3' does not train"):
        build_objective(dllm, dataclasses.replace(spec, objectives=("flow_matching",)), mc)
    with pytest.raises(ConfigError, match="unknown objective 'flow'; did you mean 'flow_matching'"):
        build_objective(cfg, dataclasses.replace(spec, objectives=("flow",)), mc)
    bad = dataclasses.replace(both, objective_options=lambda c: {"flow_matching": {"sampler": "cosine"}})
    with pytest.raises(ConfigError, match="flow matching sampler 'cosine' is unknown"):
        build_objective(cfg, bad, mc)
    with pytest.raises(ConfigError, match="name a loss term twice"):
        build_objective(cfg, dataclasses.replace(spec, objectives=("causal", "causal")), mc)
