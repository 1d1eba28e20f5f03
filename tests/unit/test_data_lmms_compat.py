"""lmms-engine datasets load unchanged: ``messages`` given as a JSON string, images with transparency
composited onto white (pixel parity with transformers is in tests/parity/test_processor_qwen3vl.py)."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.loader import build_dataloader
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import SkipSample
from titan_mm.registry import DataNeeds

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]


def _run(dataset, needs=DataNeeds(), **kw):
    data = Data(dataset=dataset, seq_len=256, micro_batch_size=1, image_min_pixels=1024, image_max_pixels=4096,
                error_min_samples=1000, **kw)
    dl = build_dataloader(data, needs=needs, epochs=1, return_sample_ids=True)
    batches, ids = [], []
    for b in dl:
        batches.append(b)
        ids += dl.last_sample_ids
    return batches, ids, dl.metrics()


def test_json_string_messages_parse_like_the_list():
    assert parse_record({"messages": json.dumps(MSGS)}) == parse_record({"messages": MSGS})
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    assert parse_record({"conversations": json.dumps(conv)}) == parse_record({"conversations": conv})


@pytest.mark.parametrize("value,reason", [
    ('[{"role": "user", "content": "hi"', "malformed_json"),   # cut-off JSON
    ("not json at all", "malformed_json"),
    ('{"role": "user", "content": "hi"}', "bad_schema"),        # JSON, but not a list of turns
    ('"just a string"', "bad_schema"),
])
def test_bad_json_string_messages_are_skipped_by_reason(value, reason):
    with pytest.raises(SkipSample) as e:
        parse_record({"messages": value})
    assert e.value.reason == reason


def test_json_string_messages_through_the_loader(tmp_path):
    """JSONL and Parquet with the chat as a JSON string give the same tokens as the list form; a malformed
    string is one skipped sample, counted by reason, never a crash."""
    (tmp_path / "list.jsonl").write_text(json.dumps({"messages": MSGS}) + "\n")
    (tmp_path / "str.jsonl").write_text(json.dumps({"messages": json.dumps(MSGS)}) + "\n"
                                        + json.dumps({"messages": json.dumps(MSGS)[:-3]}) + "\n")
    pq.write_table(pa.table({"messages": [json.dumps(MSGS)], "id": [0]}), tmp_path / "str.parquet")
    ref, ids, m = _run(str(tmp_path / "list.jsonl"))
    assert len(ids) == 1 and m["skipped"] == 0
    for name, skipped in (("str.jsonl", 1), ("str.parquet", 0)):
        got, ids, m = _run(str(tmp_path / name))
        assert len(ids) == 1 and m["skipped"] == skipped, (name, m)
        assert m.get("skipped/malformed_json", 0) == skipped
        assert got[0]["input_ids"].tolist() == ref[0]["input_ids"].tolist()
        assert got[0]["labels"].tolist() == ref[0]["labels"].tolist()


def _png(img: Image.Image) -> bytes:
    b = io.BytesIO()
    img.save(b, format="PNG")
    return b.getvalue()


def test_transparent_images_are_white_under_their_alpha(tmp_path):
    """Through the loader (lazy patches at collate time): an RGBA PNG whose alpha is 0 or 255 and a P PNG
    with a transparent index give exactly the pixels of the same picture painted white where transparent."""
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    clear = rng.random((48, 64)) < 0.4
    white = rgb.copy()
    white[clear] = 255
    rgba = Image.fromarray(np.dstack([rgb, np.where(clear, 0, 255).astype(np.uint8)]), mode="RGBA")
    idx = rng.integers(1, 8, (48, 64), dtype=np.uint8)
    idx[clear] = 0
    pal = rng.integers(0, 256, (8, 3), dtype=np.uint8)
    p = Image.fromarray(idx, mode="P")
    p.putpalette(pal.reshape(-1).tolist())
    p.info["transparency"] = 0
    p_white = pal[idx]
    p_white[clear] = 255
    imgs = {"rgba.png": rgba, "rgba_ref.png": Image.fromarray(white), "p.png": p, "p_ref.png": Image.fromarray(p_white)}
    for name, im in imgs.items():
        (tmp_path / name).write_bytes(_png(im))
        rec = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": name}},
                                                         {"type": "text", "text": "what?"}]},
                            {"role": "assistant", "content": "this."}]}
        (tmp_path / (name + ".jsonl")).write_text(json.dumps(rec) + "\n")
    pv = {}
    for name in imgs:
        batches, ids, m = _run(str(tmp_path / (name + ".jsonl")), needs=QWEN3_VL_NEEDS)
        assert len(ids) == 1 and m["skipped"] == 0, m
        pv[name] = batches[0]["pixel_values"].numpy()
    np.testing.assert_array_equal(pv["rgba.png"], pv["rgba_ref.png"])
    np.testing.assert_array_equal(pv["p.png"], pv["p_ref.png"])
    assert np.abs(pv["rgba.png"] - pv["p.png"]).max() > 0  # two different pictures
