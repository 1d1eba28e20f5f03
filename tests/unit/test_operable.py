"""Operable under mistakes (issue 45, items 4 and 6): every mistake is one line, with NPROC > 1 too (a worker's
error ends in its own lines, not torchrun's traceback); the console shows every eval; a malformed JSONL line is
named by one line number; an export's files share one mode; an empty completions prompt is called empty."""

import functools
import io
import json
import logging
import os
import re
import subprocess
import typing
from pathlib import Path

import pytest

from tests.data_needs import QWEN3_VL_NEEDS
from titan_mm.config import ConfigError, Data, JobConfig, _leaf_type, all_keys, load_config
from titan_mm.data.loader import build_dataloader
from titan_mm.export import main as export_main
from titan_mm.observe.metrics import ConsoleSink
from titan_mm.serve.entrypoints.openai_protocol import CompletionRequest, RequestError, parse_body
from titan_mm.launch import torchrun
from titan_mm.launch.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
        "--data.seq_len", "32", "--data.micro_batch_size", "2", "--metrics.enable_tensorboard", "False"]


def run_sh(args, cwd=ROOT, **env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def _bad_word(tp) -> str | None:
    """A word the command line cannot turn into ``tp`` (None: every word is a value of it)."""
    if typing.get_origin(tp) is list:
        return _bad_word(typing.get_args(tp)[0])
    if tp is bool:
        return "maybe"
    if tp in (int, float):
        return "abc"
    if typing.get_origin(tp) in (typing.Literal, dict):
        return "{nope"
    return None


def _good_words(value) -> list[str]:
    """A field's default as command-line words (a mixture: one source, as an empty one is refused)."""
    if isinstance(value, dict):
        return ['{"builtin:text": 1.0}']
    if isinstance(value, list):
        return [str(v) for v in value]
    return ["x" if value is None else str(value)]


def test_every_bad_value_is_a_one_line_config_error():
    """Each field's unparsable word, a missing value and a stray word are ConfigErrors naming the flag (tyro would
    print a box), and each field's own default, written as words, still parses (nothing tyro takes is refused)."""
    for key in all_keys():
        tp = _leaf_type(key)
        bad = _bad_word(tp)
        if bad is not None:
            _one_line_error([f"--{key}", bad], rf"^--{key} .*got '{re.escape(bad)}'")
        if typing.get_origin(tp) is not list:
            _one_line_error([f"--{key}"], rf"^--{key} needs a value")
    # every default as words in one command line (the mixtures in a second: a mixture replaces the dataset)
    for keys in ([k for k in all_keys() if not k.endswith(".mixture")], ["data.mixture", "eval.mixture"]):
        load_config([w for k in keys for w in (f"--{k}", *_good_words(functools.reduce(getattr, k.split("."),
                                                                                        JobConfig())))])
    _one_line_error(["--training.steps", "1", "2"], r"^--training.steps takes one value \(int\), got 2: 1 2$")
    _one_line_error(["debug_qwen3.toml"], r"pass the config file as --config debug_qwen3.toml$")


def _one_line_error(argv: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(argv)
    assert "\n" not in str(e.value), str(e.value)


def test_run_train_sh_mistakes_exit_2_with_one_line(tmp_path):
    """A bare ./run_train.sh prints usage (no run); an NPROC that is not a number and a bad value are one line; with
    NPROC=3 the launcher finds the global batch that does not divide before any worker starts: one line. Exit 2."""
    r = run_sh([], cwd=tmp_path)  # a default run would write tmp_path/outputs/run
    assert r.returncode == 2 and r.stderr.startswith("usage: ./run_train.sh --config NAME_OR_PATH"), r.stderr
    assert "debug_qwen3.toml" in r.stderr and not any(tmp_path.iterdir())
    r = run_sh(["--config", "debug_qwen3.toml"], NPROC="two")
    assert (r.returncode, r.stderr) == (2, "run_train.sh: NPROC must be a positive number of processes, got 'two'\n")
    r = run_sh(["--config", "debug_qwen3.toml", "--training.steps", "abc"])
    assert (r.returncode, r.stderr) == (2, "config error: --training.steps expects int, got 'abc'\n")
    r = run_sh(["--config", "debug_qwen3.toml", "--job.dump_folder", str(tmp_path)], NPROC="3")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("config error: training.global_batch_size=4 ") and "(3)" in lines[0], lines
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.slow
def test_a_worker_error_with_nproc_2_ends_in_its_own_lines(tmp_path):
    """Found by the workers (every JSONL line malformed): their ``data error:`` lines and their exit code, not
    torchrun's ChildFailedError traceback (exit 1 either way: a data error is not a config error)."""
    (tmp_path / "bad.jsonl").write_text("{bad\n" * 300)
    r = run_sh(["--config", "debug_qwen3.toml", "--data.dataset", str(tmp_path / "bad.jsonl"), "--job.dump_folder",
                str(tmp_path), "--training.steps", "2"], NPROC="2")
    assert r.returncode == 1, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("data error: ")], r.stderr
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 1-step run folder (in-process trainer)."""
    folder = tmp_path_factory.mktemp("runs")
    args = [*TINY, "--job.dump_folder", str(folder), "--job.name", "done", "--training.steps", "1"]
    assert train_main(args) == 0
    return folder / "done", args


def test_launcher_refuses_a_finished_run_and_a_bad_eval_task_once(finished_run, tmp_path, capsys):
    """torchrun for 2 processes on a run folder already at training.steps, or with an eval task that does not
    exist: the launcher's one line, exit 2, no worker started."""
    run, args = finished_run
    argv = ["--standalone", "--nproc_per_node", "2", "-m", "titan_mm.launch.train", *args]
    assert torchrun.main(argv) == 2
    assert capsys.readouterr().err == (f"config error: run folder {run} is already at step 1 >= training.steps 1; "
                                       "raise --training.steps or use a new --job.name\n")
    task = tmp_path / "nope.jsonl"
    assert torchrun.main([*argv, "--job.name", "new", "--eval.interval", "1", "--eval.tasks", str(task)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: eval.tasks '{task}' is not a built-in task"), err


def test_export_files_share_one_mode(finished_run, tmp_path):
    """safetensors writes its files 0600; the export gives them the mode of the folder's other files."""
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(finished_run[0]), "--out", str(out)]) == 0
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert "model.safetensors" in modes and len(set(modes.values())) == 1, modes
    assert modes["config.json"] == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_console_shows_every_eval_step():
    """log_freq 5: step 3 carries eval results, so it gets its line; step 4 does not; step 5 does."""
    out = io.StringIO()
    sink = ConsoleSink(out, total_steps=10, log_freq=5)
    base = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1}
    sink.write(3, {**base, "eval/time_s": 0.5, "eval/loss": 2.0, "eval/digits/accuracy": 0.25})
    sink.write(4, base)
    sink.write(5, base)
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step  3/10 ( 30%)", "step  5/10 ( 50%)"]
    assert "eval digits/accuracy 0.25 (0.5s)" in lines[0]


