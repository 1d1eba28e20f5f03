"""Online best-fit packing of processed documents into fixed-length rows, and batch collation.

Legend: B rows per batch, S tokens per row (the budget rounded up to a multiple of 16), L doc length.

A :class:`Doc` is one processed sample: token ids, labels already shifted inside the document
(``labels[t]`` is the target for token ``t``; -100 on prompt tokens and on the doc's last token),
optional 3-D M-RoPE positions (VL) and its media tensors. The :class:`BestFitPacker` keeps up to
``open_rows`` partially filled rows; each new doc goes to the open row it fills best (least room left
after it); among rows that fit almost equally well (within 1% of the budget) it picks the one with the
smallest sum of squared doc lengths, which balances attention cost (sum of L^2) across rows. A row whose
vision-patch count would exceed ``max_patches_per_row`` is not considered. When no open row fits and
all are in use, the fullest one is closed. Closed rows wait in ``ready`` until a batch of B is full.
A doc may carry per-token arrays besides its tokens (``seq``: latents [L, C], latent masks, ...; a doc may hold no
tokens at all, a diffusion transformer's) and a segment description of causal, full and noised splits
(``segments``: split lengths and kinds, titan_mm.nn.attention SEGMENT_KINDS). The packer's open rows and ready rows
are part of the loader state (the loader saves each doc as a small reference and rebuilds it on resume, see
loader.PackedStream._encode), so resume loses nothing.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from titan_mm.nn.attention import SEGMENT_KINDS
from titan_mm.registry import BatchSchema

IGNORE_INDEX = -100
PAD_MULTIPLE = 16
# Docs keep audio frames first ([frames, n_mels] per clip) so every media key joins on axis 0; the batch gives
# them mels first, [n_mels, sum frames], the layout HF's Omni audio towers take.
MELS_FIRST = ("input_features",)


def round_up(x: int, m: int = PAD_MULTIPLE) -> int:
    return (x + m - 1) // m * m


def padded_seq_len(data) -> int:
    """The row length S of every batch for the ``[data]`` section (titan_mm.config.Data): data.seq_len rounded up
    to a multiple of 16. The loader pads to it and the mesh checks it (ParallelDims.check_model)."""
    return round_up(data.seq_len)


@dataclass
class Doc:
    input_ids: np.ndarray | None  # [L] int64; None: a doc without tokens (its length is that of its seq arrays)
    labels: np.ndarray | None  # [L] int64, shifted within the doc
    sample_id: str = ""
    positions: np.ndarray | None = None  # [3, L] int64 M-RoPE positions (start at 0); None: arange(L)
    media: dict = field(default_factory=dict)  # key -> list[np.ndarray] (pixel_values, image_grid_thw, ...)
    n_patches: int = 0  # vision patches (before merge) this doc feeds to the vision tower
    ref: tuple | None = None  # where it came from (source, location, chunk), to rebuild it on resume
    seq: dict = field(default_factory=dict)  # key -> [L, *trailing] per-token array (latents [L, C], latent_mask)
    segments: tuple = ()  # ((length, kind), ...) in token order, kind of SEGMENT_KINDS; (): one causal segment

    def __len__(self) -> int:
        if self.input_ids is not None:
            return int(self.input_ids.shape[0])
        if not self.seq:
            raise ValueError(f"doc {self.sample_id!r} has neither input_ids nor seq arrays; give it one of them")
        return int(next(iter(self.seq.values())).shape[0])


class _Row:
    __slots__ = ("docs", "used", "patches", "sumsq")

    def __init__(self):
        self.docs: list[Doc] = []
        self.used = 0
        self.patches = 0
        self.sumsq = 0

    def add(self, d: Doc) -> None:
        self.docs.append(d)
        self.used += len(d)
        self.patches += d.n_patches
        self.sumsq += len(d) ** 2


class BestFitPacker:
    def __init__(self, budget: int, open_rows: int = 32, max_patches_per_row: int = 0):
        if budget < 1:
            raise ValueError(f"packing budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.open_rows = max(1, open_rows)
        self.max_patches_per_row = max_patches_per_row
        self.open: list[_Row] = []
        self.ready: deque[list[Doc]] = deque()

    def fits(self, d: Doc) -> bool:
        """Whether a doc can ever be packed (tokens and vision patches within one row's limits)."""
        if len(d) > self.budget:
            return False
        return not (self.max_patches_per_row and d.n_patches > self.max_patches_per_row)

    def add(self, d: Doc) -> None:
        n = len(d)
        best, best_key = None, None
        slack = max(1, self.budget // 100)
        for i, r in enumerate(self.open):
            room = self.budget - r.used - n
            if room < 0:
                continue
            if self.max_patches_per_row and r.patches + d.n_patches > self.max_patches_per_row:
                continue
            key = (room // slack, r.sumsq, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        if best is None:
            if len(self.open) >= self.open_rows:
                j = min(range(len(self.open)), key=lambda k: (self.budget - self.open[k].used, k))
                self.ready.append(self.open.pop(j).docs)
            r = _Row()
            r.add(d)
            self.open.append(r)
            best = len(self.open) - 1
        else:
            self.open[best].add(d)
        if self.open[best].used == self.budget:
            self.ready.append(self.open.pop(best).docs)

    def flush(self) -> None:
        """Close every open row (end of a finite stream)."""
        for r in self.open:
            self.ready.append(r.docs)
        self.open = []

    def pop_rows(self, n: int) -> list[list[Doc]] | None:
        if len(self.ready) < n:
            return None
        return [self.ready.popleft() for _ in range(n)]

    def state_dict(self, encode=None) -> bytes:
        """Open and waiting rows, pickled; ``encode(doc)`` may replace each doc by a small reference."""
        enc = encode or (lambda d: d)
        return pickle.dumps(([[enc(d) for d in r.docs] for r in self.open],
                             [[enc(d) for d in row] for row in self.ready]), protocol=4)

    def load_state_dict(self, blob: bytes, decode=None) -> None:
        """Inverse of state_dict; ``decode(list of encoded docs) -> list of docs`` rebuilds them."""
        open_rows, ready = pickle.loads(blob)
        if decode is not None:
            flat = [x for row in open_rows + ready for x in row]
            docs = iter(decode(flat))
            open_rows = [[next(docs) for _ in row] for row in open_rows]
            ready = [[next(docs) for _ in row] for row in ready]
        self.open = []
        for docs_ in open_rows:
            r = _Row()
            for d in docs_:
                r.add(d)
            self.open.append(r)
        self.ready = deque(ready)


def collate_rows(rows: list[list[Doc]], seq_len: int, pad_id: int, position_axes: int,
                 multiple: int = PAD_MULTIPLE, schema: BatchSchema | None = None) -> dict[str, torch.Tensor]:
    """Build the contract batch (docs/architecture.md, "Batch") from packed rows: the one collator of the
    data pipeline and of the synthetic loaders (titan_mm.train.synthetic, a vision family's synthetic.py).

    Rows are padded to ``S = round_up(seq_len, multiple)`` (16 by default; the synthetic loaders pass 1 to
    keep their exact row length). ``cu_seqlens`` runs over the flattened B*S tokens:
    every doc is a segment, and each row's padding is one more trailing segment. ``max_seqlen`` is the
    longest segment (docs and padding alike), so varlen kernels given it never under-size a tile. Media keys
    join their items in token order: images ``pixel_values`` / ``image_grid_thw``, videos, and audio
    ``input_features [n_mels, sum frames]`` (clips side by side) with ``audio_feature_lengths [n_clips]``.

    Docs without tokens give a batch without ``input_ids`` / ``labels`` / ``num_label_tokens``. A doc's ``seq``
    arrays become [B, S, *trailing] keys (zeros where a doc lacks the key, and on padding); docs with
    ``segments`` add ``seg_ids`` / ``seg_kinds`` (attention kind "segments"; a doc without them is one causal
    segment, each row's padding one more). ``schema``: the family's BatchSchema, which must declare every such key
    (with its trailing dims) and whether the batch holds tokens.
    """
    B, S = len(rows), round_up(seq_len, multiple)
    docs_all = [d for docs in rows for d in docs]
    tokens = _check_docs(docs_all, schema)
    seq_like = {}  # key -> an array of the first doc carrying it (trailing shape, dtype)
    for d in docs_all:
        for key, a in d.seq.items():
            seq_like.setdefault(key, a)
    ids = np.full((B, S), pad_id, dtype=np.int64)
    labels = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    doc_ids = np.full((B, S), -1, dtype=np.int32)
    pos = np.zeros((position_axes, B, S), dtype=np.int64)
    seq = {key: np.zeros((B, S) + a.shape[1:], dtype=a.dtype) for key, a in seq_like.items()}
    segmented = any(d.segments for d in docs_all)
    seg_ids = np.zeros((B, S), dtype=np.int32)
    seg_kinds = np.zeros((B, S), dtype=np.int8)  # 0: "causal", padding included
    seg = [0]
    media: dict[str, list[np.ndarray]] = {}
    for b, docs in enumerate(rows):
        t = n_seg = 0
        for k, d in enumerate(docs):
            n = len(d)
            if tokens:
                ids[b, t : t + n] = d.input_ids
                labels[b, t : t + n] = d.labels
            doc_ids[b, t : t + n] = k
            pos[:, b, t : t + n] = d.positions[:position_axes] if d.positions is not None else np.arange(n)
            for key, a in d.seq.items():
                seq[key][b, t : t + n] = a
            o = t
            for length, kind in d.segments or ((n, "causal"),):
                seg_ids[b, o : o + length] = n_seg
                seg_kinds[b, o : o + length] = SEGMENT_KINDS.index(kind)
                o, n_seg = o + length, n_seg + 1
            seg.append(n)
            t += n
            for key, arrs in d.media.items():
                if key == "_lazy_image":  # vision.LazyImage: patches computed now, in token order
                    for lazy in arrs:
                        for mk, v in lazy.materialize().items():
                            media.setdefault(mk, []).append(v)
                else:
                    media.setdefault(key, []).extend(arrs)
        if t > S:
            raise AssertionError(f"packed row holds {t} tokens > row length {S} (packer bug)")
        if t < S:
            seg.append(S - t)
            seg_ids[b, t:] = n_seg
    cu = np.cumsum(np.asarray(seg, dtype=np.int64)).astype(np.int32)
    batch = {}
    if tokens:
        batch.update(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))
    batch.update({
        "position_ids": torch.from_numpy(pos[0] if position_axes == 1 else pos),  # [B, S] or [P, B, S]
        "doc_ids": torch.from_numpy(doc_ids),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": torch.tensor(max(seg[1:]) if len(seg) > 1 else 0, dtype=torch.int64),
    })
    if tokens:
        batch["num_label_tokens"] = torch.tensor(int((labels != IGNORE_INDEX).sum()), dtype=torch.int64)
    if segmented:
        batch.update(seg_ids=torch.from_numpy(seg_ids), seg_kinds=torch.from_numpy(seg_kinds))
    batch.update((key, torch.from_numpy(a)) for key, a in seq.items())
    for key, arrs in media.items():
        x = np.concatenate(arrs, axis=0)
        batch[key] = torch.from_numpy(np.ascontiguousarray(x.T) if key in MELS_FIRST else x)
    return batch


def _check_docs(docs: list[Doc], schema: BatchSchema | None) -> bool:
    """Whether the docs hold tokens; a doc whose seq arrays, segments or tokens do not fit is refused by name."""
    tokens = docs[0].input_ids is not None if docs else schema is None or schema.tokens
    declared = {k.name: k for k in schema.seq_keys} if schema is not None else None
    if schema is not None and docs and tokens != schema.tokens:
        raise ValueError(f"doc {docs[0].sample_id!r} {'holds' if tokens else 'lacks'} input_ids but the family's "
                         f"BatchSchema says tokens={schema.tokens}; build its docs to match")
    for d in docs:
        n = len(d)
        if (d.input_ids is not None) != tokens:
            raise ValueError(f"doc {d.sample_id!r}: a batch mixes docs with and without input_ids; give every doc "
                             "tokens or none")
        for key, a in d.seq.items():
            if a.shape[0] != n:
                raise ValueError(f"doc {d.sample_id!r}: seq array {key!r} has {a.shape[0]} rows for its {n} tokens")
            if declared is not None and (key not in declared or len(declared[key].trailing) != a.ndim - 1):
                raise ValueError(f"doc {d.sample_id!r}: seq array {key!r} of shape {list(a.shape)} is not a "
                                 "sequence key of the family's BatchSchema with as many trailing dims; declare it")
        if d.segments:
            bad = [k for _, k in d.segments if k not in SEGMENT_KINDS]
            if bad or sum(length for length, _ in d.segments) != n:
                raise ValueError(f"doc {d.sample_id!r}: segments {d.segments} must cover its {n} tokens with "
                                 f"kinds of {SEGMENT_KINDS}")
    return tokens
