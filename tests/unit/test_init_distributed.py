"""A plain ``python`` run's one-rank process group (titan_mm.parallel.mesh.init_distributed) leaves the environment as
it was: a run launched from that process (a test, a sweep, an eval job) inherited RANK and the store's port, tried
to bind that port itself and stopped with EADDRINUSE (three GPU tests of the eval area on the H100, 2026-12-06)."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, torch.distributed as dist
from titan_mm.parallel.mesh import init_distributed
assert init_distributed("gloo") == (0, 1)
dist.destroy_process_group()
print("child ok")
"""

PARENT = """
import os, subprocess, sys
import torch.distributed as dist
from titan_mm.parallel.mesh import init_distributed
assert init_distributed("gloo") == (0, 1)
leaked = sorted(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in os.environ)
assert not leaked, leaked
child = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True)
assert child.returncode == 0, child.stderr[-2000:]
print(child.stdout.strip())
dist.destroy_process_group()
assert init_distributed("gloo") == (0, 1)  # a second group in the same process binds a fresh port
dist.destroy_process_group()
"""


def test_a_one_rank_group_leaves_the_environment_to_child_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-c", PARENT, CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "child ok"
