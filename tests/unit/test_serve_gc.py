"""serve.freeze_gc: the first engine of a process freezes the heap alive before it (gc.freeze), once; its own
objects stay collectable, so a dropped engine is freed; off, the process's GC is left as it is. Each case runs in
a fresh interpreter (the freeze is process-wide)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import gc, sys, weakref
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import Engine

freeze = sys.argv[1] == "1"
cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
spec = get_model_spec("qwen3")
model = spec.build(cfg)
model.init_weights()
sc = ServeConfig(max_model_len=64, block_size=4, num_blocks=32, max_num_seqs=2, freeze_gc=freeze)
assert gc.get_freeze_count() == 0
engine = Engine(model, spec, cfg, sc, eos_token_ids=[])
frozen = gc.get_freeze_count()
assert (frozen > 10000) == freeze, frozen  # the libraries' objects, or none
second = Engine(model, spec, cfg, sc, eos_token_ids=[])
assert gc.get_freeze_count() == frozen, "a second engine froze again"
ref = weakref.ref(engine.core)
del engine, second
gc.collect()
assert ref() is None, "a dropped engine was kept"
print("OK", frozen)
"""


def _run(freeze: int) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(freeze)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr[-3000:]
    return out.stdout


def test_freeze_gc_freezes_the_start_up_heap_once_and_frees_dropped_engines():
    _run(1)


def test_freeze_gc_off_leaves_the_gc_alone():
    _run(0)
