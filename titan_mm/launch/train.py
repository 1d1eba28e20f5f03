"""``python -m titan_mm.launch.train [--config NAME] [--section.key value ...]``: one trainer process (run_train.sh
starts it, through titan_mm.launch.torchrun when NPROC > 1). It reads the config, builds the [eval] callback and
the [rl] rollout source (each reads its files first: a mistake is one line before anything is built) and hands
them to titan_mm.train.trainer.train. Every expected failure is one line: ``config error:`` and exit 2 for a
mistake found before the first step, ``data error:`` / ``error:`` and exit 1 later, 128 + the signal when
interrupted."""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import logging
import os
import signal
import sys

import torch.distributed as dist

from titan_mm.checkpoint_io import CheckpointError
from titan_mm.config import ConfigError, load_config
from titan_mm.data.sources import DataError
from titan_mm.eval.evaluator import online_eval
from titan_mm.models.hf_io import HFCheckpointError
from titan_mm.observe.health import NonFiniteError
from titan_mm.rl import rl_data
from titan_mm.train.run_lock import RunLockError
from titan_mm.train.setup import pick_device
from titan_mm.train.trainer import Interrupted, train


def keep_host_heap() -> None:
    """Make glibc keep freed host memory instead of unmapping it (CPU jobs). A CPU step frees and reallocates
    tensors of tens of MB (a 152k-row embedding's gradient, the optimizer's temporaries). By default each one is
    mapped fresh, so its pages fault again: 200k faults a step, a third of the CPU time of debug_qwen2_5_omni.toml
    (0.84 -> 0.55 s a step). The setting is process-wide, so the command sets it, not ``train()``."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to set
        return
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)
    mallopt(m_top_pad, 256 << 20)


def say(line: object) -> None:
    """One write per line: the ranks share stderr, and print's two writes (the text, then the newline) interleave."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    if not faulthandler.is_enabled():  # a native abort or crash (a gloo terminate, a segfault) prints the stacks
        faulthandler.enable(sys.__stderr__)
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        say(f"config error: {e}")
        return 2
    try:
        make_eval = online_eval(cfg)  # reads [eval] tasks: a bad one fails here, before anything is built
        make_data = rl_data(cfg)  # [rl]: reads the prompts and rewards, likewise
        if pick_device(cfg).type == "cpu":
            keep_host_heap()
        train(cfg, make_eval, make_data)
    except ConfigError as e:  # found before the first step (preflight, setup): nothing was written
        say(f"config error: {e}")
        return 2
    except DataError as e:  # the loader's error-rate stop (re-raised from a worker: its reason, one line)
        say(f"data error: {e.reason}")
        return 1
    except RunLockError as e:  # another trainer holds the run folder (every rank prints it)
        say(f"error: {e}")
        if dist.is_initialized():  # every rank got the verdict: none leaves (torchrun then stops the rest) unprinted
            dist.barrier()
        return 2
    except (CheckpointError, NonFiniteError, HFCheckpointError) as e:
        say(f"error: {e}")
        return 1
    except Interrupted as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            say(e)
        return e.code
    except KeyboardInterrupt:  # Ctrl-C before the loop installed its handler
        say("interrupted during start-up, before the first step; nothing was saved")
        return 128 + signal.SIGINT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_worker() -> None:
    """End a process of a multi-process job that finished cleanly without the interpreter's finalization: c10d's
    native threads can outlive the destroyed groups and abort it ("terminate called without an active exception",
    exit -6, seen on gloo CPU runs after a clean last step). train() has closed its files and the groups are
    destroyed by now. Failures exit normally: torchrun stops the other ranks as soon as one fails, so a rank that
    left early would cut off their one-line errors."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    rc = main()
    if rc == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_worker()
    sys.exit(rc)
