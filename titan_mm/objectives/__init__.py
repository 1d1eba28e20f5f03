"""Training objectives as registered data (docs/models.md "Objectives"): the batch fields each reads, the attention
kind it asks for, its host-side ``prepare`` (noise, corrupted inputs, targets), the host-counted normalizer of each
loss term, and the named loss-term sums it returns from the model's output (titan_mm.objectives.base)."""

from titan_mm.objectives.base import Objective, noise_generator
from titan_mm.objectives.flow_matching import FlowMatching

__all__ = ["FlowMatching", "Objective", "noise_generator"]
