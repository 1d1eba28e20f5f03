"""The one map from the dtype names the config and the CLIs use to torch dtypes.

titan_mm.config stays importable without torch, so its fields hold names ("bfloat16"); code that needs the
torch dtype asks :func:`torch_dtype`.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; an unknown name is a ValueError that lists the known ones."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None
