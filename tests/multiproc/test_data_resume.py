"""Exact resume: save the loader state at batch k (in the middle of a step of 2 micro-batches), rebuild
everything in a new process, and the next 50 batches equal the uninterrupted run bit for bit (num_workers 0
and 2, a 3-source mixture with images, open packer rows in the saved state)."""

import hashlib
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import Data
from titan_mm.data.builtin.generate import generate
from titan_mm.data.loader import build_dataloader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K, N = 7, 50


def _data(d, **kw) -> Data:
    return Data(**{"seq_len": 256, "micro_batch_size": 2, "image_min_pixels": 1024, "image_max_pixels": 4096,
                   "open_rows": 8, "mixture": {"builtin:text": 0.5, f"{d}/txt": 0.3, f"{d}/img": 0.2}, **kw})


def make(d, nw):  # 2 micro-batches per step: two streams, one per worker with num_workers=2
    return build_dataloader(_data(d, num_workers=nw), needs=QWEN3_VL_NEEDS, n_micro=2, seed=11)


def digest(b) -> str:
    h = hashlib.sha1()
    for k in sorted(b):
        h.update(k.encode())
        h.update(str(tuple(b[k].shape)).encode())
        h.update(b[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def _find(obj, key):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            else:
                yield from _find(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _find(v, key)


_CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {here!r})
from test_data_resume import make, digest, N
dl = make({d!r}, {nw})
dl.load_state_dict(torch.load({state!r}, weights_only=False))
out = []
for b in dl:
    out.append(digest(b))
    if len(out) == N:
        break
print(json.dumps(out))
"""


@pytest.mark.parametrize("nw", [0, 2])
def test_exact_resume_new_process(tmp_path, nw):
    d = str(tmp_path)
    generate(f"{d}/txt", 300, "jsonl", shards=3, seed=1)
    generate(f"{d}/img", 120, "parquet", shards=2, images=0.5, seed=2, row_group=20)
    dl = make(d, nw)
    ref, state, saw_img = [], None, False
    for i, b in enumerate(dl):
        saw_img |= i >= K and "pixel_values" in b
        if i == K - 1:
            state = dl.state_dict()
        elif i >= K:
            ref.append(digest(b))
            if len(ref) == N:
                break
    assert saw_img, "the compared batches should include images"
    # the saved state holds open (half-filled) packer rows
    blobs = list(_find(state, "packer"))
    assert blobs, "no packer state in the loader state"
    assert any(pickle.loads(bl)[0] for bl in blobs), "expected open packer rows in the saved state"
    # buffered docs are saved as references (re-read and re-processed on resume), not as tensors
    assert all(kind == "ref" for bl in blobs for row in pickle.loads(bl)[0] for kind, _ in row)
    assert max(len(bl) for bl in blobs) < 20_000
    sp = f"{d}/state.pt"
    torch.save(state, sp)
    here = os.path.dirname(os.path.abspath(__file__))
    code = _CHILD.format(root=ROOT, here=here, d=d, nw=nw, state=sp)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == ref


def test_resume_rejects_other_layout(tmp_path):
    d = str(tmp_path)
    generate(f"{d}/txt", 50, "jsonl", shards=1)
    generate(f"{d}/img", 10, "jsonl", shards=1)
    dl = make(d, 0)
    next(iter(dl))
    state = dl.state_dict()
    other = build_dataloader(_data(d), needs=QWEN3_VL_NEEDS, seed=11, n_micro=4)  # another global batch
    with pytest.raises(ValueError, match="for 2 micro-batch slots per global batch, this loader has 4"):
        other.load_state_dict(state)
    fewer = build_dataloader(_data(d, mixture={f"{d}/txt": 1.0}), needs=QWEN3_VL_NEEDS, seed=11, n_micro=2)
    with pytest.raises(ValueError, match="3 sources, the config 1"):
        fewer.load_state_dict(state)


def test_resume_rebuilds_buffered_docs_from_every_format(tmp_path):
    """tar shards with image members, a JSON array file, split long texts: the buffered docs rebuilt from
    their references equal the originals (in-process, num_workers 0)."""
    import json as _json

    d = str(tmp_path)
    generate(f"{d}/t", 80, "tar", shards=2, images=0.5, seed=4)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.json").write_text(_json.dumps([{"text": "word " * n} for n in range(5, 700, 7)]))

    data = _data(d, split_long_text=True, open_rows=6, mixture={f"{d}/t": 1.0, f"{d}/j": 1.0})

    def mk():
        return build_dataloader(data, needs=QWEN3_VL_NEEDS, seed=2)

    dl = mk()
    it = iter(dl)
    for _ in range(5):
        next(it)
    st = dl.state_dict()
    ref = [digest(next(it)) for _ in range(20)]
    dl2 = mk()
    dl2.load_state_dict(st)
    it2 = iter(dl2)
    assert [digest(next(it2)) for _ in range(20)] == ref
