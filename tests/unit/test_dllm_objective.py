"""Diffusion objectives (titan_mm/objectives/diffusion.py): the masked-diffusion loss equals LLaDA's formula on a fixed
batch, SFT masking leaves the prompt clean, the shifted variant's labels, seeded noise, packed == unpacked for the
three objectives (corruption and loss, sdpa and flex), the weighted cross-entropy, the mask token's resolution and
its errors, FLOPs, and a one-step MoE run and a bitwise resume through the trainer."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_mm.config import ConfigError, load_config
from titan_mm.data.packing import Doc, collate_rows
from titan_mm.data.processors import shift_labels
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.loss import chunked_cross_entropy
from titan_mm.registry import resolve_model
from titan_mm.objectives import DiffusionLM, attention_pairs, build_objective
from titan_mm.objectives.diffusion import resolve_mask_id

V, MASK = 64, 63
KINDS = {"masked_diffusion": None, "shifted_diffusion": None, "block_diffusion": 3}


def tiny_model(seed=0):
    spec, cfg = resolve_model("qwen3", "debug", overrides={"vocab_size": V, "num_hidden_layers": 2})
    torch.manual_seed(seed)
    model = spec.build(cfg)
    model.init_weights()
    return spec, cfg, model.eval()


def objective(kind, sft=False, eps=1e-3):
    return DiffusionLM(kind=kind, mask_id=MASK, eps=eps, block_size=KINDS[kind], sft=sft, seed=7)


def doc(ids, prompt=0):
    """A Doc as the processors make it: labels shifted inside the doc, targets after the first ``prompt`` tokens."""
    ids = np.asarray(ids, dtype=np.int64)
    target = np.arange(len(ids)) >= prompt
    return Doc(ids, shift_labels(ids, target))


def rand_docs(lens, seed=0, prompt=0):
    g = np.random.default_rng(seed)
    return [doc(g.integers(1, MASK, n), prompt) for n in lens]


def forward_loss(model, batch, obj, backend="sdpa"):
    meta = build_attn_meta(batch, backend, "cpu", kind=obj.mask_kind, block_size=obj.block_size)
    with torch.no_grad():
        return model(batch["input_ids"], position_ids=batch["position_ids"], attn=meta,
                     loss=obj.bind(batch)).terms["ce"]


def test_weighted_chunked_cross_entropy_is_the_weighted_sum():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 20, (11,), generator=g)
    labels[::3] = -100
    wt = 1.0 / (0.05 + torch.rand(11, generator=g, dtype=torch.float64))
    got = chunked_cross_entropy(h, w, labels, chunk_size=4, weights_N=wt)
    keep = labels != -100
    ref = (F.cross_entropy(h @ w.t(), labels.clamp(min=0), reduction="none") * wt)[keep].sum()
    torch.testing.assert_close(got, ref)
    gh, gw = torch.autograd.grad(got, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)
    with pytest.raises(ValueError, match="one weight per label"):
        chunked_cross_entropy(h, w, labels, weights_N=wt[:5])


def test_masked_diffusion_loss_is_llada_formula_on_a_fixed_batch():
    """LLaDA (GUIDELINES.md): p = (1 - eps) t + eps per sample, masked iff u < p, loss = sum over masked tokens of
    CE / p divided by batch x length; here through the train step with two micro-batches (slots 0 and 1)."""
    from titan_mm.train.state import TrainState
    from titan_mm.train.step import StepContext, train_step

    _, _, model = tiny_model()
    B, L, eps = 2, 12, 0.05
    obj = objective("masked_diffusion", eps=eps)
    mbs = [collate_rows([[d] for d in rand_docs([L] * B, seed=s)], L, pad_id=0, position_axes=1, multiple=1)
           for s in (1, 2)]
    ref_sum = 0.0
    for slot, mb in enumerate(mbs):
        u_t, u_m = obj.noise((B, L), 3, slot)
        p = (1 - eps) * u_t[:, :1] + eps  # one t per sample (the row is one document)
        masked = u_m < p
        noisy = torch.where(masked, MASK, mb["input_ids"])
        meta = build_attn_meta({"input_ids": noisy}, "sdpa", "cpu", kind="bidirectional")
        with torch.no_grad():
            logits = model(noisy, attn=meta).logits.float()
        ce = F.cross_entropy(logits[masked], mb["input_ids"][masked], reduction="none")
        ref_sum += float((ce / p.expand(B, L)[masked]).sum())
        assert masked.any()
    ref = ref_sum / (2 * B * L)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    state = TrainState(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       step=3)
    ctx = StepContext(device=torch.device("cpu"), objective=obj)
    res = train_step(state, mbs, ctx)
    assert res.counts == {"ce": 2 * B * L}  # the normalizer: every token of the global batch
    assert math.isclose(res.loss, ref, rel_tol=1e-5), (res.loss, ref)


def test_sft_masks_only_the_response_and_leaves_the_prompt_clean():
    from titan_mm.data.builtin import builtin_records
    from titan_mm.data.processors import Processor, ProcessorConfig
    from titan_mm.data.schema import parse_record
    from titan_mm.data.tokenizer import load_tokenizer

    cfg = load_config(["--config", "debug_dllm_qwen3"])
    proc = Processor(load_tokenizer(), ProcessorConfig(cfg.data))
    docs = [proc(parse_record(r)) for r in builtin_records("qa")[:3]]
    batch = collate_rows([docs], 96, pad_id=0, position_axes=1)
    obj = DiffusionLM(kind="masked_diffusion", mask_id=151669, sft=True)
    ids = batch["input_ids"]
    u_t, _ = obj.noise(tuple(ids.shape), 0, 0)
    out = obj.corrupt(batch, u_t, torch.zeros_like(u_t))  # u = 0 < t: every maskable token is masked
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 1:] = batch["labels"][:, :-1] != -100  # the data's targets (labels are shifted)
    assert int(target.sum()) == 3 * 4  # three digits and <|im_end|> per chat
    assert torch.equal(out["input_ids"][~target], ids[~target])  # prompts, templates and padding stay clean
    assert bool((out["input_ids"][target] == 151669).all())
    assert torch.equal(out["labels"][target], ids[target]) and bool((out["labels"][~target] == -100).all())
    assert int(out["num_label_tokens"]) == 12 == int(batch["num_label_tokens"])


def test_shifted_labels_predict_the_next_token_and_skip_each_documents_first_token():
    docs = rand_docs([5, 7])
    batch = collate_rows([docs], 16, pad_id=0, position_axes=1, multiple=1)
    obj = objective("shifted_diffusion")
    ids = batch["input_ids"]
    out = obj.corrupt(batch, torch.full((1, 16), 0.999), torch.zeros(1, 16))  # t ~ 1: every maskable token masked
    first = torch.tensor([[True] + [False] * 4 + [True] + [False] * 6 + [False] * 4])
    pad = batch["doc_ids"] < 0
    masked = out["input_ids"] == MASK
    assert torch.equal(masked, ~first & ~pad)  # a document's first token never is
    lab, w = out["labels"][0], out["loss_weights"][0]
    for t in range(15):  # hidden state t predicts token t + 1
        if masked[0, t + 1]:
            assert lab[t] == ids[0, t + 1] and w[t] > 1.0
        else:
            assert lab[t] == -100 and w[t] == 0
    assert lab[15] == -100
    assert int(out["num_label_tokens"]) == 10


def test_noise_is_seeded_by_step_and_global_slot():
    obj = objective("masked_diffusion")
    a, b = obj.noise((2, 8), 5, 1), obj.noise((2, 8), 5, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[1], obj.noise((2, 8), 6, 1)[1]) and not torch.equal(a[1], obj.noise((2, 8), 5, 2)[1])
    mbs = [collate_rows([rand_docs([6, 4], seed=s)], 12, pad_id=0, position_axes=1, multiple=1) for s in range(4)]
    one_rank = obj.prepare(mbs, 5, dp_rank=0)  # 4 micro-batches on 1 rank == rank 1 of 2 reading slots 2, 3
    other = obj.prepare(mbs[2:], 5, dp_rank=1)
    for x, y in zip(one_rank[2:], other):
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "loss_weights"))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_equals_unpacked(kind, backend):
    """A packed row of documents gives the corruption and the loss of each document alone (t restarts per
    document or block; attention never crosses documents)."""
    _, _, model = tiny_model()
    obj = objective(kind)
    rows = [[5, 7, 4], [9, 6]]
    docs = [rand_docs(r, seed=i) for i, r in enumerate(rows)]
    S = 20
    packed = collate_rows(docs, S, pad_id=0, position_axes=1, multiple=1)
    u_t, u_m = obj.noise((2, S), 0, 0)
    u_t, u_m = u_t * 0.6, u_m * 0.6  # t and masks spread over both outcomes
    out = obj.corrupt(packed, u_t, u_m)
    total = 0.0
    for b, lens in enumerate(rows):
        o = 0
        for d, n in zip(docs[b], lens):
            alone = collate_rows([[d]], n, pad_id=0, position_axes=1, multiple=1)
            one = obj.corrupt(alone, u_t[b:b + 1, o:o + n], u_m[b:b + 1, o:o + n])
            for k in ("input_ids", "labels", "loss_weights"):
                assert torch.equal(one[k][0], out[k][b, o:o + n]), (k, b, o)
            total += float(forward_loss(model, one, obj, backend))
            o += n
    assert (out["input_ids"] == MASK).any() and (out["labels"] != -100).any()
    got = float(forward_loss(model, out, obj, backend))
    assert math.isclose(got, total, rel_tol=1e-5), (got, total)


def test_mask_token_resolution(tmp_path):
    from tokenizers import Tokenizer as HFTok
    from tokenizers.models import WordLevel

    from titan_mm.data.tokenizer import Tokenizer, load_tokenizer

    qwen = load_tokenizer()
    assert resolve_mask_id("auto", qwen, 151936) == 151669 == qwen.max_id + 1  # the first row no token uses
    assert resolve_mask_id("151700", qwen, 151936) == 151700
    assert resolve_mask_id("auto", None, 256) == 255  # synthetic data: the last row
    with pytest.raises(ConfigError, match="has no mask token.*add '<\\|mask\\|>' to the tokenizer"):
        resolve_mask_id("auto", qwen, 151669)
    with pytest.raises(ConfigError, match="'<\\|nope\\|>' is not a token of"):
        resolve_mask_id("<|nope|>", qwen, 151936)
    with pytest.raises(ConfigError, match="a token the chat template writes"):
        resolve_mask_id("151645", qwen, 151936)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        resolve_mask_id("999999", qwen, 151936)
    t = HFTok(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    own = Tokenizer(str(tmp_path))
    assert resolve_mask_id("auto", own, 64) == own.token_to_id("<|mask|>") == 6


def test_config_mistakes_fail_before_the_model_is_built(tmp_path, capsys):
    from titan_mm.train.setup import model_from_config
    from titan_mm.launch.train import main

    cfg = load_config(["--config", "debug_dllm_qwen3", "--model.attn_backend", "varlen",
                       "--objective.kind", "block_diffusion", "--training.param_dtype", "bfloat16"])
    spec, mc = model_from_config(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="objective.kind='block_diffusion'.*cannot do kind 'block_causal'"):
        build_objective(cfg, spec, mc)
    assert main(["--config", "debug_dllm_qwen3", "--objective.mask_token", "<|nope|>", "--job.dump_folder",
                 str(tmp_path)]) == 2
    assert not (tmp_path / "debug_dllm_qwen3").exists()  # refused before the run folder is written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "objective.mask_token '<|nope|>' is not a token of" in err[0], err
    with pytest.raises(ConfigError, match="attn_backend='varlen' runs flash kernels"):
        load_config(["--config", "debug_dllm_qwen3", "--model.attn_backend", "varlen"])
    with pytest.raises(ConfigError, match="objective.eps must be in \\(0, 1\\)"):
        load_config(["--config", "debug_dllm_qwen3", "--objective.eps", "0"])


def test_attention_pairs_and_flops():
    for L in (1, 5, 12):
        for kind, bs in (("causal", None), ("bidirectional", None), ("block_causal", 1), ("block_causal", 4),
                         ("block_causal", 20)):
            m = build_attn_meta({"input_ids": torch.zeros(1, L, dtype=torch.long),
                                 "doc_ids": torch.zeros(1, L, dtype=torch.int32)}, "sdpa", "cpu", kind=kind,
                                block_size=bs, dense_mask=True)
            dense = m.sdpa_mask if m.sdpa_mask is not None else torch.ones(L, L).tril().bool()
            assert attention_pairs(L, kind, bs) == int(dense.sum()), (L, kind, bs)
    spec, cfg, _ = tiny_model()
    d = spec.dims(cfg)
    for kind in KINDS:
        obj = objective(kind)
        extra = sum(attention_pairs(L, obj.mask_kind, obj.block_size) - L * (L + 1) // 2 for L in (7, 9))
        per_pair = 12 * d.num_heads * d.head_dim * d.num_layers
        assert obj.flops(spec, cfg, [7, 9]) == spec.flops(cfg, [7, 9]) + per_pair * extra


TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False",
        "--training.deterministic", "True", "--lr_scheduler.warmup_steps", "1"]


def test_moe_backbone_trains_one_step_as_a_block_diffusion_lm(tmp_path):
    from titan_mm.observe.metrics import read_metrics
    from titan_mm.launch.train import main

    assert main(["--model.name", "qwen3_moe", "--model.flavor", "debug_moe", *TINY, "--job.dump_folder", str(tmp_path),
                 "--job.name", "moe", "--objective.kind", "block_diffusion", "--objective.block_size", "4",
                 "--training.steps", "1", "--checkpoint.enable", "False"]) == 0
    row = read_metrics(tmp_path / "moe" / "metrics.jsonl")[1]
    assert math.isfinite(row["loss"]) and row["loss"] > 0 and row["aux_loss"] > 0


def test_resume_is_bitwise_with_the_diffusion_noise(tmp_path):
    from titan_mm.observe.metrics import read_metrics
    from titan_mm.launch.train import main

    common = [*TINY, "--job.dump_folder", str(tmp_path), "--objective.kind", "masked_diffusion",
              "--checkpoint.interval", "2", "--checkpoint.async_mode", "disabled",
              "--lr_scheduler.name", "constant"]  # a schedule that does not depend on training.steps
    assert main([*common, "--job.name", "straight", "--training.steps", "4"]) == 0
    assert main([*common, "--job.name", "cut", "--training.steps", "2"]) == 0
    assert main([*common, "--job.name", "cut", "--training.steps", "4"]) == 0  # resumes from step 2
    a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [a[s]["loss"] for s in (3, 4)] == [b[s]["loss"] for s in (3, 4)]  # bitwise
    assert a[4]["count/ce"] == b[4]["count/ce"] and a[4]["loss/ce"] == a[4]["loss"]


def test_dllm_recipe_resolves():
    """dllm_qwen3_1.7b.toml: the config, the objective on the CUDA defaults (flex) and its FLOPs (the run is the
    H200's: bench/dllm.py)."""
    from titan_mm.train.setup import model_from_config

    cfg = load_config(["--config", "dllm_qwen3_1.7b"])
    spec, mc = model_from_config(cfg, torch.device("cuda"))  # no CUDA needed: only picks cuda defaults
    obj = build_objective(cfg, spec, mc)
    assert mc.attn_backend == "flex" and obj.mask_kind == "bidirectional" and obj.mask_id == 151669
    d = spec.dims(mc)
    extra = 12 * d.num_heads * d.head_dim * d.num_layers * 4 * (4096 * 4096 - 4096 * 4097 // 2)
    assert obj.flops(spec, mc, [4096] * 4) == spec.flops(mc, [4096] * 4) + extra
    block = build_objective(load_config(["--config", "dllm_qwen3_1.7b", "--objective.kind", "block_diffusion"]),
                            spec, mc)
    assert block.mask_kind == "block_causal" and block.block_size == 32
