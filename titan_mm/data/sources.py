"""Sources: shards of records read as streams over fsspec, with a deterministic order.

A *source* is one dataset given by a path or URL (a file, a folder, or a glob; local or any fsspec
URL such as s3://, gs://, https://, memory://) or a built-in name (``builtin:text``, ``builtin:digits``,
``builtin:digits_test``, ``builtin:photos``, ``builtin:dtmf``, ...: titan_mm.data.builtin.NUM_PARTS). It is
split into *units* that can be read independently: a JSONL/JSON file, one row group of a Parquet file, one tar
shard (WebDataset layout: members grouped by key, ``000123.json`` + ``000123.jpg``), or a slice of a built-in
dataset.

Order, the same on every machine:
  (seed, epoch) -> permutation of the units -> packed-stream slot -> in-unit order (file order for
  JSONL and tar; a (seed, epoch, unit)-keyed permutation for Parquet row groups, JSON files, built-ins).
A slot is one packed stream of the global sample stream (loader.StreamLayout: n = the global batch's
micro-batches x data.streams_per_slot, whatever the dp world and the workers).
With at least as many units as slots, slot s reads units s, s+n, s+2n, ... of
the permutation. With fewer units, every slot walks all units and keeps the samples whose
(unit position + in-unit index) is congruent to s modulo n, so no sample is read by two slots and none
is lost. Each sample gets a stable global id: ``<source>/<unit>:<index>``.

Readers never materialize the dataset: JSONL is read line by line (resume seeks to a byte offset),
Parquet one row group at a time, tar shards member by member.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import logging
import posixpath
import re
import tarfile
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
import pyarrow.parquet as pq

from titan_mm.data.builtin import NUM_PARTS, builtin_num_parts, builtin_records

log = logging.getLogger("titan_mm.data")

FORMATS = ("jsonl", "json", "parquet", "tar", "builtin")


class SkipSample(Exception):
    """A sample (or whole unit) that cannot be used; ``reason`` is its metrics key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DataError(RuntimeError):
    """The data cannot feed the run (more samples skipped than data.max_error_rate allows). Raised inside a
    loader worker too: torch re-raises it in the main process with the worker's traceback as the message, so
    :attr:`reason` gives the one line that says why."""

    @property
    def reason(self) -> str:
        msg = str(self)
        prefix = f"{type(self).__module__}.{type(self).__qualname__}: "  # how the worker's traceback ends
        if prefix in msg:
            msg = msg.rsplit(prefix, 1)[1]
        return " ".join(msg.split())


@dataclass(frozen=True)
class Unit:
    source: str  # source name
    url: str  # file URL / path, or builtin name
    fmt: str
    part: int = 0  # parquet row group, or builtin slice index
    nparts: int = 1  # builtin: number of slices

    @property
    def uid(self) -> str:
        base = self.url.rsplit("/", 1)[-1]
        return f"{base}#{self.part}" if self.fmt in ("parquet", "builtin") else base


def detect_format(url: str) -> str:
    u = url.lower().split("?")[0]
    for ext, fmt in ((".jsonl", "jsonl"), (".jsonl.gz", "jsonl"), (".json", "json"), (".parquet", "parquet"),
                     (".tar", "tar"), (".tar.gz", "tar"), (".tgz", "tar")):
        if u.endswith(ext):
            return fmt
    raise ValueError(
        f"cannot tell the format of {url!r} from its name; use a name ending in .jsonl, .json, .parquet or .tar"
    )


def source_name(spec: str) -> str:
    if spec.startswith("builtin:"):
        return spec
    return hashlib.sha1(spec.encode()).hexdigest()[:8] + ":" + spec.rstrip("/").rsplit("/", 1)[-1]


