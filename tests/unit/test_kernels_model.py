"""Integration: a tiny Qwen3 with kernels=True (every op through the Triton interpreter on CPU) equals the
same model with kernels=False: loss_sum and every parameter gradient, fp32."""

import pytest

from titan_mm.kernels.testing import failures, run_in_interpreter

pytest.importorskip("titan_mm.models.qwen3.model")


def test_qwen3_kernels_on_equals_off():
    result = run_in_interpreter(["model"])
    bad = failures(result, "model", "float32")
    assert not bad, "\n".join(bad)
