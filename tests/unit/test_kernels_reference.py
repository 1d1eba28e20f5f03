"""Every Triton kernel vs the float64 PyTorch reference, on CPU through TRITON_INTERPRET=1.

The checks run in one child process (titan_mm.kernels.testing.run_in_interpreter) so the interpreter
setting never leaks into the rest of the suite. Inputs are fresh random draws each run (the seed is
printed on failure); outputs start NaN-poisoned. Forward and backward, odd sizes, strided inputs,
ignore-index rows and z-loss for the cross-entropy.
"""

import pytest

from titan_mm.kernels.testing import failures, run_in_interpreter

OPS = ["rms_norm", "add_rms_norm", "swiglu", "rope", "mrope", "linear_cross_entropy", "bias_gelu"]



@pytest.fixture(scope="module")
def result():
    return run_in_interpreter(OPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(result, op, dtype):
    bad = failures(result, op, dtype)
    assert not bad, "\n".join(bad)
