"""Low-precision training: module swaps and per-step hooks that change how linears compute, not what they are.

float8.py: torchao float8 training (tensorwise or rowwise scaling) for a model's nn.Linear layers, and the
hook that precomputes the FSDP float8 weight scales after each optimizer step. parallel/apply.py calls
:func:`~titan_mm.quant.float8.apply_float8` first in its fixed order (before TP / FSDP see the modules).
"""
