"""HF round trip for Qwen3-VL and Qwen3-VL-MoE: transformers save_pretrained -> titan load_hf -> titan
save_hf -> transformers from_pretrained gives identical logits (and titan's own logits match).
Also: a checkpoint in the released MoE layout (experts stored [E, D, 2F] / [E, F, D]) loads the same.

Run: OMP_NUM_THREADS=1 pytest -q tests/parity/test_qwen3_vl_roundtrip.py
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from titan_mm.models.qwen3_vl import hf as vl_hf  # noqa: E402
from titan_mm.models.qwen3_vl.config import Qwen3VLConfig  # noqa: E402
from titan_mm.models.qwen3_vl.model import Qwen3VLModel  # noqa: E402
from titan_mm.models.qwen3_vl.synthetic import make_sample, pack  # noqa: E402

from _qwen3_helpers import titan_from_hf  # noqa: E402
from test_qwen3_vl_parity import SAMPLES, hf_config, hf_inputs, randomize_, titan_forward  # noqa: E402


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)], ids=["dense", "dense_tied", "moe"])
def test_hf_round_trip(tmp_path, moe, tie):
    hcfg = hf_config(moe)
    hcfg.tie_word_embeddings = tie
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    hf = cls._from_config(hcfg, attn_implementation="sdpa").float().eval()
    randomize_(hf, seed=1)
    if tie:
        hf.tie_weights()
    src, dst = tmp_path / "hf", tmp_path / "export"
    hf.save_pretrained(src)

    name = "qwen3_vl_moe" if moe else "qwen3_vl"
    tm, spec, cfg = titan_from_hf(src, vision_attn_backend="sdpa")
    assert spec.name == name and cfg.tie_word_embeddings == tie
    spec.save_hf(tm, cfg, str(dst))
    hf2 = cls.from_pretrained(dst, attn_implementation="sdpa").float().eval()
    assert json.loads((dst / "config.json").read_text())["model_type"] == name

    s = make_sample(cfg, SAMPLES["images"] + [("video", (2, 4, 4))], torch.Generator().manual_seed(0), text_vocab=150)
    with torch.no_grad():
        ref = hf(**hf_inputs(s)).logits
        out = hf2(**hf_inputs(s)).logits
        ours = titan_forward(tm, pack([s], cfg)).logits[:, : ref.shape[1]]
    assert torch.equal(ref, out), f"round-trip logits differ by {(ref - out).abs().max():.2e}"
    assert (ours - ref).abs().max() <= 1e-5


def test_moe_released_expert_layout_loads(tmp_path):
    """Released Qwen3-VL-MoE checkpoints store experts transposed; both layouts load to the same model."""
    hcfg = hf_config(True)
    hf = transformers.Qwen3VLMoeForConditionalGeneration._from_config(hcfg, attn_implementation="sdpa").float()
    randomize_(hf, seed=2)
    hf.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(f)
    released = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in sd.items()}
    cfg = Qwen3VLConfig.from_hf(tmp_path)
    a = vl_hf.hf_to_titan(sd, cfg)
    b = vl_hf.hf_to_titan(released, cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and our export writes the released layout for these (unambiguous) shapes
    out = vl_hf.titan_to_hf(a, cfg)
    for k, v in out.items():
        if k.endswith("experts.gate_up_proj"):
            assert tuple(v.shape) == (4, 48, 40)
        if k.endswith("experts.down_proj"):
            assert tuple(v.shape) == (4, 20, 48)
    save_file(released, f, metadata={"format": "pt"})  # transformers reads the released layout too
    hf2 = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).float()
    for k, v in hf.state_dict().items():
        assert torch.equal(v, hf2.state_dict()[k]), k


def test_load_errors_name_the_problem(tmp_path):
    hcfg = hf_config(False)
    hf = transformers.Qwen3VLForConditionalGeneration._from_config(hcfg).float()
    hf.save_pretrained(tmp_path)
    cfg = Qwen3VLConfig.from_hf(tmp_path)
    bad = Qwen3VLConfig.from_hf_dict({**json.loads((tmp_path / "config.json").read_text()),
                                      "vision_config": {**hcfg.vision_config.to_dict(), "depth": 4,
                                                        "deepstack_visual_indexes": [0, 2]}})
    tm = Qwen3VLModel(bad)
    with pytest.raises(ValueError, match=r"missing 1[0-9] tensor\(s\): model.visual.blocks.3"):
        vl_hf.load_hf(tm, tmp_path)
    moe_model = Qwen3VLModel(Qwen3VLConfig.from_hf_dict(hf_config(True).to_dict()))
    with pytest.raises(ValueError, match="model_type='qwen3_vl' but the model is 'qwen3_vl_moe'"):
        vl_hf.load_hf(moe_model, tmp_path)
    assert cfg.model_type == "qwen3_vl"
