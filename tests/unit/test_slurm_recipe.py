"""scripts/slurm/: the torchrun command train.sbatch builds from a (fake) Slurm allocation, and its time-limit path
(USR1 to the batch shell -> SIGTERM to the training step -> scontrol requeue once the step has exited).

Slurm itself is not here: `scontrol` and `srun` are small stand-ins on PATH. The fake scontrol expands node lists
(`show hostnames`) and records `requeue`; the fake srun runs its command once, as one task, and forwards SIGTERM
to it, which is what srun does for the tasks it controls.
"""

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"

FAKE_SCONTROL = r'''#!/usr/bin/env python3
"""scontrol show hostnames LIST (bracket ranges, zero padding kept) | scontrol requeue ID (logged)."""
import os, re, sys
a = sys.argv[1:]
if a[:2] == ["show", "hostnames"]:
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", a[2]):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            print(part)
            continue
        for r in m[2].split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                print(f"{m[1]}{i:0{len(lo)}d}")
elif a[:1] == ["requeue"]:
    open(os.environ["FAKE_LOG"] + "/requeue", "a").write(a[1] + "\n")
else:
    sys.exit(f"fake scontrol: unexpected {a}")
'''

# srun OPTIONS... CMD...: runs CMD (from the first argument that is not an option), forwarding SIGTERM to it
FAKE_SRUN = r'''#!/usr/bin/env bash
echo "$*" > "$FAKE_LOG/srun_args"
while [[ "$1" == --* ]]; do shift; done
"$@" &
child=$!
trap 'echo TERM >> "$FAKE_LOG/srun_signals"; kill -TERM $child' TERM
while :; do
  wait $child; rc=$?
  (( rc > 128 )) && kill -0 $child 2>/dev/null && continue
  break
done
exit $rc
'''


def _fake_bin(tmp_path: Path) -> Path:
    b = tmp_path / "bin"
    b.mkdir(parents=True)
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (b / name).write_text(body)
        (b / name).chmod(0o755)
    (tmp_path / "log").mkdir()
    return b


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{_fake_bin(tmp_path)}:{env['PATH']}", FAKE_LOG=str(tmp_path / "log"),
               SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_NODEID="0",
               SLURM_SUBMIT_DIR=str(ROOT))
    env.update(extra)
    return env


