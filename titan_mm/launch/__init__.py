"""The training job's commands, which compose the rooms that do not import each other: train() is handed the [eval]
callback (titan_mm.eval) and the [rl] rollout source (titan_mm.rl) here (``python -m titan_mm.launch.train``, and
``python -m titan_mm.launch.torchrun`` for NPROC > 1)."""
