"""``preflight(cfg)``: every cheap user-error check of a job, run first by the trainer (``train()``): before the
process group, the model build, the loader workers and the run folder. A mistake is one ConfigError line that
names what is wrong and what to do (``main()`` prints ``config error: ...`` and exits 2); nothing is left behind.

Checked, in order:
- the device (``job.device``) and the kernel ops (``kernels.ops``);
- the model: flavor, or ``model.hf_path`` (a local folder or a Hub repo id, fetched here) with its config.json
  and model_type, then ``model.overrides``; the weight files when they will be loaded;
- the parallel degrees against the world size and the model's shapes, and the global batch; data.balance with
  several dp ranks against a family whose batches carry keys that are not per row (BatchSchema.flat);
- the objective: its options, the mask token and the attention kind it asks for (``build_objective``);
- [eval] when on: tasks only with the causal objective, sources listed (the task files: the [eval] callback);
- a family trained on clips (DataNeeds.clips): a latent cache's index, or the sources and data.encoders' folder;
- otherwise, unless ``data.dataset = "synthetic"``: every source of ``data.dataset`` / ``data.mixture`` lists its files
  (or built-in parts), and the tokenizer loads, gives the family's special tokens their ids (or the family's own
  document builder, DataNeeds.docs, accepts the [data] settings and makes a document of one of each source's first
  records) and emits no id at or above the model's vocab_size.

Cheap means file listings, config.json, tokenizer.json and safetensors headers; a Hub id's files are downloaded
here (the weights too when they will be loaded), which the run needs anyway.
"""

from __future__ import annotations

import itertools
import os
import sys

from safetensors import SafetensorError

from titan_mm.config import ConfigError, Data, JobConfig
from titan_mm.data.clips import uses_cache
from titan_mm.data.loader import resolve_sources
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.sources import READERS, SkipSample, list_units
from titan_mm.data.tokenizer import load_tokenizer, tokenizer_for
from titan_mm.models.hf_io import HFCheckpointError, local_hf_dir, safetensors_files
from titan_mm.objectives import build_objective
from titan_mm.train.setup import check_parallel, grad_accum_steps, model_from_config, parallel_dims, pick_device


def preflight(cfg: JobConfig, world: int | None = None) -> None:
    """Raise ConfigError (one line) on the first user mistake in ``cfg``; build, start and write nothing.
    ``world``: the number of processes (default: WORLD_SIZE; the launcher passes the one it will start)."""
    spec, model_cfg = model_from_config(cfg, pick_device(cfg))
    if cfg.model.hf_path and cfg.model.init_from_hf:
        _check_weights(cfg.model.hf_path)
    pd = parallel_dims(cfg, world or int(os.environ.get("WORLD_SIZE", "1")))
    check_parallel(cfg, pd, spec, model_cfg)
    grad_accum_steps(cfg, pd.dp)
    _check_balance(cfg, spec, model_cfg, pd.dp)
    build_objective(cfg, spec, model_cfg)
    _check_eval(cfg, spec)
    if cfg.data.dataset == "synthetic":  # the trainer's rule (build_data): random rows, no files, no tokenizer
        return
    if spec.data_needs(model_cfg).clips is not None:
        _check_clips(cfg.data)
        return
    _check_sources(cfg.data)
    _check_tokenizer(cfg, spec, model_cfg)


def _check_balance(cfg: JobConfig, spec, model_cfg, dp: int) -> None:
    """data.balance re-places rows between dp ranks (titan_mm.parallel.balance_dispatch); keys that are not per row
    (BatchSchema.flat) cannot travel with their rows."""
    flat = spec.schema().flat
    if dp > 1 and cfg.data.balance != "none" and flat and spec.data_needs(model_cfg).clips is None:
        raise ConfigError(f"data.balance={cfg.data.balance!r} cannot move {spec.name!r} rows between data-parallel "
                          f"ranks (its batches carry {list(flat)} side by side, not per row): set --data.balance none")


