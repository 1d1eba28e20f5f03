"""Shared pieces of the parallel multi-process tests: a tiny stand-in model, packed batches, and a
train loop that returns per-step global losses and full (unsharded) gradients for comparison.

Contract followed (docs/architecture.md): the loss of a micro-batch is ``loss_sum / global_label_tokens``
and data-parallel gradients are summed (parallelize() sets FSDP2 to SUM).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class StandIn(nn.Module):
    """Embedding -> 2 residual MLP blocks -> norm -> head; forward returns the CE loss sum."""

    def __init__(self, vocab=64, d=32, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): _Block(d) for i in range(n_layers)})
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def make_batches(n_steps, batch, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[:, -1] = -100
        labels[torch.rand(batch, seq, generator=g) < 0.2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        g = p.grad
        if g is None:
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def make_optimizer(model, lr=1e-2):
    """SGD with momentum (stateful, so checkpoints carry optimizer state). Not AdamW: its g / (sqrt(v) + eps)
    turns last-bit differences of near-zero gradients (reduction order) into lr-sized updates, which makes
    a 1e-5 comparison of later steps meaningless."""
    return torch.optim.SGD(model.parameters(), lr=lr * 10, momentum=0.9, foreach=False)


def train_steps(model, batches, step_fn, dp_rank=0, dp_size=1, max_norm=1.0, lr=1e-2, loss_group=None,
                select=None, skip_grads=(), opt=None):
    """Run len(batches) optimizer steps (make_optimizer); each rank takes rows dp_rank::dp_size of the global batch.

    ``step_fn(model, local_batch) -> loss_sum``. ``loss_group``: process group over which per-rank loss sums
    are summed (the data-parallel ranks; default: the whole world when dp_size > 1).
    Returns (losses, grads_per_step, norms).
    """
    from titan_mm.parallel.clip import clip_grad_norm_

    if opt is None:
        opt = make_optimizer(model, lr)
    losses, grads, norms = [], [], []
    for gb in batches:
        if select is not None:  # (global batch, dp_rank, dp_size) -> (local batch, global label count)
            local, ntok = select(gb, dp_rank, dp_size)
        else:
            local = {k: (v[dp_rank::dp_size] if v.dim() >= 2 else v) for k, v in gb.items()}
            ntok = (gb["labels"] != -100).sum()
        loss_sum = step_fn(model, local)
        (loss_sum / ntok).backward()
        norm = clip_grad_norm_(model, max_norm)
        ls = loss_sum.detach().clone()
        if isinstance(ls, DTensor):
            ls = ls.full_tensor()
        if dist.is_initialized() and (dp_size > 1 or loss_group is not None):
            dist.all_reduce(ls, group=loss_group)
        losses.append((ls / ntok).item())
        norms.append(float(norm))
        grads.append({k: v for k, v in full_grads(model).items() if not any(x in k for x in skip_grads)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, norms


def assert_close_runs(ref, got, atol=1e-5, rtol=1e-5):
    rl, rg, rn = ref
    gl, gg, gn = got
    for i, (a, b) in enumerate(zip(rl, gl)):
        assert abs(a - b) <= atol + rtol * abs(a), f"step {i}: loss {b} != reference {a}"
    for i, (a, b) in enumerate(zip(rn, gn)):
        assert abs(a - b) <= atol + rtol * abs(a), f"step {i}: grad norm {b} != reference {a}"
    for i, (ra, ga) in enumerate(zip(rg, gg)):
        assert set(ra) == set(ga), f"step {i}: grad names differ: {sorted(set(ra) ^ set(ga))}"
        for k in ra:
            torch.testing.assert_close(ga[k], ra[k], atol=atol, rtol=rtol, msg=lambda m: f"step {i} grad {k}: {m}")


def make_packed_batches(n_steps, batch, seq, vocab, seed=0, max_docs=3):
    """Packed rows: documents of random length, positions restart per document, labels shifted with -100 on
    each document's last token and on padding (doc_id -1 at the end of some rows)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        doc = torch.full((batch, seq), -1, dtype=torch.int32)
        pos = torch.zeros((batch, seq), dtype=torch.int64)
        labels = torch.full((batch, seq), -100, dtype=torch.int64)
        for b in range(batch):
            t, d = 0, 0
            fill = seq - int(torch.randint(0, seq // 4, (1,), generator=g))
            while t < fill:
                n = min(int(torch.randint(3, seq // 2 + 1, (1,), generator=g)), fill - t)
                if d == max_docs - 1:
                    n = fill - t
                doc[b, t : t + n] = d
                pos[b, t : t + n] = torch.arange(n)
                labels[b, t : t + n - 1] = ids[b, t + 1 : t + n]
                t, d = t + n, d + 1
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc})
    return out


def tiny_qwen3_config(moe: bool = False, **kw):
    from titan_mm.models.qwen3.config import Qwen3Config

    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                attn_backend="sdpa", loss_chunk_size=64, moe_aux_loss=False)
    if moe:
        base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    base.update(kw)
    return Qwen3Config(**base)


def build_tiny_qwen3(cfg, seed=0):
    from titan_mm.models.qwen3.model import Qwen3Model

    torch.manual_seed(seed)
    model = Qwen3Model(cfg)
    model.init_weights()
    return model


def qwen3_step(model, b):
    from titan_mm.nn.attention import build_attn_meta

    meta = build_attn_meta(b, "sdpa", "cpu")
    return model(b["input_ids"], position_ids=b["position_ids"], attn=meta, labels=b["labels"]).loss_sum


def run_cells(cells, run_one):
    """Worker side of a grouped launch: ``run_one(*cell[1:])`` for each cell ``(name, ...)`` in turn, in the same
    processes (process start-up, imports and gloo set-up dominate these CPU tests, not the three steps). An
    exception is annotated with its cell's name (the harness reports the traceback)."""
    out = []
    for name, *args in cells:
        try:
            out.append(run_one(*args))
        except Exception as e:
            e.add_note(f"in test cell {name!r}")
            raise
    return out


def check_cells(cells, got, reference):
    """Parent side: every rank's result of every cell equals ``reference(cell)`` (assert_close_runs)."""
    for i, cell in enumerate(cells):
        ref = reference(cell)
        for rank, per_cell in enumerate(got):
            try:
                assert_close_runs(ref, per_cell[i])
            except AssertionError as e:
                raise AssertionError(f"cell {cell[0]!r}, rank {rank}: {e}") from None
