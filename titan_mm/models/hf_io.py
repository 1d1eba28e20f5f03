"""Generic HF safetensors IO: find the HF folder of ``model.hf_path`` (a local folder or a Hub repo id), read it,
check names/shapes, write (sharded) safetensors.

Model families provide pure name maps (``hf_to_titan(sd, cfg)`` / ``titan_to_hf(sd, cfg)``); this module
does the files and the checks, so every family reports problems the same way.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HFCheckpointError(ValueError):
    """A local HF directory does not match the model (names, shapes, model_type, files)."""


class HFPathNotFound(HFCheckpointError):
    """``model.hf_path`` is neither a local folder nor a Hub repo that can be fetched now."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the Hub spells repo ids
# what a model folder needs besides its weights: architecture, tokenizer, chat template, media processors
_META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
               "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.json",
               "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json"]
_WEIGHT_FILES = ["*.safetensors", INDEX_NAME]


def component_dir(path: str | os.PathLike, name: str) -> str:
    """A diffusers pipeline component's folder: ``path``'s ``name``/ subfolder when it holds a config.json (``path`` is
    the pipeline), else ``path`` itself (the component's own folder; the caller checks it)."""
    sub = os.path.join(path, name)
    return sub if os.path.isfile(os.path.join(sub, "config.json")) else str(path)


