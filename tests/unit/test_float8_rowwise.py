"""titan_mm.quant.rowwise (float8.rowwise_casts = "titan") on the CPU: the linear's three float8 GEMMs are the
products of its operands' rowwise e4m3 casts (torch._scaled_mm runs on the CPU; the casts take titan_mm.nn.fp8's
reference there), the swap keeps the parameters and state-dict keys, torch.compile traces it in one graph, and the
config refuses it where it does not apply. The transposed cast kernel, fp8_cols, is checked bit-equal to fp8_rows of
the transpose in Triton's interpreter; on CUDA: tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.triton_interp import run_interpreted
from titan_mm.config import ConfigError, load_config
from titan_mm.kernels import fp8_cast
from titan_mm.quant.rowwise import Float8RowwiseLinear, to_rowwise


def _deq(t: torch.Tensor, cols: bool = False) -> torch.Tensor:
    q, s = fp8_cast(t, cols)
    return q.double() * s.double()


def _close(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """got = a @ b.T of the dequantized operands, up to fp32 sums in another order (k roundings of the terms)."""
    ref = a @ b.t()
    tol = (a.abs() @ b.abs().t()) * (a.shape[1] * 2.0**-24) + 1e-30
    assert ((got.double() - ref).abs() <= tol).all(), ((got.double() - ref).abs() / tol).max()


@pytest.mark.parametrize("tokens", [32, 20], ids=["rows%16", "ragged"])
def test_the_three_gemms_are_the_products_of_the_casts(tokens):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    to_rowwise(lin, lambda m, fqn: True)
    x = (torch.randn(tokens, 64) * torch.logspace(-2, 2, 64)).requires_grad_()
    g = torch.randn(tokens, 48)
    y = lin(x)
    y.backward(g)
    _close(y - lin.bias, _deq(x), _deq(lin.weight))
    _close(x.grad, _deq(g), _deq(lin.weight, cols=True))
    if tokens % 16:  # the float8 GEMM needs its reduction (the tokens) a multiple of 16: dw in x's dtype
        torch.testing.assert_close(lin.weight.grad, g.t() @ x.detach(), rtol=1e-6, atol=1e-6)
    else:
        _close(lin.weight.grad, _deq(g, cols=True), _deq(x, cols=True))
    torch.testing.assert_close(lin.bias.grad, g.sum(0))


def test_float8_is_close_to_the_linear():
    """e4m3 keeps 3 mantissa bits: each operand within 2^-4 of itself, the product of random rows within a few %."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False)
    ref = lin(x := torch.randn(64, 256))
    to_rowwise(lin, lambda m, fqn: True)
    assert ((lin(x) - ref).norm() / ref.norm()).item() < 0.05


def test_swap_keeps_parameters_and_keys_and_skips_what_keep_refuses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert to_rowwise(model, lambda m, fqn: fqn != "2") == 1
    assert type(model[0]) is Float8RowwiseLinear and type(model[2]) is nn.Linear
    assert [id(p) for p in model.parameters()] == params
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_compiles_in_one_graph():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    to_rowwise(lin, lambda m, fqn: True)
    x = torch.randn(2, 16, 64, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    y = lin(x)
    y.sum().backward()
    wg = lin.weight.grad.clone()
    lin.weight.grad = None
    yc = torch.compile(lin, backend="aot_eager", fullgraph=True)(xc)
    yc.sum().backward()
    assert torch.equal(yc, y) and torch.equal(xc.grad, x.grad) and torch.equal(lin.weight.grad, wg)


def test_config_refuses_it_off_rowwise_and_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="rowwise_casts='titan' is for float8.recipe='rowwise'"):
        load_config(["--float8.rowwise_casts", "titan"])
    with pytest.raises(ConfigError, match="no tensor-parallel linear"):
        load_config(["--float8.enable", "true", "--float8.recipe", "rowwise", "--float8.rowwise_casts", "titan",
                     "--parallel.tp", "2"])
    cfg = load_config(["--float8.enable", "true", "--float8.recipe", "rowwise", "--float8.rowwise_casts", "titan"])
    assert cfg.float8.rowwise_casts == "titan"


COLS = r"""
import torch
from titan_mm.kernels.fp8_rows import fp8_cols, fp8_rows
torch.manual_seed(0)
for m, c in ((70, 40), (64, 32), (5, 96), (130, 33)):
    x = (torch.randn(m, c) * torch.logspace(-2, 2, c)[None, :]).to(torch.bfloat16)
    x[:, 3] = 0
    q_ref, s_ref = fp8_rows(x.t().contiguous())  # the interpreted row kernel
    for rows in (0, 32, 48):  # one program a column block, or split over blocks of rows (amax by atomic max)
        q, s = fp8_cols(x, block_m=16, block_c=8, rows=rows)
        assert q.shape == (c, m) and q.is_contiguous() and s.shape == (c, 1)
        assert torch.equal(s, s_ref), (m, c, rows)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (m, c, rows)
print("OK")
"""


def test_fp8_cols_in_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(COLS)


def test_apply_float8_swaps_the_eligible_linears(monkeypatch):
    """The trainer's entry (titan_mm.quant.float8.apply_float8, on an H100 here by a patched capability): every
    nn.Linear but the filtered names (the LM head "output") and the widths the float8 GEMM refuses."""
    from titan_mm.config import Float8
    from titan_mm.quant.float8 import apply_float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    model = nn.ModuleDict(dict(mlp=nn.Linear(32, 64), odd=nn.Linear(32, 24), output=nn.Linear(64, 128)))
    apply_float8(model, Float8(enable=True, recipe="rowwise", rowwise_casts="titan"), on_cuda=True)
    assert [type(m).__name__ for m in model.values()] == ["Float8RowwiseLinear", "Linear", "Linear"]
