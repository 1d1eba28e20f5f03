"""Observability: metrics sinks (console, jsonl, TensorBoard, wandb, Prometheus), the profiler window, health (NaN guard, step times, memory) and MFU."""
