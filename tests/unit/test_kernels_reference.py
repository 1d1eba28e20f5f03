"""Every Triton kernel vs the float64 PyTorch reference, on CPU through TRITON_INTERPRET=1.

The checks run in one child process (titan_mm.tools.kernel_checks.run_in_interpreter) so the interpreter
setting never leaks into the rest of the suite. Inputs are fresh random draws each run (the seed is
printed on failure); outputs start NaN-poisoned. Forward and backward, odd sizes, strided inputs,
ignore-index rows and z-loss for the cross-entropy.
"""

import pytest

from titan_mm.tools.kernel_checks import failures, run_in_interpreter

OPS = ["rms_norm", "add_rms_norm", "swiglu", "rope", "linear_cross_entropy", "bias_gelu"]


@pytest.fixture(scope="module")
def result():
    return run_in_interpreter(OPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(result, op, dtype):
    bad = failures(result, op, dtype)
    assert not bad, "\n".join(bad)


_COL_SUMS = r"""
import torch
from titan_mm.kernels._tl import col_sums
bad = []
for r, d in [(1, 1), (33, 63), (70, 130), (64, 64)]:
    p = torch.randn(r, d, dtype=torch.float32)
    for dt, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]:
        got = col_sums(p, dt)
        want = p.double().sum(0)
        err = ((got.double() - want).norm() / want.norm()).item()
        if got.dtype != dt or got.shape != (d,) or not err < tol:
            bad.append(f"[{r}, {d}] {dt}: rel err {err} dtype {got.dtype} shape {tuple(got.shape)}")
print("BAD" if bad else "OK", bad)
"""


def test_col_sums_in_interpreter():
    """The column-sum launch that finishes the norms' dW and bias-GELU's db (every row and column summed,
    several tiles of rows and columns, the output dtype)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", TITAN_KERNELS_POISON="1")
    out = subprocess.run([sys.executable, "-c", _COL_SUMS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr[-2000:]