def list_units(spec: str, name: str | None = None) -> list[Unit]:
    """Enumerate the units of a source (reads only file listings and Parquet footers)."""
    name = name or source_name(spec)
    if spec.startswith("builtin:"):
        n = builtin_num_parts(spec[len("builtin:"):])
        return [Unit(name, spec, "builtin", i, n) for i in range(n)]
    fs, _, paths = fsspec.get_fs_token_paths(spec)
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    files: list[str] = []
    for p in sorted(paths):
        if fs.isdir(p):
            files += sorted(f for f in fs.find(p) if _known(f))
        elif fs.exists(p):
            files.append(p)
    if not files:
        near = difflib.get_close_matches(spec, list(NUM_PARTS), n=1)
        raise FileNotFoundError(
            f"data source {spec!r} matched no files ({_nearby(fs, spec)}); "
            f"{f'did you mean builtin:{near[0]}? ' if near else ''}check the path / glob: files ending in "
            f".jsonl .json .parquet .tar are read, or a built-in: {', '.join('builtin:' + n for n in NUM_PARTS)}"
        )
    units = []
    for f in files:
        url = f if proto in ("file", "local") else f"{proto}://{f}" if "://" not in f else f
        fmt = detect_format(f)
        if fmt == "parquet":
            try:
                with fsspec.open(url, "rb") as fh:
                    n_rg = pq.ParquetFile(fh).metadata.num_row_groups
            except Exception as e:  # an unreadable shard is skipped, with a log line
                log.warning("data: unreadable Parquet shard %s skipped (%s)", url, e)
                units.append(Unit(name, url, "parquet", -1))
                continue
            units += [Unit(name, url, "parquet", g) for g in range(n_rg)]
        else:
            units.append(Unit(name, url, fmt))
    return units


def _nearby(fs, spec: str) -> str:
    """What the nearest existing folder above a path / glob that matched nothing holds."""
    d = fs._strip_protocol(re.split(r"[*?\[]", spec, maxsplit=1)[0]).rstrip("/")
    while d not in ("", "/", ".") and not fs.isdir(d):
        d = posixpath.dirname(d)
    if d in ("", "/", "."):
        return "no folder of that path exists"
    names = sorted(n for p in fs.ls(d, detail=False) if not (n := posixpath.basename(p.rstrip("/"))).startswith("."))
    if not names:
        return f"{d} is empty"
    return f"{d} holds {', '.join(names[:8])}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"


def _known(f: str) -> bool:
    try:
        detect_format(f)
        return True
    except ValueError:
        return False


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def hash_ints(*xs: int) -> int:
    h = 0x1234567
    for x in xs:
        h = splitmix64(h ^ (x & 0xFFFFFFFFFFFFFFFF))
    return h


def permutation(n: int, *key: int) -> list[int]:
    """A deterministic permutation of range(n) keyed by integers (no global RNG, same everywhere)."""
    return sorted(range(n), key=lambda i: hash_ints(*key, i))


# ----------------------------------------------------------------------------------------- readers
# A reader yields (position, record id, resume_token, record) from position `start` / `token` (a
# format-specific resume token, e.g. a byte offset). `record` is a dict, or a SkipSample for a bad record.
# Random-access units (a JSON file, a Parquet row group, a built-in slice) are read in an order permuted by
# `order` = (seed, source, epoch, unit) when given; streamed units (JSONL, tar) in file order.


def _read_jsonl(unit: Unit, start: int, token: Any, order: tuple | None = None) -> Iterator:
    opener = fsspec.open(unit.url, "rb", compression="infer")
    with opener as fh:
        idx = 0
        if token and unit.url.endswith(".jsonl"):
            fh.seek(token)
            idx = start
        while True:
            line = fh.readline()
            if not line:
                return
            if idx < start:
                idx += 1
                continue
            off = fh.tell() if unit.url.endswith(".jsonl") else None
            s = line.strip()
            if not s:
                idx += 1
                continue
            try:
                rec = json.loads(s)
                if not isinstance(rec, dict):
                    raise ValueError(f"a line must hold a JSON object, got {type(rec).__name__}")
            except ValueError as e:
                rec = SkipSample("malformed_json", f"{unit.url} line {idx + 1}: {e}")
            yield idx, idx + 1, off, rec  # the record id is the line number, as editors and the report count
            idx += 1


