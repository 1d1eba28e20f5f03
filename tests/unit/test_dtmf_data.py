"""The built-in DTMF audio data, and audio through the processor, packer, collator and loader: batch keys and
shapes, placeholder counts, and bad audio skipped and counted."""

import base64
import json
import os

import numpy as np
import pytest

from tests.data_needs import OMNI_NEEDS, QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.builtin import builtin_records
from titan_mm.data.builtin.dtmf import KEYS, RATE, dtmf_clip, dtmf_record, key_freqs
from titan_mm.data.loader import build_dataloader
from titan_mm.data.packing import BestFitPacker, collate_rows
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import SkipSample, list_units
from titan_mm.data.tokenizer import Tokenizer, qwen3_tokenizer_dir

# Qwen3-Omni's added tokens after the Qwen3 vocabulary, in id order: <|audio_start|> 151669 ... <|audio_pad|> 151675
OMNI_TOKENS = ["<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
               "<tts_text_bos_single>", "<|audio_pad|>"]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    """A folder with the Qwen3 tokenizer plus Qwen3-Omni's audio tokens at their ids."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    tk = HFTokenizer.from_file(os.path.join(qwen3_tokenizer_dir(), "tokenizer.json"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in OMNI_TOKENS])
    d = tmp_path_factory.mktemp("omni_tok")
    tk.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="module")
def omni_tok(omni_dir):
    tok = Tokenizer(omni_dir)
    assert (tok.audio_start_id, tok.audio_pad_id) == (151669, 151675)
    return tok


def test_keys_are_their_two_tones():
    assert key_freqs("1") == (697, 1209) and key_freqs("0") == (941, 1336) and key_freqs("#") == (941, 1477)
    import random

    w = dtmf_clip("5", random.Random(0))
    spec = np.abs(np.fft.rfft(w))
    peaks = sorted(np.argsort(spec)[-2:] * RATE / w.shape[0])
    np.testing.assert_allclose(peaks, key_freqs("5"), atol=12)  # 770 + 1336 Hz, within a bin or two


def test_records_are_deterministic_and_split():
    a, b = dtmf_record(7), dtmf_record(7)
    np.testing.assert_array_equal(a["messages"][0]["content"][0]["audio"], b["messages"][0]["content"][0]["audio"])
    train, test = builtin_records("dtmf"), builtin_records("dtmf_test")
    assert (len(train), len(test)) == (1600, 400)
    assert {r["index"] % 5 for r in test[:50]} == {0} and 0 not in {r["index"] % 5 for r in train[:50]}
    for r in list(train[:40]) + list(test[:10]):
        wave = r["messages"][0]["content"][0]["audio"]
        assert wave.dtype == np.float32 and wave.ndim == 1 and 0.1 <= wave.shape[0] / RATE <= 2.1
        assert len(r["keys"]) == 1 and r["keys"] in KEYS
        assert r["messages"][1]["content"][0]["text"] == r["answer"] == r["keys"]
        assert r["messages"][0]["content"][1]["text"] == "Which key was pressed?"
    mixed = builtin_records("dtmf_digits_test")[3]
    assert [p["type"] for p in mixed["messages"][0]["content"]] == ["image", "audio", "text"]
    assert mixed["answer"].startswith(f"key {mixed['keys']}, digit ")
    assert len(list_units("builtin:dtmf_digits")) == 16
    seqs = builtin_records("dtmf_seq_test")[:40]
    assert {len(r["keys"]) for r in seqs} == set(range(1, 7)) and len(builtin_records("dtmf_seq")) == 1600
    assert seqs[0]["messages"][0]["content"][1]["text"] == "Which keys were pressed?"


def _wav_b64(secs: float = 0.5) -> str:
    import io

    import av

    x = (0.3 * np.sin(2 * np.pi * 941 * np.arange(int(8000 * secs)) / 8000) * 32767).astype(np.int16)[None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=8000, layout="mono")
        fr = av.AudioFrame.from_ndarray(x, format="s16", layout="mono")
        fr.sample_rate = 8000
        for p in [*s.encode(fr), *s.encode()]:
            c.mux(p)
    return base64.b64encode(buf.getvalue()).decode()


def test_pack_text_audio_and_audio_image(omni_tok):
    data = Data(image_min_pixels=1024, image_max_pixels=4096)  # the 64x64 digit stays 64x64
    proc = Processor(omni_tok, ProcessorConfig(data=data, needs=OMNI_NEEDS))
    recs = [{"text": "a plain document"}, builtin_records("dtmf")[0], builtin_records("dtmf_digits")[0]]
    docs = [proc(parse_record(r)) for r in recs]
    packer = BestFitPacker(2048, open_rows=1)
    for d in docs:
        packer.add(d)
    packer.flush()
    batch = collate_rows(packer.pop_rows(1), 2048, omni_tok.pad_id, position_axes=3)
    clips = [r["messages"][0]["content"][i]["audio"] for r, i in ((recs[1], 0), (recs[2], 1))]
    frames = [-(-w.shape[0] // 160) for w in clips]  # Qwen2.5-Omni: ceil(samples / hop), under 30 s
    assert batch["input_features"].shape == (128, sum(frames)) and batch["input_features"].is_contiguous()
    assert batch["audio_feature_lengths"].tolist() == frames
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]  # a 64x64 digit: 4x4 patches of 16
    assert batch["pixel_values"].shape == (16, 3 * 2 * 16 * 16) and batch["position_ids"].shape == (3, 1, 2048)
    ids = batch["input_ids"][0]
    want = [((f - 1) // 2 + 1 - 2) // 2 + 1 for f in frames]
    assert [int((d.input_ids == omni_tok.audio_pad_id).sum()) for d in docs] == [0, want[0], want[1]]
    assert int((ids == omni_tok.audio_pad_id).sum()) == sum(want) and int((ids == omni_tok.image_pad_id).sum()) == 4
    # in document order: the second clip's frames follow the first's
    np.testing.assert_array_equal(batch["input_features"][:, frames[0]:].numpy(), docs[2].media["input_features"][0].T)


def test_bad_audio_is_skipped_and_counted(omni_dir, omni_tok, tmp_path):
    proc = Processor(omni_tok, ProcessorConfig(needs=OMNI_NEEDS))
    for bad in (np.zeros((2, 100), np.float32), np.array([np.nan] * 1000, np.float32), np.zeros(100, np.int16)):
        with pytest.raises(SkipSample) as e:
            proc(parse_record(_chat({"type": "audio", "audio": bad})))
        assert e.value.reason == "bad_audio"

    lines = [_chat({"type": "input_audio", "input_audio": {"data": _wav_b64(), "format": "wav"}}),
             _chat({"type": "input_audio", "input_audio": {"data": "not base64 !!", "format": "wav"}}),
             _chat({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF junk").decode()}}),
             {"text": "a good document"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    data = Data(dataset=str(tmp_path / "a.jsonl"), seq_len=256, micro_batch_size=1, tokenizer_path=omni_dir,
                error_min_samples=1000)
    dl = build_dataloader(data, needs=OMNI_NEEDS, epochs=1, return_sample_ids=True)
    batches = list(dl)
    m = dl.metrics()
    assert m["skipped/bad_audio"] == 2 and m["skipped"] == 2, m
    audio = [b for b in batches if "input_features" in b]
    assert len(audio) == 1 and audio[0]["audio_feature_lengths"].tolist() == [50]  # 0.5 s at 8 kHz -> 16 kHz


def test_a_family_without_audio_skips_audio_parts(omni_tok):
    """Qwen3-VL's data needs name no audio encoder: a clip, even through an Omni tokenizer, skips its sample as
    unknown_modality rather than being counted as some other family's audio."""
    proc = Processor(omni_tok, ProcessorConfig(needs=QWEN3_VL_NEEDS))
    with pytest.raises(SkipSample, match="takes no audio") as e:
        proc(parse_record(builtin_records("dtmf")[0]))
    assert e.value.reason == "unknown_modality"


def _chat(part) -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Which keys were pressed?"}]},
                         {"role": "assistant", "content": "0"}]}


def test_loader_reads_builtin_dtmf_digits(omni_dir):
    data = Data(dataset="builtin:dtmf_digits", seq_len=512, micro_batch_size=2, tokenizer_path=omni_dir,
                image_min_pixels=1024, image_max_pixels=4096)
    batch = next(iter(build_dataloader(data, needs=OMNI_NEEDS)))
    n_clips = batch["audio_feature_lengths"].shape[0]
    assert n_clips >= 2 and batch["image_grid_thw"].shape == (n_clips, 3)  # one image and one clip per sample
    assert batch["input_features"].shape == (128, int(batch["audio_feature_lengths"].sum()))
