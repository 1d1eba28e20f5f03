"""Filters for three messages that third-party imports print on every run and that say nothing about the run.

- torchao logs "Failed to load .../_C_mxfp8...so" / "_C_cutlass_90a...so" when its optional C++ extensions do not
  match the installed torch; titan_mm's float8 path (torchao.float8 on torch._scaled_mm) does not use them.
- torch's pytree logs that registering Enum subclasses as constants is deprecated (torchao does it at import).
- torchdata's StatefulDataLoader calls the deprecated ``torch.set_vital`` on every iterator.

Each filter matches its message exactly; any other warning from these libraries still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

_TORCHAO_SO = re.compile(r"Failed to load .*torchao/_C_(mxfp8|cutlass)\w*\..*so")
_PYTREE_ENUM = "is an Enum subclass and is now natively supported by torch.compile"


class _Drop(logging.Filter):
    def __init__(self, match):
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.match(record.getMessage())


def install() -> None:
    logging.getLogger("torchao").addFilter(_Drop(lambda m: _TORCHAO_SO.search(m) is not None))
    logging.getLogger("torch.utils._pytree").addFilter(_Drop(lambda m: _PYTREE_ENUM in m))
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
