"""titan_mm.kernels.greedy_pick, serving's greedy rows: the Triton kernel (one pass per row, online logsumexp) equals
the PyTorch reference (argmax, logit - logsumexp) through TRITON_INTERPRET=1: fp32 / bf16 / fp16 logits, a vocabulary
that is not a multiple of the block, ties (the first index wins, as torch.argmax), the max in a late block, and
rows of a wider tensor (a row stride)."""

from __future__ import annotations

from tests.triton_interp import run_interpreted

_INTERP = r"""
import torch
from titan_mm.kernels import greedy_pick
from titan_mm.kernels import greedy as G
G.BLOCK = 256  # several blocks per row at test sizes
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for R, V in ((1, 1000), (5, 777), (3, 256)):
        x = (3 * torch.randn(R, V + 7, generator=g)).to(dtype)[:, :V]  # a row stride past V
        x[0, 5] = x[0, 600 % V] = x[0].max() + 1  # a tie across blocks: the first index wins
        if R > 1:
            x[1, V - 1] = x[1].max() + 2  # the max in the last, partial block
        tok, lp = G.greedy_pick(x)  # the kernel itself
        assert all(torch.equal(a, b) for a, b in zip(greedy_pick(x), (tok, lp)))  # the dispatch takes it
        ref = x.float()
        want = ref.argmax(1)
        assert torch.equal(tok, want), (dtype, R, V, tok, want)
        assert tok[0] == 5
        wlp = ref.gather(1, want[:, None])[:, 0] - ref.logsumexp(1)
        assert torch.allclose(lp, wlp, atol=1e-5, rtol=1e-5), (lp, wlp)
print("OK")
"""


def test_greedy_pick_kernel_equals_the_reference():
    run_interpreted(_INTERP)
