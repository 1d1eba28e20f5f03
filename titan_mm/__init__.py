"""titan_mm: a functional trainer for multimodal LLMs on PyTorch."""

from titan_mm import _quiet

_quiet.install()
