"""The README runs top to bottom: every command of its ```bash blocks, in order, in a copy of the working tree,
exits 0 (issue 45 item 5). The README and the code cannot drift apart unnoticed.

What differs from a user pasting the blocks, all of it listed here:
- SKIP: the lines this machine cannot run (network installs, GPUs, Hub downloads, Slurm) and the test suites
  themselves, each with its reason. A pattern that matches no line fails the test, so the list cannot rot.
- SHORTEN: training runs 2 steps and the evaluation tools score a few records, so the page runs in minutes.
- A server line (``-m titan_mm.serve``) starts a real server process on a free port (the README's 8000 may be
  taken here); once its /health answers, the block's other commands (the curl) run against it with
  ``--fail-with-body`` (an HTTP error fails), then the server is stopped (SIGINT to its process group).
"""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = {
    "pip install": "installs from the network; the package is installed",
    "pytest ": "the test suites themselves (this test is one of them)",
    "hf download ": "a Hub download",
    "NPROC=8 ": "8 GPUs",
    "--model.hf_path Qwen/": "a Hub id: downloads the weights",
    "outputs/qwen3_vl_30b_a3b_sft": "exports the 8-GPU run skipped above",
    "sbatch ": "Slurm",
}
SHORTEN = {
    "./run_train.sh ": ["--training.steps", "2"],
    "-m titan_mm.tools.eval_digits ": ["--limit", "4"],
    "-m titan_mm.tools.eval_dllm ": ["--limit", "4"],
    "-m titan_mm.eval ": ["--task-limit", "4", "--max-batches", "1"],
}
SERVER = "-m titan_mm.serve "


def readme_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comment lines dropped."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        cmds, cur = [], ""
        for line in body.splitlines():
            cur += line[:-1] if line.endswith("\\") else line
            if line.endswith("\\"):
                continue
            if cur.strip() and not cur.strip().startswith("#"):
                cmds.append(cur.strip())
            cur = ""
        blocks.append(cmds)
    return blocks


def _copy_tree(dst: Path) -> None:
    """The working tree as git sees it (tracked and untracked, ignored files such as outputs/ left out)."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: str, cwd: Path, env: dict) -> None:
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def _serve(cmd: str, clients: list[str], cwd: Path, env: dict, log: Path) -> None:
    """Start the server of ``cmd``, run ``clients`` once it is healthy, stop it."""
    m = re.search(r"--port (\d+)", cmd)
    assert m, f"{cmd}: a README server line names its --port (the curl lines use it)"
    port = int(m.group(1))
    with open(log, "w") as out:
        p = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        end = time.monotonic() + 600
        while True:
            assert p.poll() is None, f"{cmd}\nexited {p.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < end, f"{cmd}: no /health answer in 600 s\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        for c in clients:
            _run(c, cwd, env)
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _shorten(cmd: str) -> str:
    words = shlex.split(cmd, comments=True)
    for pattern, extra in SHORTEN.items():
        if pattern in cmd:
            words += extra
    if words[0] == "curl":
        words[1:1] = ["--fail-with-body", "-sS"]
    return shlex.join(words)


@pytest.mark.slow
def test_readme_runs_top_to_bottom(tmp_path):
    blocks = readme_blocks((ROOT / "README.md").read_text())
    used = set()
    repo = tmp_path / "repo"
    _copy_tree(repo)
    env = dict(os.environ, PYTHONPATH=str(repo))
    ran = 0
    for block in blocks:
        todo = []
        for cmd in block:
            hit = [p for p in SKIP if p in cmd]
            used.update(hit)
            if not hit:
                todo.append(cmd)
        port = str(_free_port())
        todo = [_shorten(re.sub(r"\b8000\b", port, c)) for c in todo]
        servers = [c for c in todo if SERVER in c]
        clients = [c for c in todo if SERVER not in c]
        if servers:
            for i, s in enumerate(servers):
                _serve(s, clients, repo, env, tmp_path / f"server{i}.log")
        else:
            for c in clients:
                _run(c, repo, env)
        ran += len(todo)
    assert used == set(SKIP), f"SKIP patterns that match no README line: {set(SKIP) - used}"
    text = " ".join(c for b in blocks for c in b)
    assert all(p in text for p in SHORTEN), [p for p in SHORTEN if p not in text]
    assert ran >= 15, ran  # the README's CPU commands: trainings, export, evals, two servers and their curl
