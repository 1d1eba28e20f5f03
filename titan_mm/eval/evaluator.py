"""One run's evaluation, online (the trainer, every eval.interval steps) and offline (python -m titan_mm.eval):
held-out loss per source through the train step's forward, and generation tasks through the serving engine.

Held-out loss: each source of [eval] is read by the trainer's data pipeline, one finite pass from the run's seed,
with the training layout of micro-batch slots (so the rows do not depend on the world size); its first
eval.max_batches global batches are kept and scored at every eval by titan_mm.train.step.eval_loss_sums (the
mesh and plan as trained, no grads). Generation: the live parameters are gathered in memory
(get_model_state_dict, full tensors on every rank; no disk), put into a model of the same family built on meta,
and an Engine with a pool sized for this eval runs the tasks greedily (images and audio clips included), each rank
taking every world-th prompt; the engine and the gathered tensors are freed before training goes on. RNG state is put back afterwards, so a
run with eval trains the same steps as one without.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from titan_mm.config import ConfigError, Data, JobConfig
from titan_mm.data.loader import resolve_sources
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.eval.tasks import Task, load_task
from titan_mm.loader import model_from_config, tokenizer_path
from titan_mm.observe.health import peak_memory_gb, reset_peak_memory
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.train.setup import Run, build_data
from titan_mm.train.state import get_rng_state, set_rng_state
from titan_mm.train.step import eval_loss_sums

ENGINE_SEQS = 32  # sequences decoded together; the pool holds that many of <= 512 tokens, plus one of seq_len


def source_name(source: str) -> str:
    """A metric-safe name of a source: builtin:qa_test -> qa_test, data/val-*.jsonl -> val."""
    base = source.split(":", 1)[1] if source.startswith("builtin:") else source.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]+", "", base.split(".")[0].split("*")[0].rstrip("-_")) or "source"


def online_eval(cfg: JobConfig) -> Callable[[Run], Evaluator] | None:
    """The trainer's [eval] callback: ``make_eval(run) -> Evaluator`` (None when eval.interval is 0). The tasks are
    read here, before anything is built, so a bad task is one ConfigError line."""
    if not cfg.eval.interval:
        return None
    tasks = read_tasks(cfg)
    if tasks:  # a task's media the model cannot take would fail at the first eval, deep into training
        spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
        needs = spec.data_needs(model_cfg)
        for t in tasks:
            if refused := sorted(k for k in t.media if not needs.takes(k)):
                kinds = " and ".join(refused)
                raise ConfigError(f"eval.tasks {t.name!r} has {kinds} in its prompts, but model {spec.name!r} takes "
                                  f"no {kinds} input; drop the task from eval.tasks")
    return functools.partial(Evaluator, cfg, tasks=tasks)


def read_tasks(cfg: JobConfig) -> list[Task]:
    """eval.tasks, the first eval.task_limit prompts of each (ConfigError: a bad task)."""
    return [load_task(t, cfg.eval.task_limit) for t in cfg.eval.tasks]


class Evaluator:
    def __init__(self, cfg: JobConfig, run: Run, tasks: list[Task] | None = None):
        """``tasks``: eval.tasks already read (:func:`online_eval`); None: read here."""
        self.cfg, self.run, e = cfg, run, cfg.eval
        sources = resolve_sources(e.dataset, e.mixture) if (e.dataset or e.mixture) else []
        names = [source_name(s) for s, _ in sources]
        self.sources = [(f"{n}{i}" if names.count(n) > 1 else n, s, w) for i, ((s, w), n) in
                        enumerate(zip(sources, names))]
        self.tasks: list[Task] = tasks if tasks is not None else read_tasks(cfg)
        self._batches: dict[str, list[list[dict]]] = {}
        self._tasks_at = 0  # checkpoints saved when the tasks last ran

    def due(self, step: int) -> bool:
        e = self.cfg.eval
        return bool(e.interval) and (step % e.interval == 0 or step == self.cfg.training.steps)

    def tasks_due(self, step: int, n_saved: int) -> bool:
        """eval.tasks_every_checkpoints: the tasks run when that many checkpoints were saved since they last ran."""
        k = self.cfg.eval.tasks_every_checkpoints
        return bool(self.tasks) and (not k or n_saved - self._tasks_at >= k or step == self.cfg.training.steps)

    def __call__(self, step: int, n_saved: int = 0, tasks: bool | None = None) -> dict[str, float]:
        """eval/* metrics of the model as it is now; ``tasks`` None: as tasks_due says (True: whenever there are)."""
        run = self.run
        rng = get_rng_state()
        t0 = time.perf_counter()
        reset_peak_memory(run.device)
        held = torch.cuda.memory_allocated(run.device) if run.device.type == "cuda" else 0
        m = self.heldout()
        if self.tasks and (tasks if tasks is not None else self.tasks_due(step, n_saved)):
            self._tasks_at = n_saved
            m.update(self.generate())
        m["eval/time_s"] = time.perf_counter() - t0
        m["eval/peak_mem_gb"] = peak_memory_gb(run.device)
        if run.device.type == "cuda":  # what the eval left allocated: on top of every later step's peak
            m["eval/kept_mem_gb"] = (torch.cuda.memory_allocated(run.device) - held) / 1e9
        set_rng_state(rng)
        return m

    # ---- held-out loss ----
    def _global_batches(self, name: str, source: str) -> list[list[dict]]:
        if name not in self._batches:
            run, cfg = self.run, self.cfg
            data = dataclasses.replace(cfg.data, dataset=source, mixture={}, num_workers=0)
            loader = build_data(cfg, run.spec, run.model_cfg, run.dp_rank, run.dp_world, run.n_micro, data=data,
                                epochs=1)
            micro = list(itertools.islice(loader, run.n_micro * cfg.eval.max_batches))
            n = len(micro) // run.n_micro
            if run.world > 1:  # every rank scores the same number of batches (a collective per batch)
                t = torch.tensor([n], device=run.device if dist.get_backend() == "nccl" else "cpu")
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                n = int(t)
            self._batches[name] = [micro[i * run.n_micro:(i + 1) * run.n_micro] for i in range(n)]
        return self._batches[name]

    def heldout(self) -> dict[str, float]:
        m, total, weights = {}, 0.0, 0.0
        for name, source, w in self.sources:
            sums: dict[str, float] = {}
            counts: dict[str, int] = {}
            for micro in self._global_batches(name, source):
                s, n = eval_loss_sums(self.run.model, micro, self.run.ctx)
                sums = {t: sums.get(t, 0.0) + v for t, v in s.items()}
                counts = {t: counts.get(t, 0) + v for t, v in n.items()}
            terms = {t: sums[t] / max(counts[t], 1) for t in sums}  # each loss term's mean (the objective's)
            loss = sum(terms.values())
            m[f"eval/{name}/loss"] = loss
            m[f"eval/{name}/ppl"] = math.exp(min(loss, 80.0))
            m[f"eval/{name}/tokens"] = sum(counts.values())
            if len(terms) > 1:
                m.update({f"eval/{name}/loss/{t}": v for t, v in terms.items()})
            total, weights = total + w * loss, weights + w
        if len(self.sources) > 1:
            m["eval/loss"] = total / weights
        return m

    # ---- generation ----
    def gathered_model(self):
        """(a model of the run's family on the live weights, gathered in memory; its config for generation)."""
        return gathered_model(self.run)

    def generate(self) -> dict[str, float]:
        run, e = self.run, self.cfg.eval
        t0 = time.perf_counter()
        model, gen_cfg = self.gathered_model()
        tok = load_tokenizer(tokenizer_path(self.cfg))
        engine = eval_engine(model, run.spec, gen_cfg, tok, run.device, self.cfg.data)
        m: dict[str, Any] = {"eval/handoff_s": time.perf_counter() - t0}
        for task in self.tasks:
            mine = task.items[run.rank::run.world]
            texts = engine_texts(engine, mine, e.max_new_tokens)
            score = sum(task.metric(x, it["reference"]) for x, it in zip(texts, mine) if x is not None)
            t = torch.tensor([score, sum(x is not None for x in texts), sum(x is None for x in texts)],
                             dtype=torch.float64)
            if run.world > 1:
                t = t.to(run.device if dist.get_backend() == "nccl" else "cpu")
                dist.all_reduce(t)
            score, n, skipped = t.tolist()
            m[f"eval/{task.name}/{task.metric_name}"] = score / max(n, 1)
            m[f"eval/{task.name}/n"] = int(n)
            if skipped:
                m[f"eval/{task.name}/skipped"] = int(skipped)
        del engine, model
        gc.collect()
        if run.device.type == "cuda":
            # the engine's CUDA graphs ran cuBLAS on the capture stream, and cuBLAS keeps a workspace per stream for
            # the process's life (32 MiB on an H100 / H200), which every later training step's peak carried; the
            # training stream's own workspace comes back at its next matmul
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        m["eval/generate_s"] = time.perf_counter() - t0
        return m


def live_state_dict(run: Run) -> dict[str, torch.Tensor]:
    """The live parameters as full tensors on every rank (a collective under FSDP / TP / PP; no disk). On one rank
    without sharding they are the trainer's own tensors."""
    # torch.distributed.checkpoint is slow to import; only an eval that gathers the live weights pays for it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))
    if run.ctx.pipeline is not None:  # this rank holds its stages only: the others' come from their pp ranks
        sd = run.ctx.pipeline.gather_state_dict(sd)
    return sd


def gathered_model(run: Run):
    """(a model of the run's family on the live weights, gathered in memory; its config for generation): the
    hand-off of online eval and of RL rollouts (titan_mm.rl)."""
    # the fused kernels on CUDA, as Engine.from_pretrained serves (serve.kernels): fewer launches per decode step
    gen_cfg = run.spec.with_runtime(run.model_cfg, attn_backend="sdpa", kernels=run.device.type == "cuda")
    with torch.device("meta"):
        model = run.spec.build(gen_cfg)
    # shares the tensors (the engine casts a copy where its dtype or device differs)
    model.load_state_dict(live_state_dict(run), strict=True, assign=True)
    model.init_buffers(run.device)
    return model, gen_cfg


def eval_engine(model, spec, model_cfg, tokenizer, device: torch.device, data: Data):
    """An Engine on ``model`` (weights in memory) whose pool holds ENGINE_SEQS prompts of <= 512 tokens and one of
    data.seq_len: the decoder of online eval, python -m titan_mm.eval and the eval tools."""
    max_len = data.seq_len
    # freeze_gc off: inside a trainer the heap is the trainer's, not the engine's to freeze
    serve = ServeConfig(max_num_seqs=ENGINE_SEQS, max_model_len=max_len, max_num_batched_tokens=max(2048, max_len),
                        max_queue_len=1 << 20, freeze_gc=False)
    serve.num_blocks = ENGINE_SEQS * -(-min(max_len, 512) // serve.block_size) + -(-max_len // serve.block_size)
    return Engine(model, spec, model_cfg, serve, tokenizer=tokenizer, device=device, data=data)


def engine_texts(engine, items: list[dict], max_new_tokens: int) -> list[str | None]:
    """The engine's greedy answer to each task item ({"messages": [...]} rendered by the chat template with the
    assistant's turn opened, or {"prompt": raw text}); None for a prompt the engine refuses (too long)."""
    prompts, images, videos, audios = [], [], [], []
    for it in items:
        ids, im, vi, au = (engine.chat_media(it["messages"]) if "messages" in it else
                           (engine.tokenizer.encode(it["prompt"]), [], [], []))
        for got, x in ((prompts, ids), (images, im), (videos, vi), (audios, au)):
            got.append(x)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outs = engine.generate(prompts, params, images, videos=videos, audios=audios, skip_bad=True)
    return [o.outputs[0].text if o else None for o in outs]
