"""The toy family (tests/toy_family): a transformer over continuous vectors with no tokens trains with flow matching
under BAGEL's segment mask, packed, through the real train step, and its loss goes down; its packed forward equals
each document's alone; under context parallelism (its BatchSchema's trailing dims) it equals the whole rows; and
data.balance cuts, prices and re-places its rows along the same schema."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiproc"))
from _harness import run_multiproc  # noqa: E402

from tests.toy_family import SCHEMA, SPEC, ToyConfig, toy_batches, toy_collate, toy_doc  # noqa: E402
from titan_mm.data.balance import CostCoefficients, place  # noqa: E402
from titan_mm.nn.attention import build_attn_meta  # noqa: E402
from titan_mm.objectives import FlowMatching  # noqa: E402
from titan_mm.parallel.balance_dispatch import Rebalancer, join_rows, row_cost, split_rows  # noqa: E402
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


# ---- data.balance: rows without tokens are cut, priced and re-placed along the BatchSchema (world 2, gloo) ----

S_BAL = 40  # three toy docs (at most 11 each) fit a row


def _toy_rows(n_docs: list[int], seed: int = 11) -> list[list]:
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(1234).standard_normal((4, 4)).astype(np.float32)
    return [[toy_doc(rng, mix, f"{r}.{k}") for k in range(n)] for r, n in enumerate(n_docs)]


def test_toy_rows_split_and_join_along_the_schema():
    """A batch without input_ids: every schema key (cond / latents [B, S, C], latent_mask, noise_unit, the segment
    keys) is cut at its row axis; joined back, in any order, the rows are the batch collate_rows builds of their
    docs, bit for bit."""
    rows = _toy_rows([2, 1, 3, 2])
    batch = toy_collate(rows, S_BAL)
    split = split_rows(batch, {}, 1, SCHEMA)
    assert "input_ids" not in split[0] and split[0]["latents"].shape == (S_BAL, 4)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        got, want = join_rows([split[i] for i in order], SCHEMA), toy_collate([rows[i] for i in order], S_BAL)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert [row_cost(r).tokens for r in split] == [sum(len(d) for d in docs) for docs in rows]
    with pytest.raises(ValueError, match=r"keys \['extra'\] have no row split"):
        split_rows({**batch, "extra": torch.zeros(2, 3)}, {}, 1, SCHEMA)


BAL_COEFFS = CostCoefficients(a_tok=1e-6, a_attn=1e-8)
BAL_ROWS = [3, 3, 3, 3, 1, 1, 1, 1]  # docs per global row: the loader gives rank 0 every heavy row
N_MICRO, B_BAL = 2, 2


def _toy_balance_worker(rank, world, micro):
    reb = Rebalancer("kk", BAL_COEFFS, {}, 1, None, rank, world, torch.device("cpu"), SCHEMA)
    return reb(micro[rank]), reb.metrics(0.0, measure=False)


@pytest.mark.slow  # ~10 s of process start-up on a quiet 2-core machine, 30-40 s on the shared one
def test_toy_family_with_balance_on():
    """data.balance = "kk" over 2 ranks x 2 micro-batches of 2 rows: each rank gets the micro-batches of the placed
    rows, each exactly the batch collate_rows builds of those rows' docs (so every row's loss is the one it had where
    the loader put it), and the predicted imbalance drops."""
    rows = _toy_rows(BAL_ROWS)
    per = N_MICRO * B_BAL
    micro = [[toy_collate(rows[r * per + m * B_BAL:r * per + (m + 1) * B_BAL], S_BAL) for m in range(N_MICRO)]
             for r in range(2)]
    costs = BAL_COEFFS.costs([row_cost(r) for r in split_rows(toy_collate(rows, S_BAL), {}, 1, SCHEMA)])
    slots = place(costs, 2, N_MICRO, "kk")
    got = run_multiproc(_toy_balance_worker, 2, args=(micro,))
    moved = 0
    for rank, (out, metrics) in enumerate(got):
        assert len(out) == N_MICRO
        for m, mb in enumerate(out):
            want = toy_collate([rows[int(i)] for i in slots[rank, m]], S_BAL)
            assert sorted(mb) == sorted(want) and all(torch.equal(mb[k], want[k]) for k in want)
            moved += not torch.equal(mb["latents"], micro[rank][m]["latents"])
        assert metrics["balance/pred_imbalance_after"] < metrics["balance/pred_imbalance_before"]
    assert moved > 0
