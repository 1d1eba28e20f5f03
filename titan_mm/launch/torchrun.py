"""torchrun as run_train.sh launches it (``NPROC>1``): ``python -m titan_mm.launch.torchrun [torchrun args] -m ...``.

The same launcher (torch.distributed.run), with three differences:
- Before it starts the workers of ``-m titan_mm.launch.train``, it checks the job once, as one process does
  first: the config (load + validate), the [eval] tasks, ``preflight`` at the world size it will start (fixed
  ``--nnodes`` x ``--nproc_per_node``; not with an elastic node range) and the finished-run refusal. A mistake
  is one ``config error: ...`` line and exit 2, not one line per rank and torchrun's ChildFailedError.
  ``--help`` prints the fields once.
- A worker that exits 1 or 2 has printed its own line (the trainer's ``config error:`` / ``data error:`` /
  ``error:``, or a Python traceback): the launcher exits with that code, without torchrun's ChildFailedError
  traceback and table. Other failures (a signal, a native abort) keep torchrun's report.
- On a preemption signal torchrun forwards it to the workers, which finish their step, save and print their one
  line; torchrun itself would then raise its SignalException with a traceback and exit 1. Here it exits with
  128 + the signal, like a single process, and prints nothing more.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, parse_args, parse_min_max_nnodes
from torch.distributed.run import main as torchrun_main

from titan_mm.config import ConfigError, load_config, run_dir
from titan_mm.eval.evaluator import online_eval
from titan_mm.models.hf_io import HFCheckpointError
from titan_mm.train.preflight import preflight
from titan_mm.train.trainer import check_resume_step

TRAINER = "titan_mm.launch.train"


def check_job(argv: list[str]) -> None:
    """Raise ConfigError on the first mistake of the trainer job that torchrun ``argv`` would start; other
    scripts are not checked."""
    args = parse_args(argv)
    if not (args.module and args.training_script == TRAINER):
        return
    cfg = load_config(args.training_script_args)
    online_eval(cfg)  # reads the [eval] tasks: a bad one is a ConfigError
    lo, hi = parse_min_max_nnodes(args.nnodes)
    if lo == hi:  # elastic (a node range): the world size is not known before the rendezvous
        preflight(cfg, world=hi * determine_local_world_size(args.nproc_per_node))
    check_resume_step(cfg, run_dir(cfg))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_job(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except HFCheckpointError as e:  # as the trainer reports it
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        torchrun_main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        if code in (1, 2):  # the worker's own lines said why
            return code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
