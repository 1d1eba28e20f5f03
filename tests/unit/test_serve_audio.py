"""Audio in the serving engine (a tiny random Qwen2.5-Omni thinker, the built-in Qwen2.5-Omni tokenizer): OpenAI
``input_audio`` parts (wav, flac) through /v1/chat/completions (FastAPI's TestClient) answer what
``Engine.generate`` answers; a bad audio part is a 400 naming its field; the engine's own checks of ``audios``; a
clip's pads sit where the training processor puts them, with the family's TMRoPE positions; two prompts of the
same tokens with different clips share the prefix-cache keys of the blocks before the clip only. Greedy parity
with transformers: tests/parity/test_serve_omni.py."""

import base64
import io
import wave

import av
import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from titan_mm.config import Data  # noqa: E402
from titan_mm.data import audio, vision  # noqa: E402
from titan_mm.data.packing import collate_rows  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer  # noqa: E402
from titan_mm.models.qwen3_omni_moe.audio import build_audio_meta  # noqa: E402
from titan_mm.registry import resolve_model  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.core.scheduler import sequence_keys  # noqa: E402
from titan_mm.serve.engine import BadRequest, Engine  # noqa: E402
from titan_mm.serve.entrypoints.server import build_app  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

from tests.unit._serve_helpers import engine as tiny_engine, prompt  # noqa: E402

