"""BAGEL's image sampler on CUDA (the context in a KV cache, the image query per step): equal to the reference's
generate_image loop of tests/unit/test_bagel_generate.py on the same card, fp32, text-to-image and editing."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_bagel import CFG, _pair
from tests.unit.test_bagel_generate import ref_generate
from titan_mm.models.bagel.sample import sample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("editing", [False, True])
def test_sampler_matches_the_reference_loop_on_cuda(editing):
    """Text CFG (and image CFG when editing), 5 Euler steps, on the card against the reference's loop on the card."""
    model, ref, _ = _pair()
    model, ref = model.cuda(), ref.cuda()
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(6, CFG.patch_latent_dim, generator=g)
    source = (torch.randn(4, 4, 4, generator=g), torch.randn(3, 8, 12, generator=g)) if editing else None
    img_scale = 1.5 if editing else 1.0
    # the source stays on the host: the sampler and the reference lay its splits out there
    ours = sample(model, [7, 8, 9], noise, (4, 6), steps=6, shift=3.0, cfg_text_scale=4.0, source=source,
                  cfg_img_scale=img_scale)
    with torch.no_grad():
        want = ref_generate(ref, [7, 8, 9], noise.cuda(), (4, 6), 6, 3.0, 4.0, (0.4, 1.0), 0.0, source, img_scale)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)  # fp32, the CPU's ~7e-7 plus kernel order
