"""Triton kernels (compile opcheck) vs the float64 PyTorch reference, on CPU through TRITON_INTERPRET=1.

graph: the ops are torch.library.triton_ops, so torch.compile's AOT graphs of a Qwen3 block hold the kernel
launches as triton_kernel_wrapper_* nodes (not opaque titan_mm.* calls) with the Tuner's cached launch config,
picked without timing while tracing (titan_mm.tools.kernel_checks.check_graph). On CPU torch cannot compile the
kernels to TTIR to find what they write, so the interpreter child uses the kernels' declared outputs.

The checks run in a child process (titan_mm.tools.kernel_checks.run_in_interpreter) so the interpreter
setting never leaks into the rest of the suite. Inputs are fresh random draws each run (the seed is
printed on failure); outputs start NaN-poisoned. Forward and backward, odd sizes, strided inputs.
"""

import pytest

from titan_mm.tools.kernel_checks import failures, run_in_interpreter

OPS = ["compile", "opcheck", "graph"]


@pytest.fixture(scope="module")
def result():
    return run_in_interpreter(OPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(result, op, dtype):
    bad = failures(result, op, dtype)
    assert not bad, "\n".join(bad)
