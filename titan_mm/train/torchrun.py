"""torchrun as run_train.sh launches it (``NPROC>1``): ``python -m titan_mm.train.torchrun [torchrun args] -m ...``.

The same launcher (torch.distributed.run), except on a preemption signal: torchrun forwards it to the workers,
which finish their step, save and print their one line; torchrun itself would then raise its SignalException
with a traceback and exit 1. Here it exits with 128 + the signal, like a single process, and prints nothing more.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
