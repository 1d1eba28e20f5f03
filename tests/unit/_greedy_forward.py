"""A test oracle for the serving engine (the one decoder): greedy answers by re-running the whole sequence through
the training forward for every new token (no KV cache), each prompt built by the training processors (chat
template, media expanded as in training) and prepared as the train step prepares a micro-batch (the family's
prepare_batch, then the attention metadata). fp32 on the CPU, the same weights: the engine's argmax agrees."""

from __future__ import annotations

import numpy as np
import torch

from titan_mm.data.packing import IGNORE_INDEX, Doc, collate_rows
from titan_mm.data.processors import Processor
from titan_mm.data.schema import parse_record
from titan_mm.nn.attention import build_attn_meta
from titan_mm.train.step import NOT_MODEL_KWARGS

CPU = torch.device("cpu")


def _extend(doc: Doc, new: list[int]) -> Doc:
    """``doc`` followed by the generated tokens (M-RoPE: each one past the largest position so far)."""
    pos = doc.positions
    if pos is not None and new:
        pos = np.concatenate([pos, np.broadcast_to(pos.max() + 1 + np.arange(len(new)), (pos.shape[0], len(new)))], 1)
    ids = np.concatenate([doc.input_ids, np.asarray(new, dtype=np.int64)])
    return Doc(ids, np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64), positions=pos, media=doc.media)


@torch.no_grad()
def forward_greedy(model, spec, model_cfg, proc: Processor, prompts: list[list[dict]], max_new: int) -> list[str]:
    """The greedy answer to each chat prompt (messages ending before the assistant's turn), up to <|im_end|> /
    <|endoftext|> or ``max_new`` tokens, without special tokens."""
    tok = proc.tok
    stop = {tok.eos_id, tok.endoftext_id} - {None}
    texts = []
    for messages in prompts:
        doc, new = proc.prompt_doc(parse_record({"messages": messages})), []
        while len(new) < max_new and not (new and new[-1] in stop):
            d = _extend(doc, new)
            batch = collate_rows([[d]], len(d), tok.pad_id, proc.cfg.position_axes)
            if spec.prepare_batch is not None:
                batch = spec.prepare_batch(model_cfg, batch, CPU)
            logits = model(batch["input_ids"], position_ids=batch["position_ids"],
                           attn=build_attn_meta(batch, "sdpa", CPU), logits_at=torch.tensor([len(d) - 1]),
                           **{k: v for k, v in batch.items() if k not in NOT_MODEL_KWARGS}).logits
            new.append(int(logits[0].argmax()))
        texts.append(tok.decode([t for t in new if t not in stop], skip_special_tokens=True))
    return texts
