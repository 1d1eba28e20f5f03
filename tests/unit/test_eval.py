"""Online eval ([eval]) and python -m titan_mm.eval: the same numbers online and offline, user tasks, bad input.

Slow (-m slow): online = offline bitwise, and the full debug VL recipe with eval (accuracy rising over 100 steps, at
the end). 2 gloo processes equal 1 in tests/multiproc/test_eval_world2.py.
"""

import json
from pathlib import Path

import pytest

from titan_mm.config import ConfigError, load_config
from titan_mm.eval.__main__ import main as eval_main
from titan_mm.eval.tasks import exact_match, load_task
from titan_mm.observe.metrics import read_metrics
from titan_mm.launch.train import main as train_main

VL = ["--config", "debug_qwen3_vl", "--metrics.enable_tensorboard", "False", "--eval.dataset",
      "builtin:digits_test", "--eval.max_batches", "1", "--eval.task_limit", "12", "--eval.max_new_tokens", "3"]


def _offline(capsys, *args) -> dict:
    capsys.readouterr()
    assert eval_main(list(args)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # two 4-step VL runs and two offline evals: ~30 s on 2 cores
def test_online_eval_equals_offline_bitwise(tmp_path, capsys):
    """Every eval step's metrics equal python -m titan_mm.eval on that step's checkpoint: loss bitwise, scores
    exactly; the step's own metrics (loss, peak memory) are those of a run without eval."""
    common = [*VL, "--training.steps", "4", "--checkpoint.interval", "2", "--training.deterministic", "True"]
    assert train_main([*common, "--job.dump_folder", str(tmp_path), "--eval.interval", "2",
                       "--eval.tasks", "digits", "qa"]) == 0
    run = tmp_path / "debug_qwen3_vl"
    rows = read_metrics(run / "metrics.jsonl")
    assert "eval/digits_test/loss" not in rows[1] and "eval/digits_test/loss" in rows[2]
    for step in (2, 4):
        off = _offline(capsys, "--checkpoint", str(run), "--step", str(step))
        assert off["step"] == step
        for key in ("eval/digits_test/loss", "eval/digits_test/tokens", "eval/digits/accuracy", "eval/digits/n",
                    "eval/qa/exact_match", "eval/qa/n"):
            assert off[key] == rows[step][key], (step, key, off[key], rows[step][key])
    assert rows[4]["eval/digits/n"] == 12 and rows[4]["eval/handoff_s"] >= 0 and rows[4]["eval/peak_mem_gb"] > 0

    plain = tmp_path / "plain"
    assert train_main([*common, "--job.dump_folder", str(plain)]) == 0
    base = read_metrics(plain / "debug_qwen3_vl" / "metrics.jsonl")
    assert [base[s]["loss"] for s in base] == [rows[s]["loss"] for s in rows]  # eval leaves training as it was


def test_user_task_file_and_metric(tmp_path):
    f = tmp_path / "arith.jsonl"
    f.write_text(json.dumps({"prompt": "1 + 1 =", "reference": "2"}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}) + "\n")
    t = load_task(str(f))
    assert (t.name, t.metric_name, len(t.items)) == ("arith", "exact_match", 2)
    assert t.items[1] == {"messages": [{"role": "user", "content": "2 + 2?"}], "reference": "4"}
    t = load_task(f"{f}|titan_mm.eval.tasks:exact_match", limit=1)
    assert (t.metric_name, len(t.items), t.metric(" 2 ", "2")) == ("exact_match", 1, 1.0)
    assert exact_match("3", "2") == 0.0
    assert len(load_task("qa").items) == 360 and load_task("digits", limit=5).items[0]["reference"].isdigit()


@pytest.mark.parametrize("line, expect", [
    ('{"prompt": "x"}', "needs one of \"messages\" or \"prompt\" and a string \"reference\""),
    ('{"prompt": "x", "messages": [], "reference": "y"}', "needs one of"),
    ("not json", "line 1 is not JSON"),
])
def test_bad_task_file_is_one_line(tmp_path, line, expect):
    f = tmp_path / "t.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(")):
        load_task(str(f))


