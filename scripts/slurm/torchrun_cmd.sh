#!/usr/bin/env bash
# The torchrun command of one titan_mm training job over a Slurm allocation: one torchrun per node (srun starts
# one task per node), all of them meeting at a c10d rendezvous on the allocation's first node.
#   source scripts/slurm/torchrun_cmd.sh; torchrun_cmd --config NAME [--section.key value ...]   # -> TORCHRUN_CMD
#   scripts/slurm/torchrun_cmd.sh --config NAME [...]      # prints the command, shell-quoted
# Slurm's variables: SLURM_JOB_NODELIST (its first host is the rendezvous host; `scontrol show hostnames`
# expands the compressed list), SLURM_NNODES, SLURM_JOB_ID (the rendezvous id: every node of the job, and
# the same job after a requeue, joins the same rendezvous).
# Settings: GPUS_PER_NODE (default SLURM_GPUS_ON_NODE, which --gpus-per-node sets, else 8), RDZV_PORT (29500),
# PYTHON (python3; `python3 -m torch.distributed.run` is torchrun).

torchrun_cmd() {
  local v missing=()
  for v in SLURM_JOB_NODELIST SLURM_NNODES SLURM_JOB_ID; do
    [[ -n "${!v:-}" ]] || missing+=("$v")
  done
  if (( ${#missing[@]} )); then
    echo "torchrun_cmd: ${missing[*]} not set: run inside a Slurm job" \
      "(sbatch scripts/slurm/train.sbatch --config NAME ...)" >&2
    return 2
  fi
  local a has_config=""
  for a in "$@"; do
    [[ "$a" == --config || "$a" == --config=* ]] && has_config=1
  done
  if [[ -z "$has_config" ]]; then
    echo "torchrun_cmd: no --config given: pass the training config," \
      "e.g. --config qwen3_1.7b.toml [--section.key value ...]" >&2
    return 2
  fi
  local hosts=()
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  if [[ -z "${hosts[0]:-}" ]]; then
    echo "torchrun_cmd: 'scontrol show hostnames $SLURM_JOB_NODELIST' gave no host name" >&2
    return 2
  fi
  TORCHRUN_CMD=("${PYTHON:-python3}" -m torch.distributed.run
    --nnodes "$SLURM_NNODES"
    --nproc-per-node "${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
    --rdzv-backend c10d
    --rdzv-endpoint "${hosts[0]}:${RDZV_PORT:-29500}"
    --rdzv-id "$SLURM_JOB_ID"
    -m titan_mm.launch.train "$@")
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  torchrun_cmd "$@"
  line="$(printf '%q ' "${TORCHRUN_CMD[@]}")"
  echo "${line% }"
fi
