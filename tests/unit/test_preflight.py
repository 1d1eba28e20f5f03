"""Every user mistake is one line before anything heavy (titan_mm/train/preflight.py): the trainer exits 2 with
``config error: ...`` naming what is wrong and what to do, and leaves no run folder; the data error-rate stop is a
DataError that main() prints as one line with the reason counts."""

import json
import shutil

import pytest
import torch

from titan_mm.config import ConfigError, load_config
from titan_mm.data.sources import DataError
from titan_mm.data.tokenizer import qwen3_tokenizer_dir, tokenizer_for
from titan_mm import registry
from titan_mm.registry import get_model_spec
from titan_mm.train.preflight import preflight
from titan_mm.launch.train import main

BUILTIN_IDS = 151669  # ids of the built-in Qwen3 tokenizer (max id 151668)


def _hf_dir(path, vocab_size: int, tokenizer: bool = False):
    """A tiny HF Qwen3 folder (config.json + model.safetensors), optionally with the Qwen3 tokenizer files."""
    spec = get_model_spec("qwen3")
    cfg = spec.flavors["debug"].replace(vocab_size=vocab_size, num_hidden_layers=1, hidden_size=16,
                                        intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=8)
    with torch.device("meta"):
        model = spec.build(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    spec.save_hf(model, cfg, str(path))
    if tokenizer:
        shutil.copy(f"{qwen3_tokenizer_dir()}/tokenizer.json", path / "tokenizer.json")
    return path


def _fails(tmp_path, capsys, *args) -> str:
    """main() on debug_qwen3 with ``args``: exit 2, one ``config error:`` line on stderr (besides ``[titan_mm]``
    notes), no run folder."""
    rc = main(["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path / "runs"), "--job.name", "r", *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[titan_mm] ")]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert not (tmp_path / "runs").exists()
    return lines[0]


def test_data_glob_matching_nothing(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("{}")
    line = _fails(tmp_path, capsys, "--data.dataset", f"{tmp_path}/d/*.jsonl")
    assert f"'{tmp_path}/d/*.jsonl' matched no files" in line
    assert f"{tmp_path}/d holds a.txt" in line and ".jsonl .json .parquet .tar" in line


def test_unknown_builtin_dataset(tmp_path, capsys):
    line = _fails(tmp_path, capsys, "--data.dataset", "builtin:textt")
    assert "unknown built-in dataset 'textt'" in line
    assert all(n in line for n in ("'text'", "'digits'", "'digits_test'", "'photos'"))
    assert "did you mean builtin:text?" in _fails(tmp_path, capsys, "--data.dataset", "textt")


def test_bad_tokenizer_folder(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("a\n")
    line = _fails(tmp_path, capsys, "--data.tokenizer_path", str(tmp_path / "tok"))
    assert f"tokenizer folder '{tmp_path}/tok' has no tokenizer.json (it holds: vocab.txt)" in line
    assert "data.tokenizer_path must be a folder with tokenizer.json" in line
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    line = _fails(tmp_path, capsys, "--data.tokenizer_path", str(tmp_path / "tok"))
    assert "tokenizer.json is not a tokenizer.json the tokenizers library can read" in line


def test_hf_config_without_model_type(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf", BUILTIN_IDS)
    d = json.loads((hf / "config.json").read_text())
    del d["model_type"]
    (hf / "config.json").write_text(json.dumps(d))
    line = _fails(tmp_path, capsys, "--model.hf_path", str(hf))
    assert f"{hf}/config.json has no model_type" in line
    assert ", ".join(registry.hf_model_types()) in line


def test_hf_folder_without_weights(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf", BUILTIN_IDS)
    (hf / "model.safetensors").unlink()
    line = _fails(tmp_path, capsys, "--model.hf_path", str(hf))
    assert f"no *.safetensors in {hf}" in line and "--model.init_from_hf False" in line
    preflight(load_config(["--config", "debug_qwen3", "--model.hf_path", str(hf), "--model.init_from_hf", "False"]))


def test_tokenizer_ids_beyond_the_model_vocab(tmp_path, capsys):
    """A tiny HF model (vocab 300) trained with the built-in Qwen3 tokenizer: an error naming both sizes before
    the first step (it was an IndexError inside the embedding)."""
    hf = _hf_dir(tmp_path / "hf", 300)
    line = _fails(tmp_path, capsys, "--model.hf_path", str(hf))
    assert "emits ids up to 151668 (151669 tokens), but the model's vocab_size is 300" in line
    assert "vocab_size is at least 151669" in line
    line = _fails(tmp_path, capsys, "--model.overrides", '{"vocab_size": 1000}')
    assert "model's vocab_size is 1000" in line


def test_parallel_and_batch_mistakes(tmp_path, capsys):
    assert "[parallel]" in _fails(tmp_path, capsys, "--parallel.tp", "2")
    assert "training.global_batch_size=3 is not a multiple" in _fails(tmp_path, capsys,
                                                                       "--training.global_batch_size", "3")


def test_tokenizer_fallback_is_logged(tmp_path, capsys):
    """model.hf_path without tokenizer files and no data.tokenizer_path: one line names the tokenizer used."""
    hf = _hf_dir(tmp_path / "hf", 151936)
    preflight(load_config(["--config", "debug_qwen3", "--model.hf_path", str(hf)]))
    err = capsys.readouterr().err
    assert f"model.hf_path {hf} has no tokenizer.json" in err and "built-in Qwen3 tokenizer" in err
    assert f"{qwen3_tokenizer_dir()}/tokenizer.json" in err
    assert tokenizer_for(None, str(hf)) is None
    with_tok = _hf_dir(tmp_path / "hf_tok", 151936, tokenizer=True)
    preflight(load_config(["--config", "debug_qwen3", "--model.hf_path", str(with_tok)]))
    assert "has no tokenizer.json" not in capsys.readouterr().err
    assert tokenizer_for(None, str(with_tok)) == str(with_tok)
    assert tokenizer_for("/x/tok", str(with_tok)) == "/x/tok"  # data.tokenizer_path wins


def test_synthetic_data_skips_the_data_checks():
    preflight(load_config(["--config", "debug_qwen3", "--data.dataset", "synthetic", "--data.tokenizer_path",
                           "/no/such/tokenizer", "--model.overrides", '{"vocab_size": 256}']))


def test_preflight_raises_config_error():
    with pytest.raises(ConfigError, match="did you mean 'debug'"):
        preflight(load_config(["--config", "debug_qwen3", "--model.flavor", "debgu"]))


@pytest.mark.parametrize("workers", [0, 1])
def test_data_error_rate_stop_is_one_line(tmp_path, capsys, workers):
    """Past data.max_error_rate the loader raises DataError (in a worker too); main() prints its reason with the
    counts by reason on one line and exits 1."""
    lines = ["{bad"] * 40 + [json.dumps({"text": "fine"})] * 40
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    rc = main(["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path), "--job.name", "e",
               "--data.dataset", f"{tmp_path}/d.jsonl", "--data.error_min_samples", "20",
               "--data.max_error_rate", "0.1", "--data.num_workers", str(workers), "--data.shuffle_buffer", "0",
               "--model.overrides", '{"num_hidden_layers": 1}', "--training.steps", "1",
               "--checkpoint.enable", "False", "--metrics.enable_tensorboard", "False"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("data error: ")]
    assert "samples were skipped" in line and "by reason: {'malformed_json': " in line
    assert "data.max_error_rate = 10.0%" in line


def test_data_error_reason_from_a_worker_traceback():
    """torch re-raises a worker's exception as type(e)(traceback text): reason is the original message."""
    msg = ("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
           '  File "x.py", line 1, in f\n    raise DataError(...)\n'
           "titan_mm.data.sources.DataError: data: 30 of 40 samples were skipped; by reason: {'malformed_json': 30}\n")
    assert DataError(msg).reason == "data: 30 of 40 samples were skipped; by reason: {'malformed_json': 30}"
    assert DataError("data: 1 of 2\nsecond line").reason == "data: 1 of 2 second line"
