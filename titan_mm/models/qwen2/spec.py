"""The Qwen2 / Qwen2.5 answers to the family contract (titan_mm.registry.ModelSpec): Qwen3's
(titan_mm/models/qwen3/spec.py) on the derived decoder config (qk_norm=False: ``kernel_shapes`` lists no
``head_norm`` widths), except the chat template: "qwen3_vl" (titan_mm/data/processors.py): plain ChatML
(``<|im_start|>role\\n...<|im_end|>``) with no ``<think>`` block, which is Qwen2.5-Instruct's format. The
"qwen3" template adds Qwen3's hybrid-thinking block to the last assistant turn, which Qwen2.5 never saw.
(Qwen2.5's HF template also inserts a default system prompt when a chat has none; the data must carry it.)
"""

from __future__ import annotations

import dataclasses

from titan_mm.models.qwen2.config import Qwen2Config, as_decoder
from titan_mm.models.qwen3 import spec as qwen3_spec
from titan_mm.registry import DataNeeds, KernelShapes, ModelDims, Runtime


def dims(cfg: Qwen2Config) -> ModelDims:
    return qwen3_spec.dims(as_decoder(cfg))


def runtime(cfg: Qwen2Config) -> Runtime:
    return qwen3_spec.runtime(as_decoder(cfg))


def with_runtime(cfg: Qwen2Config, attn_backend: str, kernels: bool | str) -> Qwen2Config:
    return dataclasses.replace(cfg, attn_backend=attn_backend, kernels=kernels)


def data_needs(cfg: Qwen2Config) -> DataNeeds:
    return dataclasses.replace(qwen3_spec.data_needs(as_decoder(cfg)), chat_template="chatml")


def kernel_shapes(cfg: Qwen2Config, tp: int = 1, encoder_tp: bool = False) -> KernelShapes:
    return qwen3_spec.kernel_shapes(as_decoder(cfg), tp, encoder_tp)
