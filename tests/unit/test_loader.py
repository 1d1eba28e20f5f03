"""One model loader (titan_mm/loader.py) and one greedy decoder (the serving engine): a run folder, its step folder
and its HF export load the same model; the trainer's HF path fills its built model through the same reader; the
digits tool decodes through the engine, whose answers equal a greedy re-run of the training forward; train/ imports
eval/ only where its entry points compose the two."""


import pytest
import torch

from tests.unit._greedy_forward import forward_greedy
from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError, load_config
from titan_mm.data.processors import Processor, ProcessorConfig
from titan_mm.eval.evaluator import engine_texts, eval_engine
from titan_mm.eval.tasks import load_task
from titan_mm.export import export
from titan_mm.launch.train import main as train_main
from titan_mm.loader import load_model, load_weights, resolve_source
from titan_mm.tools.eval_digits import main as digits_main
from titan_mm.train.setup import setup

ONE_STEP = ["--training.steps", "1", "--checkpoint.interval", "1", "--checkpoint.async_mode", "disabled",
            "--metrics.enable_tensorboard", "False", "--eval.interval", "0", "--data.micro_batch_size", "1",
            "--training.global_batch_size", "0", "--lr_scheduler.warmup_steps", "0"]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(run folder, its HF export) of one step of debug_qwen3_vl."""
    root = tmp_path_factory.mktemp("loader")
    assert train_main(["--config", "debug_qwen3_vl", "--job.dump_folder", str(root), "--job.name", "r",
                       *ONE_STEP]) == 0
    return root / "r", export(root / "r", root / "hf")


def _same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k  # fp32 in, fp32 out: the export rounds nothing


def test_a_run_its_step_folder_and_its_export_load_the_same_model(vl):
    run, hf = vl
    a, b, c = load_model(run), load_model(run / "checkpoints" / "step-00000001"), load_model(hf)
    assert a.path == b.path == run / "checkpoints" / "step-00000001" and c.path == hf
    assert a.spec.name == c.spec.name and a.job is not None and c.job is None
    _same_weights(a.model, b.model)
    _same_weights(a.model, c.model)
    tok = a.tokenizer
    assert a.eos_ids is None and c.eos_ids == [tok.eos_id, tok.endoftext_id]  # a run stops on its tokenizer's
    assert c.tokenizer.encode("the digit 7") == tok.encode("the digit 7")
    assert a.data == a.job.data
    assert (c.data.image_min_pixels, c.data.image_max_pixels) == (a.data.image_min_pixels, a.data.image_max_pixels)


def test_the_trainer_and_offline_eval_fill_their_built_model_through_the_loader(vl):
    run, hf = vl
    want = load_model(hf).model
    cfg = load_config(["--config", "debug_qwen3_vl", "--model.hf_path", str(hf), "--model.init_from_hf", "True"])
    _same_weights(setup(cfg).model, want)  # the trainer's HF path: build_model -> load_weights
    got = setup(load_config(["--config", "debug_qwen3_vl"]))
    assert load_weights(got.model, got.spec, resolve_source(run)) == 1  # python -m titan_mm.eval: the step
    _same_weights(got.model, want)


def test_paths_that_are_no_model_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass an HF model folder"):
        load_model(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        load_model(tmp_path)


def test_eval_digits_answers_are_the_training_forwards_greedy_answers(vl, capsys):
    """The engine (KV cache, paged) and a greedy re-run of the whole sequence through the training forward give the
    same text for each prompt: fp32 on the CPU, the same weights, so the argmax of every step agrees."""
    run, hf = vl
    got = load_model(run)
    items = load_task("digits", limit=6).items
    engine = eval_engine(got.model, got.spec, got.model_cfg, got.tokenizer, torch.device("cpu"), got.data)
    proc = Processor(got.tokenizer, ProcessorConfig(got.data, got.spec.data_needs(got.model_cfg)))
    ref = forward_greedy(got.model, got.spec, got.model_cfg, proc, [it["messages"] for it in items], 3)
    assert engine_texts(engine, items, 3) == ref

    capsys.readouterr()
    assert digits_main(["--checkpoint", str(run), "--limit", "6"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("digits held-out accuracy: ") and "/6)" in line
    n_right = sum(t.strip() == it["reference"] for t, it in zip(ref, items))
    assert f"({n_right}/6)" in line
    assert digits_main(["--hf", str(hf), "--config", "debug_qwen3_vl", "--limit", "6"]) == 0
    assert f"({n_right}/6)" in capsys.readouterr().out
    assert digits_main(["--checkpoint", str(run.parent / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
