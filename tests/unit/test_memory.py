"""Memory estimator: parameter classification by plan, monotonic in the topology and AC, CLI table
(titan_mm.tools.memory), the family terms (titan_mm/models/*/memory.py) behind a generic estimator."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from titan_mm import registry
from titan_mm.parallel.memory import GiB, Topology, count_params, estimate, suggest
from titan_mm.registry import get_model_spec
from titan_mm.tools.memory import main


def _moe():
    spec = get_model_spec("qwen3_moe")
    cfg = spec.flavors["30B-A3B"]
    return spec, cfg, spec.plan(cfg)


def test_counts_match_the_model():
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"]
    c = count_params(cfg, spec.plan(cfg))
    with torch.device("meta"):
        n = sum(p.numel() for p in spec.build(cfg).parameters())
    assert c.total == n and c.experts == 0 and c.tp_sharded > 0


def test_monotonic_in_topology_and_ac():
    spec, cfg, plan = _moe()
    c = count_params(cfg, plan)
    assert 28e9 < c.experts < 30e9
    base = estimate(cfg, plan, Topology(dp_shard=8, ep=8), 4096, 1, counts=c)
    assert estimate(cfg, plan, Topology(dp_shard=4, tp=2, ep=4), 4096, 1, counts=c)["params"] > base["params"] / 2
    acts = [estimate(cfg, plan, Topology(dp_shard=8, ep=8, ac=a), 4096, 1, counts=c)["activations"]
            for a in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    assert estimate(cfg, plan, Topology(dp_shard=4, cp=2, ep=8), 4096, 1, counts=c)["activations"] < acts[0]


def test_suggest_fits():
    spec, cfg, plan = _moe()
    fits = suggest(cfg, plan, 8, 141, 4096, 1)
    assert fits and all(e["total"] <= 0.9 * 141 * GiB for _, e in fits)
    assert not suggest(cfg, plan, 1, 24, 4096, 1)


def test_cli_prints_table(capsys):
    main(["--config", "debug_qwen3.toml", "--gpus", "2", "--gpu-mem-gb", "24"])
    out = capsys.readouterr().out
    assert "activations" in out and "total" in out and "suggested for 2 GPUs" in out


def test_vl_tp_terms():
    """Qwen3-VL under tp: sequence parallel divides the residual stream and DeepStack additions, encoder_tp the ViT
    activations and parameters; the tied head (the token embedding) is vocab-sharded by loss parallel."""
    from titan_mm.parallel.memory import estimate_phases

    spec = get_model_spec("qwen3_vl")
    cfg = spec.flavor("2B")
    plan = spec.plan(cfg)
    assert plan.sequence_parallel and plan.loss_parallel == "language_model.tok_embeddings" and plan.encoder_tp
    c = count_params(cfg, plan)
    V, D = cfg.text.vocab_size, cfg.text.hidden_size
    assert c.tp_sharded >= V * D  # the tied embedding / head
    assert count_params(cfg, plan, encoder_tp=True).tp_sharded > c.tp_sharded

    def fwd(**topo):
        return estimate_phases(cfg, plan, Topology(tp=2, **topo), 8192, 1, counts=None, vision_patches=10240)["forward_end"]

    nosp, sp, enc = fwd(sp=False), fwd(sp=True), fwd(sp=True, encoder_tp=True)
    assert sp["activations"] < nosp["activations"]
    assert enc["activations"] < sp["activations"] and enc["params"] < sp["params"]


def test_ac_num_layers_interpolates():
    """activation_checkpoint.num_layers = N: N blocks hold the AC mode's bytes, the rest everything; N = 0 or
    N >= the block count is the mode on every block. Qwen3-VL counts its vision blocks first (module order)."""
    from titan_mm.models.qwen3.memory import decoder_block_bytes
    from titan_mm.parallel.memory import estimate_phases

    spec = get_model_spec("qwen3")
    cfg = spec.flavor("1.7B")
    plan = spec.plan(cfg)
    c = count_params(cfg, plan)
    L, tokens = cfg.num_hidden_layers, 4 * 4096
    fwd = {n: estimate_phases(cfg, plan, Topology(ac="selective", ac_layers=n), 4096, 4, counts=c,
                              kernels=True)["forward_end"]["activations"] for n in (0, 1, 2, L, L + 5)}
    none = estimate_phases(cfg, plan, Topology(), 4096, 4, counts=c, kernels=True)["forward_end"]["activations"]
    blk = decoder_block_bytes(cfg, Topology(ac="selective"), 2, kernels=True)
    step = (blk.full - blk.kept) * tokens
    assert abs((none - fwd[1]) - step) < 1 and abs((none - fwd[2]) - 2 * step) < 1
    assert fwd[0] == fwd[L] == fwd[L + 5] and abs((none - fwd[0]) - L * step) < 1e3

    vspec = get_model_spec("qwen3_vl")
    vcfg = vspec.flavor("2B")
    vplan = vspec.plan(vcfg)
    vc = count_params(vcfg, vplan)
    nvb = vc.vision_blocks

    def vis(n):
        return estimate_phases(vcfg, vplan, Topology(ac="full", ac_layers=n), 4096, 1, counts=vc, kernels=True,
                               vision_patches=1024)["forward_end"]["activations"]
    # the first nvb units are vision blocks: each N up to nvb takes one more ViT block under AC, each N past it
    # one more decoder block; N = 0 is every block
    assert vis(1) > vis(nvb) > vis(nvb + 1) > vis(nvb + 2) > vis(0)


def test_reshard_never_keeps_every_block_gathered():
    """parallel.fsdp_reshard_after_forward = never: at the end of the forward every block's gathered params are
    still there (bf16, or 1 byte for float8 linears), and in block j's backward the blocks 0..j are; the
    default (always) holds no block's params at the loss (only the root's). Qwen3-1.7B on one GPU: +2.44 GiB bf16 (measured +2.54 GiB on the
    H200, bench/results/mfu_reshard.json)."""
    from titan_mm.parallel.memory import GiB, estimate_phases

    spec = get_model_spec("qwen3")
    cfg = spec.flavor("1.7B")
    plan = spec.plan(cfg)
    c = count_params(cfg, plan)
    L = cfg.num_hidden_layers

    def phases(reshard, float8=False):
        return estimate_phases(cfg, plan, Topology(reshard=reshard), 4096, 4, counts=c, kernels=True, float8=float8)

    always, never = phases("always"), phases("never")
    assert never["forward_end"]["fsdp_buffers"] - always["forward_end"]["fsdp_buffers"] == 2 * c.block_dense * L
    f8 = phases("never", True)["forward_end"]["fsdp_buffers"] - phases("always", True)["forward_end"]["fsdp_buffers"]
    assert f8 == c.block_dense * L
    # block 0's backward: only block 0 is still gathered, as with always (which holds block 0, nothing prefetched)
    assert never["backward_block_0"]["fsdp_buffers"] == always["backward_block_0"]["fsdp_buffers"]
    extra = never["backward_block_27"]["total"] - always["backward_block_27"]["total"]
    assert 2.3 * GiB < extra < 2.6 * GiB
    # world 1 in fp32 has no FSDP: the policy changes nothing
    assert estimate_phases(cfg, plan, Topology(reshard="never"), 4096, 4, 4, counts=c, kernels=True)["forward_end"] \
        == estimate_phases(cfg, plan, Topology(), 4096, 4, 4, counts=c, kernels=True)["forward_end"]


def test_cli_passes_job_config_keys(capsys):
    """Flags the tool does not know are job-config overrides (titan_mm.config.load_config); a typo fails."""
    import pytest

    main(["--config", "debug_qwen3.toml", "--data.seq_len", "64", "--training.global_batch_size", "8"])
    assert "seq_len=64 micro_batch=2 grad_accum=4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--config", "debug_qwen3.toml", "--data.seq_lenn", "64"])
    assert "data.seq_len" in capsys.readouterr().err


def test_estimator_names_no_family():
    """The estimator asks the spec (dims, runtime, plan, build, memory_terms): no family names, no guessing
    at config fields."""
    src = (Path(__file__).resolve().parents[2] / "titan_mm" / "parallel" / "memory.py").read_text()
    assert not re.search(r"qwen|getattr\(|hasattr\(", src, re.IGNORECASE)


def test_vl_terms_extend_the_text_terms():
    from titan_mm.models.qwen3 import memory as text_memory
    from titan_mm.parallel.memory import memory_terms

    spec = get_model_spec("qwen3_vl")
    cfg = spec.flavor("2B")
    topo = Topology(tp=2, encoder_tp=True)
    vl = memory_terms(cfg, topo, 2, kernels=True)
    text = text_memory.memory_terms(cfg.text, topo, 2, kernels=True)
    assert vl.decoder == text.decoder and vl.head == text.head and vl.loss_chunk == cfg.text.loss_chunk_size
    assert vl.vision is not None and vl.vision.kept > 0 and vl.vision_stem > 0
    assert vl.vision_head == 2 * cfg.text.hidden_size * len(cfg.vision.deepstack_visual_indexes) / 2
    assert memory_terms(spec.flavor("debug"), Topology(), 2).vision_head > 0
    assert text.vision is None and text.vision_head == 0.0


def test_decoder_without_qk_norm_drops_its_terms():
    """Decoders built with qk_norm=False (Qwen2) keep no qk-norm inputs / rstd."""
    from titan_mm.models.qwen3.memory import decoder_block_bytes

    cfg = get_model_spec("qwen3").flavor("1.7B")
    H, G, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with_qk = decoder_block_bytes(cfg, Topology(tp=2), 2, kernels=True)
    without = decoder_block_bytes(cfg.replace(qk_norm=False), Topology(tp=2), 2, kernels=True)
    assert with_qk.full - without.full == (2 * (H + G) * K + 4 * (H + G)) / 2
    assert with_qk.bwd_tmp == without.bwd_tmp


def test_cli_without_the_hf_folder_uses_the_flavor(tmp_path, capsys):
    """A recipe whose model.hf_path is not there yet: one line says so and the flavor's estimate is printed, the
    same as without hf_path; CLI overrides (--model.flavor here) apply as in the trainer."""
    main(["--config", "qwen3_1.7b.toml", "--model.flavor", "0.6B"])
    want = capsys.readouterr().out
    main(["--config", "qwen3_1.7b.toml", "--model.hf_path", str(tmp_path / "Qwen3-0.6B"), "--model.flavor", "0.6B"])
    first, rest = capsys.readouterr().out.split("\n", 1)
    assert f"model.hf_path '{tmp_path / 'Qwen3-0.6B'}' is not a directory" in first
    assert first.endswith("estimating qwen3/0.6B (model.name / model.flavor) instead")
    assert rest == want


def test_cli_refuses_a_family_without_activation_terms(monkeypatch, capsys):
    """A family that declares no ModelSpec.memory_terms (memory_terms is optional; here Wan's taken away): one error
    line and exit 2, not a traceback."""
    spec = get_model_spec("wan")
    monkeypatch.setitem(registry._REGISTRY, "wan", dataclasses.replace(spec, memory_terms=None))
    with pytest.raises(SystemExit) as e:
        main(["--config", "debug_wan"])
    assert e.value.code == 2
    assert "family declares no activation terms (ModelSpec.memory_terms)" in capsys.readouterr().err.splitlines()[-1]


def test_cli_reads_config_json_alone(tmp_path, capsys):
    """An HF folder holding only config.json (no weights yet) is enough: the parameter count is its model's."""
    import json

    spec = get_model_spec("qwen3")
    cfg = spec.flavors["0.6B"].replace(num_hidden_layers=3)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    main(["--config", "qwen3_1.7b.toml", "--model.hf_path", str(tmp_path / "hf")])
    out = capsys.readouterr().out
    n = count_params(cfg, spec.plan(cfg)).total
    assert out.startswith(f"model {tmp_path / 'hf'}: {n / 1e9:.3f} B params")


def test_fsdp_prefetch_holds_more_gathered_blocks():
    """parallel.fsdp_prefetch = N: a block's backward holds the next N blocks' gathered params (FSDP2's own: one)."""
    from titan_mm.parallel.memory import Topology, estimate_phases
    from titan_mm.registry import get_model_spec

    spec = get_model_spec("qwen3")
    cfg = spec.flavor("debug")
    plan = spec.plan(cfg)
    one, three = (estimate_phases(cfg, plan, Topology(dp_shard=2, prefetch=n), 512, 1) for n in (0, 3))
    top = f"backward_block_{cfg.num_hidden_layers - 1}"
    with torch.device("meta"):
        n = sum(p.numel() for p in spec.build(cfg).layers["0"].parameters())  # one block's params, unsharded
    assert three[top]["fsdp_buffers"] - one[top]["fsdp_buffers"] == 2 * 2 * n  # 2 more gathered blocks, bf16
    assert three["backward_block_0"]["fsdp_buffers"] == one["backward_block_0"]["fsdp_buffers"]  # nothing below 0
