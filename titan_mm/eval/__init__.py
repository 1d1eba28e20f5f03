"""Evaluation on the training code path (docs/eval.md): ``[eval]`` in a run scores held-out sources and generation
tasks every eval.interval steps (titan_mm.eval.evaluator), ``python -m titan_mm.eval`` scores a saved checkpoint
the same way, and titan_mm.eval.tasks reads the built-in and JSONL tasks."""
