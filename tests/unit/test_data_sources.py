"""Sources over fsspec (memory://), every format, media by relative path / bytes in the shard / tar member,
LLaVA-style records, video end to end, the built-in datasets."""

import io
import json
import tarfile

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.builtin import builtin_records
from titan_mm.data.loader import build_dataloader
from titan_mm.data.sources import list_units


def _png(seed=0, h=40, w=60) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(b, format="PNG")
    return b.getvalue()


def _data(dataset) -> Data:
    return Data(dataset=dataset, seq_len=512, micro_batch_size=1, image_min_pixels=1024, image_max_pixels=4096,
                video_min_pixels=1024, video_max_pixels=20000)


def _all(dataset, **kw):
    dl = build_dataloader(_data(dataset), needs=QWEN3_VL_NEEDS, epochs=1, return_sample_ids=True, **kw)
    batches, ids = [], []
    for b in dl:
        batches.append(b)
        ids += dl.last_sample_ids
    return batches, ids, dl.metrics()


def _chat(img_ref, answer="ok"):
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": img_ref}},
                                                      {"type": "text", "text": "what?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def test_memory_fs_all_formats_and_media():
    fs = fsspec.filesystem("memory")
    root = "memory://titan_src"
    fs.pipe(f"{root}/j/imgs/a.png", _png(1))  # relative to the shard's folder
    lines = [json.dumps({"text": "plain text"}), json.dumps(_chat("imgs/a.png")),
             json.dumps({"conversations": [{"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "a"}],
                         "image": "imgs/a.png"})]
    fs.pipe(f"{root}/j/d.jsonl", ("\n".join(lines) + "\n").encode())
    fs.pipe(f"{root}/js/d.json", json.dumps([{"text": "x"}, {"text": "y"}]).encode())
    buf = io.BytesIO()
    pq.write_table(pa.table({"messages": [json.dumps(_chat("img")["messages"])], "img": [_png(2)]}), buf)
    fs.pipe(f"{root}/p/d.parquet", buf.getvalue())
    tb = io.BytesIO()
    with tarfile.open(fileobj=tb, mode="w") as tf:
        for name, data in [("0001.json", json.dumps(_chat("0001.png")).encode()), ("0001.png", _png(3)),
                           ("0002.txt", b"text from a tar shard")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    fs.pipe(f"{root}/t/d.tar", tb.getvalue())
    spec = ",".join(f"{root}/{d}" for d in ("j", "js", "p", "t"))
    batches, ids, m = _all(spec)
    assert m["skipped"] == 0, m
    assert len(ids) == 3 + 2 + 1 + 2
    n_imgs = sum(int(b["image_grid_thw"].shape[0]) for b in batches if "image_grid_thw" in b)
    assert n_imgs == 4
    for b in batches:
        assert b["position_ids"].shape[0] == 3


def _mp4(n=12, h=64, w=64, fps=6) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            f = av.VideoFrame.from_ndarray(np.full((h, w, 3), i * 20, np.uint8), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_video_end_to_end(tmp_path):
    (tmp_path / "v.mp4").write_bytes(_mp4())
    rec = {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "?"}]},
                        {"role": "assistant", "content": "frames"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n")
    batches, ids, m = _all(str(tmp_path / "d.jsonl"))
    assert m["skipped"] == 0 and len(ids) == 1
    b = batches[0]
    t, h, w = b["video_grid_thw"][0].tolist()
    assert b["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 16 * 16)
    assert int((b["input_ids"] == 151656).sum()) == t * h * w // 4


def test_builtin_datasets():
    tr, te = builtin_records("digits"), builtin_records("digits_test")
    assert len(tr) == 1437 and len(te) == 360
    assert {r["index"] % 5 for r in te} == {0} and all(r["answer"] in "0123456789" for r in te)
    assert len(builtin_records("photos")) >= 5
    assert len(builtin_records("text")) == 2000
    assert len(list_units("builtin:digits")) == 16
    with pytest.raises(ValueError, match="unknown built-in dataset"):
        list_units("builtin:nope")