def _shuffled(n: int, order: tuple | None) -> list[int]:
    return permutation(n, *order) if order is not None else list(range(n))


def _read_json(unit: Unit, start: int, token: Any, order: tuple | None = None) -> Iterator:
    # A .json file is one JSON array of records (or {"data": [...]}); it is read whole, so keep such files small.
    with fsspec.open(unit.url, "rb") as fh:
        try:
            data = json.load(fh)
        except ValueError as e:
            raise SkipSample("unreadable_shard", f"{unit.url}: not valid JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("data", data.get("samples"))
    if not isinstance(data, list):
        raise SkipSample("unreadable_shard", f"{unit.url}: expected a JSON array of records")
    perm = _shuffled(len(data), order)
    for pos in range(start, len(data)):
        i = perm[pos]
        rec = data[i] if isinstance(data[i], dict) else SkipSample("malformed_json", f"{unit.url}[{i}]: not an object")
        yield pos, i, None, rec


def _read_parquet(unit: Unit, start: int, token: Any, order: tuple | None = None) -> Iterator:
    if unit.part < 0:
        raise SkipSample("unreadable_shard", f"{unit.url}: Parquet footer could not be read")
    with fsspec.open(unit.url, "rb") as fh:
        table = pq.ParquetFile(fh).read_row_group(unit.part)
    cols = table.column_names
    data = {c: table.column(c).to_pylist() for c in cols}
    perm = _shuffled(table.num_rows, order)
    for pos in range(start, table.num_rows):
        i = perm[pos]
        rec = {c: data[c][i] for c in cols}  # chats stored as JSON strings are decoded by schema.parse_record
        yield pos, i, None, rec


def _read_tar(unit: Unit, start: int, token: Any, order: tuple | None = None) -> Iterator:
    with fsspec.open(unit.url, "rb") as fh:
        try:
            tf = tarfile.open(fileobj=fh, mode="r|*")
        except tarfile.TarError as e:
            raise SkipSample("unreadable_shard", f"{unit.url}: {e}") from None
        idx, cur_key, group = 0, None, {}

        def emit(key, group, idx):
            meta = group.pop("json", None)
            if meta is None:
                txt = group.pop("txt", None)
                if txt is None:
                    return SkipSample("malformed_json", f"{unit.url} key {key}: no .json or .txt member")
                rec = {"text": txt.decode("utf-8", "replace")}
            else:
                try:
                    rec = json.loads(meta)
                except ValueError as e:
                    return SkipSample("malformed_json", f"{unit.url} key {key}: {e}")
            rec["__key__"] = key
            rec["__files__"] = group  # ext or member name -> bytes, for media referenced inside the shard
            return rec

        try:
            for m in tf:
                if not m.isfile():
                    continue
                base = m.name.rsplit("/", 1)[-1]
                key, _, ext = base.partition(".")
                if key != cur_key and cur_key is not None:
                    if idx >= start:
                        yield idx, idx, None, emit(cur_key, group, idx)
                    idx += 1
                    group = {}
                cur_key = key
                if idx >= start:
                    data = tf.extractfile(m).read()
                    group[ext] = data
                    group[base] = data
            if cur_key is not None and idx >= start:
                yield idx, idx, None, emit(cur_key, group, idx)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise SkipSample("unreadable_shard", f"{unit.url}: {e}") from None


def _read_builtin(unit: Unit, start: int, token: Any, order: tuple | None = None) -> Iterator:
    recs = builtin_records(unit.url[len("builtin:"):])[unit.part :: unit.nparts]  # slice `part` of `nparts`
    perm = _shuffled(len(recs), order)
    for pos in range(start, len(recs)):
        yield pos, perm[pos], None, recs[perm[pos]]


READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "tar": _read_tar,
           "builtin": _read_builtin}


