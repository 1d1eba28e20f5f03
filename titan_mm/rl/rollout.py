"""Rollouts for RL post-training: the trainer's loader in an ``[rl]`` job (docs/rl.md).

    source = RolloutSource(cfg, run)        # the engine on the live weights, the prompts, the rewards
    micro = [next(source) for _ in range(run.n_micro)]   # one optimizer step's rows, made by the policy
    train_step(run.state, micro, run.ctx)    # the "policy" objective (titan_mm.objectives.policy)

At optimizer step s (the policy version v = s: updates applied so far) the source makes the rollouts of step s + k
(k = rl.staleness) from version s, and trains on those of step s, made at version max(0, s - k); at s = 0 it makes
steps 0 .. k from version 0. Making rollouts: the live weights go to the engine (one rank: the engine's model holds
the trainer's own tensors, nothing is copied; sharded: full tensors gathered through eval's hand-off, then copied in
place), each prompt is sampled rl.group_size times with a seed of (training.seed, step, prompt), the rewards are
summed, and advantages normalized within each group. The buffer holds the rollouts not trained on yet, each with the
version that made it; it is saved in checkpoints (the ``data`` items, one per dp rank) with the prompt order's
position and the reference model's path, so a resumed run trains the same steps bitwise.

Each dp rank makes the rollouts of its own rows (whole groups: rl.prompts_per_step divides by the dp degree).
Prompts with images (builtin:digits, a VL family): the engine takes the prompt and its images; the training rows
carry the image's patches, grid and M-RoPE positions, rebuilt from the prompt's index by the data processors.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from titan_mm.config import ConfigError, JobConfig
from titan_mm.data.builtin import builtin_records
from titan_mm.data.packing import Doc, collate_rows
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.data.schema import parse_record
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.eval.evaluator import gathered_model, live_state_dict
from titan_mm.eval.tasks import read_jsonl_items
from titan_mm.loader import load_model, tokenizer_path
from titan_mm.nn.attention import build_attn_meta
from titan_mm.objectives.policy import IGNORE, Policy
from titan_mm.rl.rewards import build_reward
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.train.setup import Run
from titan_mm.train.step import model_inputs, to_device
from titan_mm.train.state import from_bytes, to_bytes

ENGINE_MAX_SEQS = 64


@dataclass
class Rollout:
    """One sampled completion and what the loss needs of it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """The engine's logprob of each completion token (the behaviour policy)."""
    reward: float
    ended: bool
    """It stopped by itself (EOS or a stop string), not at rl.max_tokens."""
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    prompt: int = -1
    """The prompt's index in the prompt set where it carries images (its media and M-RoPE positions are rebuilt
    from it at collate time, not stored in the buffer); -1 for a text prompt."""


@dataclass
class RolloutBatch:
    """This rank's rollouts for one optimizer step."""

    step: int
    version: int
    """Policy version (optimizer updates applied) of the weights that sampled it."""
    rollouts: list[Rollout] = field(default_factory=list)
    """Group-major: rl.group_size completions of each prompt in turn."""


def load_prompts(source: str) -> list[dict]:
    """{"messages" | "prompt", "reference"} of ``rl.prompts``: builtin:<name> (a chat set whose last turn is the
    answer) or a JSONL file."""
    if source.startswith("builtin:"):
        try:
            records = builtin_records(source.split(":", 1)[1])
        except (KeyError, ValueError) as e:
            raise ConfigError(f"rl.prompts {source!r}: {e}") from None
        if not records or "messages" not in records[0] or "answer" not in records[0]:
            raise ConfigError(f"rl.prompts {source!r} is not a built-in chat set with answers; use builtin:qa")
        return [{"messages": r["messages"][:-1], "reference": r["answer"]} for r in records]
    path = Path(source)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ConfigError(f"rl.prompts {source!r} is neither builtin:<name> nor an existing .jsonl file")
    return read_jsonl_items(path, source, key="rl.prompts")


def reference_path(cfg: JobConfig) -> str:
    """The KL reference's folder ("" without a KL term); rl.reference "init" is model.hf_path."""
    rl = cfg.rl
    if not rl.kl_coef:
        return ""
    path = cfg.model.hf_path if rl.reference == "init" else rl.reference
    if not path:
        raise ConfigError("rl.kl_coef > 0 with rl.reference = 'init' needs model.hf_path (the weights the run starts "
                          "from); or set rl.reference to an HF folder or a titan_mm run / checkpoint")
    return path


def _seed(*parts) -> int:
    key = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(key, "little") >> 2  # the engine adds the output index: stay below 2**63


