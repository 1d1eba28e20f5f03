"""The serving engine on the training model code (docs/serving.md): paged KV blocks with prefix caching
(block_manager), continuous batching with chunked prefill and preemption (scheduler), sampling and beam search
(sampling, beam), one forward per step through the model's KV-cache path (runner), and the engine that ties them
(engine). Import the pieces from their modules: ``from titan_mm.serve.engine import Engine``."""
