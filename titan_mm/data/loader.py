"""The data loader: sources -> processor -> best-fit packer -> batches, behind one entry point.

    loader = build_dataloader(cfg.data, needs=spec.data_needs(model_cfg), dp_rank=r, dp_world=w,
                              seed=cfg.training.seed)
    for batch in loader:            # dict[str, Tensor] exactly as docs/architecture.md "Batch"
        ...; m = loader.metrics()   # data_wait_s, samples_per_s, packing_efficiency, skipped/<reason>, ...
    state = loader.state_dict()     # every source's position + the packer's open rows, per worker
    loader.load_state_dict(state)   # on a fresh loader: continues with exactly the same batches

The ``[data]`` section (titan_mm.config.Data) is the one source of the data settings; the model family's
:class:`~titan_mm.registry.DataNeeds` adds its patch / merge sizes, positions kind and special tokens
(``DataNeeds()``: text with 1-D positions). Each (dp rank, worker) slot runs its own stream: a weighted
mixture over its share of every source, each sample parsed (schema.py), processed (processors.py), packed
(packing.py) into rows of ``data.seq_len`` tokens padded to ``padded_seq_len(data)``; a batch is
``data.micro_batch_size`` rows. Worker processes take turns (StatefulDataLoader's round-robin), so the order
of batches is fixed by (seed, dp_world, dp_rank, num_workers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_mm.config import Data
from titan_mm.data.packing import BestFitPacker, Doc, collate_rows, padded_seq_len
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import SkipSample, SourceStream, hash_ints, list_units
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.registry import DataNeeds

log = logging.getLogger("titan_mm.data")


def resolve_sources(dataset: str, mixture: dict[str, float] | None) -> list[tuple[str, float]]:
    """[(source spec, weight)] from ``data.mixture`` (if given) or ``data.dataset``."""
    if mixture:
        out = []
        for spec, w in mixture.items():
            if not (isinstance(w, (int, float)) and w > 0):
                raise ValueError(f"data.mixture[{spec!r}] = {w!r}: weights must be positive numbers")
            out.append((_canon(spec), float(w)))
        return out
    return [(_canon(s.strip()), 1.0) for s in dataset.split(",") if s.strip()]


def _canon(spec: str) -> str:
    return "builtin:text" if spec == "builtin" else spec


@dataclass
class StreamConfig:
    """Everything a worker needs (picklable): the processors' settings ([data] + the family's needs) and what the
    [data] section does not hold."""
    proc: ProcessorConfig
    sources: list[tuple[str, float]]
    dp_rank: int
    dp_world: int
    seed: int
    tokenizer_path: str | None
    epochs: int = 0  # 0: cycle forever; N: stop after N epochs of every source (last batch padded)
    return_sample_ids: bool = False
    units: list = field(default_factory=list)  # per source, filled by PackedDataset

    @property
    def data(self) -> Data:
        return self.proc.data


class PackedDataset(IterableDataset):
    def __init__(self, cfg: StreamConfig):
        super().__init__()
        self.cfg = cfg
        if not cfg.units:
            cfg.units = [list_units(spec) for spec, _ in cfg.sources]

    def __iter__(self) -> "PackedStream":
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return PackedStream(self.cfg, wid, nw)


class PackedStream:
    """The iterator of one (rank, worker) slot. Stateful: state_dict() after a batch resumes right after it."""

    def __init__(self, cfg: StreamConfig, worker_id: int, num_workers: int):
        self.cfg, self.worker_id = cfg, worker_id
        self.slot = cfg.dp_rank * num_workers + worker_id
        self.n_slots = cfg.dp_world * num_workers
        self.tok = load_tokenizer(cfg.tokenizer_path)
        self.proc = Processor(self.tok, cfg.proc)
        d = cfg.data
        self.streams = [SourceStream(u, cfg.seed, self.slot, self.n_slots, i, cfg.epochs,
                                     buffer_size=d.shuffle_buffer) for i, u in enumerate(cfg.units)]
        self.weights = [w for _, w in cfg.sources]
        self.packer = BestFitPacker(d.seq_len, d.open_rows, d.max_patches_per_row)
        self.S = padded_seq_len(d)
        self.mix_n = 0
        self.done = False
        self.counters: dict[str, int] = {"seen": 0, "samples": 0, "skipped": 0, "batches": 0}
        self._logged: set = set()

    def __iter__(self):
        return self

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams], "packer": self.packer.state_dict(self._encode),
                "mix_n": self.mix_n, "done": self.done, "counters": dict(self.counters),
                "slot": self.slot, "n_slots": self.n_slots}

    def load_state_dict(self, s: dict) -> None:
        if (s["slot"], s["n_slots"]) != (self.slot, self.n_slots):
            raise ValueError(
                f"data loader state is for slot {s['slot']} of {s['n_slots']} but this loader is slot {self.slot} "
                f"of {self.n_slots}; resume with the same dp world size and data.num_workers"
            )
        if len(s["streams"]) != len(self.streams):
            raise ValueError(f"data loader state has {len(s['streams'])} sources, config has {len(self.streams)}; "
                             "resume with the same data.dataset / data.mixture")
        for st, ss in zip(self.streams, s["streams"]):
            st.load_state_dict(ss)
        self.packer.load_state_dict(s["packer"], self._decode)
        self.mix_n, self.done, self.counters = s["mix_n"], s["done"], dict(s["counters"])

    # ---------------------------------------------------------------- iteration
    def __next__(self) -> dict:
        B = self.cfg.data.micro_batch_size
        while True:
            rows = self.packer.pop_rows(B)
            if rows is not None:
                return self._emit(rows)
            if self.done:
                if self.packer.ready:
                    rows = list(self.packer.ready) + [[] for _ in range(B - len(self.packer.ready))]
                    self.packer.ready.clear()
                    return self._emit(rows)
                raise StopIteration
            self._pull()

    def _pick(self) -> int | None:
        live = [i for i, s in enumerate(self.streams) if not s.exhausted]
        if not live:
            return None
        if len(live) == 1:
            return live[0]
        u = hash_ints(self.cfg.seed, self.slot, self.mix_n, 77) / 2.0**64
        self.mix_n += 1
        tot = sum(self.weights[i] for i in live)
        acc = 0.0
        for i in live:
            acc += self.weights[i] / tot
            if u < acc:
                return i
        return live[-1]

    def _pull(self) -> None:
        i = self._pick()
        if i is None:
            self.packer.flush()
            self.done = True
            return
        got = self.streams[i].next()
        if got is None:
            return
        sid, unit, rec, loc = got
        self.counters["seen"] += 1
        try:
            sample = parse_record(rec)
            doc = self.proc(sample, rec, unit, sid)
            doc.ref = (i, loc, -1)
            if not self.packer.fits(doc):
                if self.cfg.data.split_long_text and sample.text is not None and not doc.media:
                    for d in self._split(doc):
                        self._add(d)
                    return
                raise SkipSample("too_long", f"{len(doc)} tokens / {doc.n_patches} patches > budget "
                                 f"{self.cfg.data.seq_len} tokens / {self.cfg.data.max_patches_per_row or '-'} patches")
            self._add(doc)
        except SkipSample as e:
            self._skip(e.reason, sid, e.detail)
        except Exception as e:  # a bug or an unforeseen bad input: count it, log it with where it came from
            self._skip("processing_error", sid, f"{type(e).__name__}: {e}")

    def _add(self, d: Doc) -> None:
        self.packer.add(d)
        self.counters["samples"] += 1

    def _split(self, doc: Doc) -> list[Doc]:
        return [self._chunk(doc, a) for a in range(0, len(doc), self.cfg.data.seq_len)]

    def _chunk(self, doc: Doc, a: int) -> Doc:
        n = self.cfg.data.seq_len
        lab = doc.labels[a : a + n].copy()
        lab[-1] = -100
        ref = (doc.ref[0], doc.ref[1], a) if doc.ref is not None else None
        return Doc(doc.input_ids[a : a + n].copy(), lab, f"{doc.sample_id}@{a}", ref=ref)

    # The packer's buffered docs are saved as references (source, location, chunk) and rebuilt on resume
    # by re-reading and re-processing those records (deterministic), so a snapshot is a few integers per
    # buffered sample instead of its token and pixel arrays.
    @staticmethod
    def _encode(d: Doc):
        return ("ref", d.ref) if d.ref is not None and d.ref[1] is not None else ("doc", d)

    def _decode(self, items: list) -> list[Doc]:
        locs: dict[int, list] = {}
        for kind, x in items:
            if kind == "ref":
                locs.setdefault(x[0], []).append(x[1])
        fetched = {i: self.streams[i].fetch(ls) for i, ls in locs.items()}
        memo: dict = {}
        out = []
        for kind, x in items:
            if kind == "doc":
                out.append(x)
                continue
            i, loc, chunk = x
            key = (i, loc)
            if key not in memo:
                sid, unit, rec = fetched[i][loc]
                d = self.proc(parse_record(rec), rec, unit, sid)
                d.ref = (i, loc, -1)
                memo[key] = d
            d = memo[key]
            out.append(d if chunk < 0 else self._chunk(d, chunk))
        return out

    def _skip(self, reason: str, sid: str, detail: str) -> None:
        c = self.counters
        c["skipped"] += 1
        c["skipped/" + reason] = c.get("skipped/" + reason, 0) + 1
        key = (reason, sid.split("/", 1)[0])
        if key not in self._logged:
            self._logged.add(key)
            log.warning("data: skipped sample %s (%s): %s [further skips of this kind from this source are "
                        "only counted]", sid, reason, detail[:500])
        d = self.cfg.data
        if c["seen"] >= d.error_min_samples and c["skipped"] > d.max_error_rate * c["seen"]:
            reasons = {k[8:]: v for k, v in c.items() if k.startswith("skipped/")}
            raise RuntimeError(
                f"data: {c['skipped']} of {c['seen']} samples were skipped ({c['skipped'] / c['seen']:.1%} > "
                f"data.max_error_rate = {d.max_error_rate:.1%}); by reason: {reasons}; last: {sid}: "
                f"{detail[:300]}. Fix the data (see the warnings above) or raise data.max_error_rate."
            )

    def _emit(self, rows: list[list[Doc]]) -> dict:
        batch = collate_rows(rows, self.S, self.tok.pad_id, self.cfg.proc.mrope)
        n_docs = sum(len(r) for r in rows)
        self.counters["batches"] += 1
        meta = {"worker": self.worker_id, "counters": dict(self.counters), "n_samples": n_docs,
                "n_tokens": int(sum(len(d) for r in rows for d in r)), "n_slots": len(rows) * self.S}
        if self.cfg.return_sample_ids:
            meta["sample_ids"] = [d.sample_id for r in rows for d in r]
        batch["_meta"] = meta
        return batch


class TitanDataLoader(StatefulDataLoader):
    """A StatefulDataLoader that strips the per-batch metadata off each batch and keeps it as metrics."""

    def __init__(self, dataset: PackedDataset, **kw):
        super().__init__(dataset, batch_size=None, **kw)
        self._worker_counters: dict[int, dict] = {}
        self._last: dict[str, Any] = {}
        self._t_prev: float | None = None
        self.last_sample_ids: list[str] = []

    def __iter__(self):
        it = super().__iter__()
        self._t_prev = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            meta = batch.pop("_meta")
            self._worker_counters[meta["worker"]] = meta["counters"]
            dt = max(t1 - (self._t_prev or t0), 1e-9)
            self._t_prev = t1
            self.last_sample_ids = meta.get("sample_ids", [])
            self._last = {"data_wait_s": t1 - t0, "samples_per_s": meta["n_samples"] / dt,
                          "samples": meta["n_samples"], "tokens": meta["n_tokens"],
                          "packing_efficiency": meta["n_tokens"] / max(1, meta["n_slots"])}
            yield batch

    def metrics(self) -> dict[str, float]:
        """Metrics of the last batch plus running totals over this rank's workers: data_wait_s,
        samples_per_s, samples, tokens, packing_efficiency (non-pad fraction), samples_seen,
        samples_packed, skipped (total) and skipped/<reason> (malformed_json, missing_media, corrupt_image, bad_image,
        bad_video, bad_audio, unreadable_shard, too_long, unknown_modality, bad_schema, empty, ...)."""
        out = dict(self._last)
        tot: dict[str, int] = {}
        for c in self._worker_counters.values():
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        out["samples_seen"] = tot.get("seen", 0)
        out["samples_packed"] = tot.get("samples", 0)
        out["skipped"] = tot.get("skipped", 0)
        out.update({k: v for k, v in tot.items() if k.startswith("skipped/")})
        return out


def build_dataloader(data: Data, *, needs: DataNeeds, dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
                     tokenizer_path: str | None = None, epochs: int = 0,
                     return_sample_ids: bool = False) -> TitanDataLoader:
    """The rank's loader for the ``[data]`` section and the model family's data needs (``DataNeeds()`` without a
    model: text, 1-D positions). ``tokenizer_path`` replaces data.tokenizer_path (the trainer passes the model's HF
    folder); ``epochs`` > 0 stops after that many passes; ``return_sample_ids`` keeps ``loader.last_sample_ids``."""
    if not isinstance(data, Data):
        raise TypeError(f"build_dataloader needs the [data] section (titan_mm.config.Data), got {type(data).__name__}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank must be in [0, dp_world), got rank {dp_rank} of {dp_world}")
    proc = ProcessorConfig(data=data, needs=needs, lazy_images=True)
    tok = tokenizer_path or data.tokenizer_path
    Processor(load_tokenizer(tok), proc)  # fail here, not inside a worker, on a tokenizer that misses the model's ids
    ds = PackedDataset(StreamConfig(proc=proc, sources=resolve_sources(data.dataset, data.mixture), dp_rank=dp_rank,
                                    dp_world=dp_world, seed=seed, tokenizer_path=tok, epochs=epochs,
                                    return_sample_ids=return_sample_ids))
    nw = data.num_workers
    kw: dict[str, Any] = dict(num_workers=nw, pin_memory=data.pin_memory and torch.cuda.is_available())
    if nw > 0:
        kw.update(prefetch_factor=data.prefetch_factor, persistent_workers=False,
                  multiprocessing_context="spawn" if torch.cuda.is_initialized() else None)
    return TitanDataLoader(ds, **kw)
