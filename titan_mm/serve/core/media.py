"""A prompt's images, processed the way training processes them (titan_mm.data.vision): each image pad of the
prompt becomes one pad per merged visual token, and M-RoPE positions come from the expanded prompt."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from titan_mm.config import Data
from titan_mm.data import vision
from titan_mm.data.processors import ProcessorConfig
from titan_mm.data.sources import SkipSample, media_bytes
from titan_mm.registry import DataNeeds
from titan_mm.serve.errors import BadRequest
from titan_mm.serve.core.sequence import Image


def expand_images(prompt: list[int], images: list, needs: DataNeeds, data: Data):
    """(prompt with each image pad repeated per merged token, [Image], M-RoPE positions [3, L] or None, delta).
    ``images``: PIL images, encoded bytes, ``data:`` URIs, arrays or MediaItems, one per pad of the prompt."""
    tok = needs.special_tokens
    pad = tok.get("image_pad")
    if images and not needs.patch_size:
        raise BadRequest("images", "this model takes no images")
    if tok.get("video_pad") is not None and tok["video_pad"] in prompt:
        raise BadRequest("prompt", "holds a video pad token; videos are not served yet")
    n_pads = sum(1 for t in prompt if t == pad) if pad is not None else 0
    if n_pads != len(images):
        raise BadRequest("images", f"the prompt holds {n_pads} image pad token(s) (id {pad}) but {len(images)} "
                         "image(s) came; put one pad per image where it goes (the chat template does)")
    pcfg = ProcessorConfig(data, needs)
    out, imgs, grids = [], [], []
    it = iter(images)
    for t in prompt:
        if t != pad or pad is None:
            out.append(t)
            continue
        i = len(imgs)
        payload = next(it)
        try:
            if isinstance(payload, vision.MediaItem):
                item = payload
            else:
                if isinstance(payload, str) and payload.startswith("data:"):
                    payload = media_bytes(payload, {}, None)
                elif isinstance(payload, (str, dict)):  # the engine opens no paths or URLs
                    raise SkipSample("bad_image", "give image bytes, a PIL image, an array or a data: URI")
                item = vision.process_image(payload, pcfg)
        except SkipSample as e:
            raise BadRequest(f"images[{i}]", str(e)) from None
        pv = torch.as_tensor(np.asarray(item.tensors["pixel_values"]), dtype=torch.float32)
        grid = torch.as_tensor(np.asarray(item.tensors["image_grid_thw"]), dtype=torch.long).view(1, 3)
        key = int.from_bytes(hashlib.blake2b(pv.numpy().tobytes() + grid.numpy().tobytes(),
                                             digest_size=8).digest(), "little")
        imgs.append(Image(len(out), len(out) + item.n_tokens, pv, grid, key))
        grids.append(item.grid)
        out += [pad] * item.n_tokens
    if needs.positions != "mrope":
        return out, imgs, None, 0
    kinds = np.zeros(len(out), dtype=np.int64)
    for im in imgs:
        kinds[im.start:im.end] = 1
    pos = torch.from_numpy(vision.mrope_index(kinds, grids, [], needs.merge_size))
    return out, imgs, pos, int(pos.max()) + 1 - len(out)
