"""RL post-training on the trainer's code path (docs/rl.md): rollouts from titan_mm's own serving engine on the live
weights, rewards, group-normalized advantages and a replay buffer (titan_mm.rl.rollout), trained by the "policy"
objective (titan_mm.objectives.policy) in the ordinary train step.

This room sits above train/, serve/ and eval/ (it uses eval's weight hand-off); the trainer receives it as its data
callback, as it receives eval's: ``train(cfg, make_eval, make_data=rl_data(cfg))``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from titan_mm.config import ConfigError, JobConfig
from titan_mm.rl.rewards import build_reward
from titan_mm.rl.rollout import RolloutSource, load_prompts, reference_path
from titan_mm.train.setup import Run

__all__ = ["RolloutSource", "rl_data"]


def rl_data(cfg: JobConfig) -> Callable[[Run], RolloutSource] | None:
    """The trainer's data callback of an [rl] job (None when rl.enable is off). The prompts, the rewards and the
    reference's path are checked here, before anything is built, so a bad one is one ConfigError line."""
    if not cfg.rl.enable:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))  # every rank is a dp rank: the config refuses tp / cp / pp
    if cfg.rl.prompts_per_step % world:
        raise ConfigError(f"rl.prompts_per_step ({cfg.rl.prompts_per_step}) must divide by the {world} data-parallel "
                          "ranks: each rank samples whole groups")
    build_reward(cfg.rl)
    load_prompts(cfg.rl.prompts)
    reference_path(cfg)
    return lambda run: RolloutSource(cfg, run)
