#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine in one go: device tests, decode timing,
# compute-sanitizer memcheck and racecheck on short tests, and a serving soak with injected bad
# steps (SOAK_STEPS, default 10000; 0 skips it). Full logs go under $OUT (or /tmp/kvattn-device);
# a short summary is printed last.
#   tests/cuda/run_device_checks.sh [path/to/kvattn_cuda_tests]
set -u
BIN=${1:-build-cuda/kvattn_cuda_tests}
OUT=${OUT:-/tmp/kvattn-device}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1

"$BIN" --gtest_filter='CudaScenarios.*:CudaDecode.*:Cuda/BadInput.*:CudaGraphs*:Cases/BadIndexOnCuda.*:CudaStepErrors.*:CudaAllocation.*:CudaCascade.*' \
  > "$OUT/tests.log" 2>&1
tests_rc=$?
KVATTN_DECODE_BENCH=1 "$BIN" --gtest_filter='DecodeBench.*' > "$OUT/bench.log" 2>&1
bench_rc=$?
compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN" \
  --gtest_filter='CudaDecode.SanitizerSmoke:CudaDecode.BadSlot*:CudaDecode.BadDevice*:CudaDecode.GraphReplay*:Cuda/BadInput.ReqPoolIndicesRange/*:Cuda/BadInput.OutCacheLocRange/*:Cuda/BadInput.ReqToTokenContents/*:Cuda/BadInput.SharedPrefixGroups/*:Cases/BadIndexOnCuda.*:CudaStepErrors.*:CudaGraphsBadInput.*:CudaCascade.GroupsRunEagerly*' \
  > "$OUT/memcheck.log" 2>&1
memcheck_rc=$?
compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN" \
  --gtest_filter='CudaDecode.SanitizerSmoke' > "$OUT/racecheck.log" 2>&1
racecheck_rc=$?
CLI="$(dirname "$BIN")/kvattn"
soak_rc=skipped
if [ "${SOAK_STEPS:-10000}" -gt 0 ] && [ -x "$CLI" ]; then
  "$CLI" soak --device cuda --steps "${SOAK_STEPS:-10000}" --quiet --json "$OUT/soak.json" \
    > "$OUT/soak.log" 2>&1
  soak_rc=$?
fi

echo "== GPU"; cat "$OUT/gpu.txt"
echo "== tests (rc $tests_rc)"
grep -E "^\[  (PASSED|FAILED) |FAIL |n/s |Failure|threw|standard matrix|oracle err" "$OUT/tests.log" | head -80
echo "== memcheck (rc $memcheck_rc)"; grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | head -12
echo "== racecheck (rc $racecheck_rc)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|PASSED|FAILED" "$OUT/racecheck.log" | head -8
echo "== soak (rc $soak_rc)"; grep -E "^  |soak OK|soak FAILED|^FAIL" "$OUT/soak.log" 2>/dev/null | head -14
echo "== decode timing (rc $bench_rc)"
grep -E "^decode|^\||read ceiling|read-only|Failure|FAILED" "$OUT/bench.log"
