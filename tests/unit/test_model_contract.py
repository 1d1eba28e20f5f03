"""The model contract (docs/models.md): embed -> trunk -> head, where any contiguous slice of blocks runs alone
(pipeline stages), and the registry's answers hold for every family."""

import dataclasses
import fnmatch

import pytest
import torch

from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.output import Stream
from titan_mm.models.qwen3_vl.config import FLAVORS as VL_FLAVORS
from titan_mm.models.qwen3_vl.config import with_overrides
from titan_mm.models.qwen3_vl.model import Qwen3VLModel, vision_inputs
from titan_mm.models.qwen3_vl.synthetic import synthetic_vl_batch
from titan_mm.registry import families, get_model_spec


def _text_model(moe: bool):
    spec = get_model_spec("qwen3_moe" if moe else "qwen3")
    cfg = dataclasses.replace(spec.flavor("debug_moe" if moe else "debug"), vocab_size=256, num_hidden_layers=4)
    torch.manual_seed(0)
    m = spec.build(cfg)
    m.init_weights()
    return m


@pytest.mark.parametrize("moe", [False, True])
def test_trunk_slices_compose_to_the_forward(moe):
    """Stages [0, 1), [1, 3), [3, L) with the stream handed between them give the forward's loss and aux loss
    bitwise; the head alone turns the last stream into logits."""
    m = _text_model(moe)
    ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    pos = torch.arange(12)[None].expand(2, 12)
    full = m(ids, position_ids=pos, labels=labels)
    rope = m.rope(pos, torch.float32)
    s = m.embed(ids)
    for start, stop in ((0, 1), (1, 3), (3, None)):
        s = m.trunk(s, rope, None, start, stop)
        assert isinstance(s, Stream)
    out = m.head(s, None, labels)
    assert torch.equal(out.loss_sum, full.loss_sum) and torch.equal(out.aux_loss, full.aux_loss)
    if moe:
        assert out.aux_loss > 0
    logits = m.head(s, None).logits
    assert logits.shape == (2, 12, 256)


def test_vl_stages_carry_the_deepstack_additions():
    """Qwen3-VL: the embedding stage returns the DeepStack features as the stream's adds; the text model's trunk
    slices add them after their blocks, so slicing at a DeepStack block changes nothing."""
    cfg = with_overrides(VL_FLAVORS["debug"], {"text": {"vocab_size": 512, "num_hidden_layers": 3},
                                               "vision": {"patch_size": 4, "num_position_embeddings": 64},
                                               "vision_start_token_id": 500, "image_token_id": 501,
                                               "video_token_id": 502, "vision_end_token_id": 503})
    torch.manual_seed(0)
    m = Qwen3VLModel(cfg)
    m.init_weights()
    b = synthetic_vl_batch(cfg, num_tokens=96, image_hw=(8, 8), text_per_sample=20)
    attn = build_attn_meta(b, "sdpa", "cpu")
    vis = vision_inputs(cfg, b, "cpu")
    full = m(b["input_ids"], position_ids=b["position_ids"], attn=attn, labels=b["labels"],
             pixel_values=b["pixel_values"], **vis)
    s = m.embed(b["input_ids"], b["pixel_values"], None, vis["vision_meta"], vis["visual_index"])
    assert len(s.adds) == len(cfg.vision.deepstack_visual_indexes) > 0
    rope = m.rope(b["position_ids"], torch.float32)
    lm = m.language_model
    s = lm.trunk(lm.trunk(s, rope, attn, 0, 1), rope, attn, 1, None)
    out = lm.head(s, attn, b["labels"])
    assert torch.equal(out.loss_sum, full.loss_sum)


@pytest.mark.parametrize("spec", families(), ids=lambda s: s.name)
def test_a_bare_config_finds_its_own_family(spec):
    """spec_for_config (tools handed a bare config) picks the family whose config class the config is, not a
    family whose class it subclasses (Qwen2.5-Omni's config is a Qwen2.5-VL config); families that share one
    class (qwen3 / qwen3_moe) share the answers that depend on it."""
    from titan_mm.registry import spec_for_config

    cfg = spec.flavor("debug")
    found = spec_for_config(cfg)
    assert found.config_cls is spec.config_cls
    assert found.data_needs(cfg) == spec.data_needs(cfg)


@pytest.mark.parametrize("spec", families(), ids=lambda s: s.name)
def test_every_family_answers_the_contract(spec):
    """Every registered family's debug flavor: dims match the built model, the plan's units exist, the data needs
    and kernel shapes are consistent, runtime round-trips through with_runtime."""
    cfg = spec.with_runtime(spec.flavor("debug"), attn_backend="flex", kernels="all")
    assert spec.runtime(cfg).attn_backend == "flex" and spec.runtime(cfg).kernels == "all"
    d = spec.dims(cfg)
    with torch.device("meta"):
        m = spec.build(cfg)
    names = [n for n, _ in m.named_modules()]
    plan = spec.plan(cfg)
    assert any(fnmatch.fnmatchcase(n, p) for n in names for p in plan.fsdp_units)
    trunk = "layers" if spec.schema().tokens else "blocks"  # a DiT without tokens keeps diffusers' blocks.{i}
    blocks = [n for n in names if n.rsplit(".", 2)[-2:-1] == [trunk]]  # layers.{i} / language_model.layers.{i}
    assert d.num_layers == len(blocks)
    ks = spec.kernel_shapes(cfg, tp=1)
    assert ks.vocab == d.vocab_size and d.hidden_size in ks.rms_norm
    needs = spec.data_needs(cfg)
    assert (needs.positions == "mrope") == (d.vision is not None)
    if d.vision is not None:
        assert needs.merge_size == d.vision.merge_size and needs.patch_size > 0
