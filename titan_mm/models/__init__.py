"""The model families, one folder each behind the ModelSpec contract (titan_mm.registry), and the HF safetensors IO they share (hf_io)."""
