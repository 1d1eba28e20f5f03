"""Qwen3 on the GPU: one forward+backward of the 1.7B flavor and of the 30B-A3B layer shapes (4 layers)
in bf16, every block compiled with torch.compile(fullgraph=True) (a graph break raises), and the timed
forward run under torch.cuda.set_sync_debug_mode("error") (a host sync raises). With kernels on, the
launch configs are tuned before the first step (titan_mm.kernels.tune_for_model), as the trainer does.

Run on the H200:  PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_qwen3_gpu.py -s
(split with -k "1p7b" / -k "30b" if one call must stay under 10 minutes; each case compiles its blocks.)
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from titan_mm.nn import moe as moe_mod
from titan_mm.nn.attention import build_attn_meta
from titan_mm.registry import get_model_spec, spec_for_config

pytestmark = pytest.mark.gpu


def _packed_batch(doc_lens, S, B, vocab):
    """B rows, each packing ``doc_lens`` then padding, in the data pipeline's batch format (CPU)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.zeros(B, S, dtype=torch.long)
    doc = torch.full((B, S), -1, dtype=torch.int32)
    segs = []
    for b in range(B):
        o = 0
        for d, L in enumerate(doc_lens):
            pos[b, o : o + L] = torch.arange(L)
            doc[b, o : o + L] = d
            o += L
            segs.append(L)
        if S > o:
            segs.append(S - o)
    labels = ids.roll(-1, 1).masked_fill(doc < 0, -100)
    cu = torch.tensor([0] + torch.tensor(segs).cumsum(0).tolist(), dtype=torch.int32)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc, "cu_seqlens": cu,
            "max_seqlen": torch.tensor(max(segs)), "num_label_tokens": (labels != -100).sum()}


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _run(cfg, backend, S=2048, B=2, doc_lens=(700, 900, 300)):
    torch.manual_seed(0)
    torch._dynamo.reset()
    dev = torch.device("cuda")
    spec = get_model_spec("qwen3")
    cfg = cfg.replace(attn_backend=backend)
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device=dev)
    model.to(torch.bfloat16)
    model.init_weights(buffer_device=dev)  # rope buffer recomputed in fp32
    assert model.rope_inv_freq.dtype == torch.float32
    for block in model.layers.values():
        block.compile(fullgraph=True)

    tune = None
    if cfg.kernels:  # launch configs picked before the steps, as the trainer does (the forward never tunes)
        from titan_mm import kernels as K
        from titan_mm.kernels import _utils

        _utils.reset_tuning()
        spec = spec_for_config(cfg)
        tune = K.tune_for_model(spec.kernel_shapes(cfg), spec.runtime(cfg).kernels, B * S, torch.bfloat16, dev)

    batch = _packed_batch(list(doc_lens), S, B, cfg.vocab_size)
    meta = build_attn_meta(batch, backend, dev, sliding_window=cfg.attn_sliding_window)
    ids, pos, labels = (batch[k].to(dev) for k in ("input_ids", "position_ids", "labels"))
    n_lab = int(batch["num_label_tokens"])

    def step(check_syncs: bool):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if check_syncs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(ids, position_ids=pos, attn=meta, labels=labels)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        loss = out.loss_sum / n_lab + out.aux_loss
        loss.backward()
        torch.cuda.synchronize()
        return loss.item()

    t0 = time.perf_counter()
    step(check_syncs=False)  # compiles every block (compilation itself may sync)
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = step(check_syncs=True)
    t_step = time.perf_counter() - t0
    assert math.isfinite(loss) and abs(loss - math.log(cfg.vocab_size)) < 1.5, loss
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    mem = torch.cuda.max_memory_allocated() / 2**30
    print(f"\n[qwen3 gpu] layers={cfg.num_hidden_layers} moe={cfg.is_moe} backend={backend} kernels={cfg.kernels} "
          f"loss={loss:.4f} "
          f"first(compile)={t_compile:.1f}s step={t_step * 1e3:.0f}ms peak_mem={mem:.1f}GiB "
          f"grouped_mm={moe_mod._use_grouped_mm(torch.empty(1, device=dev, dtype=torch.bfloat16))}")
    if tune is not None:  # keys the steps met that tune_for_model missed run config 0 (slower, not wrong)
        print(f"[qwen3 gpu] kernels tuned in {tune['seconds']:.1f}s: {tune['tuned']}; skipped {tune['skipped']}; "
              f"untuned keys met by the steps: {K.untuned_keys()}")
    return loss


@pytest.mark.parametrize("backend,kernels", [("flex", False), ("varlen", False), ("sdpa", False), ("flex", True)],
                         ids=["flex", "varlen", "sdpa", "flex-kernels"])
def test_qwen3_1p7b_fwd_bwd_compiled_no_syncs(backend, kernels):
    if backend == "varlen" and not _varlen_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    _run(get_model_spec("qwen3").flavor("1.7B").replace(kernels=kernels), backend)


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_qwen3_30b_a3b_layers_fwd_bwd_compiled_no_syncs(backend):
    if backend == "varlen" and not _varlen_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    cfg = get_model_spec("qwen3_moe").flavor("30B-A3B").replace(num_hidden_layers=4)
    _run(cfg, backend)
