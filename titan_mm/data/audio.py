"""Audio for Omni-style models: decode (PyAV), resample to 16 kHz mono, Whisper-style log-mel features.

Features: STFT (n_fft 400, hop 160, Hann window) power -> Slaney mel filterbank (``audio_n_mels`` bins,
0-8 kHz) -> log10(max(x, 1e-10)) -> clamp to (max - 8) -> (x + 4) / 4, equal to transformers'
WhisperFeatureExtractor (tests/parity/test_processor_audio.py). ``input_features [n_mels, frames]``
per clip; the placeholder count follows Qwen2-Audio's encoder (conv stride 2, then pool 2).
Audio needs a tokenizer with <|audio_pad|> (Omni); with the plain Qwen3 tokenizer audio parts are
skipped as ``unknown_modality``.
"""

from __future__ import annotations

import io

import numpy as np

from titan_mm.data.sources import SkipSample
from titan_mm.data.vision import MediaItem

N_FFT, HOP = 400, 160


def decode_audio(payload, rate: int = 16000) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz."""
    import av

    try:
        src = io.BytesIO(payload) if isinstance(payload, (bytes, bytearray)) else payload
        out = []
        with av.open(src) as c:
            st = c.streams.audio[0]
            rs = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for fr in c.decode(st):
                for o in rs.resample(fr):
                    out.append(o.to_ndarray().reshape(-1))
            for o in rs.resample(None):
                out.append(o.to_ndarray().reshape(-1))
    except Exception as e:
        raise SkipSample("bad_audio", f"cannot decode audio ({type(e).__name__}: {e})") from None
    if not out:
        raise SkipSample("bad_audio", "audio has no samples")
    return np.concatenate(out).astype(np.float32)


def _hz_to_mel(f):
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3)
    log_region = f >= 1000.0
    mel = np.where(log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mel)
    return mel


def _mel_to_hz(m):
    m = np.asarray(m, dtype=np.float64)
    f = m * (200.0 / 3)
    return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), f)


def mel_filters(n_mels: int, sr: int = 16000, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-style mel filterbank [n_mels, n_fft // 2 + 1] (area-normalized)."""
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    pts = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sr / 2), n_mels + 2))
    fb = np.zeros((n_mels, freqs.shape[0]))
    for i in range(n_mels):
        lo, c, hi = pts[i], pts[i + 1], pts[i + 2]
        fb[i] = np.maximum(0, np.minimum((freqs - lo) / (c - lo), (hi - freqs) / (hi - c)))
        fb[i] *= 2.0 / (hi - lo)
    return fb.astype(np.float32)


def log_mel(wave: np.ndarray, n_mels: int = 128) -> np.ndarray:
    import torch

    x = torch.from_numpy(wave)
    spec = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = torch.from_numpy(mel_filters(n_mels)) @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return ((logm + 4.0) / 4.0).numpy().astype(np.float32)


def process_audio(payload, cfg) -> MediaItem:
    wave = payload if isinstance(payload, np.ndarray) else decode_audio(payload, cfg.audio_sample_rate)
    feats = log_mel(wave, cfg.audio_n_mels)
    frames = feats.shape[1]
    n_tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    if n_tokens < 1:
        raise SkipSample("bad_audio", f"audio too short ({wave.shape[0]} samples)")
    return MediaItem("audio", {"input_features": feats.T.copy(), "audio_feature_lengths": np.asarray([frames])},
                     (1, 1, frames), 0, n_tokens)
