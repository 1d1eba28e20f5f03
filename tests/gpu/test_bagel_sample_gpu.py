"""BAGEL's image sampler on CUDA: equal to the reference's generate_image loop of tests/unit/test_bagel_generate.py
on the same card (sdpa, and flex's BlockMask of the "segments" kind), fp32."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_bagel import CFG, _pair
from tests.unit.test_bagel_generate import ref_generate
from titan_mm.models.bagel.sample import sample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_sampler_matches_the_reference_loop_on_cuda(backend):
    """The image sampler (text CFG, 5 Euler steps) on the card equals the reference's generate_image loop
    (tests/unit/test_bagel_generate.py) on the same card, fp32."""
    model, ref, _ = _pair()
    model, ref = model.cuda(), ref.cuda()
    noise = torch.randn(6, CFG.patch_latent_dim, generator=torch.Generator().manual_seed(3))
    ours = sample(model, [7, 8, 9], noise, (4, 6), steps=6, shift=3.0, cfg_text_scale=4.0, attn_backend=backend)
    with torch.no_grad():
        want = ref_generate(ref, [7, 8, 9], noise.cuda(), (4, 6), 6, 3.0, 4.0, (0.4, 1.0), 0.0)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)  # fp32, the CPU's ~7e-7 plus kernel order
