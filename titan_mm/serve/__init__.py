"""The serving engine on the training model code (docs/serving.md), grouped by layer: core/ (requests, blocks,
scheduler, output processor, decoding handlers, EngineCore), runner/ (model execution, CUDA graphs, the sampler,
tensor parallel), entrypoints/ (the OpenAI server and the CLI). The public pieces sit here: ``config``
(ServeConfig), ``sampling_params`` (SamplingParams), ``errors`` and ``engine`` (Engine):
``from titan_mm.serve.engine import Engine``."""