@functools.lru_cache(maxsize=16)
def local_hf_dir(hf_path: str, weights: bool = False) -> str:
    """The local folder behind ``model.hf_path``: the path itself when it is a folder, else a Hub repo id
    (``Qwen/Qwen3-1.7B``) fetched with huggingface_hub's ``snapshot_download`` into its cache (HF_HOME /
    HF_HUB_CACHE): config and tokenizer files, and the safetensors too with ``weights``. Every reader of
    ``model.hf_path`` goes through here. Raises :class:`HFPathNotFound` (one line) when neither works. A local
    diffusers pipeline folder (model_index.json, no config.json) gives its ``transformer/`` folder."""
    if os.path.isdir(hf_path):
        pipeline = os.path.isfile(os.path.join(hf_path, "model_index.json")) and not os.path.isfile(
            os.path.join(hf_path, "config.json"))
        return component_dir(hf_path, "transformer") if pipeline else hf_path
    if os.path.exists(hf_path) or not _HUB_ID.match(hf_path):
        raise HFPathNotFound(f"model.hf_path {hf_path!r} is not a directory nor a Hub repo id (org/name); give a "
                             "local HF model folder (config.json + *.safetensors) or a Hub id such as "
                             "Qwen/Qwen3-1.7B, or drop model.hf_path to use a flavor")
    # huggingface_hub is slow to import; only a Hub repo id (not a local folder) needs it
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(hf_path, allow_patterns=_META_FILES + (_WEIGHT_FILES if weights else []))
    except LocalEntryNotFoundError:  # offline or no network, and not in the cache (or only part of it)
        raise HFPathNotFound(
            f"model.hf_path {hf_path!r} is a Hub repo id that is not in the cache ({constants.HF_HUB_CACHE}), "
            f"and the Hub cannot be reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE') or 'unset'}); fetch "
            "it once with network access and HF_HUB_OFFLINE unset, or pass a local folder to --model.hf_path"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError):  # gated repos are a subclass
        raise HFPathNotFound(f"model.hf_path {hf_path!r} is not a local folder, and the Hub has no such model repo "
                             "(or it is gated / private: log in with `hf auth login`); check the id, or pass a "
                             "local folder to --model.hf_path") from None
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFPathNotFound(f"model.hf_path {hf_path!r}: the Hub download failed ({first}); retry, or pass a "
                             "local folder to --model.hf_path") from None


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """config.json of an HF folder as a dict; a missing, unreadable or non-JSON file is one HFCheckpointError line.
    The values' types are checked by the family readers (titan_mm.models.hf_config)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{path} not found: an HF model directory needs config.json next to its safetensors")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise HFCheckpointError(f"{path} cannot be read ({e.strerror or e}); check its permissions") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise HFCheckpointError(f"{path} is not valid JSON ({e}); re-download or re-export it") from None
    if not isinstance(d, dict):
        raise HFCheckpointError(f"{path} holds a JSON {type(d).__name__}, not an object of config keys; re-download "
                                "or re-export it")
    return d


def safetensors_files(hf_dir: str | os.PathLike) -> dict[str, str]:
    """tensor name -> file path, from model.safetensors.index.json, model.safetensors, or all *.safetensors."""
    hf_dir = os.fspath(hf_dir)
    idx = os.path.join(hf_dir, INDEX_NAME)
    if os.path.isfile(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        out = {k: os.path.join(hf_dir, v) for k, v in wm.items()}
        for p in sorted(set(out.values())):
            if not os.path.isfile(p):
                raise HFCheckpointError(f"{INDEX_NAME} in {hf_dir} names {os.path.basename(p)}, which is missing; "
                                        "re-download the checkpoint")
        return out
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise HFCheckpointError(f"no *.safetensors in {hf_dir} (.bin checkpoints are not read: convert them "
                                "with transformers' save_pretrained(safe_serialization=True))")

    out: dict[str, str] = {}
    for fn in files:
        with safe_open(os.path.join(hf_dir, fn), framework="pt") as f:
            for k in f.keys():
                out[k] = os.path.join(hf_dir, fn)
    return out


def read_safetensors(hf_dir: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Read tensors (all, or ``names``) from a local HF directory onto CPU."""
    where = safetensors_files(hf_dir)
    wanted = list(where) if names is None else list(names)
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        if n not in where:
            raise HFCheckpointError(f"tensor {n!r} not found in {hf_dir}")
        by_file.setdefault(where[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for path, ns in by_file.items():
        with safe_open(path, framework="pt") as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


def read_thinker(hf_dir: str | os.PathLike, other_parts: tuple[str, ...], log) -> dict[str, torch.Tensor]:
    """The thinker's tensors of an Omni folder, thinker-only or a full checkpoint (``thinker.`` stripped); the
    speech parts' tensors (names starting with ``other_parts``) are skipped and listed in one ``log`` line."""
    names = list(safetensors_files(hf_dir))
    skipped = [k for k in names if k.startswith(other_parts)]
    if skipped:
        prefixes = sorted({p for p in other_parts if any(k.startswith(p) for k in skipped)})
        log.info("%s: skipped %d tensors of the Omni speech parts (%s*): only the thinker is loaded", hf_dir,
                 len(skipped), "*, ".join(prefixes))
    keep = [k for k in names if not k.startswith(other_parts)]
    return {k.removeprefix("thinker."): v for k, v in read_safetensors(hf_dir, keep).items()}


def safetensors_shapes(hf_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape without reading the data."""
    where = safetensors_files(hf_dir)
    out: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(where.values())):
        with safe_open(path, framework="pt") as f:
            for n in f.keys():
                out[n] = tuple(f.get_slice(n).get_shape())
    return out


def check_tensors(
    got: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    where: str,
    hint: str = "",
    allow_extra: Iterable[str] = (),
    describe=lambda name: name,
) -> None:
    """Raise HFCheckpointError naming every missing, unexpected and mis-shaped tensor
    (``describe(name)`` turns a name into what the user should look for, e.g. its HF name)."""
    allow = set(allow_extra)
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected) - allow)
    bad = sorted(k for k in set(got) & set(expected) if tuple(got[k]) != tuple(expected[k]))
    if not (missing or extra or bad):
        return
    lines = [f"checkpoint {where} does not match the model:"]
    if missing:
        lines.append(f"  missing {len(missing)} tensor(s): {', '.join(map(describe, missing[:20]))}{' ...' if len(missing) > 20 else ''}")
    if extra:
        lines.append(f"  unexpected {len(extra)} tensor(s): {', '.join(map(describe, extra[:20]))}{' ...' if len(extra) > 20 else ''}")
    for k in bad[:20]:
        lines.append(f"  wrong shape for {describe(k)}: checkpoint {tuple(got[k])}, model expects {tuple(expected[k])}")
    lines.append(hint or "check that config.json matches the weights (same model size / flavor) and that the "
                 "download is complete")
    raise HFCheckpointError("\n".join(lines))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(
    state_dict: Mapping[str, torch.Tensor], out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3
) -> list[str]:
    """Write HF-named tensors as model.safetensors, or model-0000i-of-0000n.safetensors + index.json when
    larger than ``max_shard_bytes``. Returns the file names written."""
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state_dict):
        t = state_dict[k].detach().to("cpu").contiguous()
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += _nbytes(t)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_NAME), metadata={"format": "pt"})
        stale = os.path.join(out_dir, INDEX_NAME)
        if os.path.exists(stale):
            os.remove(stale)
        return [SINGLE_NAME]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fn, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in shard})
    total = sum(_nbytes(t) for t in state_dict.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


class ShardedWriter:
    """Write HF-named tensors as they come, closing a shard file whenever it would exceed
    ``max_shard_bytes`` (host memory stays at about one shard). ``close()`` names the files like
    transformers (model.safetensors, or model-0000i-of-0000n.safetensors + index.json)."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3):
        self.out_dir = os.fspath(out_dir)
        self.max = max_shard_bytes
        self.cur: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0
        os.makedirs(self.out_dir, exist_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if self.cur and self.size + _nbytes(t) > self.max:
            self._flush()
        self.cur[name] = t
        self.size += _nbytes(t)
        self.total += _nbytes(t)

    def _flush(self) -> None:
        tmp = f".tmp-shard-{len(self.files):05d}.safetensors"
        save_file(self.cur, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
        self.files.append((tmp, sorted(self.cur)))
        self.cur, self.size = {}, 0

    def close(self) -> list[str]:
        if self.cur or not self.files:
            self._flush()
        n = len(self.files)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), fn in zip(self.files, names):
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, fn))
            weight_map.update({k: fn for k in keys})
        idx = os.path.join(self.out_dir, INDEX_NAME)
        if n > 1:
            with open(idx, "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        elif os.path.exists(idx):
            os.remove(idx)
        return names


def iter_full_tensors(model: torch.nn.Module):
    """(name, full tensor) over ``model.state_dict()`` in order, all-gathering DTensors one at a time
    (collective: every rank must iterate to the end)."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


def write_config(cfg_dict: dict, out_dir: str | os.PathLike) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2, sort_keys=True)


def save_hf_folder(model_or_sd, cfg, out_dir: str | os.PathLike, to_hf, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = 5 * 1024**3) -> None:
    """A family's save_hf in one piece: the full state dict (gathered: collective for a sharded model, every rank
    calls it, rank 0 writes) mapped by ``to_hf(sd, cfg)`` to HF names, safetensors shards, and config.json from
    ``cfg.to_hf_dict(dtype=...)``. ``dtype``: cast on export (default: keep)."""
    sd = full_state_dict(model_or_sd) if isinstance(model_or_sd, torch.nn.Module) else dict(model_or_sd)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    hf_sd = to_hf(sd, cfg)
    dt = next(iter(hf_sd.values())).dtype
    write_safetensors(hf_sd, out_dir, max_shard_bytes=max_shard_bytes)
    write_config(cfg.to_hf_dict(dtype=str(dt).removeprefix("torch.")), out_dir)


def is_sharded(model: torch.nn.Module) -> bool:
    """True when the model holds DTensor parameters (FSDP2 / TP / EP)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict; collective when the model holds DTensors (call on every rank;
    with cpu_offload only rank 0 keeps the tensors)."""
    if is_sharded(model):
        # torch.distributed.checkpoint is slow to import; only a sharded model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_full_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors (titan names) into a plain, meta or sharded model. ``strict=False`` loads a part
    (used layer by layer for sharded models, after the names were checked)."""
    if is_sharded(model):
        # torch.distributed.checkpoint is slow to import; only a sharded model needs it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=strict))
    elif any(p.is_meta for p in model.parameters()):
        if not strict:
            raise ValueError("a meta-device model must be loaded in one strict call (assign=True)")
        model.load_state_dict(sd, strict=True, assign=True)
    else:
        model.load_state_dict(sd, strict=strict)