def test_malformed_jsonl_line_has_one_line_number(tmp_path, caplog):
    """Line 58 of bad.jsonl is malformed: the id and the message both say 58 and name the file; a good record's
    id is its line number too."""
    lines = [json.dumps({"text": f"document {i}"}) for i in range(100)]
    lines[57] = "{not json"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    data = Data(dataset=str(tmp_path / "bad.jsonl"), seq_len=64, micro_batch_size=1, error_min_samples=1000)
    dl = build_dataloader(data, needs=QWEN3_VL_NEEDS, epochs=1, return_sample_ids=True)
    ids = []
    with caplog.at_level(logging.WARNING, logger="titan_mm.data"):
        for _ in dl:
            ids += dl.last_sample_ids
    warning = next(r.getMessage() for r in caplog.records if "malformed_json" in r.getMessage())
    assert "bad.jsonl:58 (malformed_json): " in warning and f"{tmp_path / 'bad.jsonl'} line 58: " in warning
    assert sorted(int(i.rsplit(":", 1)[1].split("@")[0]) for i in ids) == [n for n in range(1, 101) if n != 58]


@pytest.mark.parametrize("prompt", ['""', "[]", '[""]', '["a", ""]', "[[]]", "[[1], []]"])
def test_empty_completions_prompt_is_called_empty(prompt):
    with pytest.raises(RequestError, match=r"^prompt: 'prompt' must not be empty"):
        parse_body(CompletionRequest, f'{{"model": "m", "prompt": {prompt}}}')
