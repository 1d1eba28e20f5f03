"""The toy family (tests/toy_family): a transformer over continuous vectors with no tokens trains with flow matching
under BAGEL's segment mask, packed, through the real train step, and its loss goes down; its packed forward equals
each document's alone; under context parallelism (its BatchSchema's trailing dims) it equals the whole rows."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiproc"))
from _harness import run_multiproc  # noqa: E402

from tests.toy_family import SCHEMA, SPEC, ToyConfig, toy_batches  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.objectives import FlowMatching  # noqa: E402
from titan_mm import registry  # noqa: E402
from titan_mm.registry import SeqKey, get_model_spec  # noqa: E402
from titan_mm.train.step import StepContext, eval_loss_sums, train_step  # noqa: E402
from titan_mm.train.state import TrainState  # noqa: E402

ROWS, S = 2, 32


class SegmentFlow(FlowMatching):
    """Flow matching under the batch's own segment description (BAGEL's mask)."""

    mask_kind = "segments"


def _state(model):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


@pytest.fixture
def registered(monkeypatch):
    """The toy family is registered for its test only: tests that walk every registered family see the built-in
    ones."""
    monkeypatch.setitem(registry._REGISTRY, SPEC.name, SPEC)


def test_toy_family_trains_with_flow_matching_under_segments(registered):
    spec = get_model_spec("toy_flow")
    assert spec.schema() is SCHEMA and not SCHEMA.tokens
    torch.manual_seed(0)
    cfg = spec.flavor("tiny")
    model = spec.build(cfg)
    ctx = StepContext(device=torch.device("cpu"), objective=SegmentFlow(sampler="uniform", seed=1),
                      seq_keys=SCHEMA.seq)
    held_out = [next(toy_batches(99, ROWS, S))]  # fixed rows; eval_loss_sums draws the noise of step 0
    data = toy_batches(0, ROWS, S)
    first = next(data)
    assert "input_ids" not in first and first["doc_ids"].max() >= 1  # no tokens; several documents in a row

    def held_out_mse():
        sums, counts = eval_loss_sums(model, held_out, ctx)
        return sums["mse"] / counts["mse"]

    before = held_out_mse()
    state = _state(model)
    results = [train_step(state, [first], ctx)] + [train_step(state, [next(data)], ctx) for _ in range(300)]
    after = held_out_mse()
    assert all(r.counts["mse"] > 0 and set(r.terms) == {"mse"} for r in results)
    # untrained: about E|eps - x0|^2 per element (x0 ~ 2 from the conditioning, eps ~ 1); a model that reads the
    # causal segment keeps only what it cannot know (eps at small t); 3.24 -> 0.70 here
    assert after < 0.5 * before, (before, after)


def test_toy_packed_forward_equals_each_document_alone():
    torch.manual_seed(0)
    model = SPEC.build(ToyConfig()).double()
    b = FlowMatching(seed=3).prepare([next(toy_batches(5, 1, S))], 0)[0]
    b = {k: v.double() if v.is_floating_point() else v for k, v in b.items()}
    keys = ("cond", "noisy_latents", "timesteps", "latent_mask")

    def run(batch):
        meta = build_attn_meta(batch, "sdpa", "cpu", kind="segments")
        return model(position_ids=batch["position_ids"], attn=meta, **{k: batch[k] for k in keys}).hidden

    with torch.no_grad():
        packed = run(b)
        doc = b["doc_ids"][0]
        for d in range(int(doc.max()) + 1):
            idx = (doc == d).nonzero()[:, 0]
            alone = {k: b[k][:, idx] for k in keys + ("position_ids", "seg_ids", "seg_kinds")}
            torch.testing.assert_close(packed[:, idx], run(alone), atol=1e-12, rtol=1e-12)


# ---- context parallelism: the schema's trailing dims let the split cut latents [B, S, C] on S (world 2, gloo) ----

FLOW_SEQ = SCHEMA.seq + (SeqKey("noisy_latents", ("C",)), SeqKey("flow_target", ("C",)), SeqKey("timesteps"),
                         SeqKey("flow_weight"))  # the objective's prepared keys along the sequence
MODES = ("ulysses", "allgather", "ring")


def _toy_cp_worker(rank, world, batch):
    from titan_mm.parallel.cp import prepare_cp_batch
    from titan_mm.parallel.mesh import ParallelDims

    pd = ParallelDims(world_size=world, dp_shard=1, cp=world)
    out = []
    for mode in MODES:
        torch.manual_seed(0)
        model = SPEC.build(ToyConfig())
        local, meta = prepare_cp_batch(batch, pd, "sdpa", "cpu", mode=mode, seq_keys=FLOW_SEQ, kind="segments")
        mse = _toy_mse(model, local, meta)
        mse.backward()
        out.append((mse.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


def _toy_mse(model, b, meta):
    obj = FlowMatching()
    keys = ("cond", "noisy_latents", "timesteps", "latent_mask")
    out = model(position_ids=b["position_ids"], attn=meta, loss=obj.bind(b), **{k: b[k] for k in keys})
    return out.terms["mse"]


def test_toy_family_under_cp_equals_the_whole_rows():
    batch = FlowMatching(seed=2).prepare([next(toy_batches(7, ROWS, S))], 0)[0]
    torch.manual_seed(0)
    model = SPEC.build(ToyConfig())
    ref = _toy_mse(model, batch, build_attn_meta(batch, "sdpa", "cpu", kind="segments"))
    ref.backward()
    got = run_multiproc(_toy_cp_worker, 2, args=(batch,))
    for i, mode in enumerate(MODES):  # each rank's sum covers its own positions; the gradients add up
        torch.testing.assert_close(got[0][i][0] + got[1][i][0], ref.detach(), atol=1e-5, rtol=1e-5)
        for p, g0, g1 in zip(model.parameters(), got[0][i][1], got[1][i][1]):
            torch.testing.assert_close(g0 + g1, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{mode}: {m}")
