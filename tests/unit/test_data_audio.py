import io

import numpy as np

from titan_mm.data import audio
from titan_mm.data.processors import ProcessorConfig
from titan_mm.registry import DataNeeds
from tests.data_needs import QWEN2_5_OMNI_AUDIO


def _wav(sr=8000, secs=1.0) -> bytes:
    import av

    t = np.arange(int(sr * secs)) / sr
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=sr, layout="mono")
        fr = av.AudioFrame.from_ndarray((x * 32767).astype(np.int16), format="s16", layout="mono")
        fr.sample_rate = sr
        for p in s.encode(fr):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_resample_and_log_mel():
    wave = audio.decode_audio(_wav(8000, 1.0), 16000)
    assert abs(wave.shape[0] - 16000) < 400  # resampled 8 kHz -> 16 kHz
    it = audio.process_audio(_wav(), ProcessorConfig(needs=DataNeeds(audio=QWEN2_5_OMNI_AUDIO)))
    f = it.tensors["input_features"]
    assert f.shape[1] == 128 and abs(f.shape[0] - 100) <= 2  # 100 frames per second
    # the 440 Hz tone is the loudest mel bin region
    assert 5 < int(f.mean(0).argmax()) < 30
    assert it.n_tokens == ((f.shape[0] - 1) // 2 + 1 - 2) // 2 + 1
