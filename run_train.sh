#!/usr/bin/env bash
# Launch a titan_mm training job.
#   ./run_train.sh --config debug_qwen3.toml [--section.key value ...]
#   NPROC=2 ./run_train.sh --config debug_qwen3.toml        # torchrun: gloo on CPU, nccl on GPU
# --config takes a name in train_configs/ or a path; every other argument goes to the config CLI (tyro):
#   ./run_train.sh --config debug_qwen3.toml --help        # lists every field
# Environment: NPROC (processes on this machine, default 1), PYTHON (default python3),
#   TORCHRUN_ARGS (extra torchrun arguments, e.g. "--master_port 29511").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -eq 0 ]]; then  # a bare call is a question, not a job: usage, and no 100-step run of the defaults
  {
    echo "usage: ./run_train.sh --config NAME_OR_PATH [--section.key value ...]   (--help lists every field)"
    echo "configs in train_configs/: $(cd "${ROOT}/train_configs" && echo *.toml)"
    sed -n '3,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  } >&2
  exit 2
fi
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-1}"
if ! [[ "${NPROC}" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NPROC must be a positive number of processes, got '${NPROC}'" >&2
  exit 2
fi
if [[ "${NPROC}" -gt 1 ]]; then
  if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    export OMP_NUM_THREADS=1
  fi
  # shellcheck disable=SC2086
  exec "${PYTHON}" -m titan_mm.launch.torchrun --standalone --nproc_per_node "${NPROC}" ${TORCHRUN_ARGS:-} \
    -m titan_mm.launch.train "$@"
else
  exec "${PYTHON}" -m titan_mm.launch.train "$@"
fi
