"""Online eval over 2 gloo processes equals 1 process, with FSDP2 (dp 2) and with a pipeline (pp 2: the loss through the
schedule's forward-only pass, the engine on the stages gathered from both pp ranks): the held-out loss to float
rounding, the generated texts exactly (each rank decodes every 2nd prompt on the gathered weights; the scores are
summed). The head is untied, as pp needs."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from titan_mm.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three launches of the debug Qwen3, 60-90 s on 2 cores
def test_two_processes_evaluate_as_one(tmp_path):
    task = tmp_path / "echo.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"Count: {i}, {i + 1},", "reference": str(i + 2)}) + "\n"
                            for i in range(10)))
    args = ["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path), "--training.steps", "2",
            "--metrics.enable_tensorboard", "False", "--checkpoint.enable", "False", "--eval.interval", "2",
            "--eval.dataset", "builtin:qa_test", "--eval.max_batches", "2", "--eval.max_new_tokens", "4",
            "--eval.tasks", "qa", f"{task}|_eval_metric:text_code", "--eval.task_limit", "10",
            "--model.overrides", '{"tie_word_embeddings": false}']
    rows = {}
    for name, n, extra in (("w1", 1, []), ("dp2", 2, []), ("pp2", 2, ["--parallel.pp", "2"])):
        env = dict(os.environ, OMP_NUM_THREADS="1", NPROC=str(n),
                   PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'multiproc'}")
        r = subprocess.run([str(ROOT / "run_train.sh"), *args, *extra, "--job.name", name], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        rows[name] = read_metrics(tmp_path / name / "metrics.jsonl")[2]
    for layout in ("dp2", "pp2"):
        _same_eval(rows["w1"], rows[layout])


def _same_eval(one: dict, two: dict) -> None:
    assert abs(two["eval/qa_test/loss"] - one["eval/qa_test/loss"]) <= 1e-6 * abs(one["eval/qa_test/loss"])
    assert two["eval/qa_test/tokens"] == one["eval/qa_test/tokens"] > 0
    assert two["eval/echo/text_code"] == one["eval/echo/text_code"] and two["eval/echo/n"] == one["eval/echo/n"] == 10
    assert two["eval/qa/exact_match"] == one["eval/qa/exact_match"] and two["eval/qa/n"] == 10
