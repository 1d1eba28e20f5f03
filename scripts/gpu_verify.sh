#!/usr/bin/env bash
# One device call that checks the working tree on a GPU machine before an issue touching GPU code is resolved:
# the GPU test suite (bf16, torch.compile, sync-debug mode), then the single-GPU throughput of the main cases next
# to the reference-op path. Each part has its own time limit so the call ends inside the 10-minute device limit
# and returns what finished. Logs and JSON go to $OUT (the device tool's folder), or ./outputs/gpu_verify.
#
#   source scripts/gpu_setup.sh && bash scripts/gpu_verify.sh            # about 6-8 minutes on an H200
#   GPU_VERIFY_SKIP_BENCH=1 bash scripts/gpu_verify.sh                   # tests only
out=${OUT:-outputs/gpu_verify}
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
timeout 330 python3 -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider --junitxml="$out/gpu_tests.xml" \
  > "$out/gpu_tests.log" 2>&1
echo "gpu tests: exit $? (log $out/gpu_tests.log)"
tail -n 5 "$out/gpu_tests.log"
if [ -z "${GPU_VERIFY_SKIP_BENCH:-}" ]; then
  timeout 200 python3 bench/mfu.py --warmup 2 --steps 4 --timeout 60 --cases qwen3_1.7b,qwen3_vl_2b \
    --stacks titan,titan_nokernels --out "$out/mfu_verify.json" > "$out/mfu_verify.log" 2>&1
  echo "mfu: exit $? (log $out/mfu_verify.log)"
  tail -n 8 "$out/mfu_verify.log"
fi
