"""Model execution: one forward per step through the model's KV-cache path (model_runner, CUDA graphs), the
batched sampler on the device (sampler) and tensor parallelism (tp)."""
