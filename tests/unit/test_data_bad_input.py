"""Bad input is skipped, counted by reason and logged once; past data.max_error_rate the loader stops."""

import io
import json
import logging

import numpy as np
import pytest
from PIL import Image

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.loader import build_dataloader
from titan_mm.registry import DataNeeds


def _png() -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(b, format="PNG")
    return b.getvalue()


def _chat(part):
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]},
                         {"role": "assistant", "content": "this."}]}


def _data(dataset, **kw) -> Data:
    return Data(**{"dataset": dataset, "seq_len": 128, "micro_batch_size": 1, "image_min_pixels": 1024,
                   "image_max_pixels": 4096, "error_min_samples": 1000, **kw})


def _run(data):
    dl = build_dataloader(data, needs=QWEN3_VL_NEEDS, epochs=1, return_sample_ids=True)
    ids = []
    for _ in dl:
        ids += dl.last_sample_ids
    return dl.metrics(), ids


def test_each_bad_case_is_skipped_and_counted(tmp_path, caplog):
    d = tmp_path
    (d / "ok.png").write_bytes(_png())
    (d / "bad.png").write_bytes(b"not an image at all")
    (d / "bad.mp4").write_bytes(b"\x00\x01garbage video")
    lines = [
        json.dumps({"text": "a good document"}),
        "{this is not json",
        json.dumps(_chat({"type": "image", "image": "missing.png"})),
        json.dumps(_chat({"type": "image", "image": "bad.png"})),
        json.dumps(_chat({"type": "video", "video": "bad.mp4"})),
        json.dumps({"text": "long " * 400}),
        json.dumps(_chat({"type": "hologram", "hologram": "x"})),
        json.dumps(_chat({"type": "image", "image": "ok.png"})),
        json.dumps({"text": "another good document"}),
    ]
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    (d / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (d / "broken.tar").write_bytes(b"\x00" * 100 + b"not a tar" * 50)
    with caplog.at_level(logging.WARNING, logger="titan_mm.data"):
        m, ids = _run(_data(f"{d}/data.jsonl,{d}/broken.parquet,{d}/broken.tar"))
    expect = {"malformed_json": 1, "missing_media": 1, "corrupt_image": 1, "bad_video": 1, "too_long": 1,
              "unknown_modality": 1}
    for reason, n in expect.items():
        assert m.get(f"skipped/{reason}") == n, (reason, m)
    assert m.get("skipped/unreadable_shard") == 2, m
    assert m["skipped"] == 8
    assert len(ids) == 3  # the three good samples came through
    text = caplog.text
    assert "data.jsonl line 2" in text  # logged with source and line
    assert "missing.png" in text and "broken.parquet" in text


def test_logged_once_per_reason_and_source(tmp_path, caplog):
    lines = ["{bad"] * 5 + [json.dumps({"text": "fine"})] * 50
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="titan_mm.data"):
        m, _ = _run(_data(f"{tmp_path}/d.jsonl"))
    assert m["skipped/malformed_json"] == 5
    assert caplog.text.count("malformed_json") == 1


def test_error_rate_stops_with_clear_message(tmp_path):
    lines = ["{bad"] * 30 + [json.dumps({"text": "fine"})] * 30
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    with pytest.raises(RuntimeError, match="max_error_rate"):
        _run(_data(f"{tmp_path}/d.jsonl", error_min_samples=20, max_error_rate=0.1))


def test_split_long_text_option(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "long " * 400}) + "\n")
    m, ids = _run(_data(f"{tmp_path}/d.jsonl", split_long_text=True))
    assert m["skipped"] == 0 and len(ids) >= 3


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matched no files"):
        build_dataloader(_data(f"{tmp_path}/nothing-here/*.jsonl"), needs=QWEN3_VL_NEEDS)


def test_media_for_a_text_model_is_skipped(tmp_path):
    """DataNeeds() (a text family): image parts have no patch size to be cut with, so they are skipped by reason."""
    (tmp_path / "ok.png").write_bytes(_png())
    lines = [json.dumps(_chat({"type": "image", "image": "ok.png"})), json.dumps({"text": "fine"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    dl = build_dataloader(_data(f"{tmp_path}/d.jsonl"), needs=DataNeeds(), epochs=1)
    for b in dl:
        assert b["position_ids"].dim() == 2  # 1-D positions: [B, S]
    assert dl.metrics()["skipped/unknown_modality"] == 1


def test_config_mistakes_fail_when_the_loader_is_built():
    with pytest.raises(ValueError, match="gives image_pad the id 151655, the model expects 7"):
        build_dataloader(_data("builtin"), needs=DataNeeds(special_tokens={"image_pad": 7}))
    with pytest.raises(ValueError, match="unknown role 'img'"):
        build_dataloader(_data("builtin"), needs=DataNeeds(special_tokens={"img": 7}))
    with pytest.raises(ValueError, match="data.chat_template must be empty"):
        build_dataloader(_data("builtin", chat_template="llama"), needs=DataNeeds())
    with pytest.raises(TypeError, match="needs the \\[data\\] section"):
        build_dataloader({"seq_len": 128}, needs=DataNeeds())
