"""RL post-training on the trainer's code path (docs/rl.md): rollouts from titan_mm's own serving engine on the live
weights, rewards, group-normalized advantages and a replay buffer (titan_mm.rl.rollout), trained by the "policy"
objective (titan_mm.objectives.policy) in the ordinary train step.

This room sits above train/, serve/ and eval/ (it uses eval's weight hand-off); the trainer receives it as its data
callback, as it receives eval's: ``train(cfg, make_eval, make_data=rl_data(cfg))``.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_mm.config import JobConfig
from titan_mm.rl.rewards import build_reward
from titan_mm.rl.rollout import RolloutSource, load_prompts, reference_path
from titan_mm.train.setup import Run

__all__ = ["RolloutSource", "rl_data"]


def rl_data(cfg: JobConfig) -> Callable[[Run], RolloutSource] | None:
    """The trainer's data callback of an [rl] job (None when rl.enable is off). The prompts, the rewards and the
    reference's path are checked here, before anything is built, so a bad one is one ConfigError line."""
    if not cfg.rl.enable:
        return None
    build_reward(cfg.rl)
    load_prompts(cfg.rl.prompts)
    reference_path(cfg)
    return lambda run: RolloutSource(cfg, run)
