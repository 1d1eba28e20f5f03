"""The three benign third-party messages (titan_mm/_quiet.py) are gone, and nothing else is hidden."""

import subprocess
import sys


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr


def test_imports_and_a_loader_print_nothing():
    err = _stderr(
        "import titan_mm, torchao, transformers\n"
        "from transformers import Qwen3ForCausalLM\n"
        "from titan_mm.config import Data\n"
        "from titan_mm.data.loader import build_dataloader\n"
        "from titan_mm.registry import DataNeeds\n"
        "next(iter(build_dataloader(Data(dataset='builtin', seq_len=64, micro_batch_size=1), needs=DataNeeds())))\n"
    )
    for noise in ("Failed to load", "set_vital", "is an Enum subclass"):
        assert noise not in err, err


def test_other_warnings_still_show():
    err = _stderr(
        "import logging, warnings, titan_mm\n"
        "logging.getLogger('torchao').warning('Failed to load /x/other_ext.so: boom')\n"
        "warnings.warn('a real problem')\n"
    )
    assert "other_ext.so: boom" in err and "a real problem" in err
