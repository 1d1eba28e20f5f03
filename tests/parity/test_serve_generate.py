"""The serving engine's greedy outputs are token-identical to transformers' ``generate`` (fp32, CPU, tiny random
models) for 16 prompts of mixed lengths run together: Qwen3, Qwen3-MoE and Qwen3-VL with images (dense and MoE),
with prefix caching on and off, with preemption forced by a tiny block pool, with chunked prefill under a small
token budget, without chunking, and with each speculative method (n-gram prompt lookup; a draft model of the same
registry and vocabulary, also under preemption and chunking), and with serve.mixed_attention (each step's rows in
one packed row read in place by titan_mm.kernels.paged_attention, decode rows beside prefill chunks; also with
n-gram speculation under preemption). Prompts share prefixes (so the prefix cache hits) and sequences stop at an
EOS token that greedy decoding meets mid-way for some of them. HF runs the prompts as one left-padded batch.

Run: pytest -q tests/parity/test_serve_generate.py
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.parity._qwen3_helpers import hf_model, titan_twin  # noqa: E402
from titan_mm.config import Data  # noqa: E402
from titan_mm.data import vision  # noqa: E402
from titan_mm.data.processors import ProcessorConfig  # noqa: E402
from titan_mm.kernels import paged_attention  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.runner import model_runner  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 10
N = 16
# name -> ServeConfig fields; each case says what it must have exercised
CASES = {
    "prefix_cache": dict(block_size=4, num_blocks=256, max_num_seqs=4),  # admitted in waves: later ones hit
    "no_prefix_cache": dict(block_size=4, num_blocks=256, enable_prefix_caching=False),
    "padded_prefill": dict(block_size=4, num_blocks=256, max_num_seqs=4, packed_prefill=False,  # rows, not packed
                           mixed_attention=False),
    "preemption": dict(block_size=4, num_blocks=22, max_num_seqs=16),
    "chunked_prefill": dict(block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8),
    "whole_prefill": dict(block_size=16, num_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=256),
    "spec_ngram": dict(block_size=4, num_blocks=256, speculative_method="ngram", num_speculative_tokens=3),
    "spec_draft": dict(block_size=4, num_blocks=256, speculative_method="draft", num_speculative_tokens=3),
    "spec_draft_preempt": dict(block_size=4, num_blocks=16, speculative_method="draft", max_num_batched_tokens=16,
                               max_num_seqs=8),
    # one packed row per step, decode rows beside prefill chunks, keys read in place (paged_attention)
    "mixed_attention": dict(block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=8,
                            mixed_attention=True),
    "mixed_spec_preempt": dict(block_size=4, num_blocks=22, speculative_method="ngram", num_speculative_tokens=3,
                               max_num_seqs=16, mixed_attention=True),
}
_DRAFTS: dict = {}


def draft_model(text):
    """A draft of the same registry and vocabulary: the target's text model with its weights perturbed, so that some
    guesses are kept and some rejected (Qwen3-VL: its language model, which sees the image pads as text)."""
    if id(text) not in _DRAFTS:
        d = copy.deepcopy(text)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for w in d.parameters():
                w.add_(0.03 * torch.randn(w.shape, generator=g))
        _DRAFTS[id(text)] = (d, get_model_spec("qwen3"), d.cfg)
    return _DRAFTS[id(text)]


def text_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of 1 .. 40 tokens; groups of them start with the same 9 or 21 tokens."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (21, 9)]
    out = []
    for i in range(N):
        tail = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        out.append((heads[i % 2] + tail) if i % 4 < 2 else tail)
    return out


def left_padded(prompts: list[list[int]]):
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    return ids, mask


def with_eos(refs: list[list[int]]) -> tuple[int, list[list[int]]]:
    """An EOS id that greedy decoding meets mid-way in some outputs, and the references cut after it (greedy: the
    same as generating with that EOS)."""
    counts: dict[int, int] = {}
    for r in refs:
        for t in set(r[2:MAX_NEW - 2]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t], -t))
    return eos, [r[: r.index(eos) + 1] if eos in r else r for r in refs]


_REF: dict = {}


def text_reference(moe: bool):
    """(HF model, titan twin, prompts, eos, HF greedy outputs cut after eos), built once per kind."""
    if ("hf", moe) not in _REF:
        hf = hf_model(moe=moe)
        hf.config.output_router_logits = False  # batched generate: no aux loss over padded rows
        prompts = text_prompts(hf.config.vocab_size)
        ids, mask = left_padded(prompts)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        eos, refs = with_eos(out[:, ids.shape[1]:].tolist())
        _REF["hf", moe] = hf, titan_twin(hf), prompts, eos, refs
    return _REF["hf", moe]


def text_setup(moe: bool):
    _, tm, prompts, eos, refs = text_reference(moe)
    return tm, get_model_spec("qwen3"), prompts, None, eos, refs, Data()


def _image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def vl_setup(moe: bool):
    key = ("vl", moe)
    if key in _REF:
        return _REF[key]
    from tests.parity.test_qwen3_vl_parity import TOK, models

    hf, tm, cfg = models(moe)
    spec = get_model_spec("qwen3_vl_moe" if moe else "qwen3_vl")
    data = Data(image_min_pixels=64, image_max_pixels=32 * 32)  # tiny images: 4-pixel patches, 2x2 merge
    pcfg = ProcessorConfig(data, spec.data_needs(cfg))
    g = torch.Generator().manual_seed(1)
    shared = _image(16, 24, 0)  # the same picture opens several prompts: cached like any prefix
    img, vs, ve = TOK["image_token_id"], TOK["vision_start_token_id"], TOK["vision_end_token_id"]
    head = torch.randint(0, 150, (5,), generator=g).tolist()
    prompts, images = [], []
    for i in range(N):
        tail = torch.randint(0, 150, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        if i % 4 == 3:
            prompts.append(tail)
            images.append([])
            continue
        ims = [shared if i % 2 == 0 else _image(24, 16, 100 + i)] + ([_image(16, 16, 200 + i)] if i % 3 == 1 else [])
        p = head + [vs, img, ve] + tail + ([vs, img, ve, 7] if len(ims) > 1 else [])
        prompts.append(p)
        images.append(ims)
    # HF: the expanded prompts, left-padded, with the same pixels (titan_mm's processor, as in training)
    expanded, pix, grids = [], [], []
    for p, ims in zip(prompts, images):
        items = [vision.process_image(im, pcfg) for im in ims]
        e = []
        it = iter(items)
        for t in p:
            e += [img] * next(it).n_tokens if t == img else [t]
        expanded.append(e)
        pix += [torch.from_numpy(x.tensors["pixel_values"]) for x in items]
        grids += [torch.from_numpy(x.tensors["image_grid_thw"]) for x in items]
    ids, mask = left_padded(expanded)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, mm_token_type_ids=(ids == img).long(), pixel_values=torch.cat(pix),
                          image_grid_thw=torch.cat(grids), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    eos, refs = with_eos(out[:, ids.shape[1]:].tolist())
    _REF[key] = (tm, spec, prompts, images, eos, refs, data)
    return _REF[key]


def case_engine(model: str, case: str, served, tm, spec, eos: int, data, **kw) -> Engine:
    """The engine of one serving case (CASES) on ``served`` (``tm`` or a copy of it), with a draft of ``tm``'s text
    model for the draft cases."""
    cfg = ServeConfig(max_model_len=256, **{"packed_prefill": True, "mixed_attention": False, **CASES[case]})
    text = tm.language_model if model.startswith("qwen3_vl") else tm
    draft = draft_model(text) if cfg.speculative_method == "draft" else None
    return Engine(served, spec, tm.cfg, cfg, eos_token_ids=[eos], data=data, draft=draft, **kw)


MODELS = {"qwen3": lambda: text_setup(False), "qwen3_moe": lambda: text_setup(True),
          "qwen3_vl": lambda: vl_setup(False), "qwen3_vl_moe": lambda: vl_setup(True)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers_generate(model, case, monkeypatch):
    tm, spec, prompts, images, eos, refs, data = MODELS[model]()
    mixed = []  # the rows' new-token counts of each paged_attention call (mixed_attention cases)

    def counted(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window=None):
        mixed.append(cu_seqlens_q.diff().tolist())
        return paged_attention(q, k_pool, v_pool, block_tables, seq_lens, cu_seqlens_q, window)

    monkeypatch.setattr(model_runner, "paged_attention", counted)
    engine = case_engine(model, case, tm, tm, spec, eos, data)
    cfg = engine.cfg
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images=images)
    got = [o.outputs[0].token_ids for o in outs]
    bad = [i for i in range(N) if got[i] != refs[i]]
    assert not bad, f"prompts {bad} differ from HF generate: got {[got[i] for i in bad]}, HF {[refs[i] for i in bad]}"
    assert any(len(r) < MAX_NEW for r in refs) and any(len(r) == MAX_NEW for r in refs)  # EOS and length both met
    reasons = {o.outputs[0].finish_reason for o in outs}
    assert reasons == {"stop", "length"}, reasons
    st = engine.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0  # every block came back
    if case == "prefix_cache":
        assert st["prefix_cache_hit_rate"] > 0.1, st
    if case == "no_prefix_cache":
        assert st["prefix_cache_hit_tokens"] == 0
    assert engine.runner.packed == (case != "padded_prefill")  # the other cases prefill through one packed row
    # decode rows ran beside longer rows in one call (and only with mixed_attention)
    assert any(1 in n and max(n) > 1 for n in mixed) == bool(CASES[case].get("mixed_attention")), mixed[:5]
    if case in ("preemption", "spec_draft_preempt"):
        assert st["num_preemptions"] > 0, st
    if cfg.speculative_method:  # guesses were made, and some kept
        acc = [o.metrics.spec_acceptance for o in outs if o.metrics.spec_acceptance is not None]
        assert acc and sum(o.metrics.spec_proposed for o in outs) > N, acc
        assert 0 < sum(o.metrics.spec_accepted for o in outs)


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
@pytest.mark.parametrize("eos", [False, True], ids=["no_eos", "eos"])
def test_beam_search_matches_transformers(eos, pool):
    """Beam search (width 4, two returned) equals HF's generate(num_beams=4): the same hypotheses in the same order,
    also when beams are preempted and recomputed (forked beams share blocks copy-on-write)."""
    tm, spec, prompts, _, eos_id, _, data = text_setup(False)
    hf = hf_model()
    prompts = prompts[:6]
    W, NR = 4, 2
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, num_beams=W, num_return_sequences=NR, max_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=eos_id if eos else None, pad_token_id=0,
                          early_stopping=False, length_penalty=1.0)
    refs = []
    for row in out[:, ids.shape[1]:].tolist():
        refs.append(row[: row.index(eos_id) + 1] if eos and eos_id in row else row)
    cfg = ServeConfig(max_model_len=256, **(dict(block_size=4, num_blocks=256) if pool == "roomy" else
                                            dict(block_size=2, num_blocks=100, max_num_seqs=24)))
    engine = Engine(tm, spec, tm.cfg, cfg, eos_token_ids=[eos_id] if eos else [], data=data)
    outs = engine.generate(prompts, SamplingParams(use_beam_search=True, best_of=W, n=NR, max_tokens=MAX_NEW))
    got = [c.token_ids for o in outs for c in o.outputs]
    assert got == refs
    if pool == "preempting":
        assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["kv_blocks_used"] == 0
