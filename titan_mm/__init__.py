"""titan_mm: a functional trainer for multimodal LLMs on PyTorch."""
