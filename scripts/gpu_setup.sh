#!/usr/bin/env bash
# Source on the GPU machine (device tool; carry .whl) before GPU tests/benchmarks: installs the carried wheels
# (.whl, fetched here by scripts/fetch_wheels.sh: torchtitan, torchdata, tyro, torchao, liger, fla-core, ...) into
# /tmp/site and puts the repo and them on PYTHONPATH. Triton compiles into .triton_cache of the checkout, which a
# warm machine keeps between calls (fla's kernels take minutes cold).
# no `set -e`: this file is sourced, and the caller's later commands must run even if one fails
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
    | grep -v WARNING || true
else
  echo "gpu_setup: no .whl/*.whl here: run scripts/fetch_wheels.sh on the CPU machine and carry .whl" >&2
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import fla; print('fla-core', fla.__version__)" 2>/dev/null \
  || echo "gpu_setup: fla-core missing (Qwen3.5 GPU tests skip): scripts/fetch_wheels.sh fetches it" >&2