def test_bad_eval_config_fails_before_training(tmp_path, capsys):
    base = [*VL, "--job.dump_folder", str(tmp_path), "--training.steps", "2", "--eval.interval", "1"]
    cases = [
        (["--eval.tasks", "nope"],
         "eval.tasks 'nope' is not a built-in task (digits, qa, dtmf, dtmf_digits, dtmf_seq) or an existing .jsonl"),
        (["--eval.tasks", f"{tmp_path}/x.jsonl"], "is not a built-in task"),
        (["--eval.dataset", str(tmp_path / "missing.jsonl")], "eval.dataset:"),
        (["--eval.max_new_tokens", "0"], "eval.max_new_tokens must be >= 1"),
        (["--eval.mixture", '{"builtin:qa_test": 1}'], "--eval.dataset and --eval.mixture are both given"),
        (["--eval.tasks", "qa", "--objective.kind", "masked_diffusion"], "eval.tasks decode causally"),
        (["--eval.tasks", "digits", "--model.name", "qwen3", "--model.flavor", "debug"],
         "eval.tasks 'digits' has image in its prompts, but model 'qwen3' takes no image input"),
    ]
    (tmp_path / "m.jsonl").write_text('{"prompt": "a", "reference": "b"}\n')
    cases.append((["--eval.tasks", f"{tmp_path}/m.jsonl|no_such_module:f"], "cannot import the metric"))
    for extra, msg in cases:
        capsys.readouterr()
        assert train_main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (extra, err)
    assert not (tmp_path / "debug_qwen3_vl").exists()  # nothing written
    with pytest.raises(ConfigError, match="eval.mixture entry 'builtin:qa_test'"):
        load_config(["--eval.mixture", '{"builtin:qa_test": 0}'])


def test_eval_command_errors_are_one_line(tmp_path, capsys):
    assert eval_main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert eval_main(["--checkpoint", str(hf), "--step", "3"]) == 2
    assert "--step picks a titan_mm checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_debug_vl_recipe_accuracy_rises_and_matches_the_eval_command(tmp_path, capsys, all_threads):
    """train_configs/debug_qwen3_vl.toml as shipped ([eval] every 25 steps, 64 held-out digits): the accuracy
    rises, and the last one equals python -m titan_mm.eval on the final checkpoint."""
    assert train_main(["--config", "debug_qwen3_vl", "--job.dump_folder", str(tmp_path),
                       "--metrics.enable_tensorboard", "False"]) == 0
    run = tmp_path / "debug_qwen3_vl"
    rows = read_metrics(run / "metrics.jsonl")
    acc = {s: r["eval/digits/accuracy"] for s, r in rows.items() if "eval/digits/accuracy" in r}
    assert sorted(acc) == [25, 50, 75, 100]
    assert acc[100] >= 0.8 and acc[100] > acc[25] + 0.3, acc
    off = _offline(capsys, "--checkpoint", str(run))
    assert off["step"] == 100 and off["eval/digits/accuracy"] == acc[100]
    assert off["eval/digits_test/loss"] == rows[100]["eval/digits_test/loss"]
    assert load_config(["--config", "debug_qwen3_vl"]).eval.tasks == ["digits"]
    assert Path(run / "checkpoints").is_dir()


def test_tasks_run_at_most_every_k_checkpoints():
    from titan_mm.eval.evaluator import Evaluator

    cfg = load_config(["--eval.interval", "10", "--eval.tasks", "qa", "--eval.tasks_every_checkpoints", "2",
                       "--training.steps", "100"])
    ev = Evaluator(cfg, run=None)  # the schedule reads no model
    assert [s for s in range(1, 101) if ev.due(s)] == list(range(10, 101, 10))
    assert not ev.tasks_due(10, 1) and ev.tasks_due(20, 2)
    ev._tasks_at = 2  # as __call__ records when the tasks ran at 2 saved checkpoints
    assert not ev.tasks_due(30, 3) and ev.tasks_due(40, 4) and ev.tasks_due(100, 3)  # the last step always
    cfg.eval.tasks_every_checkpoints = 0
    assert ev.tasks_due(10, 0)
