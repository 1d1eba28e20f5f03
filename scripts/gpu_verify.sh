#!/usr/bin/env bash
# One device call that checks the working tree on a GPU machine. The whole GPU suite takes longer than a 10-minute
# call, so it is cut by area (tests/gpu/shards.py: every GPU test in exactly one area, each area <= 8 minutes):
#
#   source scripts/gpu_setup.sh && bash scripts/gpu_verify.sh                # smoke: the most telling cases, <= 5 min
#   source scripts/gpu_setup.sh && bash scripts/gpu_verify.sh --area serve   # one area, <= 8 min
#   bash scripts/gpu_verify.sh --list                                        # the areas and their tests (no GPU)
#   ... --bench                                                              # then bench/mfu.py's quick check
#
# Areas: kernels, ops, models, vl, qwen3_5_fla (then qwen3_5 on the same warm machine), train, eval, serve.
# Writes to $OUT (the device tool's folder, else outputs/gpu_verify): <area>.log, <area>.xml (JUnit) and
# <area>.json, the summary (tests, passed, failed, errors, skipped, seconds, exit code, device, failed tests,
# the slowest; ok: exit 0, nothing failed and something passed).
area=smoke bench=
while [ $# -gt 0 ]; do
  case "$1" in
    --area) area=${2:?gpu_verify: --area needs a name (bash scripts/gpu_verify.sh --list shows them)}; shift 2 ;;
    --bench) bench=1; shift ;;
    --list)
      for a in smoke $(python3 -c "from tests.gpu.shards import AREAS; print(*AREAS)"); do
        echo "[$a]"; python3 -m tests.gpu.shards list "$a"
      done
      exit 0 ;;
    *) echo "gpu_verify: unknown argument '$1'; use --area NAME, --list or --bench" >&2; exit 2 ;;
  esac
done
mapfile -t nodes < <(python3 -m tests.gpu.shards list "$area") || exit 2
[ ${#nodes[@]} -gt 0 ] || exit 2
out=${OUT:-outputs/gpu_verify}
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
limit=$([ "$area" = smoke ] && echo 300 || echo 480)
start=$(date +%s)
# -m gpu: only the gpu-marked tests of files that mix CPU tests in (tests/unit/test_attention_kinds.py); -v: each
# test's outcome as it ends (what the summary counts if the limit cuts pytest off); -rA: passed tests' prints too.
# No --timeout: pytest-timeout is not on the GPU image; the outer timeout is the limit.
# --continue-on-collection-errors: a file that fails to import (a module missing on the GPU image) is one error, and
# the area's other files still run (2026-12-06: two such files stopped the whole models area).
rm -f "$out/$area.xml"
timeout "$limit" python3 -m pytest -v -rA -m gpu -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$out/$area.xml" "${nodes[@]}" \
  > "$out/$area.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) " "$out/$area.log" | head -n 20
tail -n 1 "$out/$area.log"
python3 -m tests.gpu.shards summary "$area" "$out/$area.xml" "$out/$area.log" $(( $(date +%s) - start )) "$rc" \
  "$out/$area.json"
if [ -n "$bench" ]; then
  timeout 200 python3 bench/mfu.py --warmup 2 --steps 4 --timeout 60 --cases qwen3_1.7b,qwen3_vl_2b \
    --stacks titan,titan_nokernels --out "$out/mfu_verify.json" > "$out/mfu_verify.log" 2>&1
  echo "mfu: exit $? (log $out/mfu_verify.log)"
  tail -n 8 "$out/mfu_verify.log"
fi
exit $rc
