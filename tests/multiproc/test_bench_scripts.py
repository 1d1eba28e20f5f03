"""The multi-GPU bench scripts (bench/scaling.py, bench/multigpu_plans.py) in their --cpu mode: gloo processes,
tiny flavors, 3-4 steps. They launch the real trainer (torchrun for world 2), so these are end-to-end checks of
the scripts' launch / metrics / comparison / JSON logic, ready for the GPU machines. bench/serve.py's smoke (the
serving engine against transformers) runs here too.

Default suite (~1.5 min on 2 busy cores): the equality verdict against its bounds (no processes), scaling.py on
worlds 1 and 2 (throughput rows, loss equality 2 vs 1, checkpoint written on 2 and resumed on 1) and
multigpu_plans.py's tp2 case. Marked slow and skipped unless ``-m slow`` or ``TITAN_MM_SLOW=1`` (~5 min):
every world-2 plans case and the MFU runs (EP MoE, VL-MoE with the image+text worker, CP long context).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--cpu", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (f"{script} failed ({p.returncode}):\n{_failed_runs(p.stdout)}\n...\n"
                               f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def _failed_runs(stdout: str, lines: int = 60) -> str:
    """Each failed run's line and its log's last ``lines`` lines: a native crash's stacks (faulthandler's, from
    both ranks, interleaved) do not fit the script's one-line summary."""
    out = []
    for block in re.split(r"\n(?=\[(?:plans|scaling)\] )", stdout):
        if ": FAILED" not in block:
            continue
        out.append(block[:3000])
        log = re.search(r"\(log: (\S+?)\)", block)
        if log and Path(log.group(1)).is_file():
            out.append(f"--- {log.group(1)}, last {lines} lines:\n"
                       + "\n".join(Path(log.group(1)).read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def test_compare_bounds():
    """The equality check fails on a grad-norm or loss difference over its bound (no processes)."""
    sys.path.insert(0, str(ROOT))
    from bench.scaling import BOUNDS_GPU, compare

    ref = {s: dict(loss=12.0 - 0.01 * s, grad_norm=3.0 + 0.1 * s) for s in range(1, 21)}
    same = {s: dict(m) for s, m in ref.items()}
    assert compare(same, ref, list(range(1, 21)), BOUNDS_GPU)["ok"]
    noisy = {s: dict(loss=m["loss"] * (1 + 5e-3), grad_norm=m["grad_norm"] * (1 + 2e-2)) for s, m in ref.items()}
    noisy[1] = dict(ref[1])
    assert compare(noisy, ref, list(range(1, 21)), BOUNDS_GPU)["ok"]
    doubled = {s: dict(m, grad_norm=2 * m["grad_norm"]) for s, m in ref.items()}  # a doubled gradient reduction
    assert not compare(doubled, ref, list(range(1, 21)), BOUNDS_GPU)["ok"]
    drift = {s: dict(m, loss=m["loss"] * (1 + 0.02 * (s > 10))) for s, m in ref.items()}
    assert not compare(drift, ref, list(range(1, 21)), BOUNDS_GPU)["ok"]
    short = {s: m for s, m in ref.items() if s < 15}
    assert not compare(short, ref, list(range(1, 21)), BOUNDS_GPU)["ok"]


def test_noise_floor_bound():
    """With a control row (1 process vs 1 process, other bf16 rounding) the bound over the steps widens to twice
    the control's distance, while step 1 keeps the fixed bounds (a real fault shows there)."""
    sys.path.insert(0, str(ROOT))
    from bench.scaling import BOUNDS_GPU, apply_noise_floor

    def row(kind, first, gmax, model="dense"):
        return dict(kind=kind, case=kind, model=model, parallel={"control": "x"} if kind == "control" else {},
                    loss_rel_first=1e-5, loss_rel_max=4e-4, gnorm_rel_first=first, gnorm_rel_max=gmax,
                    ok=gmax <= BOUNDS_GPU["gnorm"] and first <= BOUNDS_GPU["gnorm_step1"])

    floor = row("control", 1e-4, 0.05)
    noisy = row("loss_equality", 1e-4, 0.07)             # 1.4x the floor: bf16 drift
    fault = row("loss_equality", 3e-2, 0.07)             # step 1 off: a fault, whatever the floor
    far = row("loss_equality", 1e-4, 0.2)                # 4x the floor
    other = row("loss_equality", 1e-4, 0.07, model="moe")  # no control for this model: fixed bound
    checks = apply_noise_floor([floor, noisy, fault, far, other], BOUNDS_GPU)
    assert [c["ok"] for c in checks[1:]] == [True, False, False, False]
    assert noisy["ok_fixed"] is False and noisy["bounds_used"]["gnorm"] == pytest.approx(0.1)
    assert "bounds_used" not in other


def test_launch_runs_a_native_crash_again_once(tmp_path):
    """A CPU run from nothing that dies in native code (faulthandler's report) runs once more and the result names
    the kept crash log; an ordinary failure, or a run that resumes from its folder, is not run again."""
    sys.path.insert(0, str(ROOT))
    from bench.scaling import launch

    script = tmp_path / "child.py"
    script.write_text("import faulthandler, os, sys\nfrom pathlib import Path\n"
                      "m = Path(sys.argv[1])\nif sys.argv[2] == 'abort' and not m.exists():\n"
                      "    m.write_text('x'); faulthandler.enable(); os.abort()\nsys.exit(0 if m.exists() else 3)\n")
    run = tmp_path / "run"
    run.mkdir()
    res = launch(1, [str(script)], [str(tmp_path / "m1"), "abort"], tmp_path / "a.log", 60, True, run_dir=run)
    assert res["rc"] == 0 and "error" not in res and not run.exists()
    assert "Fatal Python error: Aborted" in (tmp_path / "a.crashed.log").read_text()
    assert res["crash_retried"].startswith(str(tmp_path / "a.crashed.log"))
    res = launch(1, [str(script)], [str(tmp_path / "m2"), "exit"], tmp_path / "b.log", 60, True, run_dir=run)
    assert res["rc"] == 3 and "crash_retried" not in res
    res = launch(1, [str(script)], [str(tmp_path / "m3"), "abort"], tmp_path / "c.log", 60, True)
    assert res["rc"] != 0 and "crash_retried" not in res and (tmp_path / "m3").exists()


def test_scaling_cpu(tmp_path):
    out = tmp_path / "scaling.json"
    p = _run("scaling.py", ["--nprocs", "1,2", "--steps", "4", "--warmup", "1", "--dump", str(tmp_path / "runs"),
                            "--out", str(out), "--control", "--kernels.mode reference"])
    doc = json.loads(out.read_text())
    assert doc["meta"]["mode"] == "cpu" and doc["meta"]["bounds"]["loss"] == 1e-4
    runs = {r["world"]: r for r in doc["runs"]}
    assert set(runs) == {1, 2}
    for w, r in runs.items():
        assert "error" not in r, r
        assert r["steps_done"] == 4 and r["global_batch_rows"] == 4 and r["grad_accum"] == 2 // w
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0 and r["mfu"] is None
        assert 0 < r["weak_scaling_eff"] < 10
    assert runs[1]["weak_scaling_eff"] == 1.0 and runs[2]["loss_equal"] is True
    checks = {c["kind"]: c for c in doc["checks"]}
    eq, rs, ctl = checks["loss_equality"], checks["resharding"], checks["control"]
    # the control (1 process again, other overrides) sets the noise floor the loss-equality row is judged by
    assert ctl["world"] == 1 and ctl["control"] == "--kernels.mode reference" and ctl["steps"] == [1, 4]
    assert eq["bounds_used"]["rule"] == "max(fixed, 2 x control --kernels.mode reference)"
    assert eq["ok"] and eq["world"] == 2 and eq["ref_world"] == 1 and eq["steps"] == [1, 4]
    assert eq["loss_rel_max"] <= 1e-4 and eq["gnorm_rel_max"] <= 1e-4
    assert rs["ok"] and rs["written_world"] == 2 and rs["resumed_world"] == 1 and rs["steps"] == [3, 4]
    assert rs["resumed_log_line"] and rs["loss_rel_max"] <= 1e-4
    # the writer's checkpoints are deleted after the resharding check (disk on the GPU machines)
    assert not (tmp_path / "runs" / "debug_w2" / "checkpoints").exists()
    assert "| debug | cpu (gloo) | False | 2 |" in p.stdout and "(noise floor: 1 GPU vs 1 GPU)" in p.stdout


def test_plans_cpu_tp2(tmp_path):
    out = tmp_path / "plans.json"
    _run("multigpu_plans.py", ["--cases", "tp2", "--mfu-cases", "none", "--steps", "3",
                               "--dump", str(tmp_path / "runs"), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["meta"]["world"] == 2 and doc["mfu"] == []
    (c,) = doc["checks"]
    assert c["case"] == "tp2" and c["world"] == 2 and c["parallel"] == {"tp": 2} and c["dp"] == 1
    assert c["ok"], c
    assert c["steps"] == [1, 3] and len(c["loss"]) == 3 and c["loss_rel_max"] <= 1e-4


def test_serve_cpu(tmp_path):
    """bench/serve.py's smoke (~40 s, one process): every part on a tiny model, titan_mm's engine and transformers'
    continuous batching over the same weights, the JSON and its tables."""
    out = tmp_path / "serve.json"
    _run("serve.py", ["--out", str(out)])
    assert '"error"' not in out.read_text()  # no part, and no engine of a part, failed
    doc = json.loads(out.read_text())
    A, C = doc["parts"]["A"], doc["parts"]["C"]
    a = A["debug"]
    assert a["titan"]["output_tokens"] == a["hf"]["output_tokens"] == A["output_tokens"]  # EOS off, exact lengths
    assert a["first_tokens_match"] == 1.0  # the same weights: the same greedy tokens
    assert a["roofline"]["concurrency"] == A["requests"] and a["roofline"]["tokens_per_s"] > a["titan"]["tokens_per_s"]
    assert doc["parts"]["B"]["on"]["prefix_hit_rate"] > 0 == doc["parts"]["B"]["off"]["prefix_hit_rate"]
    assert C["draft"]["spec_acceptance"] == 1.0  # on CPU the target drafts for itself
    assert C["ngram"]["greedy_same_start"] and C["draft"]["greedy_same_start"]
    sys.path.insert(0, str(ROOT))
    from bench.serve import table

    assert "| debug | titan_mm |" in table(doc) and "draft debug" in table(doc)
    # Q: int8 weight-only served (its start-up line says so) within 1% of fp32's perplexity on the built-in text
    q = doc["parts"]["Q"]["debug"]["int8_weight_only"]
    assert "quantization int8_weight_only" in q["describe"] and abs(q["ppl_over_none"] - 1) <= 0.01, q
    # kernels (CPU: aten GEMMs): fused projections launch 3 GEMMs fewer per layer in a decode step
    k = doc["parts"]["kernels"]["debug"]
    assert k["gemms_saved_per_step"] == k["gemms_saved_expected"] == 12, k
    # serve.mixed_attention: a mixed step (decode rows beside a prefill) is one forward, not a decode step and one
    assert k["mixed_one_call"]["gemms_per_step"] == k["fused"]["gemms_per_step"] < k["mixed_apart"]["gemms_per_step"]
    assert "| debug | int8_weight_only |" in table(doc) and "| debug | fused |" in table(doc)


def test_serve_bad_quantization_is_one_line():
    """bench/serve.py refuses a --quantization mode it does not know before building anything (exit 2)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--cpu", "--quantization", "int8,fp8_rowwise"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown --quantization mode(s) ['int8']; modes are none, int8_weight_only" in p.stderr


@pytest.mark.slow
def test_plans_cpu_all(tmp_path, request):
    if "slow" not in (request.config.getoption("markexpr") or "") and not os.environ.get("TITAN_MM_SLOW"):
        pytest.skip("~5 min on 2 cores: run with -m slow or TITAN_MM_SLOW=1")
    out = tmp_path / "plans.json"
    _run("multigpu_plans.py", ["--steps", "3", "--mfu-steps", "3", "--warmup", "1",
                               "--dump", str(tmp_path / "runs"), "--out", str(out)], timeout=1500)
    doc = json.loads(out.read_text())
    checks = {c["case"]: c for c in doc["checks"]}
    assert set(checks) == {"tp2", "tp2_plain", "cp2_ulysses", "cp2_ring", "cp2_allgather", "ep2", "pp2", "pp2_interleaved",
                           "pp2_zbv"}  # W cases need 4
    for c in checks.values():
        assert c["ok"], c
    mfu = {r["case"]: r for r in doc["mfu"]}
    assert set(mfu) == {"moe_ep", "vl_moe_ep", "cp_long"}
    for r in mfu.values():
        assert "error" not in r, r
        assert r["steps_done"] == 3 and r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0