class SourceStream:
    """The samples of one source assigned to one packed-stream slot, over epochs, resumable.

    State: epoch, position in this slot's unit list, in-unit index and resume token.
    """

    def __init__(self, units: list[Unit], seed: int, slot: int, n_slots: int, source_idx: int,
                 max_epochs: int = 0, shuffle: bool = True, buffer_size: int = 0):
        if not units:
            raise ValueError("a data source with no units")
        self.units, self.seed, self.slot, self.n_slots = units, seed, slot, n_slots
        self.source_idx, self.max_epochs, self.shuffle = source_idx, max_epochs, shuffle
        self.epoch, self.upos, self.index, self.token = 0, 0, 0, None
        self._it: Iterator | None = None
        self._plan: list[tuple[int, int]] | None = None  # (unit id, stride offset) for this epoch
        self._plan_epoch = -1
        self._raw_exhausted = False
        # shuffle buffer: up to buffer_size read-ahead samples; one is drawn per next() by a counter hash
        self.buffer_size = buffer_size
        self._buf: list[tuple] = []
        self._draws = 0

    @property
    def exhausted(self) -> bool:
        return self._raw_exhausted and not self._buf

    def _epoch_plan(self) -> list[tuple[int, int]]:
        if self._plan_epoch != self.epoch:
            perm = permutation(len(self.units), self.seed, self.source_idx, self.epoch)
            if len(self.units) >= self.n_slots:
                self._plan = [(u, -1) for u in perm[self.slot :: self.n_slots]]
            else:
                self._plan = [(u, p) for p, u in enumerate(perm)]
            self._plan_epoch = self.epoch
        return self._plan

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "upos": self.upos, "index": self.index,
                "token": -1 if self.token is None else self.token, "exhausted": self._raw_exhausted,
                "got_any": self._got_any, "draws": self._draws, "buffer": [b[3] for b in self._buf]}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.upos, self.index = s["epoch"], s["upos"], s["index"]
        self.token = None if s["token"] == -1 else s["token"]
        self._raw_exhausted, self._got_any = s["exhausted"], s["got_any"]
        self._it = None
        self._draws = s["draws"]
        locs = [tuple(x) for x in s["buffer"]]
        got = self.fetch(locs) if locs else {}
        self._buf = [(*got[loc], loc) for loc in locs]

    def next(self) -> tuple[str, Unit, Any, tuple | None] | None:
        """(global id, unit, record or SkipSample, location); None when a finite stream is exhausted."""
        if self.buffer_size <= 1:
            return self._next_raw()
        while len(self._buf) < self.buffer_size and not self._raw_exhausted:
            got = self._next_raw()
            if got is None:
                break
            if got[3] is None:  # an unreadable unit: report at once
                return got
            self._buf.append(got)
        if not self._buf:
            return None
        j = hash_ints(self.seed, self.slot, self.source_idx, self._draws, 99) % len(self._buf)
        self._draws += 1
        item = self._buf[j]
        self._buf[j] = self._buf[-1]
        self._buf.pop()
        return item

    def _next_raw(self) -> tuple[str, Unit, Any, tuple | None] | None:
        while not self._raw_exhausted:
            plan = self._epoch_plan()
            if self.upos >= len(plan):
                got_any = self._got_any
                self.epoch += 1
                self.upos, self.index, self.token, self._it, self._got_any = 0, 0, None, None, False
                if self.max_epochs and self.epoch >= self.max_epochs:
                    self._raw_exhausted = True
                    return None
                if not got_any:
                    raise RuntimeError(
                        f"data source {self.units[0].source!r} gave no samples to stream {self.slot} of "
                        f"{self.n_slots} (micro-batches per global batch x data.streams_per_slot) in a whole "
                        "epoch; use a smaller global batch or data.streams_per_slot, or add data"
                    )
                continue
            u, stride_off = plan[self.upos]
            unit = self.units[u]
            if self._it is None:
                order = (self.seed, self.source_idx, self.epoch, u) if self.shuffle else None
                self._it = READERS[unit.fmt](unit, self.index, self.token, order)
            try:
                item = next(self._it)
            except StopIteration:
                self._it = None
                self.upos, self.index, self.token = self.upos + 1, 0, None
                continue
            except SkipSample as e:  # the whole unit is unreadable
                self._it = None
                self.upos, self.index, self.token = self.upos + 1, 0, None
                return f"{unit.source}/{unit.uid}", unit, e, None
            pos, rid, token, rec = item
            prev_token = self.token
            self.index, self.token = pos + 1, token
            if stride_off >= 0 and (stride_off + pos) % self.n_slots != self.slot:
                continue
            self._got_any = True
            return f"{unit.source}/{unit.uid}:{rid}", unit, rec, (self.epoch, u, pos, prev_token)
        return None

    def fetch(self, locs: list[tuple]) -> dict[tuple, tuple[str, Unit, Any]]:
        """Re-read records by location ``(epoch, unit, position, resume token)`` (as returned by next()):
        one pass per unit from the smallest position asked for. Used to rebuild the packer's open rows
        on resume, so the loader state holds a few integers per buffered sample, not its tensors."""
        by_unit: dict[tuple[int, int], list[tuple]] = {}
        for loc in locs:
            by_unit.setdefault((loc[0], loc[1]), []).append(loc)
        out = {}
        for (epoch, u), ls in by_unit.items():
            unit = self.units[u]
            first = min(ls, key=lambda x: x[2])
            by_pos = {x[2]: x for x in ls}
            last = max(by_pos)
            order = (self.seed, self.source_idx, epoch, u) if self.shuffle else None
            for pos, rid, _, rec in READERS[unit.fmt](unit, first[2], first[3], order):
                if pos in by_pos:
                    out[by_pos[pos]] = (f"{unit.source}/{unit.uid}:{rid}", unit, rec)
                if pos >= last:
                    break
        missing = [x for x in locs if x not in out]
        if missing:
            raise RuntimeError(
                f"data: {len(missing)} buffered samples of the saved loader state could not be re-read from "
                f"{self.units[missing[0][1]].url} (did the data change since the checkpoint?); restore the "
                "original files, or start the data stream fresh by not loading the data state"
            )
        return out

    _got_any = False


