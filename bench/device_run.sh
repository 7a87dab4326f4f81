#!/usr/bin/env bash
# One device call that checks and measures everything the CUDA backend claims, in priority order,
# each step under its own time limit so a slow step cannot starve the rest. Build here first and
# carry the binaries:
#   mkdir -p .carry && cp build/kvattn build/kvattn_cuda_tests .carry/ && cp <kvattn wheel> .carry/
#   device run: bash bench/device_run.sh .carry      (carry: [".carry"])
# Full logs and JSON results go to $OUT; a summary table is printed last.
set -u
CARRY=${1:-.carry}
OUT=${OUT:-/tmp/kvattn-device}
mkdir -p "$OUT"
export KVATTN_GIT_COMMIT=${KVATTN_GIT_COMMIT:-$(cat "$CARRY/COMMIT" 2>/dev/null || echo unknown)}
date_tag=$(date +%Y%m%d)
summary=()

step() {  # step NAME SECONDS COMMAND...: runs, logs to $OUT/NAME.log, records rc and wall time
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc %-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  return $rc
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt" 2>&1

step tests 110 "$CARRY/kvattn_cuda_tests" --gtest_brief=1
step check 40 "$CARRY/kvattn" check --device cuda
step python 70 bash -c "python3 -m pip install -q --no-index --no-deps --target /tmp/site \
  $CARRY/kvattn-*.whl && PYTHONPATH=/tmp/site python3 -m pytest -q -s -p no:cacheprovider \
  python/tests/test_gpu_torch.py python/tests/test_torch_backend.py"
step graphs 80 "$CARRY/kvattn" bench --device cuda --graphs --json "$OUT/h200-graphs-$date_tag.json"
step grid 80 "$CARRY/kvattn" bench --device cuda --json "$OUT/h200-grid-$date_tag.json"
step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$CARRY/kvattn_cuda_tests" \
  --gtest_filter='CudaGraphsVerify.*:CudaGraphsDraft.*:PrefillKernel.NarrowV*:CudaDecode.SanitizerSmoke'
step racecheck 30 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$CARRY/kvattn_cuda_tests" --gtest_filter='PrefillKernel.NarrowVHeadDimFp8Kv:CudaDecode.SanitizerSmoke'

echo "== GPU"; cat "$OUT/gpu.txt"
echo "== tests"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  |Failure" "$OUT/tests.log" | head -30
echo "== check"; grep -E "FAIL|not supported|passed, " "$OUT/check.log" | head -10
echo "== python"; grep -E "kvattn-gpu-test|passed|failed|Error" "$OUT/python.log" | tail -12
echo "== memcheck / racecheck"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log"
echo "== graphs"; grep -vE "^\[" "$OUT/graphs.log" | tail -22
echo "== grid"; grep -E "^decode|^prefill|^extend|ceiling" "$OUT/grid.log" | tail -45
echo "== steps"; printf '%s\n' "${summary[@]}"
