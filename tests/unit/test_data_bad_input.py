"""Bad input is skipped, counted by reason and logged once; past data.max_error_rate the loader stops."""

import io
import json
import logging

import numpy as np
import pytest
from PIL import Image

from titan_mm.data.loader import build_dataloader


def _png() -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(b, format="PNG")
    return b.getvalue()


def _chat(part):
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]},
                         {"role": "assistant", "content": "this."}]}


class Cfg:
    seq_len = 128
    micro_batch_size = 1
    image_min_pixels = 1024
    image_max_pixels = 4096
    error_min_samples = 1000

    def __init__(self, dataset, **kw):
        self.dataset = dataset
        self.__dict__.update(kw)


def _run(cfg):
    dl = build_dataloader(cfg, epochs=1, return_sample_ids=True)
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
        m, ids = _run(Cfg(f"{d}/data.jsonl,{d}/broken.parquet,{d}/broken.tar"))
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
        m, _ = _run(Cfg(f"{tmp_path}/d.jsonl"))
    assert m["skipped/malformed_json"] == 5
    assert caplog.text.count("malformed_json") == 1


def test_error_rate_stops_with_clear_message(tmp_path):
    lines = ["{bad"] * 30 + [json.dumps({"text": "fine"})] * 30
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    with pytest.raises(RuntimeError, match="max_error_rate"):
        _run(Cfg(f"{tmp_path}/d.jsonl", error_min_samples=20, max_error_rate=0.1))


def test_split_long_text_option(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "long " * 400}) + "\n")
    m, ids = _run(Cfg(f"{tmp_path}/d.jsonl", split_long_text=True))
    assert m["skipped"] == 0 and len(ids) >= 3


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matched no files"):
        build_dataloader(Cfg(f"{tmp_path}/nothing-here/*.jsonl"))