def group_advantages(rewards: list[float], group_size: int, std_normalize: bool,
                     negative_scale: float = 1.0) -> list[float]:
    """(r - group mean) / (group std + 1e-6) per completion (std: unbiased, as torch.std), or r - group mean; the
    negative ones times ``negative_scale``."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    a = r - r.mean(1, keepdim=True)
    if std_normalize:
        a = a / (r.std(1, keepdim=True) + 1e-6)
    a = torch.where(a < 0, a * negative_scale, a)
    return a.flatten().tolist()


class RolloutSource:
    """The micro-batches of an [rl] job (module docstring). ``state_dict`` / ``load_state_dict`` follow the
    loaders' per-slot layout, one slot per dp rank."""

    def __init__(self, cfg: JobConfig, run: Run):
        self.cfg, self.run, self.rl = cfg, run, cfg.rl
        rl = cfg.rl  # tp / cp / pp > 1 are refused by the config's checks, an uneven dp split by rl_data
        self.reward = build_reward(rl)
        self.items = load_prompts(rl.prompts)
        self.tok = load_tokenizer(tokenizer_path(cfg))
        self.needs = run.spec.data_needs(run.model_cfg)
        self.engine, self.gen_model = self._engine()
        prompts = [self.engine.chat_prompt(it["messages"]) if "messages" in it else (self.tok.encode(it["prompt"]), [])
                   for it in self.items]
        self.prompt_ids = [ids for ids, _ in prompts]
        self.prompt_images = [imgs for _, imgs in prompts]
        self.processor = Processor(self.tok, ProcessorConfig(cfg.data, self.needs))
        # an image prompt's length is its expanded one (a pad per merged visual token): every built-in image has one
        # size, so the first image prompt stands for the rest; a file's larger one fails in its step's collate
        lens = [len(ids) for ids in self.prompt_ids]
        longest = max((n for n, imgs in zip(lens, self.prompt_images) if not imgs), default=0)
        first = next((i for i, imgs in enumerate(self.prompt_images) if imgs), None)
        if first is not None:
            grown = len(self.prompt_doc(first)) - lens[first]
            longest = max(longest, grown + max(n for n, imgs in zip(lens, self.prompt_images) if imgs))
        if longest + rl.max_tokens > cfg.data.seq_len:
            raise ConfigError(f"rl.prompts: the longest prompt has {longest} tokens, + rl.max_tokens {rl.max_tokens} "
                              f"> data.seq_len {cfg.data.seq_len}; raise data.seq_len or lower rl.max_tokens")
        self.reference = reference_path(cfg)
        self.ref_model = None
        if self.reference:
            self.ref_model = load_model(self.reference, run.device).model
        self.buffer: dict[int, RolloutBatch] = {}
        self._queue: list[dict] = []
        self._stats: dict[str, float] = {}

    # ---- the engine on the live weights ----
    def _engine(self):
        """An engine on the live weights (eval's hand-off), its pool sized for this rank's completions per step.
        No prefix caching: a cached block would hold keys of older weights."""
        rl, data = self.rl, self.cfg.data
        model, gen_cfg = gathered_model(self.run)
        seqs = min(ENGINE_MAX_SEQS, rl.prompts_per_step * rl.group_size // self.run.dp_world)
        # graph_sampling: the decode steps draw the rows themselves (each token's own logprob included), in their
        # CUDA graphs on a GPU; freeze_gc off: the heap is the trainer's, not the engine's to freeze
        serve = ServeConfig(max_num_seqs=seqs, max_model_len=data.seq_len, enable_prefix_caching=False,
                            max_num_batched_tokens=max(2048, data.seq_len, seqs), max_queue_len=1 << 20,
                            graph_sampling=True, freeze_gc=False)
        serve.num_blocks = seqs * -(-data.seq_len // serve.block_size) + 1
        engine = Engine(model, self.run.spec, gen_cfg, serve, tokenizer=self.tok, device=self.run.device, data=data)
        return engine, model

    @torch.no_grad()
    def sync_weights(self) -> tuple[float, int]:
        """The live weights into the engine's model: (seconds, bytes copied; 0 where it holds the trainer's own
        tensors)."""
        t0 = time.perf_counter()
        live = live_state_dict(self.run)
        copied = 0
        for name, p in self.gen_model.state_dict().items():
            src = live[name]
            if p.data_ptr() != src.data_ptr() or p.dtype != src.dtype:
                p.copy_(src)
                copied += p.numel() * p.element_size()
        if self.run.device.type == "cuda":
            torch.cuda.synchronize(self.run.device)
        return time.perf_counter() - t0, copied

    # ---- prompts and rollouts ----
    @functools.lru_cache(maxsize=256)
    def prompt_doc(self, i: int) -> Doc:
        """The training-side prompt of image prompt ``i``: ids with each image pad expanded, pixel values, grids and
        M-RoPE positions, processed as the engine processes its images (titan_mm.serve.core.media)."""
        return self.processor.prompt_doc(parse_record({"messages": self.items[i]["messages"]}))

    def prompts_of(self, step: int) -> list[int]:
        """This rank's prompt indices for ``step``: a fixed shuffle per pass over the prompts (training.seed)."""
        rl, n = self.rl, len(self.items)
        per_rank = rl.prompts_per_step // self.run.dp_world
        first = step * rl.prompts_per_step + self.run.dp_rank * per_rank
        return [self._order(i // n)[i % n] for i in range(first, first + per_rank)]

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(_seed(self.cfg.training.seed, "epoch", epoch)).shuffle(order)
        return order

    def generate(self, step: int) -> RolloutBatch:
        """Sample the rollouts of ``step`` from the weights as they are now."""
        rl = self.rl
        t0 = time.perf_counter()
        sync_s, copied = self.sync_weights()
        idx = self.prompts_of(step)
        params = [SamplingParams(max_tokens=rl.max_tokens, temperature=rl.temperature, top_p=rl.top_p,
                                 stop=list(rl.stop), n=rl.group_size, logprobs=0,
                                 seed=_seed(self.cfg.training.seed, step, i)) for i in idx]
        outs = self.engine.generate([self.prompt_ids[i] for i in idx], params, [self.prompt_images[i] for i in idx])
        batch = RolloutBatch(step, self.run.state.step)
        for i, o in zip(idx, outs):
            vl = bool(self.prompt_images[i])
            prompt = self.prompt_doc(i).input_ids.tolist() if vl else list(self.prompt_ids[i])
            for c in o.outputs:
                ids = list(c.token_ids)
                batch.rollouts.append(Rollout(
                    prompt, ids, [lp[t] for lp, t in zip(c.logprobs, ids)],
                    self.reward(c.text, self.items[i]["reference"], c.finish_reason == "stop"),
                    c.finish_reason == "stop", prompt=i if vl else -1))
        adv = group_advantages([r.reward for r in batch.rollouts], rl.group_size, rl.std_normalize, rl.negative_scale)
        for r, a in zip(batch.rollouts, adv):
            r.advantage = a
        if self.ref_model is not None:
            self._reference_logprobs(batch.rollouts)
        self._stats.update({"rl/sync_s": sync_s, "rl/sync_bytes": copied,
                            "rl/generate_s": time.perf_counter() - t0 - sync_s})
        return batch

    @torch.no_grad()
    def _reference_logprobs(self, rollouts: list[Rollout]) -> None:
        mbs = self.cfg.data.micro_batch_size
        for k in range(0, len(rollouts), mbs):
            part = rollouts[k:k + mbs]
            b = self.collate(part)
            logp = token_logprobs(self.ref_model, b, self.run.device, self.run.ctx.prepare_batch)
            for row, r in enumerate(part):
                p = len(r.prompt_ids)
                r.ref_logprobs = logp[row, p - 1:p - 1 + len(r.completion_ids)].tolist()

    # ---- batches ----
    def collate(self, rollouts: list[Rollout]) -> dict:
        """One row per completion: prompt + completion, targets on the completion tokens (shifted), and per target
        position the engine's logprob, the advantage, the loss weight and the reference's logprob."""
        docs = []
        for r in rollouts:
            p, c = len(r.prompt_ids), len(r.completion_ids)
            n = p + c
            labels = np.full(n, IGNORE, dtype=np.int64)
            labels[p - 1:n - 1] = r.completion_ids
            seq = {k: np.zeros(n, dtype=np.float32) for k in ("old_logprobs", "advantages", "rl_weights",
                                                              "ref_logprobs")}
            at = slice(p - 1, n - 1)
            seq["old_logprobs"][at] = r.logprobs
            seq["advantages"][at] = r.advantage
            seq["rl_weights"][at] = 1.0 if self.rl.loss_norm == "token" else 1.0 / max(c, 1)
            if r.ref_logprobs is not None:
                seq["ref_logprobs"][at] = r.ref_logprobs
            doc = Doc(np.asarray(r.prompt_ids + r.completion_ids, dtype=np.int64), labels, seq=seq)
            if r.prompt >= 0:  # the prompt's images; the completion's M-RoPE positions go on from the prompt's max
                pd = self.prompt_doc(r.prompt)
                after = pd.positions.max() + 1 + np.arange(c, dtype=np.int64)
                doc.positions = np.concatenate([pd.positions, np.broadcast_to(after, (pd.positions.shape[0], c))], 1)
                doc.media, doc.n_patches = pd.media, pd.n_patches
            docs.append([doc])
        batch = collate_rows(docs, self.cfg.data.seq_len, self.tok.pad_id, self.needs.position_axes)
        # the policy head's rows (objectives.policy): built here on the host, no sync in the step
        batch["label_index"] = (batch["labels"].reshape(-1) != IGNORE).nonzero().squeeze(1)
        return batch

    def _fill(self, step: int) -> None:
        """Make the rollouts due at ``step`` (module docstring): steps step .. step + k not made yet."""
        for s in range(step, step + self.rl.staleness + 1):
            if s not in self.buffer:
                self.buffer[s] = self.generate(s)

    def _step_batches(self) -> list[dict]:
        step = self.run.state.step
        self._fill(step)
        batch = self.buffer.pop(step)
        mbs, n_micro = self.cfg.data.micro_batch_size, self.run.n_micro
        rows = batch.rollouts
        if len(rows) != mbs * n_micro:
            raise RuntimeError(f"rl: {len(rows)} rollouts for {n_micro} micro-batches of {mbs} rows")
        self._stats.update(self._batch_stats(batch, step))
        return [self.collate(rows[i * mbs:(i + 1) * mbs]) for i in range(n_micro)]

    def _batch_stats(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        rewards = torch.tensor([r.reward for r in batch.rollouts], dtype=torch.float64)
        lens = torch.tensor([len(r.completion_ids) for r in batch.rollouts], dtype=torch.float64)
        flat = rewards.view(-1, self.rl.group_size).std(1) == 0
        s = torch.stack([rewards.sum(), (rewards**2).sum(), lens.sum(),
                         torch.tensor(float(sum(not r.ended for r in batch.rollouts))), flat.sum().double(),
                         torch.tensor(float(len(rewards)))])
        if self.run.world > 1:  # the global batch's statistics (every rank holds its own rows)
            dev = self.run.device if dist.get_backend() == "nccl" else torch.device("cpu")
            s = s.to(dev)
            dist.all_reduce(s)
            s = s.cpu()
        r_sum, r_sq, len_sum, cut, flat_n, n = s.tolist()
        mean = r_sum / n
        return {"rl/reward_mean": mean, "rl/reward_std": math.sqrt(max(r_sq / n - mean * mean, 0.0)),
                "rl/completion_len": len_sum / n, "rl/truncated_frac": cut / n,
                "rl/flat_group_frac": flat_n / (n / self.rl.group_size), "rl/staleness": step - batch.version,
                "rl/buffer_size": len(self.buffer), "rl/policy_version": step}

    # ---- the loader protocol the trainer uses ----
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self._queue:
            self._queue = self._step_batches()
        return self._queue.pop(0)

    def metrics(self) -> dict[str, float]:
        return dict(self._stats)

    def state_dict(self) -> dict:
        """{"num_slots": dp ranks, "slots": {dp_rank: this rank's buffer and the reference's path}}; taken between
        steps (nothing half-consumed)."""
        if self._queue:
            raise RuntimeError("rl: the rollout source is saved in the middle of a step")
        mine = {"buffer": to_bytes(self.buffer), "reference": self.reference}
        return {"num_slots": self.run.dp_world, "slots": {self.run.dp_rank: mine}}

    def load_state_dict(self, sd: dict) -> None:
        mine = sd["slots"][self.run.dp_rank]
        if mine["reference"] != self.reference:
            raise ConfigError(f"rl: the checkpoint's KL reference is {mine['reference'] or 'none'!r}, this run's "
                              f"{self.reference or 'none'!r}; resume with the saved rl.reference / rl.kl_coef")
        self.buffer = from_bytes(mine["buffer"])
        self._queue = []


def token_logprobs(model, batch: dict, device: torch.device, prepare=None) -> torch.Tensor:
    """[B, S] fp32 log p of ``batch["labels"]`` under ``model`` (0 where -100): a causal forward through the family's
    policy hook, as the train step runs it. ``prepare``: the family's prepare_batch (the run's
    ``ctx.prepare_batch``; images become the vision tower's inputs)."""
    if prepare is not None:
        batch = prepare(batch, device)
    attn = build_attn_meta(batch, "sdpa", device)
    b = to_device(batch, device)
    labels = b["labels"]
    out = model(b["input_ids"], position_ids=b["position_ids"], attn=attn,
                loss=lambda m, o: {"logp": m.token_logprobs(o.hidden, labels, b.get("label_index"))[0]},
                **model_inputs(b, Policy()))
    return out.terms["logp"].float().cpu()
