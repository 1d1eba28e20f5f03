"""Log-mel features equal transformers' WhisperFeatureExtractor (128 bins, the Qwen Omni audio front end)."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from titan_mm.data import audio  # noqa: E402


@pytest.mark.parametrize("secs", [0.5, 2.0])
def test_log_mel_matches_whisper_feature_extractor(secs):
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    rng = np.random.default_rng(0)
    t = np.arange(int(16000 * secs)) / 16000
    w = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
    ref = fe._np_extract_fbank_features(w[None], "cpu")[0]
    mine = audio.log_mel(w, 128)
    assert mine.shape == ref.shape
    np.testing.assert_allclose(mine, ref, atol=1e-4, rtol=0)