def _check_eval(cfg: JobConfig, spec) -> None:
    """The tasks themselves are read by the [eval] callback, before train() (titan_mm.eval.evaluator.online_eval)."""
    e = cfg.eval
    if not e.interval:
        return
    if e.tasks and not spec.kv_cache:
        raise ConfigError(f"eval.tasks decode through the serving engine, which cannot run {spec.name!r} yet (its "
                          "layers keep state the KV cache does not hold); keep the held-out loss and drop eval.tasks")
    if e.tasks and cfg.objective.kind != "causal":
        raise ConfigError(f"eval.tasks decode causally through the serving engine; objective.kind "
                          f"{cfg.objective.kind!r} is scored by python -m titan_mm.tools.eval_dllm: drop eval.tasks")
    if (e.dataset or e.mixture) and e.dataset != "synthetic":
        _check_sources(Data(dataset=e.dataset, mixture=e.mixture), "eval")


def _check_weights(hf_path: str) -> None:
    try:
        safetensors_files(local_hf_dir(hf_path, weights=True))
    except (HFCheckpointError, SafetensorError, OSError) as e:
        raise ConfigError(f"{e}; or set --model.init_from_hf False to take only the architecture") from None


def _check_sources(data: Data, section: str = "data") -> None:
    key = f"{section}.mixture" if data.mixture else f"{section}.dataset"
    try:
        sources = resolve_sources(data.dataset, data.mixture)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not sources:
        raise ConfigError(f"{key} is empty; give a path, glob or URL (.jsonl .json .parquet .tar), builtin:<name> "
                          "or synthetic")
    for source, _ in sources:
        try:
            list_units(source)
        except (OSError, ValueError, ImportError) as e:  # ImportError: fsspec lacks the protocol's package
            raise ConfigError(f"{key}: {e}") from None


def _check_clips(data: Data) -> None:
    """A family trained on clips (titan_mm.data.clips): a latent cache's index, or raw sources and the encoders'
    folder; the rows themselves are read when the loader lists them."""
    try:
        cached = uses_cache(data)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cached:
        _check_sources(data)


FIRST_RECORDS = 8
"""Records of each source a family building its own documents must find one usable sample in, before the build."""


def _check_first_records(data: Data, build, family: str) -> None:
    """A source of records the family cannot use (another kind, missing images) is one line here, not a data error
    after the model is built: one of its first FIRST_RECORDS records must make a document."""
    for source, _ in resolve_sources(data.dataset, data.mixture):
        unit, why = list_units(source)[0], "it holds no records"
        for _, rid, _, rec in itertools.islice(READERS[unit.fmt](unit, 0, None), FIRST_RECORDS):
            try:
                build(rec, unit, f"{unit.source}/{unit.uid}:{rid}", 0)
                break
            except SkipSample as e:
                why = f"{e.reason}: {e.detail}"
        else:
            raise ConfigError(f"data source {source}: none of its first {FIRST_RECORDS} records makes a {family!r} "
                              f"sample (last: {why}); give records of the kinds docs/{family}.md lists")


def _check_tokenizer(cfg: JobConfig, spec, model_cfg) -> None:
    hf_dir = local_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else None
    path = tokenizer_for(cfg.data.tokenizer_path, hf_dir)
    try:
        tok = load_tokenizer(path)
        needs = spec.data_needs(model_cfg)
        if needs.docs is not None:  # a family building its own documents checks its [data] settings
            # deferred where the trainer defers (a family encoder): no VAE is loaded or run on the host here
            build = needs.docs.builder(cfg.data, tok, cfg.training.seed, defer=needs.docs.encoder is not None)
            _check_first_records(cfg.data, build, spec.name)
        else:
            Processor(tok, ProcessorConfig(data=cfg.data, needs=needs))  # the special tokens
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if hf_dir and path is None and os.environ.get("RANK", "0") == "0":
        print(f"[titan_mm] model.hf_path {cfg.model.hf_path} has no tokenizer.json: the data is tokenized with "
              f"the built-in Qwen3 tokenizer ({tok.path}); set data.tokenizer_path to use another", file=sys.stderr)
    vocab = spec.dims(model_cfg).vocab_size
    if tok.max_id >= vocab:
        raise ConfigError(
            f"the tokenizer {tok.path} emits ids up to {tok.max_id} ({tok.vocab_size} tokens), but the model's "
            f"vocab_size is {vocab}: ids >= {vocab} have no embedding row; use the model's own tokenizer "
            f"(data.tokenizer_path, or tokenizer.json in model.hf_path), or a model whose vocab_size is at least "
            f"{tok.max_id + 1}")