DATA = Data(image_min_pixels=3136, image_max_pixels=3136)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def sine(ms: int, hz: float = 440.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(ms * rate // 1000) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def flac_bytes(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as c:
        st = c.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray((x * 32767).astype(np.int16)[None], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*st.encode(frame), *st.encode(None)]:
            c.mux(packet)
    return buf.getvalue()


def wav_bytes(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def omni():
    spec, cfg = resolve_model("qwen2_5_omni", "debug")
    torch.manual_seed(0)
    model = spec.build(cfg)
    with torch.no_grad():
        model.init_weights()
    tok = load_tokenizer("builtin:qwen2_5_omni")
    engine = Engine(model, spec, cfg, ServeConfig(max_model_len=256, block_size=4, num_blocks=256), tokenizer=tok,
                    data=DATA)
    return engine, spec, cfg, tok


def _chat(part: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Which key was pressed?"}, part]}]


def test_input_audio_parts_and_bad_ones(omni):
    engine = omni[0]
    clip = wav_bytes(sine(300, rate=22050), 22050)  # another rate: resampled to 16 kHz as in training
    b64 = base64.b64encode(clip).decode()
    with TestClient(build_app(engine, "tiny-omni")) as client:
        body = {"model": "tiny-omni", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "messages": _chat({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ids, images, videos, audios = engine.chat_media(_chat({"type": "input_audio",
                                                               "input_audio": {"data": b64, "format": "wav"}}))
        assert (images, videos, len(audios)) == ([], [], 1) and audios[0] == clip
        (ref,) = engine.generate([ids], GREEDY, audios=[audios])
        assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) > len(ids)  # expanded audio pads
        flac = flac_bytes(sine(300), 16000)
        r = client.post("/v1/chat/completions", json=body | {"messages": _chat({"type": "input_audio", "input_audio": {
            "data": base64.b64encode(flac).decode(), "format": "flac"}})})
        (ref,) = engine.generate([ids], GREEDY, audios=[[flac]])
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text

        at = "messages[0].content[1].input_audio"
        for audio_part, param, words in (
            ({"data": "not base64!", "format": "wav"}, f"{at}.data", "is not base64"),
            ({"data": base64.b64encode(b"RIFF but no wave").decode(), "format": "wav"}, at, "cannot decode audio"),
            ({"data": b64, "format": "mp3"}, f"{at}.format", "'wav' or 'flac'"),
            ({"format": "wav"}, f"{at}.data", "is required"),
        ):
            r = client.post("/v1/chat/completions", json=body | {"messages": _chat({"type": "input_audio",
                                                                                    "input_audio": audio_part})})
            e = r.json()["error"]
            assert r.status_code == 400 and e["param"] == param and words in e["message"], (audio_part, e)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


def test_bad_audios_are_one_line(omni):
    engine, spec, cfg, tok = omni
    ids, _, _, _ = engine.chat_media(_chat({"type": "audio", "audio": sine(200)}))
    item = vision.MediaItem("image")
    for audios, field, words in (
        ([], "audios", "holds 1 audio pad token(s)"),
        ([sine(200), sine(200)], "audios", "but 2 audio clip(s) came"),
        (["clips/a.wav"], "audios[0]", "the engine opens no paths"),
        ([item], "audios[0]", "a MediaItem of kind 'image'"),
        ([np.zeros((2, 10), np.float32)], "audios[0]", "1-D float array"),
        ("a.wav", "audios", "must be a list of audios"),
    ):
        with pytest.raises(BadRequest) as e:
            engine.add_request("bad", ids, GREEDY, audios=audios)
        assert e.value.field == field and words in e.value.message, (field, e.value)
    with pytest.raises(BadRequest, match="holds video or audio parts"):
        engine.chat_prompt(_chat({"type": "audio", "audio": sine(200)}))
    text_only = tiny_engine()  # a model without audio
    with pytest.raises(BadRequest, match="takes no audio"):
        text_only.chat_media(_chat({"type": "audio", "audio": sine(200)}))
    with pytest.raises(BadRequest, match="this model takes no audio"):
        text_only.add_request("t", prompt(5), GREEDY, audios=[sine(200)])


def test_audio_pads_and_positions_are_the_training_ones(omni):
    """The engine's expanded prompt and positions equal the training processor's document and the family's
    prepare_batch TMRoPE positions, for a prompt with an image and two clips."""
    engine, spec, cfg, tok = omni
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": sine(300)}, {"type": "image", "image": img},
                                             {"type": "text", "text": "and"},
                                             {"type": "audio", "audio": sine(500, 880.0)}]}]
    ids, images, _, audios = engine.chat_media(messages)
    req, _ = engine.inputs.make("r", ids, GREEDY, images, [], 0, None, audios=audios)
    doc = Processor(tok, ProcessorConfig(DATA, spec.data_needs(cfg))).prompt_doc(parse_record({"messages": messages}))
    assert req.prompt == doc.input_ids.tolist()
    pads = [i for i, t in enumerate(req.prompt) if t == tok.audio_pad_id]
    assert [(c.start, c.end) for c in req.audios] == [(pads[0], pads[0] + req.audios[0].end - req.audios[0].start),
                                                      (pads[-1] + 1 - (req.audios[1].end - req.audios[1].start),
                                                       pads[-1] + 1)]
    for c, m in zip(req.audios, audios):
        want = audio.process_audio(m, ProcessorConfig(DATA, spec.data_needs(cfg)))
        assert torch.equal(c.features, torch.from_numpy(want.tensors["input_features"]))
    batch = spec.prepare_batch(cfg, collate_rows([[doc]], len(doc), tok.pad_id, 3, multiple=1), "cpu")
    assert torch.equal(req.positions, batch["position_ids"][:, 0])
    assert req.rope_delta == int(req.positions.max()) + 1 - len(req.prompt)


def test_clips_are_part_of_the_prefix_keys(omni):
    engine, spec, cfg, tok = omni
    reqs = []
    for clip in (sine(300), sine(300, 660.0)):
        ids, _, _, audios = engine.chat_media(_chat({"type": "audio", "audio": clip}))
        reqs.append(engine.inputs.make(f"r{len(reqs)}", ids, GREEDY, [], [], 0, None, audios=audios)[0])
    a, b = reqs
    assert a.prompt == b.prompt
    bs = engine.blocks.block_size
    ka, kb = (sequence_keys(r, r.seqs[0], len(r.prompt), bs) for r in reqs)
    first = a.audios[0].start // bs  # the first block the clip overlaps
    assert ka[:first] == kb[:first] and all(x != y for x, y in zip(ka[first:], kb[first:]))


def test_each_requests_clips_encode_as_a_call_of_their_own():
    """Qwen3-Omni's audio tower pads a call's chunks to its longest, unmasked (HF's quirk, kept for training):
    with ``groups`` a forward of several requests' clips gives each clip the tokens of its own request's call."""
    spec, cfg = resolve_model("qwen3_omni_moe", "debug")
    torch.manual_seed(0)
    tower = spec.build(cfg).audio_tower.eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.1 * torch.randn_like(p))  # biases off zero: the padding's conv output is not zero
    g = torch.Generator().manual_seed(0)
    lens = [37, 230, 12, 150]  # one chunk, three chunks (the last short), one short chunk, two chunks
    feats = [torch.randn(cfg.audio.num_mel_bins, n, generator=g) for n in lens]
    groups = [0, 1, 1, 2]

    def encode(idx, groups=None):
        meta = build_audio_meta([lens[i] for i in idx], cfg.audio, "sdpa", "cpu", groups)
        with torch.no_grad():
            return tower(torch.cat([feats[i] for i in idx], 1), meta)

    alone = torch.cat([encode([0]), encode([1, 2]), encode([3])])
    together = encode([0, 1, 2, 3], groups)
    # the same arithmetic in other shapes (fp32 matmuls of other sizes round apart): a few ulps of outputs ~3
    assert torch.allclose(together, alone, rtol=0, atol=1e-5), (together - alone).abs().max()
    assert not torch.allclose(encode([0, 1, 2, 3]), alone, rtol=0, atol=1e-3)  # one group: the quirk shows
