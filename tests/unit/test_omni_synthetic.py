"""titan_mm.models.qwen2_5_omni.synthetic (the Omni cases of bench/mfu.py): for both Omni debug flavors, a packed
image + audio + text batch has one placeholder per encoder output token (the family's own length rule), labels off
the placeholders, the family's TMRoPE positions (= its prepare_batch's, = HF's get_rope_index), and
bench.peers.hf_audio_inputs pads its clips back into HF's layout."""

from __future__ import annotations

import pytest
import torch

from titan_mm.models.qwen2_5_omni import synthetic as syn
from titan_mm.models.qwen2_5_omni.audio import conv_lengths
from titan_mm.models.qwen3_omni_moe.audio import output_lengths
from titan_mm.registry import resolve_model


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_pack_image_audio_text(family):
    spec, cfg = resolve_model(family, "debug")
    frames = [250, 1234, 100]
    g = torch.Generator().manual_seed(0)
    samples = [syn.make_sample(cfg, [("text", 5), ("image", (4, 6)), ("audio", frames[0]), ("text", 7)], g),
               syn.make_sample(cfg, [("audio", frames[1]), ("text", 3), ("audio", frames[2]), ("text", 4)], g)]
    b = syn.pack(samples, cfg, seq_len=sum(len(s.input_ids) for s in samples) + 5)
    ids = b["input_ids"]
    n_tok = [int(conv_lengths(f)[1]) if family == "qwen2_5_omni" else int(output_lengths(f)) for f in frames]
    assert [syn.audio_tokens(cfg, f) for f in frames] == n_tok
    assert int((ids == cfg.audio_token_id).sum()) == sum(n_tok)
    assert int((ids == cfg.image_token_id).sum()) == 4 * 6 // cfg.vision.spatial_merge_size**2
    assert b["input_features"].shape == (cfg.audio.num_mel_bins, sum(frames))
    assert b["audio_feature_lengths"].tolist() == frames and b["pixel_values"].shape[0] == 24
    assert not torch.isin(b["labels"], torch.tensor([cfg.image_token_id, cfg.audio_token_id])).any()
    assert torch.equal(spec.prepare_batch(cfg, b, "cpu")["position_ids"].long(), b["position_ids"].long())
    # HF's layout of the same clips (the bench peers'), and HF's positions of the same batch
    from bench.peers import hf_audio_inputs

    hf = hf_audio_inputs(b)
    assert hf["feature_attention_mask"].sum(-1).tolist() == frames
    assert torch.equal(hf["input_features"][1, :, : frames[1]], b["input_features"][:, frames[0]: frames[0] + frames[1]])
    transformers = pytest.importorskip("transformers")
    hfd = cfg.to_hf_dict()
    with torch.device("meta"):
        model = getattr(transformers, {"qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
                                       "qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}[family])(
            transformers.AutoConfig.for_model(**hfd))
    # one document (HF's positions do not restart per packed document), padded at the end: HF's mask leaves the
    # padding out
    one = syn.make_sample(cfg, [("text", 3), ("audio", 321), ("image", (6, 4)), ("text", 2), ("audio", 205),
                                ("text", 4)], g)
    b = syn.pack([one], cfg, seq_len=len(one.input_ids) + 7)
    mask = (b["doc_ids"] >= 0).long()
    want, _ = model.model.get_rope_index(b["input_ids"], b["image_grid_thw"], None, mask, False,
                                         hf_audio_inputs(b)["feature_attention_mask"].sum(-1), None)
    n = int(mask.sum())
    assert torch.equal(want[:, :, :n].long(), b["position_ids"][:, :, :n].long())
