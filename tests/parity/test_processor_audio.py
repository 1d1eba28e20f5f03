"""Audio features, frame counts and placeholder counts equal the Qwen Omni processors of transformers
(WhisperFeatureExtractor with 128 bins, driven by each processor's own ``_process_audio`` and audio defaults) and
the audio towers' output lengths (``_get_feat_extract_output_lengths`` of the modeling files)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder  # noqa: E402
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe  # noqa: E402
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor  # noqa: E402

from titan_mm.data import audio  # noqa: E402
from titan_mm.data.processors import ProcessorConfig  # noqa: E402
from titan_mm.models.qwen2_5_omni.spec import AUDIO as Q25_AUDIO  # noqa: E402
from titan_mm.models.qwen3_omni_moe.spec import AUDIO as Q3_AUDIO  # noqa: E402
from titan_mm.registry import DataNeeds  # noqa: E402

SECONDS = (0.1, 1.0, 30.0, 31.0, 1.2345)  # 1.2345 s: a clip that is not a whole number of hops


def _clip(secs: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * secs)) / 16000
    return (0.3 * np.sin(2 * np.pi * 697 * t) + 0.3 * np.sin(2 * np.pi * 1336 * t)
            + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def _hf(processor_cls, clips: list[np.ndarray], **attrs) -> tuple[dict, list[int]]:
    """HF's own _process_audio of ``processor_cls`` with its audio defaults: (features, placeholder counts)."""
    fake = SimpleNamespace(feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128), **attrs,
                           replace_audio_token=lambda inputs, audio_idx: int(inputs["num_audio_tokens"][audio_idx]))
    return processor_cls._process_audio(fake, clips, return_tensors="np", **processor_cls.audio_kwargs)


def test_log_mel_matches_whisper_feature_extractor():
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    w = _clip(2.0)
    np.testing.assert_array_equal(audio.log_mel(w, 128), fe._torch_extract_fbank_features(w[None])[0])
    np.testing.assert_allclose(audio.log_mel(w, 128), fe._np_extract_fbank_features(w[None], "cpu")[0], atol=1e-4)


def test_qwen2_5_omni_pads_and_truncates_to_30_s():
    clips = [_clip(s, i) for i, s in enumerate(SECONDS)]
    ref, n_tokens = _hf(Qwen2_5OmniProcessor, clips)  # one call: every clip padded to 30 s alone
    cfg = ProcessorConfig(needs=DataNeeds(audio=Q25_AUDIO))
    lengths = ref["feature_attention_mask"].sum(-1)
    assert lengths.tolist() == [10, 100, 3000, 3000, 124]  # 31 s: truncated; 1.2345 s: ceil(19752 / 160)
    for i, w in enumerate(clips):
        it = audio.process_audio(w, cfg)
        k = int(lengths[i])
        assert it.tensors["audio_feature_lengths"].tolist() == [k]
        np.testing.assert_array_equal(it.tensors["input_features"].T, ref["input_features"][i][:, :k])
        assert it.n_tokens == n_tokens[i]
        _, tower = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(k))
        assert it.n_tokens == int(tower)


@pytest.mark.parametrize("secs", SECONDS)
def test_qwen3_omni_keeps_the_whole_clip(secs):
    w = _clip(secs)
    # one clip per call: no padding, no truncation
    ref, n_tokens = _hf(Qwen3OmniMoeProcessor, [w], n_window=Qwen3OmniMoeProcessor.n_window)
    it = audio.process_audio(w, ProcessorConfig(needs=DataNeeds(audio=Q3_AUDIO)))
    k = int(ref["feature_attention_mask"].sum())
    assert k == w.shape[0] // 160 and it.tensors["audio_feature_lengths"].tolist() == [k]
    np.testing.assert_array_equal(it.tensors["input_features"].T, ref["input_features"][0][:, :k])
    assert it.n_tokens == n_tokens[0] == int(modeling_qwen3_omni_moe._get_feat_extract_output_lengths(torch.tensor(k)))


def test_token_counts_over_every_length():
    frames = torch.arange(3, 3200)
    _, q25 = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, frames)
    q3 = modeling_qwen3_omni_moe._get_feat_extract_output_lengths(frames)
    assert [Q25_AUDIO.tokens(f) for f in frames.tolist()] == q25.tolist()
    assert [int(Q3_AUDIO.tokens(f)) for f in frames.tolist()] == q3.tolist()
