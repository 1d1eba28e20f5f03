"""Built-in DTMF audio (and DTMF + digits) through the data pipeline for each Omni family's debug flavor: the loader
pads and counts clips the way the family's HF processor does (DataNeeds.audio), so the family's
prepare_batch accepts the batch (each clip's <|audio_pad|> run is the audio tower's output length) and a forward
runs."""

import pytest
import torch

from titan_mm.config import Data
from titan_mm.data.loader import build_dataloader
from titan_mm.data.processors import ProcessorConfig, check_special_tokens
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.nn.attention import build_attn_meta
from titan_mm.models.qwen2_5_omni.audio import conv_lengths
from titan_mm.models.qwen3_omni_moe.audio import output_lengths
from titan_mm.registry import families, get_model_spec
from titan_mm.train.step import NOT_MODEL_KWARGS

OMNI = "builtin:qwen2_5_omni"
FAMILIES = {  # family -> (its audio clips' padding in seconds, its audio tower's output tokens per clip of n frames)
    "qwen2_5_omni": (30, lambda n: conv_lengths(n)[1]),
    "qwen3_omni_moe": (0, output_lengths),
}


def _runs(ids: torch.Tensor, tok: int) -> list[int]:
    """Lengths of the runs of ``tok`` in ``ids`` (row-major: document order, as the collator lays the clips)."""
    out, n = [], 0
    for t in ids.reshape(-1).tolist() + [None]:
        if t == tok:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def test_each_family_names_its_audio_front_end():
    for spec in families():
        needs = spec.data_needs(spec.flavor("debug"))
        ProcessorConfig(needs=needs)  # every family's needs pass the processors' checks
        if spec.name not in FAMILIES:
            assert needs.audio is None, spec.name  # the family's audio parts are skipped
            continue
        pad_seconds, tower = FAMILIES[spec.name]
        assert needs.audio.max_seconds == pad_seconds, spec.name
        assert [int(needs.audio.tokens(n)) for n in range(1, 3200)] == [int(tower(n)) for n in range(1, 3200)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dtmf_batches_fit_the_model(name):
    spec = get_model_spec(name)
    cfg = spec.flavor("debug")
    needs = spec.data_needs(cfg)
    # the debug flavors place Qwen2.5-Omni's audio ids, the built-in Omni tokenizer's
    tok = load_tokenizer(OMNI)
    check_special_tokens(tok, needs)
    assert (needs.special_tokens["audio_pad"], needs.special_tokens["audio_start"],
            needs.special_tokens["audio_end"]) == (tok.audio_pad_id, tok.audio_start_id, tok.audio_end_id) == (
            151646, 151647, 151648)

    data = Data(mixture={"builtin:dtmf": 0.5, "builtin:dtmf_digits": 0.5}, tokenizer_path=OMNI, seq_len=256,
                micro_batch_size=2, image_min_pixels=4096, image_max_pixels=4096)
    batch = next(iter(build_dataloader(data, needs=needs)))
    frames = batch["audio_feature_lengths"]
    assert frames.shape[0] >= 2 and batch["input_features"].shape == (128, int(frames.sum()))
    tower = FAMILIES[name][1]
    assert _runs(batch["input_ids"], tok.audio_pad_id) == [int(tower(int(f))) for f in frames]

    torch.manual_seed(0)
    model = spec.build(cfg)
    model.init_weights()
    mb = spec.prepare_batch(cfg, batch, "cpu")  # raises on a placeholder count the tower does not give
    attn = build_attn_meta(mb, "sdpa", "cpu")
    extra = {k: v for k, v in mb.items() if k not in NOT_MODEL_KWARGS}
    with torch.no_grad():
        out = model(mb["input_ids"], position_ids=mb["position_ids"], attn=attn, labels=mb["labels"], **extra)
    assert torch.isfinite(out.loss_sum) and out.loss_sum > 0