def open_media(ref: str, unit: Unit, media_root: str = "") -> bytes:
    """Bytes of a media file referenced by a URL, an absolute path, or a path relative to ``media_root``
    (default: the folder of the shard)."""
    if "://" in ref or ref.startswith("/"):
        url = ref
    else:
        root = media_root or (unit.url.rsplit("/", 1)[0] if "/" in unit.url else ".")
        url = root.rstrip("/") + "/" + ref
    try:
        with fsspec.open(url, "rb") as fh:
            return fh.read()
    except (FileNotFoundError, OSError) as e:
        raise SkipSample("missing_media", f"{url}: {e}") from None


def media_bytes(spec: Any, rec: dict, unit: Unit, media_root: str = "") -> bytes:
    """Resolve a media part's payload: raw bytes, {"bytes": ...}, a data: URI, a member of the tar shard,
    or a path/URL."""
    if isinstance(spec, (bytes, bytearray)):
        return bytes(spec)
    if isinstance(spec, dict):
        if spec.get("bytes") is not None:
            return bytes(spec["bytes"])
        spec = spec.get("url") or spec.get("path")
    if not isinstance(spec, str) or not spec:
        raise SkipSample("missing_media", f"media reference {spec!r} is neither bytes nor a path/URL")
    if spec.startswith("data:"):
        try:
            return base64.b64decode(spec.split(",", 1)[1])
        except Exception as e:
            raise SkipSample("corrupt_media", f"bad data: URI ({e})") from None
    if isinstance(rec.get(spec), (bytes, bytearray)):  # Parquet: the name of a binary column of this row
        return bytes(rec[spec])
    files = rec.get("__files__")
    if files:
        name = spec.rsplit("/", 1)[-1]
        for k in (spec, name, name.partition(".")[2]):
            if k in files:
                return files[k]
    return open_media(spec, unit, media_root)
