"""The Wan and BAGEL activation terms (titan_mm/models/{wan,bagel}/memory.py) against what one block really saves
for its backward: the unique storages held by the block output's autograd graph, on CPU in fp32 and bf16 (the
trainer's mixed-precision activations), eager.

The measure is the slope over the sequence (saved bytes at 2S minus at S, per token), so what is per clip or per row
(the cross-attention's text keys and values, per-clip modulation) cancels; the block's inputs, parameters, RoPE
tables and routing indices are not the block's. The CPU SDPA path's dense [S, S] mask is left out (the estimate
models the GPU backends, which hold none). Every saved byte is an element of an op the formula names, in the dtype
it names (the fp32 norms and upcasts in bf16 too), so the estimate (act_bytes 4 or 2, compile off, no AC) must equal
the measure exactly."""

import dataclasses

import pytest
import torch

from titan_mm.models.bagel import memory as bagel_memory
from titan_mm.models.bagel.config import FLAVORS as BAGEL
from titan_mm.models.bagel.model import build as build_bagel, routing
from titan_mm.models.bagel.spec import TEXT, VAE, expert_routing
from titan_mm.models.wan import memory as wan_memory
from titan_mm.models.wan.config import FLAVORS as WAN
from titan_mm.models.wan.model import build as build_wan
from titan_mm.models.wan.model import rope_cos_sin
from titan_mm.nn.attention import build_attn_meta
from titan_mm.parallel.memory import Topology, estimate
from titan_mm.registry import spec_for_config
from titan_mm.tools.memory import main


def _saved_bytes(out: torch.Tensor, outside: list[torch.Tensor]) -> int:
    """Bytes of the unique storages the autograd graph of ``out`` saved, less those of ``outside`` tensors."""
    skip = {t.untyped_storage().data_ptr() for t in outside}
    seen, held, todo = set(), {}, [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_") or name == "_saved_attn_mask":
                continue
            v = getattr(node, name)
            for t in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        todo.extend(f for f, _ in node.next_functions)
    return sum(held.values())


def _per_token(run, S: int = 16, B: int = 2) -> float:
    return (run(2 * S, B) - run(S, B)) / (B * S)


def _wan_block(cfg, dt):
    torch.manual_seed(0)
    model = build_wan(cfg)
    model.init_weights()
    model.to(dt)

    def run(S, B):
        D = cfg.dim
        h, text = (torch.randn(B, n, D, dtype=dt, requires_grad=True) for n in (S, 5))
        mod = torch.randn(B, S if cfg.first_frame_clean else 1, 6, D, dtype=dt, requires_grad=True)
        grid = torch.stack([torch.arange(S) // 8, torch.arange(S) // 2 % 4, torch.arange(S) % 2], -1)
        rope = rope_cos_sin(grid[None].expand(B, -1, -1), cfg)
        meta = build_attn_meta({"doc_ids": torch.zeros(B, S, dtype=torch.int32)}, "sdpa", "cpu", kind="bidirectional")
        out = model.blocks["0"](h, text, mod, rope, meta)
        return _saved_bytes(out, [*model.parameters(), text, mod, *rope])

    return run


def _bagel_layer(cfg, dt):
    torch.manual_seed(0)
    model = build_bagel(cfg)
    model.init_weights()
    model.to(dt)
    model.init_buffers()  # the RoPE frequencies stay fp32, as the trainer keeps them

    def run(S, B):
        gen = torch.rand(B * S, generator=torch.Generator().manual_seed(S)) < 0.4  # a mix of both experts' tokens
        index = routing(**expert_routing(torch.where(gen, VAE, TEXT)))  # as prepare_batch and the trunk route
        h = torch.randn(B, S, cfg.llm_config.hidden_size, dtype=dt, requires_grad=True)
        rope = model.rope(torch.arange(S)[None].expand(B, S), h.dtype)
        meta = build_attn_meta({"doc_ids": torch.zeros(B, S, dtype=torch.int32)}, "sdpa", "cpu", kind="causal")
        out = model.layers["0"](h, index, rope, meta)
        return _saved_bytes(out, [*model.parameters(), *index, *rope])

    return run


WAN_CASES = {
    "debug": WAN["debug"],
    "no_norms": dataclasses.replace(WAN["debug"], qk_norm=None, cross_attn_norm=False),
    "first_frame_clean": dataclasses.replace(WAN["debug"], first_frame_clean=True),
}
LLM = BAGEL["debug"].llm_config
BAGEL_CASES = {
    "debug": BAGEL["debug"],  # 4 query heads, 2 kv heads: the sdpa path repeats k and v
    "no_gqa": dataclasses.replace(BAGEL["debug"], llm_config=dataclasses.replace(LLM, num_key_value_heads=4)),
    "mlp_only": dataclasses.replace(BAGEL["debug"], llm_config=dataclasses.replace(
        LLM, layer_module="Qwen2MoEDecoderLayer")),  # one attention for every token, the MLP by expert
}


DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}


CASES = {f"wan-{k}": (cfg, _wan_block, wan_memory) for k, cfg in WAN_CASES.items()}
CASES.update({f"bagel-{k}": (cfg, _bagel_layer, bagel_memory) for k, cfg in BAGEL_CASES.items()})


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_block_bytes_are_what_a_block_saves(case, dtype):
    (cfg, block, mem), (dt, a) = CASES[case], DTYPES[dtype]
    want = mem.block_bytes(cfg, Topology(), a, compile=False)
    assert _per_token(block(cfg, dt)) == want.full == want.kept


@pytest.mark.parametrize("mem, cfg", [(wan_memory, WAN["1.3B"]), (bagel_memory, BAGEL["7B-MoT"])])
def test_ac_and_tp_shrink_the_terms(mem, cfg):
    full = mem.block_bytes(cfg, Topology(), 2)
    sel = mem.block_bytes(cfg, Topology(ac="selective"), 2)
    ac = mem.block_bytes(cfg, Topology(ac="full"), 2)
    assert full.kept > sel.kept > ac.kept > 0 and full.full == sel.full == ac.full
    assert mem.block_bytes(cfg, Topology(tp=2), 2).kept < full.kept
    est = estimate(cfg, spec_for_config(cfg).plan(cfg), Topology(dp_shard=8), 4096, 1)
    assert est["activations"] > 0 and est["total"] > est["params"]


@pytest.mark.parametrize("config", ["debug_wan", "debug_bagel"])
def test_cli_answers_for_the_family(config, capsys):
    main(["--config", config])
    out = capsys.readouterr().out
    assert "activations" in out and "total" in out
