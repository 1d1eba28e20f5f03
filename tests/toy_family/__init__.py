"""A toy family, registered by its test: a tiny transformer over continuous vectors, no tokens, trained with flow
matching under BAGEL's segment mask. Each document is a causal segment of conditioning vectors ``cond``, then a
noise segment of latents whose clean value depends on the conditioning; documents are packed several to a row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from titan_mm.data.packing import BestFitPacker, Doc, collate_rows
from titan_mm.nn.attention import Attention
from titan_mm.nn.output import ModelOutput
from titan_mm.registry import BatchSchema, ModelSpec, Runtime, SeqKey


@dataclass(frozen=True)
class ToyConfig:
    dim: int = 32
    layers: int = 2
    heads: int = 4
    channels: int = 4
    """C: channels of a latent and of a conditioning vector."""
    max_len: int = 64
    attn_backend: str = "sdpa"


SCHEMA = BatchSchema((SeqKey("cond", ("C",), "float32"), SeqKey("latents", ("C",), "float32"),
                      SeqKey("latent_mask", dtype="bool"), SeqKey("noise_unit")), tokens=False)


class Block(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.attn = Attention(c.dim, c.heads, c.heads, c.dim // c.heads, bias=False, eps=1e-6, qk_norm=False,
                              rope_impl=lambda q, k, cos, sin: (q, k))  # positions come from an embedding
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(), nn.Linear(4 * c.dim, c.dim))

    def forward(self, h, attn):
        h = h + self.attn(self.attn_norm(h), None, None, attn)
        return h + self.mlp(self.mlp_norm(h))


class ToyModel(nn.Module):
    def __init__(self, c: ToyConfig):
        super().__init__()
        self.cond_in, self.latent_in = nn.Linear(c.channels, c.dim), nn.Linear(c.channels, c.dim)
        self.time_in, self.pos = nn.Linear(1, c.dim), nn.Embedding(c.max_len, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm, self.velocity = nn.RMSNorm(c.dim), nn.Linear(c.dim, c.channels)

    def forward(self, input_ids=None, position_ids=None, attn=None, loss=None, cond=None, noisy_latents=None,
                timesteps=None, latent_mask=None, **_):
        lat = self.latent_in(noisy_latents) + self.time_in(timesteps[..., None])
        h = torch.where(latent_mask[..., None], lat, self.cond_in(cond)) + self.pos(position_ids)
        for blk in self.blocks:
            h = blk(h, attn)
        out = ModelOutput(None, None, torch.zeros(()), hidden=self.norm(h))
        return out._replace(terms=loss(self, out)) if loss is not None else out

    def predict_velocity(self, out, batch):  # flow matching's hook
        return self.velocity(out.hidden)


def _none(*_, **__):
    raise NotImplementedError("the toy family has no HF weights, FLOPs, plan or memory terms")


SPEC = ModelSpec(
    name="toy_flow", config_cls=ToyConfig, flavors={"tiny": ToyConfig()}, build=ToyModel, config_from_hf=_none,
    load_hf=_none, save_hf=_none, flops=_none, plan=_none, dims=_none, data_needs=_none, kernel_shapes=_none,
    memory_terms=_none, runtime=lambda c: Runtime(c.attn_backend, False),
    with_runtime=lambda c, attn_backend="sdpa", kernels=False: dataclasses.replace(c, attn_backend=attn_backend),
    batch_schema=SCHEMA)


def toy_doc(rng: np.random.Generator, mix: np.ndarray, sid: str) -> Doc:
    """2-5 conditioning vectors, then 3-6 latents: each latent is ``mix`` of the mean conditioning vector plus a
    ramp over its position, so the model must read the causal segment to denoise the noise segment."""
    n_c, n_l = int(rng.integers(2, 6)), int(rng.integers(3, 7))
    C = mix.shape[0]
    cond = rng.standard_normal((n_c, C)).astype(np.float32)
    x0 = np.tanh(cond.mean(0) @ mix)[None] * 2 + np.linspace(-1, 1, n_l, dtype=np.float32)[:, None]
    z_c, z_l = np.zeros((n_c, C), np.float32), np.zeros((n_l, C), np.float32)
    return Doc(None, None, sid, segments=((n_c, "causal"), (n_l, "noise")),
               seq={"cond": np.concatenate([cond, z_l]), "latents": np.concatenate([z_c, x0.astype(np.float32)]),
                    "latent_mask": np.arange(n_c + n_l) >= n_c})


def toy_batches(seed: int, rows: int, seq_len: int, channels: int = 4):
    """Packed batches forever: best-fit rows of toy docs (:func:`toy_collate`)."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(1234).standard_normal((channels, channels)).astype(np.float32)
    packer, i = BestFitPacker(seq_len, open_rows=4), 0
    while True:
        while (got := packer.pop_rows(rows)) is None:
            packer.add(toy_doc(rng, mix, str(i)))
            i += 1
        yield toy_collate(got, seq_len)


def toy_collate(rows: list[list[Doc]], seq_len: int) -> dict:
    """The batch of these rows of toy docs; ``noise_unit`` is each latent's document in its row."""
    b = collate_rows(rows, seq_len, 0, 1, multiple=1, schema=SCHEMA)
    b["noise_unit"] = torch.where(b["latent_mask"], b["doc_ids"].long(), -1)
    return b
