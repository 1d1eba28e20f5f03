"""Audio for the families that take it (DataNeeds.audio): decode (PyAV) or take an in-memory waveform, 16 kHz mono, Whisper log-mel.

Features: STFT (n_fft 400, hop 160, Hann window) power -> Slaney mel filterbank (``audio_n_mels`` bins,
0-8 kHz) -> log10(max(x, 1e-10)) -> clamp to (max - 8) -> (x + 4) / 4, transformers' WhisperFeatureExtractor
bit for bit. How a clip is padded and counted follows the family's front end (DataNeeds.audio, a
:class:`~titan_mm.nn.media.AudioFrontEnd`; tests/parity/test_processor_audio.py checks both Omni families' against
transformers):

- ``max_seconds`` > 0 (Qwen2.5-Omni's 30): every clip is padded with zeros to that length and truncated there
  (``padding="max_length"``, Whisper's default truncation), so a clip's last frames see zeros, not the STFT's
  reflection, and audio past it is dropped. Frames = ceil(samples / 160) (``feature_attention_mask.sum()``).
- ``max_seconds`` 0 (one clip per processor call, Qwen3-Omni's): no padding, no truncation; frames = samples // 160.
- tokens = ``front_end.tokens(frames)``: the length of the family's audio-tower output.

Per clip the processor keeps ``input_features [frames, n_mels]`` (the padding frames dropped, as the HF thinker
drops them with ``feature_attention_mask``) and ``audio_feature_lengths [1]``; the collator puts a batch's clips
side by side as ``[n_mels, sum frames]``. Audio needs a tokenizer with <|audio_pad|> (Omni); with the plain
Qwen3 tokenizer audio parts are skipped as ``unknown_modality``.
"""

from __future__ import annotations

import io

import numpy as np
import torch

from titan_mm.data.sources import SkipSample
from titan_mm.data.vision import MediaItem
from titan_mm.nn.media import AudioFrontEnd

N_FFT, HOP = 400, 160


def decode_audio(payload, rate: int = 16000) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz of the first audio stream of any container (a video's own track too)."""
    import av  # PyAV (FFmpeg) only for audio payloads: a text or image run never loads it

    try:
        src = io.BytesIO(payload) if isinstance(payload, (bytes, bytearray)) else payload
        out = []
        with av.open(src) as c:
            if not c.streams.audio:
                raise SkipSample("no_audio_track", "the file has no audio stream (a video part with "
                                 "use_audio_in_video needs one: drop the flag or give a video with sound)")
            st = c.streams.audio[0]
            rs = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for fr in c.decode(st):
                for o in rs.resample(fr):
                    out.append(o.to_ndarray().reshape(-1))
            for o in rs.resample(None):
                out.append(o.to_ndarray().reshape(-1))
    except SkipSample:
        raise
    except Exception as e:
        raise SkipSample("bad_audio", f"cannot decode audio ({type(e).__name__}: {e})") from None
    if not out:
        raise SkipSample("bad_audio", "audio has no samples")
    return np.concatenate(out).astype(np.float32)


def waveform(payload, rate: int = 16000) -> np.ndarray:
    """Mono float32 samples at ``rate`` Hz from encoded bytes (any PyAV format) or an in-memory waveform
    (a 1-D float numpy array, already at ``rate``)."""
    if not isinstance(payload, np.ndarray):
        return decode_audio(payload, rate)
    if payload.ndim != 1 or payload.dtype.kind != "f" or payload.size == 0 or not np.isfinite(payload).all():
        raise SkipSample("bad_audio", f"a waveform must be a non-empty 1-D float array of finite samples at {rate} "
                         f"Hz, got {payload.dtype} of shape {payload.shape}")
    return payload.astype(np.float32, copy=False)


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
    """[n_mels, len(wave) // 160] Whisper log-mel of the whole waveform (its max sets the floor)."""
    x = torch.from_numpy(wave)
    spec = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = (spec[..., :-1].abs() ** 2).contiguous()  # contiguous as HF's: the strided matmul rounds otherwise
    mel = torch.from_numpy(mel_filters(n_mels)) @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return ((logm + 4.0) / 4.0).numpy().astype(np.float32)


def clip_features(wave: np.ndarray, n_mels: int, front: AudioFrontEnd, rate: int = 16000) -> np.ndarray:
    """[n_mels, frames]: the frames the family's processor gives this clip, without its padding frames."""
    if not front.max_seconds:
        return log_mel(wave, n_mels)
    wave = wave[: front.max_seconds * rate]
    n = wave.shape[0]
    # Zeros up to a window past the end stand in for the padding: later frames are all log10(1e-10),
    # which changes neither the kept frames nor the max that sets the floor.
    padded = np.zeros(min(front.max_seconds * rate, n + N_FFT), dtype=np.float32)
    padded[:n] = wave
    return log_mel(padded, n_mels)[:, : -(-n // HOP)]


def add_video_audio(video: MediaItem, payload, cfg) -> MediaItem:
    """use_audio_in_video: the video item with its own audio track (decoded from the same payload) added, features
    and token count as an audio part's; the clip's keys join the item's, so its clip keeps its placeholder order."""
    clip = process_audio(payload, cfg)
    video.tensors.update(clip.tensors)
    video.audio_tokens = clip.n_tokens
    return video


def process_audio(payload, cfg) -> MediaItem:
    wave = waveform(payload, cfg.audio_sample_rate)
    feats = clip_features(wave, cfg.audio_n_mels, cfg.needs.audio, cfg.audio_sample_rate)
    frames = feats.shape[1]
    n_tokens = int(cfg.needs.audio.tokens(frames))
    if n_tokens < 1:
        raise SkipSample("bad_audio", f"audio too short ({wave.shape[0]} samples give {n_tokens} tokens)")
    return MediaItem("audio", {"input_features": feats.T.copy(), "audio_feature_lengths": np.asarray([frames])},
                     (1, 1, frames), 0, n_tokens)
