"""Sampling from a diffusion LM through titan_mm's own forward (embed -> trunk -> head): iterative unmasking with
low-confidence remasking (LLaDA), semi-autoregressive over blocks.

    gen = sample(model, prompts, objective, gen_length=4, steps=4)        # list of token lists, one per prompt

Each row is one document: the prompt, then ``gen_length`` mask tokens (the canvas). The canvas is split into blocks
that are finished one after the other:
  * masked / shifted diffusion: blocks of ``block_length`` tokens counted from the end of the prompt (LLaDA's
    semi-autoregressive sampling; default one block, the whole canvas), bidirectional attention;
  * block diffusion: the objective's blocks (``block_size`` tokens from the document's first token, so the prompt's
    last block may hold the first masks), block-causal attention.
Each of ``steps`` steps per block runs the model on the whole canvas, predicts every masked position of the block
(argmax over every token but the mask; the confidence is its softmax probability), commits the k most confident
predictions (k spreads the block's masks evenly over the steps left) and leaves the rest masked. Shifted diffusion reads position j's prediction from
hidden state j - 1. Sampling stops after a block in which every row has produced a stop token.

Finished blocks are recomputed at every step, not cached: titan_mm's KV cache (nn/kv_cache.py) is causal
only. Under block-causal attention the masks after the current block do not change its predictions, so running the
whole canvas is exact, only slower than a cache of the finished blocks would be.
"""

from __future__ import annotations

import numpy as np
import torch

from titan_mm.data.packing import IGNORE_INDEX, Doc, collate_rows
from titan_mm.nn.attention import build_attn_meta


def _canvas(prompts: list[list[int]], gen_length: int, mask_id: int) -> dict[str, torch.Tensor]:
    """One document per row: prompt + gen_length masks, right-padded (padding is its own document)."""
    rows = [[Doc(np.asarray(list(p) + [mask_id] * gen_length, dtype=np.int64),
                 np.full(len(p) + gen_length, IGNORE_INDEX, dtype=np.int64))] for p in prompts]
    return collate_rows(rows, max(len(p) for p in prompts) + gen_length, pad_id=0, position_axes=1, multiple=1)


def _blocks(start: int, end: int, objective, block_length: int | None) -> list[tuple[int, int]]:
    """[a, b) spans of a row's canvas positions start .. end-1, in the order they are finished."""
    if objective.block_size:  # the objective's blocks: boundaries at multiples of block_size
        b = objective.block_size
        edges = [start] + list(range((start // b + 1) * b, end, b)) + [end]
    else:
        b = block_length or (end - start)
        edges = list(range(start, end, b)) + [end]
    return list(zip(edges[:-1], edges[1:]))


@torch.no_grad()
def sample(model, prompts: list[list[int]], objective, gen_length: int, steps: int, block_length: int | None = None,
           stop_ids: tuple[int, ...] = (), attn_backend: str = "sdpa",
           device: torch.device | str = "cpu") -> list[list[int]]:
    """Generated tokens per prompt: the canvas after the prompt, cut before the first stop token (masks that were
    never committed stay ``objective.mask_id``). ``steps``: denoising steps per block (more than the block's length
    adds nothing); ``block_length``: semi-autoregressive blocks of masked / shifted diffusion (None: one block)."""
    if gen_length < 1 or steps < 1 or not prompts or not all(prompts):
        raise ValueError(f"sample needs non-empty prompts, gen_length >= 1 and steps >= 1; got {len(prompts)} "
                         f"prompts, gen_length={gen_length}, steps={steps}")
    device = torch.device(device)
    mask_id, shift = objective.mask_id, 1 if objective.shifted else 0
    batch = _canvas(prompts, gen_length, mask_id)
    ids, B = batch["input_ids"], len(prompts)
    meta = build_attn_meta(batch, attn_backend, device, kind=objective.mask_kind, block_size=objective.block_size)
    pos = batch["position_ids"].to(device)
    blocks = [_blocks(len(p), len(p) + gen_length, objective, block_length) for p in prompts]
    for r in range(max(len(b) for b in blocks)):
        span = [b[r] if r < len(b) else (len(p), len(p)) for b, p in zip(blocks, prompts)]  # empty: row done
        start = torch.tensor([a for a, _ in span])
        length = torch.tensor([b - a for a, b in span])
        offs = torch.arange(int(length.max()))
        in_block = offs[None] < length[:, None]  # [B, width]
        at = start[:, None] + torch.minimum(offs[None], (length - 1).clamp(min=0)[:, None])  # positions, clamped
        for s in range(steps):
            stream = model.embed(ids.to(device))
            stream = model.trunk(stream, model.rope(pos, stream.h.dtype), meta)
            conf, pred = [], []
            for k in range(at.shape[1]):  # one [B, V] slice of logits at a time, never [B, S, V]
                logits = model.head(stream, meta, None, (at[:, k] - shift).to(device)).logits.float()
                logits[:, mask_id] = float("-inf")  # never "predict" the mask token itself
                c, t = logits.softmax(-1).max(-1)
                conf.append(c.cpu())
                pred.append(t.cpu())
            masked = in_block & (ids.gather(1, at) == mask_id)
            conf = torch.where(masked, torch.stack(conf, 1), -1.0)
            pred = torch.stack(pred, 1)
            for i in range(B):  # commit the row's most confident predictions; the others stay masked
                m = int(masked[i].sum())
                if m:
                    top = conf[i].topk(-(-m // (steps - s))).indices  # ceil: the block is done after its last step
                    ids[i, at[i, top]] = pred[i, top]
        ends = [b[min(r, len(b) - 1)][1] for b in blocks]
        if stop_ids and all(set(ids[i, len(p): ends[i]].tolist()) & set(stop_ids) for i, p in enumerate(prompts)):
            break
    out = []
    for i, p in enumerate(prompts):
        g = ids[i, len(p): len(p) + gen_length].tolist()
        out.append(g[:next((j for j, t in enumerate(g) if t in stop_ids), len(g))])
    return out