def _cmd(env, *args):
    return subprocess.run(["bash", str(SLURM / "torchrun_cmd.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("script", ["train.sbatch", "torchrun_cmd.sh"])
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_header_one_task_per_node_signal_and_requeue():
    head = [ln for ln in (SLURM / "train.sbatch").read_text().splitlines() if ln.startswith("#SBATCH")]
    for want in ("--ntasks-per-node=1", "--gpus-per-node=8", "--signal=B:USR1@120", "--requeue",
                 "--open-mode=append"):
        assert f"#SBATCH {want}" in head, want


def test_torchrun_command_from_the_allocation(tmp_path):
    overrides = '{"num_hidden_layers": 2}'
    r = _cmd(_env(tmp_path), "--config", "qwen3_1.7b.toml", "--training.steps", "100",
             "--model.overrides", overrides)
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "python3", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-07:29500", "--rdzv-id", "4242",
        "-m", "titan_mm.launch.train", "--config", "qwen3_1.7b.toml", "--training.steps", "100",
        "--model.overrides", overrides]
    # a longer list, the GPU count Slurm reports, another port and Python
    env = _env(tmp_path / "b", SLURM_JOB_NODELIST="node[003,010-011],login1", SLURM_NNODES="4",
               SLURM_GPUS_ON_NODE="4", RDZV_PORT="29611", PYTHON="/opt/py/bin/python")
    r = _cmd(env, "--config=debug_qwen3")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "/opt/py/bin/python", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "node003:29611", "--rdzv-id", "4242",
        "-m", "titan_mm.launch.train", "--config=debug_qwen3"]


def test_torchrun_command_refuses_outside_slurm_and_without_config(tmp_path):
    env = _env(tmp_path)
    del env["SLURM_JOB_NODELIST"], env["SLURM_JOB_ID"]
    r = _cmd(env, "--config", "debug_qwen3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "SLURM_JOB_NODELIST SLURM_JOB_ID not set" in r.stderr and "sbatch" in r.stderr
    r = _cmd(_env(tmp_path / "b"), "--training.steps", "5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no --config" in r.stderr


def _start_sbatch(tmp_path, trainer_py: str, *args, **env_extra):
    """train.sbatch with `python3` replaced by a stand-in trainer (the fake srun runs it as the one task)."""
    env = _env(tmp_path, **env_extra)
    fake_py = tmp_path / "trainer.py"
    fake_py.write_text(textwrap.dedent(trainer_py))
    wrapper = tmp_path / "bin" / "fake-python"  # PYTHON is one word in the command
    wrapper.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} {fake_py} "$@"\n')
    wrapper.chmod(0o755)
    env["PYTHON"] = str(wrapper)
    return subprocess.Popen(["bash", str(SLURM / "train.sbatch"), "--config", "debug_qwen3", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# the stand-in trainer: started -> wait; SIGTERM -> "save" and exit 143 (as titan_mm's trainer does); else exit 0
TRAINER = """
    import os, signal, sys, time
    log = os.environ["FAKE_LOG"]
    def term(*_):
        open(log + "/trainer", "a").write("saved\\n")
        sys.exit(143)
    signal.signal(signal.SIGTERM, term)
    open(log + "/trainer", "a").write("started " + " ".join(sys.argv[1:]) + "\\n")
    time.sleep(float(os.environ.get("FAKE_TRAIN_S", "30")))
"""


def _wait_for(path: Path, timeout=30.0):
    t = time.time()
    while not path.exists():
        assert time.time() - t < timeout, f"{path} never appeared"
        time.sleep(0.05)


def test_time_limit_signal_saves_then_requeues(tmp_path):
    p = _start_sbatch(tmp_path, TRAINER)
    log = tmp_path / "log"
    _wait_for(log / "trainer")
    os.kill(p.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 sends
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert (log / "srun_signals").read_text() == "TERM\n"  # forwarded once
    assert (log / "trainer").read_text().splitlines()[-1] == "saved"
    assert (log / "requeue").read_text() == "4242\n"
    assert "requeueing job 4242" in err
    started = (log / "trainer").read_text().splitlines()[0]
    assert started.endswith("-m titan_mm.launch.train --config debug_qwen3")
    assert "--ntasks-per-node=1" in (log / "srun_args").read_text()


def test_no_requeue_when_the_run_ends_or_slurm_signals_the_step(tmp_path):
    p = _start_sbatch(tmp_path, TRAINER, FAKE_TRAIN_S="0.5")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert not (tmp_path / "log" / "requeue").exists()
    # SIGTERM to the batch shell (preemption, scancel): Slurm signals the step itself; the shell neither forwards
    # it again (the trainer would ignore the duplicate) nor requeues, and waits for the step
    q = _start_sbatch(tmp_path / "t", TRAINER, FAKE_TRAIN_S="2")
    _wait_for(tmp_path / "t" / "log" / "trainer")
    os.kill(q.pid, signal.SIGTERM)
    out, err = q.communicate(timeout=60)
    assert q.returncode == 0, err
    assert "waiting for the training step" in err
    assert not (tmp_path / "t" / "log" / "srun_signals").exists()
    assert not (tmp_path / "t" / "log" / "requeue").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_torchrun_and_trainer_save_on_time_limit_then_resume(tmp_path):
    """The generated command for real (torchrun, c10d rendezvous, 2 gloo workers on one 'node'): USR1 to the batch
    shell -> the trainer saves and exits -> requeue; the requeued job resumes from that checkpoint."""
    from titan_mm.checkpoint_io import list_checkpoints

    env = _env(tmp_path, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", GPUS_PER_NODE="2",
               RDZV_PORT=str(_free_port()), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    args = ["--config", "debug_qwen3", "--job.dump_folder", str(tmp_path / "runs"), "--job.name", "j",
            "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 2}', "--data.dataset", "synthetic",
            "--data.seq_len", "32", "--data.micro_batch_size", "1", "--metrics.enable_tensorboard", "False",
            "--metrics.log_freq", "1", "--checkpoint.interval", "1000", "--lr_scheduler.warmup_steps", "0"]
    sbatch = ["bash", str(SLURM / "train.sbatch")]
    p = subprocess.Popen([*sbatch, *args, "--training.steps", "100000"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "j" / "metrics.jsonl"
    _wait_for(metrics, timeout=300)
    t = time.time()
    while not metrics.read_text().strip():  # a step has run: the trainer's signal handler is in place
        assert time.time() - t < 300 and p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGUSR1)
    out, err = p.communicate(timeout=300)
    assert p.returncode != 0, err[-3000:]
    assert "checkpoint step-" in err and "saved" in err, err[-3000:]
    assert (tmp_path / "log" / "requeue").read_text() == "4242\n"
    saved = list_checkpoints(tmp_path / "runs" / "j" / "checkpoints")
    assert saved, err[-3000:]
    step = int(saved[-1].name.split("-")[1])
    # the requeued job: same command; it resumes and runs to the end
    r = subprocess.run([*sbatch, *args, "--training.steps", str(step + 2)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and saved[-1].name in r.stderr, r.stderr[-3000:]
