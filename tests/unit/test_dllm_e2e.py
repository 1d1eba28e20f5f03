"""End to end, train_configs/debug_dllm_qwen3.toml (a masked-diffusion Qwen3 on builtin:qa): a short run trains and
checkpoints, the export is a Qwen3 HF folder whose config.json notes the objective, titan_mm's HF path loads it back
unchanged (and transformers too), and the sampler eval runs on the checkpoint and on the export. The full run and
its accuracy over training are the slow test at the end (the figures are in docs/dllm.md)."""

import json
from pathlib import Path

import pytest
import torch

from titan_mm.observe.metrics import read_metrics

SHORT = ["--training.steps", "8", "--lr_scheduler.warmup_steps", "2", "--checkpoint.interval", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "False", "--data.seq_len", "128"]


@pytest.mark.slow  # train, export, sample: ~16 s on 2 cores
def test_debug_dllm_config_trains_exports_and_samples(tmp_path, capsys):
    from titan_mm.export import main as export_main
    from titan_mm.loader import load_model
    from titan_mm.nn.attention import build_attn_meta
    from titan_mm.registry import spec_for_hf_dir
    from titan_mm.tools.eval_dllm import main as eval_main
    from titan_mm.launch.train import main

    assert main(["--config", "debug_dllm_qwen3", "--job.dump_folder", str(tmp_path), *SHORT]) == 0
    run = tmp_path / "debug_dllm_qwen3"
    rows = read_metrics(run / "metrics.jsonl")
    assert sorted(rows) == list(range(1, 9))
    first, last = rows[1]["loss"], rows[8]["loss"]
    # from ~log(V) = 12 towards the digits' entropy; early diffusion losses are noisy (the 1/t weights)
    assert last < first - 3.0, [rows[s]["loss"] for s in rows]
    assert rows[1]["count/ce"] > 0 and rows[1]["mfu"] == 0.0  # CPU: no peak FLOP/s

    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == "qwen3" and conf["architectures"] == ["Qwen3ForCausalLM"]
    assert conf["titan_mm_objective"] == {"kind": "masked_diffusion", "mask_token_id": 151669, "eps": 0.001,
                                          "sft": True, "attention": "bidirectional"}
    ours = load_model(run).model
    spec = spec_for_hf_dir(str(out))
    back = spec.build(spec.config_from_hf(str(out)))
    back.init_weights()
    spec.load_hf(back, str(out))
    ids = torch.randint(0, 1000, (1, 16))
    ids[0, 8:] = 151669
    meta = build_attn_meta({"input_ids": ids}, "sdpa", "cpu", kind="bidirectional")
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attn=meta).logits, ours(ids, attn=meta).logits)
        import transformers

        hf = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()  # the HF model is causal: compare causally
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)

    capsys.readouterr()
    assert eval_main(["--checkpoint", str(run), "--all", "--limit", "8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["checkpoint"] for x in lines] == ["step-00000004", "step-00000008"]
    assert all(x["n"] == 8 and 0.0 <= x["accuracy"] <= 1.0 for x in lines)
    assert eval_main(["--hf", str(out), "--config", "debug_dllm_qwen3", "--limit", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["objective"] == "masked_diffusion"


@pytest.mark.slow
def test_debug_dllm_config_learns_the_qa(tmp_path, capsys, all_threads):
    """The full debug run (300 steps; docs/dllm.md records its time): held-out exact match rises over training."""
    from titan_mm.tools.eval_dllm import main as eval_main
    from titan_mm.launch.train import main

    assert main(["--config", "debug_dllm_qwen3", "--job.dump_folder", str(tmp_path),
                 "--metrics.enable_tensorboard", "False"]) == 0
    capsys.readouterr()
    assert eval_main(["--checkpoint", str(tmp_path / "debug_dllm_qwen3"), "--all"]) == 0
    acc = [json.loads(x)["accuracy"] for x in capsys.readouterr().out.strip().splitlines()]
    assert acc[-1] >= 0.8 and acc[-1] > acc[0] + 0.5, acc  # measured: 0.04, 0.58, 0.88, 0.94, 0.95, 0.97
    assert Path(tmp_path / "debug_dllm_qwen3" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_bench_dllm_measures_the_three_objectives_in_one_process(tmp_path):
    """bench/dllm.py's CPU smoke run (the H200 run is the lead's: docs/dllm.md)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "dllm.json"
    r = subprocess.run([sys.executable, str(root / "bench/dllm.py"), "--cpu", "--case", "debug", "--stack",
                        "titan_eager", "--warmup", "1", "--steps", "1", "--out", str(out)], capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["objective"], x["mask_kind"]) for x in rows] == [
        ("causal", "causal"), ("masked_diffusion", "bidirectional"), ("block_diffusion", "block_causal")]
    assert all(x["tokens_per_s"] > 0 and x["tflops"] > 0 for x in rows)
    assert rows[1]["tflops"] / rows[1]["tokens_per_s"] > rows[0]["tflops"] / rows[0]["tokens_per_s"]  # L^2 pairs
