"""Write large synthetic datasets for benchmarks and tests: JSONL (+ image files), Parquet, tar shards.

    python -m titan_mm.data.builtin.generate --out /tmp/ds --n 100000 --format jsonl --shards 8 [--images 0.2]

Text samples are templated sentences of varied length (cheap: a 1M-sample JSONL takes seconds); with
``--images p`` a fraction p of samples are chats with a small generated PNG (JSONL: files under
``images/`` referenced by relative path; Parquet: bytes in the row; tar: a member of the same key).
Everything is a pure function of (n, seed): the same files on every machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

_WORDS = ("the a cat dog runs jumps over under big small red blue house tree river stone bird sings "
          "quickly slowly today tomorrow one two three four five green old new light dark").split()


def _text(r: random.Random) -> str:
    n = int(min(600, r.lognormvariate(3.6, 0.7)))  # ~45 words median, long tail
    return " ".join(r.choices(_WORDS, k=max(3, n))) + "."


def _png(r: random.Random, size: int = 64) -> bytes:
    rng = np.random.default_rng(r.randrange(1 << 30))
    arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _sample(i: int, seed: int, images: float) -> tuple[dict, bytes | None]:
    r = random.Random(seed * 1_000_003 + i)
    if images and r.random() < images:
        png = _png(r)
        rec = {"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{i:08d}.png"},
                                         {"type": "text", "text": "Describe the picture."}]},
            {"role": "assistant", "content": _text(r)}]}
        return rec, png
    return {"text": _text(r)}, None


def generate(out: str, n: int, fmt: str = "jsonl", shards: int = 4, images: float = 0.0, seed: int = 0,
             row_group: int = 1000) -> list[str]:
    """Write ``n`` samples into ``shards`` files of ``fmt`` under ``out``; returns the file paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    per = (n + shards - 1) // shards
    for s in range(shards):
        lo, hi = s * per, min(n, (s + 1) * per)
        if fmt == "jsonl":
            p = os.path.join(out, f"shard-{s:05d}.jsonl")
            with open(p, "w") as f:
                for i in range(lo, hi):
                    rec, png = _sample(i, seed, images)
                    if png is not None:
                        os.makedirs(os.path.join(out, "images"), exist_ok=True)
                        with open(os.path.join(out, "images", f"{i:08d}.png"), "wb") as g:
                            g.write(png)
                    f.write(json.dumps(rec) + "\n")
        elif fmt == "parquet":
            p = os.path.join(out, f"shard-{s:05d}.parquet")
            texts, msgs, imgs = [], [], []
            for i in range(lo, hi):
                rec, png = _sample(i, seed, images)
                if png is not None:
                    rec["messages"][0]["content"][0]["image"] = "image_bytes"  # a binary column of the row
                texts.append(rec.get("text"))
                msgs.append(json.dumps(rec["messages"]) if "messages" in rec else None)
                imgs.append(png)
            cols = {"text": pa.array(texts, pa.string())}
            if images:
                cols["messages"] = pa.array(msgs, pa.string())
                cols["image_bytes"] = pa.array(imgs, pa.binary())
            pq.write_table(pa.table(cols), p, row_group_size=row_group)
        elif fmt == "tar":
            p = os.path.join(out, f"shard-{s:05d}.tar")
            with tarfile.open(p, "w") as tf:
                for i in range(lo, hi):
                    rec, png = _sample(i, seed, images)
                    members = [(f"{i:08d}.json", json.dumps(rec).encode())]
                    if png is not None:
                        rec["messages"][0]["content"][0]["image"] = f"{i:08d}.png"
                        members = [(f"{i:08d}.json", json.dumps(rec).encode()), (f"{i:08d}.png", png)]
                    for name, data in members:
                        ti = tarfile.TarInfo(name)
                        ti.size = len(data)
                        tf.addfile(ti, io.BytesIO(data))
        else:
            raise ValueError(f"unknown format {fmt!r}; use jsonl, parquet or tar")
        paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--format", default="jsonl", choices=["jsonl", "parquet", "tar"])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--images", type=float, default=0.0, help="fraction of samples that are image chats")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for p in generate(a.out, a.n, a.format, a.shards, a.images, a.seed):
        print(p)


if __name__ == "__main__":
    main()
