"""The trainer: preflight checks, setup(cfg), the pure train step, optimizers, the loop and checkpoints."""
