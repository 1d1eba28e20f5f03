"""Greedy decoding through the family's training forward, for tasks whose prompts hold media the serving engine does
not take yet (audio: docs/qwen2_5_omni.md, "Not done yet"). Prompts are built by the training processors (the
chat template, media expanded as in training), collated and prepared as the train step prepares a micro-batch
(ModelSpec.prepare_batch, then the attention metadata), and every new token re-runs the whole prefix: there is no
KV cache, which is cheap at the tasks' sizes (prompts of ~100 tokens, answers of a few)."""

from __future__ import annotations

import numpy as np
import torch

from titan_mm.data.packing import IGNORE_INDEX, Doc, collate_rows
from titan_mm.data.processors import Processor
from titan_mm.data.schema import parse_record
from titan_mm.nn.attention import build_attn_meta
from titan_mm.train.step import NOT_MODEL_KWARGS, to_device  # the train step's split of batch keys and its move

ROWS = 32  # prompts decoded together


def _extend(doc: Doc, new: list[int]) -> Doc:
    """``doc`` followed by the generated text tokens (M-RoPE: each one past the largest position so far)."""
    k = len(new)
    pos = doc.positions
    if pos is not None and k:
        pos = np.concatenate([pos, np.broadcast_to(pos.max() + 1 + np.arange(k), (pos.shape[0], k))], axis=1)
    ids = np.concatenate([doc.input_ids, np.asarray(new, dtype=np.int64)])
    return Doc(ids, np.full(ids.shape[0], IGNORE_INDEX, dtype=np.int64), positions=pos, media=doc.media)


@torch.no_grad()
def greedy_texts(model, spec, model_cfg, proc: Processor, prompts: list[list[dict]], max_new_tokens: int,
                 device: torch.device) -> list[str]:
    """The greedy answer to each chat prompt (OpenAI-style messages ending before the assistant's turn), up to the
    tokenizer's <|im_end|> / <|endoftext|> or ``max_new_tokens``; special tokens are not in the text."""
    tok = proc.tok
    stop = {tok.eos_id, tok.endoftext_id} - {None}
    docs = [proc.prompt_doc(parse_record({"messages": m})) for m in prompts]
    out: list[list[int]] = [[] for _ in docs]
    model.eval()
    for lo in range(0, len(docs), ROWS):
        live = list(range(lo, min(lo + ROWS, len(docs))))
        for _ in range(max_new_tokens):
            rows = [[_extend(docs[i], out[i])] for i in live]
            batch = collate_rows(rows, max(len(r[0]) for r in rows), tok.pad_id, proc.cfg.mrope)
            if spec.prepare_batch is not None:
                batch = spec.prepare_batch(model_cfg, batch, device)
            attn = build_attn_meta(batch, "sdpa", device)
            b = to_device(batch, device)
            at = torch.tensor([len(r[0]) - 1 for r in rows], device=device)
            logits = model(b["input_ids"], position_ids=b["position_ids"], attn=attn, logits_at=at,
                           **{k: v for k, v in b.items() if k not in NOT_MODEL_KWARGS}).logits
            for i, t in zip(live, logits.argmax(-1).tolist()):
                out[i].append(t)
            live = [i for i in live if out[i][-1] not in stop]
            if not live:
                break
    return [tok.decode([t for t in o if t not in stop], skip_special_tokens=True) for o in out]
