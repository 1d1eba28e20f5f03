"""Run a script in a child process under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, hence the child), for kernels whose loops run to bounds read from memory."""

from __future__ import annotations

import os
import subprocess
import sys

# Triton 3.6's interpreter turns a loaded scalar (a 1-element array there) into a loop bound with int(), which
# numpy >= 2.3 refuses; kernels that loop to a length read from device memory need it
_PRELUDE = r"""
import triton.runtime.interpreter as _interp

_patch = _interp._patch_lang_tensor


def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patched
"""


def run_interpreted(script: str, timeout: int = 300) -> str:
    """``script`` (which prints "OK ..." on success) in the interpreter; -> its stdout, asserting it says OK."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _PRELUDE + script], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr[-3000:]
    return out.stdout
