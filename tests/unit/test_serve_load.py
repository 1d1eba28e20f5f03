"""Engine.from_pretrained reads a titan_mm run (its DCP checkpoint, [data] and tokenizer) and the HF folder exported
from it, and both serve the same greedy tokens; a draft model loads from serve.draft_model; chat messages render
through the family's template; a path that is neither is one ConfigError line."""

import pytest

from titan_mm.config import ConfigError
from titan_mm.export import export
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.launch.train import main

ONE_STEP = ["--training.steps", "1", "--checkpoint.interval", "1", "--checkpoint.async_mode", "disabled",
            "--metrics.enable_tensorboard", "False", "--training.global_batch_size", "0",
            "--lr_scheduler.warmup_steps", "0", "--data.micro_batch_size", "1", "--data.seq_len", "32",
            "--data.dataset", "synthetic", "--model.overrides", '{"num_hidden_layers": 1}']


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_load")
    assert main(["--config", "debug_qwen3", "--job.dump_folder", str(root), "--job.name", "r", *ONE_STEP]) == 0
    return root / "r", export(root / "r", root / "hf")


def test_a_run_and_its_hf_export_serve_the_same_tokens(run):
    ck, hf = run
    cfg = ServeConfig(num_blocks=64, max_model_len=512)
    a = Engine.from_pretrained(ck, cfg, device="cpu")
    b = Engine.from_pretrained(hf, ServeConfig(num_blocks=64, max_model_len=512, speculative_method="draft",
                                               draft_model=str(hf)), device="cpu")
    ids, images = a.chat_prompt([{"role": "user", "content": "Hello there"}])
    assert images == [] and a.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out_a = a.generate([ids], p)[0].outputs[0]
    out_b = b.generate([ids], p)[0].outputs[0]
    assert out_a.token_ids == out_b.token_ids and len(out_a.token_ids) == 8
    assert b.generate([ids], p)[0].metrics.spec_acceptance == 1.0  # the draft is the model itself
    assert a.eos == {a.tokenizer.eos_id, a.tokenizer.endoftext_id} and b.eos == a.eos  # generation_config.json


def test_a_path_that_is_no_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass an HF model folder"):
        Engine.from_pretrained(tmp_path / "nothing", ServeConfig(num_blocks=8), device="cpu")
