#!/usr/bin/env bash
# Source on the H200 (device tool) before GPU tests/benchmarks: installs the carried wheels (.whl, fetched
# here by ../shared/gpu/fetch_wheels.sh) into /tmp/site and puts the repo and them on PYTHONPATH.
# no `set -e`: this file is sourced, and the caller's later commands must run even if one fails
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING || true
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
