"""The data loader: sources -> processor -> best-fit packer -> batches, behind one entry point.

    loader = build_dataloader(cfg.data, needs=spec.data_needs(model_cfg), dp_rank=r, dp_world=w,
                              n_micro=grad_accum, seed=cfg.training.seed)
    for batch in loader:            # dict[str, Tensor] exactly as docs/architecture.md "Batch"
        ...; m = loader.metrics()   # data_wait_s, samples_per_s, packing_efficiency, skipped/<reason>, ...
    state = loader.state_dict()     # per micro-batch slot: its streams' positions + the packers' open rows
    loader.load_state_dict(state)   # on a fresh loader of any dp world with the same slots: the same batches

The ``[data]`` section (titan_mm.config.Data) is the one source of the data settings; the model family's
:class:`~titan_mm.registry.DataNeeds` adds its patch / merge sizes, positions kind and special tokens
(``DataNeeds()``: text with 1-D positions).

One global sample stream (:class:`StreamLayout`): a global batch is K = ``n_micro x dp_world`` micro-batch
*slots* (training.global_batch_size / data.micro_batch_size), and slot k of every step is read from its own
packed streams (``data.streams_per_slot`` of them, taking turns by step). A packed stream is a weighted
mixture over its shard of every source, each sample parsed (schema.py), processed (processors.py), packed
(packing.py) into rows of ``data.seq_len`` tokens padded to ``padded_seq_len(data)``; a micro-batch is
``data.micro_batch_size`` rows. So the rows of every global batch are fixed by (seed, K, streams_per_slot, the
data) alone: rank r of W computes slots r*K/W .. (r+1)*K/W-1, and neither W nor data.num_workers changes what a
step trains on. Worker processes (StatefulDataLoader's, used for prefetching) each own whole streams and take
the rank's positions in turn; the loader's state is each stream's state after the last micro-batch the
trainer consumed, saved per slot, so any W with the same K resumes it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_mm.config import Data
from titan_mm.data.packing import BestFitPacker, Doc, collate_rows, padded_seq_len
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import DataError, SkipSample, SourceStream, hash_ints, list_units
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
    layout: "StreamLayout"
    seed: int
    tokenizer_path: str | None
    epochs: int = 0  # 0: cycle forever; N: stop after N epochs of every source (last batch padded)
    return_sample_ids: bool = False
    defer_encoding: bool = False  # a family's builder leaves its encoder's work to the trainer's process
    units: list = field(default_factory=list)  # per source, filled by PackedDataset
    start: dict = field(default_factory=dict)  # stream -> state to start from (None: fresh); set by the loader
    start_pos: int = 0  # micro-batches the rank had read at ``start``

    @property
    def data(self) -> Data:
        return self.proc.data


@dataclass(frozen=True)
class StreamLayout:
    """Which packed streams a data-parallel rank reads, in which order: where the one global sample stream meets
    the ranks (the data loader and the synthetic loader both follow it).

    A global batch is ``slots`` = K micro-batches. Slot k of optimizer step t is the next micro-batch of stream
    ``k * per_slot + t % per_slot`` of ``n_streams`` = K x per_slot (per_slot = data.streams_per_slot), so the
    rows of a global batch depend on neither the dp world nor the workers. Rank r of W reads slots r*n ..
    (r+1)*n-1 (n = ``n_micro`` = K / W) in slot order, one micro-batch of each per step: micro-batch q of its
    reading comes from stream ``stream(q % period)``.

    Loader state (what ``state()`` builds and ``unpack()`` reads): ``{"num_slots": K, "slots": {k: [state of
    each of slot k's streams, None while fresh]}}`` over the rank's slots; each stream state holds ``turns``,
    the micro-batches it has given."""

    slots: int
    per_slot: int = 1
    dp_rank: int = 0
    dp_world: int = 1

    def __post_init__(self):
        if self.slots < 1 or self.per_slot < 1 or self.slots % self.dp_world or not 0 <= self.dp_rank < self.dp_world:
            raise ValueError(f"a global batch of {self.slots} micro-batches (x {self.per_slot} streams each) cannot "
                             f"be split over data-parallel rank {self.dp_rank} of {self.dp_world}")

    @property
    def n_micro(self) -> int:
        return self.slots // self.dp_world

    @property
    def n_streams(self) -> int:
        return self.slots * self.per_slot

    @property
    def period(self) -> int:
        """Micro-batches after which the rank's order of streams repeats (every stream once)."""
        return self.n_micro * self.per_slot

    @property
    def owned_slots(self) -> range:
        return range(self.dp_rank * self.n_micro, (self.dp_rank + 1) * self.n_micro)

    def stream(self, r: int) -> int:
        """The stream that position r (0 <= r < period) of the rank's reading comes from."""
        return (self.dp_rank * self.n_micro + r % self.n_micro) * self.per_slot + r // self.n_micro

    @property
    def streams(self) -> list[int]:
        return [self.stream(r) for r in range(self.period)]

    def turns(self, q: int, r: int) -> int:
        """Micro-batches stream ``stream(r)`` has given once the rank has read q."""
        return q // self.period + (r < q % self.period)

    def position(self, states: dict[int, Any]) -> int:
        """Micro-batches the rank has read, from its streams' states (None: fresh); ValueError when the turns are not
        those of one position (a state saved in the middle of a step, then loaded by another dp world)."""
        turns = [states[v]["turns"] if states[v] is not None else 0 for v in self.streams]
        q = sum(turns)
        if turns != [self.turns(q, r) for r in range(self.period)]:
            raise ValueError(f"data loader state: the streams of rank {self.dp_rank} of {self.dp_world} have given "
                             f"{turns} micro-batches, which is no position of this rank's reading (saved in the middle "
                             "of a step under another dp world?); save it at a step boundary")
        return q

    def state(self, states: dict[int, Any]) -> dict:
        S = self.per_slot
        return {"num_slots": self.slots, "slots": {k: [states[k * S + s] for s in range(S)] for k in self.owned_slots}}

    def counted_state(self, served: int) -> dict:
        """The state of a rank that has read ``served`` micro-batches from streams whose only state is their turns
        (the synthetic and clip loaders, which make micro-batch j from j alone); :meth:`counted` reads it back."""
        return self.state({self.stream(r): {"turns": self.turns(served, r)} for r in range(self.period)})

    def counted(self, sd: Any) -> int:
        """The micro-batches read, from a :meth:`counted_state` (saved by any dp world with the same slots)."""
        return self.position(self.unpack(sd))

    def unpack(self, sd: Any) -> dict[int, Any]:
        """The states of this rank's streams from a loader state: one saved by any dp world with the same slots, or
        a merge of several ranks' (``slots`` may hold more than this rank's)."""
        if not isinstance(sd, dict) or "num_slots" not in sd:
            raise ValueError("not a data loader state of this titan_mm (no micro-batch slots); it was written by an "
                             "older version or another loader")
        if sd["num_slots"] != self.slots:
            raise ValueError(f"data loader state is for {sd['num_slots']} micro-batch slots per global batch, this "
                             f"loader has {self.slots}; resume with the saved training.global_batch_size and "
                             "data.micro_batch_size")
        missing = [k for k in self.owned_slots if k not in sd["slots"]]
        if missing:
            raise ValueError(f"data loader state has no micro-batch slots {missing} (it holds "
                             f"{sorted(sd['slots'])}); load the states of every rank that saved them")
        out = {}
        for k in self.owned_slots:
            got = sd["slots"][k]
            if len(got) != self.per_slot:
                raise ValueError(f"data loader state has {len(got)} streams per micro-batch slot, the config "
                                 f"{self.per_slot}; resume with data.streams_per_slot = {len(got)}")
            out.update({k * self.per_slot + s: st for s, st in enumerate(got)})
        self.position(out)
        return out


class CountedLoader:
    """A loader that makes micro-batch j from j alone: its whole state is the count it has served, saved through
    its ``layout`` (a :class:`StreamLayout`) so any dp world with the same slots resumes it."""

    layout: StreamLayout
    served: int

    def state_dict(self) -> dict:
        return self.layout.counted_state(self.served)

    def load_state_dict(self, sd: dict) -> None:
        self.served = self.layout.counted(sd)


class PackedDataset(IterableDataset):
    def __init__(self, cfg: StreamConfig):
        super().__init__()
        self.cfg = cfg
        if not cfg.units:
            cfg.units = [list_units(spec) for spec, _ in cfg.sources]

    def __iter__(self) -> "_Reader":
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return _Reader(self.cfg, wid, nw)


class _Reader:
    """What one worker yields (the main process with num_workers=0): positions u0 + w, u0 + w + nw, ... of the
    rank's reading, which is StatefulDataLoader's round robin over nw workers from u0. Each period of positions is
    padded to a multiple of nw, so a worker always meets the same streams and no stream is read by two workers;
    a padding position yields a placeholder that the loader drops. Every micro-batch carries the state of the
    stream that gave it, taken right after it, so the loader's state never includes a prefetched batch."""

    def __init__(self, cfg: StreamConfig, worker_id: int, num_workers: int):
        L = cfg.layout
        self.cfg, self.L, self.nw = cfg, L, num_workers
        self.P = -(-L.period // num_workers) * num_workers
        self.u = cfg.start_pos // L.period * self.P + cfg.start_pos % L.period + worker_id
        self.tok = load_tokenizer(cfg.tokenizer_path)
        docs = cfg.proc.needs.docs  # a family that builds its documents itself (DataNeeds.docs)
        self.proc = docs.builder(cfg.data, self.tok, cfg.seed, defer=cfg.defer_encoding) if docs is not None \
            else Processor(self.tok, cfg.proc)
        self.streams: dict[int, PackedStream] = {}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        r = self.u % self.P
        self.u += self.nw
        if r >= self.L.period:
            return {"_meta": {}}
        v = self.L.stream(r)
        if v not in self.streams:
            self.streams[v] = PackedStream(self.cfg, v, self.tok, self.proc)
            if self.cfg.start.get(v) is not None:
                self.streams[v].load_state_dict(self.cfg.start[v])
        s = self.streams[v]
        batch = s.turn() or {"_meta": {}}
        batch["_meta"].update(stream=v, state=s.state_dict())
        return batch


class PackedStream:
    """Packed stream ``stream`` of the layout's ``n_streams`` (a shard of every source), one micro-batch per turn.
    Stateful: state_dict() after a turn resumes right after it."""

    def __init__(self, cfg: StreamConfig, stream: int, tok, proc: Processor | Callable):
        self.cfg, self.tok, self.proc = cfg, tok, proc
        self.family_docs = cfg.proc.needs.docs
        self.slot, self.n_slots = stream, cfg.layout.n_streams
        d = cfg.data
        self.streams = [SourceStream(u, cfg.seed, self.slot, self.n_slots, i, cfg.epochs,
                                     buffer_size=d.shuffle_buffer) for i, u in enumerate(cfg.units)]
        self.weights = [w for _, w in cfg.sources]
        self.packer = BestFitPacker(d.seq_len, d.open_rows, d.max_patches_per_row)
        self.S = padded_seq_len(d)
        self.mix_n = 0
        self.done = False
        self.turns, self.finished = 0, False
        self.counters: dict[str, int] = {"seen": 0, "samples": 0, "skipped": 0, "batches": 0}
        self._logged: set = set()

    def __iter__(self):
        return self

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams], "packer": self.packer.state_dict(self._encode),
                "mix_n": self.mix_n, "done": self.done, "counters": dict(self.counters), "turns": self.turns,
                "finished": self.finished, "stream": self.slot, "n_streams": self.n_slots}

    def load_state_dict(self, s: dict) -> None:
        """A state of this stream (the loader checked its stream id and source count)."""
        for st, ss in zip(self.streams, s["streams"]):
            st.load_state_dict(ss)
        self.packer.load_state_dict(s["packer"], self._decode)
        self.mix_n, self.done, self.counters = s["mix_n"], s["done"], dict(s["counters"])
        self.turns, self.finished = s["turns"], s["finished"]

    def turn(self) -> dict | None:
        """The next micro-batch, or None once a finite stream has ended (the turn still counts, so the rank's
        positions keep mapping onto the same streams)."""
        self.turns += 1
        if not self.finished:
            try:
                return next(self)
            except StopIteration:
                self.finished = True
        return None

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
            doc, sample = self._make(rec, unit, sid, loc)
            doc.ref = (i, loc, -1)
            if not self.packer.fits(doc):
                if self.cfg.data.split_long_text and sample is not None and sample.text is not None and not doc.media:
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

    def _make(self, rec, unit, sid: str, loc: tuple | None) -> tuple[Doc, Any]:
        """(a record's doc, its parsed sample): the processors', or the family's builder's (no sample; it is told
        the record's epoch)."""
        if self.family_docs is not None:
            return self.proc(rec, unit, sid, loc[0] if loc else 0), None
        sample = parse_record(rec)
        return self.proc(sample, rec, unit, sid), sample

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
                d = self._make(rec, unit, sid, loc)[0]
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
            raise DataError(
                f"data: {c['skipped']} of {c['seen']} samples were skipped ({c['skipped'] / c['seen']:.1%} > "
                f"data.max_error_rate = {d.max_error_rate:.1%}); by reason: {reasons}; last: {sid}: "
                f"{detail[:300]}. Fix the data (see the warnings above) or raise data.max_error_rate."
            )

    def _emit(self, rows: list[list[Doc]]) -> dict:
        if self.family_docs is not None:
            batch = self.family_docs.collate(rows, self.S)
        else:
            batch = collate_rows(rows, self.S, self.tok.pad_id, self.cfg.proc.position_axes)
        n_docs = sum(len(r) for r in rows)
        self.counters["batches"] += 1
        meta = {"n_samples": n_docs,
                "n_tokens": int(sum(len(d) for r in rows for d in r)), "n_slots": len(rows) * self.S}
        if self.cfg.return_sample_ids:
            meta["sample_ids"] = [d.sample_id for r in rows for d in r]
        batch["_meta"] = meta
        return batch


class TitanDataLoader(StatefulDataLoader):
    """The rank's micro-batches, with StatefulDataLoader's workers as the prefetching machinery. It strips the
    per-batch metadata off each batch and keeps it: as metrics, and as the state of the stream that gave the batch.
    So ``state_dict()`` is the state right after the last consumed micro-batch (prefetched ones are read again
    after a load), laid out per micro-batch slot (:class:`StreamLayout`), and ``load_state_dict`` takes one saved
    by any dp world with the same slots. Each ``iter()`` starts from the state reached so far (one at a time).
    ``encode``: a family's frozen encoder (DocLayout.encoder), run here on each batch the workers deferred."""

    def __init__(self, dataset: PackedDataset, encode: Callable[[dict], dict] | None = None, **kw):
        super().__init__(dataset, batch_size=None, **kw)
        self.encode = encode
        self.layout: StreamLayout = dataset.cfg.layout
        self._states: dict[int, dict | None] = dict.fromkeys(self.layout.streams)
        self._last: dict[str, Any] = {}
        self._t_prev: float | None = None
        self.last_sample_ids: list[str] = []

    def state_dict(self) -> dict:
        return self.layout.state(self._states)

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict`` at the next ``iter()``."""
        states = self.layout.unpack(state_dict)
        n_src = len(self.dataset.cfg.sources)
        for v, st in states.items():
            if st is None:
                continue
            if (st["stream"], st["n_streams"]) != (v, self.layout.n_streams):
                raise ValueError(f"data loader state: slot entry for stream {v} of {self.layout.n_streams} holds "
                                 f"stream {st['stream']} of {st['n_streams']}; the state is damaged")
            if len(st["streams"]) != n_src:
                raise ValueError(f"data loader state has {len(st['streams'])} sources, the config {n_src}; resume "
                                 "with the same data.dataset / data.mixture")
        self._states = states

    def _finished(self) -> bool:
        return all(s is not None and s["finished"] for s in self._states.values())

    def __iter__(self):
        cfg = self.dataset.cfg  # read by the workers, which start in super().__iter__()
        cfg.start, cfg.start_pos = dict(self._states), self.layout.position(self._states)
        if self._finished():
            return
        it = super().__iter__()
        self._t_prev = t0 = time.perf_counter()
        while not self._finished():
            try:
                batch = next(it)
            except StopIteration:
                return
            meta = batch.pop("_meta")
            if "stream" not in meta:  # a padding position of the workers' round robin
                continue
            self._states[meta["stream"]] = meta["state"]
            if "n_tokens" not in meta:  # the turn of a finite stream that has ended
                continue
            t_enc = time.perf_counter()
            if self.encode is not None:
                batch = self.encode(batch)
            t1 = time.perf_counter()
            dt = max(t1 - (self._t_prev or t0), 1e-9)
            self._t_prev = t1
            self.last_sample_ids = meta.get("sample_ids", [])
            self._last = {"data_wait_s": t1 - t0, "samples_per_s": meta["n_samples"] / dt,
                          "samples": meta["n_samples"], "tokens": meta["n_tokens"], "encode_s": t1 - t_enc,
                          "packing_efficiency": meta["n_tokens"] / max(1, meta["n_slots"])}
            yield batch
            t0 = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        """Metrics of the last batch plus running totals over this rank's streams: data_wait_s (encode_s of it:
        the family's encoder in this process), samples_per_s, samples, tokens, packing_efficiency (non-pad
        fraction), samples_seen, samples_packed, skipped (total) and skipped/<reason> (malformed_json, missing_media,
        corrupt_image, bad_image, bad_video, bad_audio, unreadable_shard, too_long, unknown_modality, bad_schema,
        empty, ...)."""
        out = dict(self._last)
        tot: dict[str, int] = {}
        for st in self._states.values():
            for k, v in (st["counters"] if st is not None else {}).items():
                tot[k] = tot.get(k, 0) + v
        out["samples_seen"] = tot.get("seen", 0)
        out["samples_packed"] = tot.get("samples", 0)
        out["skipped"] = tot.get("skipped", 0)
        out.update({k: v for k, v in tot.items() if k.startswith("skipped/")})
        return out


def _ignore_stop_signals(_worker_id: int) -> None:
    """Loader workers leave SIGINT / SIGTERM to the trainer: a preemption signal sent to every process (Slurm,
    Ctrl-C in a terminal) must let the trainer finish its step and save, which needs its workers alive. A SIGTERM
    from the trainer itself (torch's shutdown, multiprocessing's exit hook) still ends the worker at once: a
    thread reads the sender of each SIGTERM (sigwaitinfo), as torch's own worker handler does in C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit the mask
    threading.Thread(target=_exit_on_parent_sigterm, args=(os.getppid(),), daemon=True).start()


def _exit_on_parent_sigterm(parent: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
        pass
    os._exit(0)


def build_dataloader(data: Data, *, needs: DataNeeds, dp_rank: int = 0, dp_world: int = 1, n_micro: int = 1,
                     seed: int = 0, tokenizer_path: str | None = None, epochs: int = 0,
                     return_sample_ids: bool = False, encode_device: str | None = None) -> TitanDataLoader:
    """Data-parallel rank ``dp_rank``'s loader for the ``[data]`` section and the model family's data needs
    (``DataNeeds()`` without a model: text, 1-D positions). ``n_micro``: micro-batches per rank and optimizer step
    (gradient accumulation), so the global batch is K = n_micro x dp_world micro-batch slots (the trainer: K =
    training.global_batch_size / data.micro_batch_size). ``tokenizer_path`` replaces data.tokenizer_path (the
    trainer passes the model's HF folder); ``epochs`` > 0 stops after that many passes; ``return_sample_ids`` keeps
    ``loader.last_sample_ids``; ``encode_device`` (a family with DocLayout.encoder; the trainer passes its device):
    the frozen encoder runs in this process on that device, micro-batch by micro-batch, not in the builder."""
    if not isinstance(data, Data):
        raise TypeError(f"build_dataloader needs the [data] section (titan_mm.config.Data), got {type(data).__name__}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank must be in [0, dp_world), got rank {dp_rank} of {dp_world}")
    if n_micro < 1:
        raise ValueError(f"n_micro (micro-batches per rank and step) must be >= 1, got {n_micro}")
    layout = StreamLayout(slots=n_micro * dp_world, per_slot=data.streams_per_slot, dp_rank=dp_rank, dp_world=dp_world)
    proc = ProcessorConfig(data=data, needs=needs, lazy_images=True)
    tok = tokenizer_path or data.tokenizer_path
    defer = encode_device is not None and needs.docs is not None and needs.docs.encoder is not None
    if needs.docs is not None:  # fail here, not inside a worker: the family's builder checks [data]
        needs.docs.builder(data, load_tokenizer(tok), seed, defer=defer)
    else:  # ... and the processors, a tokenizer that misses the model's ids
        Processor(load_tokenizer(tok), proc)
    ds = PackedDataset(StreamConfig(proc=proc, sources=resolve_sources(data.dataset, data.mixture), layout=layout,
                                    seed=seed, tokenizer_path=tok, epochs=epochs,
                                    return_sample_ids=return_sample_ids, defer_encoding=defer))
    nw = min(data.num_workers, layout.period)  # a stream is read by one worker: more would only pad
    if nw < data.num_workers and dp_rank == 0:
        log.warning("data: using %d of data.num_workers = %d loader workers: each stream is read by one worker, and "
                    "a rank reads %d (micro-batches per step: %d, x data.streams_per_slot = %d); raise "
                    "data.streams_per_slot for more workers (it changes the data order)",
                    nw, data.num_workers, layout.period, layout.n_micro, layout.per_slot)
    kw: dict[str, Any] = dict(num_workers=nw, pin_memory=data.pin_memory and torch.cuda.is_available())
    if nw > 0:
        kw.update(prefetch_factor=data.prefetch_factor, persistent_workers=False, worker_init_fn=_ignore_stop_signals,
                  multiprocessing_context="spawn" if torch.cuda.is_initialized() else None)
    return TitanDataLoader(ds, encode=needs.docs.encoder(data, encode_device) if defer else None, **kw)
